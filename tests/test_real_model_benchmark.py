"""benchmarks/real_model.py: the rule it reports by (fixed before any run), and that the command
it runs is a valid configuration of the recipe for both engines."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

from tiderl.config import load_config

ROOT = Path(__file__).resolve().parents[1]


def _module():
    spec = importlib.util.spec_from_file_location("real_model_bench", ROOT / "benchmarks" / "real_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rows(before, after, se=0.03, steps=3):
    out = [{"step": 0, "eval/success": before, "eval/success_se": se, "time/eval_s": 600.0}]
    for step in range(1, steps + 1):
        row = {"step": step, "reward": 0.25, "episode/action_tokens": 280.0, "step_s": 300.0 + step,
               "time/wait_batch_s": 70.0, "time/train_s": 200.0 + step, "time/sync_s": 5.0, "time/prep_s": 30.0}
        if step == steps:
            row.update({"eval/success": after, "eval/success_se": se})
        out.append(row)
    return out


@pytest.mark.parametrize("after, learns", [(0.40, True), (0.30, False), (0.20, False)])
def test_the_verdict_is_the_gain_against_three_standard_errors_of_the_difference(after, learns):
    bench = _module()
    lines, figures = bench.report(rows(0.25, after))
    assert figures["learns"] is learns and figures["before"] == 0.25 and figures["after_step"] == 3
    assert figures["gain_se"] == pytest.approx(0.03 * 2 ** 0.5)
    assert figures["median_s"]["train"] == 202.0 and figures["median_s"]["step"] == 302.0
    assert len(lines) == 1 + 3 + 2  # header, 3 steps, 2 held-out figures
    last = bench.last_line(figures)
    assert last.startswith("real model: held-out success 0.250 -> ") and ("learns" in last) is learns


def test_a_run_without_both_figures_is_reported_incomplete():
    bench = _module()
    _, figures = bench.report(rows(0.25, 0.4)[1:])  # no step-0 evaluation
    assert "z" not in figures and "incomplete" in bench.last_line(figures)
    _, figures = bench.report([])
    assert figures["steps"] == 0 and "incomplete" in figures["verdict"]


@pytest.mark.parametrize("engine", ["vllm", "torch"])
def test_the_command_is_a_valid_configuration_of_the_recipe(engine, tmp_path):
    bench = _module()
    args = argparse.Namespace(config=bench.RECIPE, steps=4, eval_n=16, engine=engine, out=str(tmp_path / "r"),
                              overrides=["rollout.max_new_tokens=64"])
    command = bench.train_command(args)
    at = command.index("--config")
    cfg = load_config(command[at + 1], command[at + 2:])
    assert cfg.eval.before and cfg.eval.every == 4 and cfg.train.steps == 4 and cfg.eval.n == 16
    assert cfg.rollout.max_new_tokens == 64
    assert (cfg.rollout.engine == "http") is (engine == "vllm")
    if engine == "vllm":
        assert cfg.rollout.options.weight_sync == "collective" and cfg.rollout.options.server == "vllm"


def _records(successes):
    return [{"task_id": f"t{i}", "success": s} for i, s in enumerate(successes)]


def test_the_paired_rule_counts_gains_and_losses_per_task():
    bench = _module()
    # 200 tasks: 22 gained, 8 lost, the rest unchanged (30 solved both times): the split seen before
    # the rule was fixed, 2.6 paired SE, McNemar p 0.016.
    before = [False] * 22 + [True] * 8 + [True] * 30 + [False] * 140
    after = [True] * 22 + [False] * 8 + [True] * 30 + [False] * 140
    p = bench.paired_figures(_records(before), _records(after))
    assert (p["n"], p["gained"], p["lost"]) == (200, 22, 8)
    assert p["gain"] == pytest.approx(0.07) and p["before"] == pytest.approx(0.19)
    assert p["z"] == pytest.approx(2.6, abs=0.05) and p["learns"] is False
    assert p["mcnemar_p"] == pytest.approx(0.0161, abs=5e-4)
    # The same split on three times the tasks clears the line.
    p3 = bench.paired_figures(_records(before * 3), _records(after * 3))
    assert p3["z"] > 3 and p3["learns"] is True and "learns" in bench.paired_line(p3)
    # Tasks only one evaluation scored are left out; none shared is an error.
    assert bench.paired_figures(_records(before), _records(after)[:100])["n"] == 100
    with pytest.raises(ValueError, match="share 0"):
        bench.paired_figures(_records([True]), [{"task_id": "other", "success": True}])


def test_mcnemar_is_symmetric_and_one_without_changes():
    bench = _module()
    assert bench.mcnemar_p(0, 0) == 1.0 and bench.mcnemar_p(3, 3) == 1.0
    assert bench.mcnemar_p(10, 0) == pytest.approx(2 / 2 ** 10) == bench.mcnemar_p(0, 10)


def test_the_paired_evaluations_are_valid_configurations(tmp_path):
    bench = _module()
    args = argparse.Namespace(config="configs/smollm2-135m_place_value_cpu.yaml", paired=600,
                              overrides=["seed=1", "data.eval_size=600"])
    for model in (None, str(tmp_path / "actor")):
        command = bench.eval_command(args, model, tmp_path / "paired_before")
        assert command[3] == "eval" and ("--model" in command) is (model is not None)
        at = command.index("--config")
        overrides = command[at + 2:command.index("--transcripts")]
        cfg = load_config(command[at + 1], overrides)
        assert cfg.data.eval_size == 600 and cfg.seed == 1 and cfg.eval.greedy and not cfg.eval.sampled
        assert command[command.index("--transcripts") + 1] == "600"
