"""`tiderl eval`: pass@k arithmetic, per-task grouping of samples, the Markdown table, the
shortcut flags, and the scripted oracle through the evaluation path reaching the environment
ceilings measured by the env authors (MetaQA, AgentBench DB dev). Tests that need the shared
data skip with a message when it is absent."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from tiderl.agent.loop import ScriptedEngine
from tiderl.cli import main
from tiderl.config import RolloutConfig, load_config
from tiderl.embedded.tiny import IM_END_ID, train_tokenizer
from tiderl.envs.protocol import Action, StepResult, Task
from tiderl.envs.setup import data_root
from tiderl.evaluate import (
    evaluate,
    markdown_table,
    oracle_engine,
    pass_at_k,
    result_rows,
    run_samples,
    summarize_samples,
)
from tiderl.rollout.base import Completion, SamplingParams
from tiderl.types import Trajectory


def _data_or_skip(folder: str, file: str):
    root = data_root()
    if not (root / folder / file).is_file():
        pytest.skip(f"{folder}/{file} not found under {root}: set TIDERL_DATA_DIR to the folder holding {folder}/")
    return root


# -- pass@k and the summaries -------------------------------------------------------------------


def test_pass_at_k_is_the_unbiased_estimator():
    # 1 - C(n - c, k) / C(n, k)
    assert pass_at_k(5, 1, 2) == pytest.approx(1 - 6 / 10)
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 is the success rate
    assert pass_at_k(5, 0, 2) == 0.0
    assert pass_at_k(4, 3, 2) == 1.0  # fewer than k failures: any k samples hold a success
    # n = k: any success.
    assert [pass_at_k(4, c, 4) for c in range(5)] == [0.0, 1.0, 1.0, 1.0, 1.0]
    for bad in ((3, 1, 4), (3, 4, 2), (3, 1, 0)):
        with pytest.raises(ValueError):
            pass_at_k(*bad)


def _traj(task_id: str, success: int, f1: float | None = None, turns: int = 2, errors: int = 0) -> Trajectory:
    info: dict[str, Any] = {"success": success, "tool_errors": errors}
    if f1 is not None:
        info["f1"] = f1
    return Trajectory(tokens=[1, 2, 3, 4], loss_mask=[0, 1, 1, 0], behavior_logprobs=[0, -1, -1, 0],
                      policy_version=[-1, 0, 0, -1], reward=float(success), task_id=task_id,
                      num_turns=turns, stop_reason="answer", env_info=info)


def test_summarize_samples_on_hand_made_trajectories():
    groups = [[_traj("a", s) for s in (1, 0, 0, 0)],
              [_traj("b", s) for s in (0, 0, 0, 0)],
              [_traj("c", s, errors=1) for s in (1, 1, 1, 1)]]
    s = summarize_samples(groups, k=4)
    assert (s["n"], s["episodes"], s["samples_per_task"]) == (3, 12, 4)
    assert s["success"] == pytest.approx(5 / 12)
    rates = [0.25, 0.0, 1.0]
    mean = 5 / 12
    assert s["stderr"] == pytest.approx(math.sqrt(sum((r - mean) ** 2 for r in rates) / 3 / 3))
    assert (s["pass_k"], s["pass_at_k"]) == (4, pytest.approx(2 / 3))
    assert s["pass_at_k_stderr"] == pytest.approx(math.sqrt(2 / 3 * 1 / 3 / 3))
    assert s["tool_errors"] == pytest.approx(4 / 12)
    # Over tasks, as success's: per-task means 0, 0, 1 around 1/3.
    assert s["tool_errors_stderr"] == pytest.approx(math.sqrt((2 * (1 / 3) ** 2 + (2 / 3) ** 2) / 3 / 3))
    assert s["f1"] is None  # no episode reported an F1 (a DB environment)
    # pass@2 from the same 4 samples: a: 1 - C(3,2)/C(4,2) = 0.5; b: 0; c: 1.
    assert summarize_samples(groups, k=2)["pass_at_k"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="pass@5"):
        summarize_samples(groups, k=5)

    # One sample per task: the binomial standard error, and no pass@k keys.
    one = summarize_samples([[_traj("a", 1, f1=1.0, errors=3)], [_traj("b", 0, f1=0.5, errors=1)]], k=1)
    assert one["stderr"] == pytest.approx(math.sqrt(0.5 * 0.5 / 2))
    assert one["tool_errors_stderr"] == pytest.approx(math.sqrt((1 + 1) / 2 / 2))  # errors 3 and 1 around 2
    assert one["f1"] == pytest.approx(0.75) and "pass_at_k" not in one


# -- evaluate through the agent loop ------------------------------------------------------------

SYSTEM = "Answer with ANSWER: <word>."


class WordEnv:
    """One-turn episodes: success iff the turn says `ANSWER: <task.answer>`."""

    def system_prompt(self) -> str:
        return SYSTEM

    def tool_schemas(self) -> list[dict[str, Any]]:
        return []

    def reset(self, task: Task) -> str:
        self.task = task
        return task.prompt

    def step(self, action: Action) -> StepResult:
        ok = action.text.strip() == f"ANSWER: {self.task.answer}"
        return StepResult([], reward=float(ok), done=True,
                          info={"success": float(ok), "tool_errors": 0, "reward_parts": {"outcome": float(ok)}})

    def finish(self, reason: str) -> StepResult:
        return StepResult([], reward=0.0, done=True, info={"success": 0.0})


@pytest.fixture(scope="module")
def tok():
    corpus = [SYSTEM, "ANSWER: yes", "ANSWER: no", "question one", "question two", "system", "user", "assistant"]
    return train_tokenizer(corpus * 4, vocab_size=300)


class ListEngine:
    """Answers the prompts of each call with the next words of `words` (one per prompt; given a
    dict, the next word of the question a prompt holds, since episodes reach the engine in no
    fixed order), and records the sampling temperature of every call."""

    def __init__(self, tok, words: list[str] | dict[str, list[str]]):
        self.tok, self.words, self.temperatures = tok, words, []

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        self.temperatures.append(params.temperature)
        out = []
        for prompt in prompts:
            if isinstance(self.words, dict):
                text = self.tok.decode(prompt)
                word = next(words for question, words in self.words.items() if question in text).pop(0)
            else:
                word = self.words.pop(0)
            ids = self.tok.encode(f"ANSWER: {word}", add_special_tokens=False) + [IM_END_ID]
            out.append(Completion(token_ids=ids, logprobs=[0.0] * len(ids), text="", finish_reason="stop",
                                  policy_version=[0] * len(ids)))
        return out

    def update_weights(self, state_dict: dict[str, Any], version: int) -> None:
        pass


def test_evaluate_groups_samples_per_task_and_reports_pass_at_k(tok):
    env_cfg = load_config(None, []).env
    tasks = [Task("t1", "question one", "yes", {"answer_type": "A"}),
             Task("t2", "question two", "yes", {"answer_type": "B"})]
    # One of t1's three samples is right, none of t2's.
    engine = ListEngine(tok, {"question one": ["no", "yes", "no"], "question two": ["no", "no", "no"]})
    r = evaluate(engine, tok, WordEnv, tasks, env_cfg, RolloutConfig(temperature=0.7), greedy=False,
                 samples_per_task=3)
    assert engine.temperatures and set(engine.temperatures) == {0.7}  # the episodes may reach it in several calls
    assert r["mode"] == "sampled(T=0.7)"
    assert (r["n"], r["episodes"], r["pass_k"]) == (2, 6, 3)
    assert r["success"] == pytest.approx(1 / 6) and r["pass_at_k"] == pytest.approx(0.5)
    assert r["by_type"]["A"]["pass_at_k"] == 1.0 and r["by_type"]["B"]["pass_at_k"] == 0.0
    assert "by_hops" not in r  # no task has hops

    greedy = evaluate(ListEngine(tok, ["yes", "no"]), tok, WordEnv, tasks, env_cfg, RolloutConfig(), greedy=True,
                      samples_per_task=3)
    assert (greedy["n"], greedy["episodes"], greedy["success"]) == (2, 2, 0.5)  # greedy: one each
    assert "pass_at_k" not in greedy


def test_a_scripted_oracle_gets_one_engine_per_distinct_prompt(tok):
    """Two tasks with the same question but different answers: a ScriptedEngine recognises an
    episode by its question, so each must be played by its own engine."""
    env_cfg = load_config(None, []).env
    tasks = [Task("t1", "question one", "yes"), Task("t2", "question one", "no"), Task("t3", "question two", "no")]
    scripts = {"t1": ["ANSWER: yes"], "t2": ["ANSWER: no"], "t3": ["ANSWER: no"]}
    made: list[list[str]] = []

    def engine_for(chunk):
        made.append([t.task_id for t in chunk])
        return oracle_engine(tok, scripts)(chunk)

    params = SamplingParams(max_new_tokens=32, stop_token_ids=[IM_END_ID])
    groups = run_samples(engine_for, tok, WordEnv, tasks, params, env_cfg)
    assert made == [["t1"], ["t2", "t3"]]
    assert [g[0].env_info["success"] for g in groups] == [1.0, 1.0, 1.0]
    # One shared engine cannot tell t1 from t2: it replays t2's script for both.
    shared = ScriptedEngine(tok, {"question one": ["ANSWER: no"], "question two": ["ANSWER: no"]})
    groups = run_samples(shared, tok, WordEnv, tasks, params, env_cfg)
    assert [g[0].env_info["success"] for g in groups] == [0.0, 1.0, 1.0]


# -- the Markdown table -------------------------------------------------------------------------


def test_markdown_table_format():
    kg = summarize_samples([[_traj("a", 1, f1=1.0)], [_traj("b", 0, f1=0.5)], [_traj("c", 1, f1=1.0)]])
    kg["by_hops"] = {"1": summarize_samples([[_traj("a", 1, f1=1.0)]]),
                     "2": summarize_samples([[_traj("b", 0, f1=0.5)], [_traj("c", 1, f1=1.0)]])}
    sampled = summarize_samples([[_traj("a", 1, f1=1.0), _traj("a", 0, f1=0.0)],
                                 [_traj("b", 0, f1=0.0), _traj("b", 0, f1=0.0)]], k=2)
    lines = markdown_table(result_rows({"greedy": kg, "sampled": sampled})).splitlines()
    assert lines[0] == "| eval | n | success | ± se | pass@2 | F1 | turns | tokens | gen. tokens | tool errors |"
    assert lines[1] == "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    assert [line.split(" | ")[0] for line in lines[2:]] == ["| greedy", "| greedy, 1-hop", "| greedy, 2-hop", "| sampled"]
    assert lines[2] == "| greedy | 3 | 0.667 | 0.272 | - | 0.833 | 2.00 | 4.0 | 2.0 | 0.00 |"
    assert lines[5] == "| sampled | 2 | 0.250 | 0.177 | 0.500 | 0.250 | 2.00 | 4.0 | 2.0 | 0.00 |"
    assert all(line.count("|") == 11 for line in lines)

    # DB results: no F1 column, per-type rows, a custom label.
    db = summarize_samples([[_traj("a", 1)], [_traj("b", 0)]])
    db["by_type"] = {"INSERT": summarize_samples([[_traj("a", 1)]]), "counting": summarize_samples([[_traj("b", 0)]])}
    lines = markdown_table(result_rows({"greedy": db}, label=lambda mode: "oracle")).splitlines()
    assert lines[0] == "| eval | n | success | ± se | turns | tokens | gen. tokens | tool errors |"
    assert lines[3] == "| oracle, INSERT | 1 | 1.000 | 0.000 | 2.00 | 4.0 | 2.0 | 0.00 |"
    assert lines[4].startswith("| oracle, counting | 1 | 0.000 |")


# -- the CLI ------------------------------------------------------------------------------------


def _dry_run(capsys, *args: str) -> dict[str, Any]:
    import yaml

    assert main(["eval", "--dry-run", *args]) == 0
    return yaml.safe_load(capsys.readouterr().out)


def test_eval_shortcut_flags_map_onto_the_config(capsys):
    cfg = _dry_run(capsys, "--env", "db", "--data", "agentbench_db", "--split", "standard", "--pass-k", "4")
    assert (cfg["env"]["name"], cfg["data"]["source"], cfg["data"]["split"], cfg["eval"]["pass_k"]) == (
        "db", "agentbench_db", "standard", 4)
    cfg = _dry_run(capsys, "--env", "kg", "--data", "metaqa", "--hops", "1,2,3")
    assert (cfg["env"]["name"], cfg["data"]["source"], cfg["env"]["options"]["hops"]) == ("kg", "metaqa", [1, 2, 3])
    # --data alone picks its environment, --env db alone its data source.
    assert _dry_run(capsys, "--data", "agentbench_db")["env"]["name"] == "db"
    assert _dry_run(capsys, "--env", "db")["data"]["source"] == "agentbench_db"
    # Dotted overrides win over the shortcuts.
    assert _dry_run(capsys, "--hops", "1,2,3", "env.options.hops=[2]")["env"]["options"]["hops"] == [2]
    # A mismatch is a config error, not a crash.
    assert main(["eval", "--env", "kg", "--data", "agentbench_db"]) == 2
    assert "env.name" in capsys.readouterr().err


def test_db_eval_without_a_model_says_what_to_do(capsys):
    _data_or_skip("agentbench_dbbench", "dev.jsonl")
    assert main(["eval", "--env", "db", "--data", "agentbench_db"]) == 2
    assert "--model" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.data
def test_oracle_reaches_the_agentbench_db_dev_ceiling(tmp_path, capsys):
    """The full dev split (60 tasks): 43/60 = 0.717, as `python -m tiderl.envs.db` measures."""
    _data_or_skip("agentbench_dbbench", "dev.jsonl")
    out = tmp_path / "db.json"
    assert main(["eval", "--env", "db", "--data", "agentbench_db", "--oracle", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    results = json.loads(out.read_text())
    greedy = results["greedy"]
    assert results["eval"]["oracle"] and results["eval"]["split"] == "dev" and results["eval"]["env"] == "db"
    assert greedy["n"] == 60 and round(greedy["success"] * 60) == 43
    assert greedy["f1"] is None and greedy["stop_reasons"] == {"answer": 60}
    by_type = {kind: round(r["success"] * r["n"]) for kind, r in greedy["by_type"].items()}
    assert by_type["INSERT"] == 20 and by_type["UPDATE"] == 20
    assert sum(by_type.values()) - 40 == 3  # SELECT-type: 3 of 20
    assert greedy["by_type"]["INSERT"]["n"] == 20 and greedy["by_type"]["INSERT"]["success"] == 1.0
    assert "| oracle | 60 | 0.717 |" in printed and "| oracle, INSERT | 20 | 1.000 |" in printed


@pytest.mark.slow
@pytest.mark.data
def test_oracle_reaches_the_metaqa_ceilings(tmp_path, capsys):
    """300 test questions per hop count, seed 0: the sample of tests/test_kg_ceiling.py, where
    the env authors measured 0.943 / 1.000 / 1.000."""
    _data_or_skip("metaqa", "kb.txt")
    out = tmp_path / "metaqa.json"
    assert main(["eval", "--env", "kg", "--data", "metaqa", "--hops", "1,2,3", "--oracle",
                 "data.eval_size=900", "env.options.num_train_tasks=10", "--json", str(out)]) == 0
    greedy = json.loads(out.read_text())["greedy"]
    by_hops = greedy["by_hops"]
    assert {h: r["n"] for h, r in by_hops.items()} == {"1": 300, "2": 300, "3": 300}
    assert round(by_hops["1"]["success"] * 300) == 283  # 0.943: MetaQA's merged same-title films
    assert by_hops["2"]["success"] == 1.0 and by_hops["3"]["success"] == 1.0
    assert greedy["tool_errors"] == 0 and greedy["stop_reasons"] == {"answer": 900}
    # One get_neighbors per hop, then the answer.
    assert [by_hops[h]["turns"] for h in "123"] == [2.0, 3.0, 4.0]
    assert by_hops["1"]["f1"] > 0.97
    assert "| oracle, 3-hop | 300 | 1.000 |" in capsys.readouterr().out


def test_oracle_on_the_embedded_world_solves_everything(tmp_path):
    out = tmp_path / "embedded.json"
    assert main(["eval", "--oracle", "data.eval_size=40", "--json", str(out)]) == 0
    greedy = json.loads(out.read_text())["greedy"]
    assert greedy["n"] == 40 and greedy["success"] == 1.0 and set(greedy["by_hops"]) == {"1", "2"}


@pytest.mark.data
def test_oracle_on_agentbench_kg_over_a_sparql_endpoint(tmp_path):
    """An AgentBench KG question through `tiderl eval` against a loopback SPARQL endpoint that
    serves the question's synthetic trace graph (no Freebase here): the gold trace solves it."""
    pytest.importorskip("pyoxigraph", reason="pyoxigraph serves the loopback SPARQL endpoint")
    from support import sparql_server
    from tiderl.envs.setup import load_setup
    from tiderl.envs.kg.agentbench import trace_graph
    from tiderl.envs.kg.rdf import FREEBASE, to_ntriples

    _data_or_skip("agentbench_kg", "dev.json")
    overrides = ["data.eval_size=1", "data.seed=3"]
    (task,) = load_setup(load_config(None, ["data.source=agentbench_kg", "env.options.sparql_endpoint=x", *overrides])).eval_tasks
    out = tmp_path / "kg.json"
    with sparql_server(to_ntriples(trace_graph(task), FREEBASE)) as (url, _):
        assert main(["eval", "--data", "agentbench_kg", "--oracle", f"env.options.sparql_endpoint={url}", *overrides,
                     "--json", str(out)]) == 0
    greedy = json.loads(out.read_text())["greedy"]
    assert greedy["n"] == 1 and greedy["success"] == 1.0 and greedy["tool_errors"] == 0
    assert greedy["turns"] == len(task.meta["actions"]) + 1
    assert set(greedy["by_type"]) == {task.meta["answer_type"]}
