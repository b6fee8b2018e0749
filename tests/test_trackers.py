"""Experiment trackers (`log.trackers`): a short training run with held-out evaluations writes a
W&B run offline (WANDB_MODE=offline) and an MLflow run into a local store (MLFLOW_TRACKING_URI),
each holding every step's metrics as metrics.jsonl has them and the resolved config; read back
with the real packages, no network. Configs naming an unknown or uninstalled tracker are refused
before any work."""

from __future__ import annotations

import importlib.util
import json
import struct
from pathlib import Path

import pytest
import yaml

from tiderl.config import ConfigError, load_config

import user_env


def test_unknown_or_missing_trackers_are_refused(monkeypatch):
    with pytest.raises(ConfigError, match=r"log.trackers: 'neptune' is not a tracker. Fix: use wandb or mlflow"):
        load_config(None, ["log.trackers=[neptune]"])
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(ConfigError, match=r"log.trackers: mlflow is not installed. Fix: pip install 'tiderl\[trackers\]'"):
        load_config(None, ["log.trackers=[mlflow]"])


def wandb_records(path: Path) -> list:
    """The records of an offline W&B run file (`run-<id>.wandb`): W&B's LevelDB-style log (a
    7-byte file header, then records with a 7-byte header, crc/length/type, in 32 KiB blocks,
    split over blocks as FIRST/MIDDLE/LAST), each a `wandb_internal_pb2.Record`."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", data[:7]
    pos, part, out = 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (length == 0 and kind == 0):  # the rest of a block is padding
            pos += left
            continue
        part += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(part)
            out.append(record)
            part = b""
    return out


@pytest.mark.slow
def test_wandb_offline_and_mlflow_local_runs_hold_the_metrics_and_the_config(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="log.trackers needs the trackers extra (pip install 'tiderl[trackers]')")
    pytest.importorskip("mlflow", reason="log.trackers needs the trackers extra (pip install 'tiderl[trackers]')")
    from mlflow.tracking import MlflowClient

    from tiderl.embedded.tiny import init_tiny_model, tiny_qwen2_config, train_tokenizer
    from tiderl.models.loading import save_model_dir
    from tiderl.recipe import train
    from tiderl.run import build_run

    store = f"file:{tmp_path / 'mlruns'}"
    for key, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "MLFLOW_TRACKING_URI": store,
                       "MLFLOW_ALLOW_FILE_STORE": "true", "MLFLOW_EXPERIMENT_NAME": "tiderl-test"}.items():
        monkeypatch.setenv(key, value)  # MLflow 3 asks for the opt-in to its file store
    monkeypatch.delenv("WANDB_DIR", raising=False)
    tokenizer = train_tokenizer(user_env.corpus(), vocab_size=300)
    model = save_model_dir(init_tiny_model(tiny_qwen2_config(len(tokenizer), hidden_size=64, num_layers=1, num_heads=2,
                                                             num_kv_heads=1, max_position_embeddings=512), seed=0),
                           tokenizer, tmp_path / "model")
    run_dir = tmp_path / "run"
    cfg = load_config(None, ["env.name=resume_env:LengthReward", "data.source=parity", f"model.path={model}",
                             f"run_dir={run_dir}", "algo.name=grpo", "algo.group_size=2", "rollout.batch_size=4",
                             "env.max_turns=2", "env.max_total_tokens=200", "rollout.max_new_tokens=16",
                             "train.micro_batch_tokens=2048", "train.steps=2", "eval.every=1", "eval.n=6",
                             "log.progress=false", "log.tensorboard=false", "log.trackers=[wandb, mlflow]",
                             "system.trainer_threads=1"])
    train(build_run(cfg))
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all("eval/success" in r for r in rows)

    # W&B, offline, under the run dir: the config once, then one history record per step.
    [path] = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    records = wandb_records(path)
    [run] = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.project == "tiderl" and run.display_name == "run"
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["model"]["path"] == str(model) and config["eval"]["every"] == 1 and config["log"]["trackers"] == [
        "wandb", "mlflow"]
    history = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    assert [h["_step"] for h in history] == [1, 2]
    for h, row in zip(history, rows):
        for key in ("eval/success", "eval/success_se", "eval/sampled/success", "reward", "policy/loss"):
            assert h[key] == pytest.approx(row[key], rel=1e-12), key

    # MLflow, in the local store: the config as an artifact, every metric with its step (`/` as `.`).
    client = MlflowClient(store)
    [mlrun] = client.search_runs([client.get_experiment_by_name("tiderl-test").experiment_id])
    assert mlrun.info.run_name == "run" and mlrun.info.status == "FINISHED"
    assert {"reward", "reward.shaped_mean", "eval.success", "eval.greedy.success_se"} <= set(mlrun.data.metrics)
    for key in ("eval/success", "reward", "policy/loss"):
        points = client.get_metric_history(mlrun.info.run_id, key.replace("/", "."))
        assert [(p.step, p.value) for p in points] == [(r["step"], pytest.approx(r[key])) for r in rows], key
    logged = yaml.safe_load(Path(client.download_artifacts(mlrun.info.run_id, "config.yaml", str(tmp_path))).read_text())
    assert logged["run_dir"] == str(run_dir) and logged["algo"]["name"] == "grpo"
