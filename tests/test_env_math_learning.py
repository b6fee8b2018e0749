"""The arithmetic learning setup end to end, kept short: build a small embedded tiny model for
data.source=arithmetic (calculator demonstrations with operation confusions), then a few SAO
steps and a greedy held-out evaluation. The learning figure itself comes from
`tiderl demo --config configs/math_arith_sao_tiny.yaml` (docs/env_math.md), not from a test."""

import json
from pathlib import Path

import pytest

from tiderl.config import load_config
from tiderl.evaluate import evaluate
from tiderl.recipe import train
from tiderl.run import build_run

pytestmark = pytest.mark.slow

SMALL = [
    "env.options.num_train_tasks=200", "data.eval_size=8",
    "model.tiny.vocab_size=512", "model.tiny.hidden_size=64", "model.tiny.num_heads=2",
    "model.tiny.num_kv_heads=1", "model.warmstart.num_traces=120", "model.warmstart.steps=15",
    "model.warmstart.batch_size=16", "rollout.batch_size=8", "train.steps=2",
    "algo.critic_warmup_steps=1", "log.progress=false", "env.options.verify_timeout_s=3",
]


def test_arithmetic_tiny_model_builds_trains_and_evaluates(tmp_path):
    cfg = load_config("configs/math_arith_sao_tiny.yaml",
                      SMALL + [f"model.cache_dir={tmp_path / 'cache'}", f"run_dir={tmp_path / 'run'}"])
    run = build_run(cfg)
    model_dir = Path(run.model_path)
    assert model_dir.name.startswith("math-tiny-arithmetic-")
    report = json.loads((model_dir / "tiderl_build.json").read_text())
    assert report["demonstrations"] == 120 and 0.0 < report["demonstration_success"] < 1.0
    assert set(report["confusion_rates"]) >= {"add", "sub", "linear_plus"}
    assert report["sft_loss_last"] < report["sft_loss_first"]

    history, _ = train(run)
    assert len(history) == 2 and run.step == 2 and run.engine.version == 2
    for h in history:
        assert 0.0 <= h["success"] <= 1.0 and h["episode/turns"] >= 1

    result = evaluate(run.engine, run.tokenizer, run.make_env, run.setup.eval_tasks, cfg.env, cfg.rollout,
                      greedy=True)
    assert result["n"] == 8 and 0.0 <= result["success"] <= 1.0
