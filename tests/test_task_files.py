"""Your own tasks from files (`data.train_files`, `data.eval_files`, `data.fields`) with the math
environment: JSON Lines and Parquet, GSM8K's `#### N` answers and MATH's `\\boxed{}` solutions read
as they are, the errors that name the file and the fix, and GSM8K's own train file training with
a held-out evaluation every step (skipped when the data is absent; never copied into the repo)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from support import block_import, data_roots
from tiderl.config import ConfigError, load_config
from tiderl.envs.math.data import file_tasks, reference_answer
from tiderl.envs.setup import load_setup, read_records, task_files

GSM8K_RECORD = {"question": "Natalia sold 48 clips in April and half as many in May. How many in all?",
                "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nSo 48+24 = <<48+24=72>>72.\n#### 1,072"}
MATH_RECORD = {"problem": "What is $\\frac{1}{2} + \\frac{1}{3}$?", "level": "Level 1", "type": "Prealgebra",
               "solution": "We have $\\frac{3}{6} + \\frac{2}{6} = \\boxed{\\frac{5}{6}}$."}


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize("text, gold", [
    (GSM8K_RECORD["answer"], "1072"),                        # GSM8K: after ####, separators removed
    (MATH_RECORD["solution"], "\\frac{5}{6}"),               # MATH: the last box, braces balanced
    ("first \\boxed{1}, then \\boxed{\\{2, 3\\}}", "\\{2, 3\\}"),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "\\left( 3, \\frac{\\pi}{2} \\right)"),  # MATH-500's answer: as is
    (" 42 ", "42"),
])
def test_reference_answers_in_the_common_formats(text, gold):
    assert reference_answer(text) == gold


def test_gsm8k_and_math_records_become_tasks_as_they_are(tmp_path):
    gsm = write_jsonl(tmp_path / "gsm" / "train.jsonl", [GSM8K_RECORD, {**GSM8K_RECORD, "answer": "x\n#### 5"}])
    math = write_jsonl(tmp_path / "competition" / "algebra.jsonl", [{**MATH_RECORD, "unique_id": "a/1.json"}])
    tasks = file_tasks([gsm, math], {})
    assert [(t.task_id, t.answer) for t in tasks] == [
        ("gsm/train-0", "1072"), ("gsm/train-1", "5"), ("competition/algebra-a/1.json", "\\frac{5}{6}")]
    assert tasks[2].prompt == MATH_RECORD["problem"] and tasks[0].meta["dataset"] == "gsm/train"
    # A record whose fields have other names: data.fields says which.
    own = write_jsonl(tmp_path / "own.jsonl", [{"q": "2 + 2?", "gold": 4, "key": "k7"}])
    assert [(t.task_id, t.prompt, t.answer) for t in file_tasks([own], {"question": "q", "answer": "gold",
                                                                         "id": "key"})] == [
        (f"{tmp_path.name}/own-k7", "2 + 2?", "4")]
    with pytest.raises(ValueError, match=r"own.jsonl: record 1: no question or problem or prompt field.*data.fields"):
        file_tasks([own], {})


def test_a_broken_line_names_the_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(GSM8K_RECORD) + "\n\n{not json\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:3: not a JSON line"):
        read_records(path)
    path.write_text("[1, 2]\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: expected a JSON object, got list"):
        read_records(path)


def test_parquet_reads_the_same_tasks_as_jsonl(tmp_path):
    pa = pytest.importorskip("pyarrow", reason="Parquet needs pyarrow (pip install 'tiderl[data]')")
    import pyarrow.parquet as pq

    records = [GSM8K_RECORD, {**GSM8K_RECORD, "question": "Another?", "answer": "y\n#### -3"}]
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "train.parquet")
    jsonl = write_jsonl(tmp_path / "train.jsonl", records)
    assert read_records(tmp_path / "train.parquet") == records
    assert [(t.prompt, t.answer) for t in file_tasks([tmp_path / "train.parquet"], {})] == [
        (t.prompt, t.answer) for t in file_tasks([jsonl], {})]


def test_parquet_without_pyarrow_names_the_extra(tmp_path, monkeypatch):
    block_import(monkeypatch, "pyarrow")
    (tmp_path / "t.parquet").write_bytes(b"PAR1")
    with pytest.raises(ImportError, match=r"pip install 'tiderl\[data\]'"):
        read_records(tmp_path / "t.parquet")


def test_files_replace_the_sources_tasks_and_are_found_under_the_data_root(tmp_path, monkeypatch):
    root = tmp_path / "data"
    write_jsonl(root / "mine" / "train.jsonl", [GSM8K_RECORD] * 3)
    write_jsonl(root / "mine" / "test.jsonl", [MATH_RECORD] * 2)
    monkeypatch.setenv("TIDERL_DATA_DIR", str(root))
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, ["env.name=math", "data.train_files=[mine/train.jsonl]"])
    setup = load_setup(cfg)
    assert [t.answer for t in setup.train_tasks] == ["1072"] * 3 and setup.name == "mine/train (held out: arithmetic)"
    assert setup.eval_tasks and all(t.meta["dataset"] == "arithmetic" for t in setup.eval_tasks)  # the source's
    both = load_setup(load_config(None, ["env.name=math", "data.train_files=[mine/train.jsonl]",
                                         f"data.eval_files=[{root / 'mine' / 'test.jsonl'}]"]))
    assert [t.answer for t in both.eval_tasks] == ["\\frac{5}{6}"] * 2
    with pytest.raises(ValueError, match="held-out tasks must not be trained on"):
        load_setup(load_config(None, ["env.name=math", "data.train_files=[mine/train.jsonl]",
                                      "data.eval_files=[mine/train.jsonl]"]))
    with pytest.raises(FileNotFoundError, match=r"'mine/nope.jsonl' not found .*TIDERL_DATA_DIR"):
        task_files(["mine/nope.jsonl"])


@pytest.mark.parametrize("more, field", [
    (["env.name=repo", "data.train_files=[a.jsonl]"], "data.train_files"),
    (["env.name=db", "data.fields={question: q}"], "data.fields"),
    (["env.name=math", "data.fields={prompt: q}"], "data.fields"),
    (["env.name=math", "data.fields={tests: t}"], "data.fields"),
    (["env.name=code", "data.fields={answer: a}"], "data.fields"),
    (["env.name=kg", "data.fields={tests: t}"], "data.fields"),
])
def test_file_settings_an_environment_would_not_read_are_refused(more, field):
    with pytest.raises(ConfigError) as error:
        load_config(None, more)
    assert error.value.field == field and "Fix:" in str(error.value)


# -- GSM8K's own train file -------------------------------------------------------------------------


def gsm8k_root() -> Path:
    for root in data_roots():
        if (root / "gsm8k" / "train.jsonl").is_file() and (root / "gsm8k" / "test.jsonl").is_file():
            return root
    pytest.skip(f"GSM8K not found under {', '.join(map(str, data_roots()))} (gsm8k/train.jsonl, gsm8k/test.jsonl): "
                "set TIDERL_DATA_DIR to the folder that holds gsm8k/")


@pytest.mark.data
@pytest.mark.slow
def test_gsm8k_train_file_trains_with_math_and_evaluates_every_step(tmp_path, monkeypatch):
    """GSM8K's train.jsonl as it is (7,473 records, answers after ####) trains a tiny model with
    env.name=math; the held-out tasks are GSM8K's test questions (data.source=gsm8k), none of them
    a training question, evaluated after every step; the W&B (offline) and MLflow (local store)
    runs get each step's held-out success (issue 32's done-when, in one run)."""
    pytest.importorskip("wandb", reason="log.trackers needs the trackers extra (pip install 'tiderl[trackers]')")
    pytest.importorskip("mlflow", reason="log.trackers needs the trackers extra (pip install 'tiderl[trackers]')")
    from mlflow.tracking import MlflowClient

    from tiderl.embedded.tiny import init_tiny_model, tiny_qwen2_config, train_tokenizer
    from tiderl.evaluate import evaluate_modes, oracle_engine, oracle_limits
    from tiderl.models.loading import save_model_dir
    from tiderl.recipe import train
    from tiderl.run import build_run

    root = gsm8k_root()
    base = ["env.name=math", "data.source=gsm8k", "data.train_files=[gsm8k/train.jsonl]", f"data.data_dir={root}",
            "data.eval_size=50", f"run_dir={tmp_path / 'run'}"]
    setup = load_setup(load_config(None, base))
    assert len(setup.train_tasks) == 7473 and setup.train_tasks[0].answer == "72"
    assert {t.prompt for t in setup.train_tasks}.isdisjoint(t.prompt for t in setup.eval_tasks)
    texts = [setup.make_env().system_prompt(), "\\boxed{72}"] + [t.prompt for t in setup.train_tasks[:400]] + [
        t.prompt for t in setup.eval_tasks]
    tokenizer = train_tokenizer(texts, vocab_size=1000)
    model = save_model_dir(init_tiny_model(tiny_qwen2_config(len(tokenizer), hidden_size=64, num_layers=1, num_heads=2,
                                                             num_kv_heads=1, max_position_embeddings=1024), seed=0),
                           tokenizer, tmp_path / "model")
    cfg = load_config(None, [*base, f"model.path={model}", "algo.name=grpo", "algo.group_size=2", "rollout.batch_size=4",
                             "rollout.max_new_tokens=8", "env.max_turns=1", "env.max_total_tokens=768",
                             "train.micro_batch_tokens=4096", "train.steps=2", "eval.every=1", "eval.n=4",
                             "log.progress=false", "log.tensorboard=false", "system.trainer_threads=1",
                             "log.trackers=[wandb, mlflow]"])
    store = f"file:{tmp_path / 'mlruns'}"
    for key, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "MLFLOW_TRACKING_URI": store,
                       "MLFLOW_ALLOW_FILE_STORE": "true", "MLFLOW_EXPERIMENT_NAME": "tiderl-gsm8k"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("WANDB_DIR", raising=False)
    run = build_run(cfg)
    trained: list[str] = []
    history, _ = train(run, observer=lambda version, metrics, batch: trained.extend(t.task_id for t in batch))
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval/success" in r] == [1, 2]
    assert all(0 <= r["eval/success"] <= 1 and r["eval/success_se"] >= 0 for r in rows)
    assert len(list((tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb"))) == 1  # written offline
    client = MlflowClient(store)
    [mlrun] = client.search_runs([client.get_experiment_by_name("tiderl-gsm8k").experiment_id])
    points = client.get_metric_history(mlrun.info.run_id, "eval.success")
    assert [(p.step, p.value) for p in points] == [(r["step"], pytest.approx(r["eval/success"])) for r in rows
                                                   if "eval/success" in r]
    train_ids = {t.task_id for t in setup.train_tasks}
    assert len(trained) == 8 and set(trained) <= train_ids and all(i.startswith("gsm8k/train-") for i in trained)
    # The rewards check the answers read from the file: the reference answer is rewarded, another is not.
    tasks = setup.train_tasks[:6]
    for turn, success in (("The answer is \\boxed{{{}}}.", 1.0), ("The answer is \\boxed{{-{}1}}.", 0.0)):
        scripts = {t.task_id: [turn.format(t.answer)] for t in tasks}
        env_cfg, rollout = oracle_limits(cfg.env, cfg.rollout, scripts)
        results = evaluate_modes(dataclasses.replace(cfg, env=env_cfg, rollout=rollout),
                                 oracle_engine(tokenizer, scripts), tokenizer, setup.make_env, tasks, oracle=True)
        assert results["greedy"]["success"] == success
