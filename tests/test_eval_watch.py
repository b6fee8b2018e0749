"""Watching `tiderl eval`: a progress callback per episode with the running success, a table
per stop reason, and transcripts (JSONL and Markdown) of the first N episodes."""

from __future__ import annotations

import json

import pytest

from tiderl.agent.loop import ScriptedEngine, play_episodes
from tiderl.cli import main
from tiderl.config import EnvConfig, RolloutConfig
from tiderl.embedded.tiny import train_tokenizer
from tiderl.envs.protocol import Action, StepResult, Task
from tiderl.evaluate import EvalProgress, append_training_transcripts, evaluate, stop_reason_table, transcript
from tiderl.rollout.base import sampling_params

SMALL = ["env.options.num_films=20", "env.options.num_people=20", "env.options.num_train_tasks=50", "data.eval_size=6"]


class CountdownEnv:
    """Succeeds when the turn says "done"; any other turn gets an observation."""

    def system_prompt(self) -> str:
        return "Say done."

    def tool_schemas(self) -> list:
        return []

    def reset(self, task: Task) -> str:
        return task.prompt

    def step(self, action: Action) -> StepResult:
        if "done" in action.text:
            return StepResult([], reward=1.0, done=True, info={"success": 1})
        return StepResult(["not yet"])

    def finish(self, reason: str) -> StepResult:
        return StepResult([], done=True, info={"success": 0})


def test_progress_stop_reasons_and_transcripts_of_an_evaluation():
    tok = train_tokenizer(["Say done.", "task one", "task two", "task three", "not yet", "done", "wait"] * 4,
                          vocab_size=300)
    tasks = [Task("t1", "task one", ""), Task("t2", "task two", ""), Task("t3", "task three", "")]
    scripts = {"task one": ["done"], "task two": ["wait", "wait"], "task three": ["wait", "done"]}
    progress = EvalProgress(len(tasks), "greedy", enabled=False, keep=2)
    result = evaluate(ScriptedEngine(tok, scripts), tok, CountdownEnv, tasks,
                      EnvConfig(max_turns=2, max_total_tokens=400), RolloutConfig(), True, on_episode=progress)
    assert progress.done == 3 and progress.successes == 2
    assert progress.status() == "success 0.667, answer 2, max_turns 1"
    rows = result["by_stop_reason"]
    assert list(rows) == ["answer", "max_turns"]  # most frequent first
    assert rows["answer"]["episodes"] == 2 and rows["answer"]["success"] == 1.0
    assert rows["max_turns"]["success"] == 0.0 and rows["max_turns"]["turns"] == 2.0
    assert abs(rows["answer"]["share"] - 2 / 3) < 1e-9
    table = stop_reason_table(rows)
    assert "| answer | 2 | 0.667 | 1.000 |" in table and "| max_turns | 1 | 0.333 | 0.000 |" in table
    # Transcripts: the kept episodes, their segments joined are the decoded episode.
    assert len(progress.kept) == 2
    task, trajectory = progress.kept[0]
    record = transcript(tok, task, trajectory)
    assert "".join(s["text"] for s in record["segments"]) == tok.decode(trajectory.tokens, skip_special_tokens=False)
    assert [s["role"] for s in record["segments"]][:2] == ["context", "model"]
    assert json.loads(json.dumps(record))["task_id"] == task.task_id


def test_eval_command_shows_progress_stop_reasons_and_writes_transcripts(tmp_path, capsys):
    prefix = tmp_path / "tr" / "run"
    code = main(["eval", "--oracle", "--transcripts", "2", "--transcripts-out", str(prefix), *SMALL,
                 "--json", str(tmp_path / "r.json")])
    out, err = capsys.readouterr()
    assert code == 0
    assert "eval greedy" in err and "success 1.000" in err  # the progress bar (the oracle solves all)
    assert "stop reasons (oracle)" in out and "| answer | 6 | 1.000 | 1.000 |" in out
    records = [json.loads(line) for line in (tmp_path / "tr" / "run_greedy.jsonl").read_text().splitlines()]
    assert len(records) == 2 and all(r["success"] == 1 and r["stop_reason"] == "answer" for r in records)
    assert any(s["role"] == "model" and "<tool_call>" in s["text"] for s in records[0]["segments"])
    markdown = (tmp_path / "tr" / "run_greedy.md").read_text()
    assert markdown.count("\n## ") == 2 and "**model**" in markdown and "**environment**" in markdown
    assert records[0]["prompt"] in markdown
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["greedy"]["by_stop_reason"]["answer"]["episodes"] == 6


def test_training_transcripts_put_rewarded_episodes_first_and_append(tmp_path):
    tok = train_tokenizer(["Say done.", "task one", "task two", "task three", "not yet", "done", "wait"] * 4,
                          vocab_size=300)
    tasks = [Task("t1", "task one", ""), Task("t2", "task two", ""), Task("t3", "task three", "")]
    scripts = {"task one": ["wait", "wait"], "task two": ["wait", "wait"], "task three": ["done"]}
    batch = play_episodes(ScriptedEngine(tok, scripts), tok, CountdownEnv, tasks,
                          sampling_params(RolloutConfig(), tok.eos_token_id, greedy=True), 2, 400)
    assert [t.reward for t in batch] == [0.0, 0.0, 1.0]
    assert append_training_transcripts(tok, batch, 1, 0, tmp_path) == []
    assert not (tmp_path / "train.jsonl").exists()
    picked = append_training_transcripts(tok, batch, 1, 2, tmp_path)
    assert [t.task_id for t in picked] == ["t3", "t1"]  # the rewarded one, then batch order
    append_training_transcripts(tok, batch, 2, 5, tmp_path)
    records = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert [(r["step"], r["task_id"]) for r in records] == [
        (1, "t3"), (1, "t1"), (2, "t3"), (2, "t1"), (2, "t2")]
    assert records[0]["prompt"] is None and records[0]["reward"] == 1.0
    markdown = (tmp_path / "train_latest.md").read_text()
    assert markdown.startswith("# Training step 2") and markdown.count("\n## ") == 3
    assert "- step: 2" in markdown and "- question:" not in markdown


@pytest.mark.slow
def test_train_command_writes_transcripts_per_step(tmp_path):
    code = main(["train", "--config", "configs/kg_sao_tiny.yaml", *SMALL, "model.tiny.hidden_size=32",
                 "model.tiny.num_layers=1", "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1",
                 "model.warmstart.steps=2", "model.warmstart.num_traces=40", "rollout.batch_size=4", "train.steps=2",
                 "log.transcripts=3",
                 "log.progress=false", f"model.cache_dir={tmp_path / 'cache'}", f"run_dir={tmp_path / 'run'}"])
    assert code == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "transcripts" / "train.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 1, 1, 2, 2, 2]
    assert all(any(s["role"] == "model" for s in r["segments"]) for r in records)
    assert (tmp_path / "run" / "transcripts" / "train_latest.md").read_text().startswith("# Training step 2")
