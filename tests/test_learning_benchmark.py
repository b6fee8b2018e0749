"""benchmarks/learning.py --config: the presets move onto another task whole (its environment,
options, prompt, answer length, model shape and warm start), keeping their own algorithms, so
SAO and GRPO compare on that task and not on a mixture of it and the presets' knowledge graph."""

from __future__ import annotations

import dataclasses

import pytest

from support import load_benchmark
from tiderl.config import load_config


def _module():
    return load_benchmark("learning")


@pytest.mark.parametrize("task", ["configs/math_place_sao_tiny.yaml", "configs/metaqa_sao_tiny.yaml"])
@pytest.mark.parametrize("preset", ["configs/sao.yaml", "configs/grpo.yaml"])
def test_the_presets_move_onto_another_task_whole_and_keep_their_algorithm(task, preset):
    overrides = _module().task_overrides(task)
    moved, target, own = load_config(preset, overrides), load_config(task), load_config(preset)
    for section, field in [("env", "name"), ("env", "options"), ("env", "max_turns"), ("env", "max_total_tokens"),
                           ("env", "system_prompt"), ("data", "source"), ("rollout", "max_new_tokens"),
                           ("model", "tiny"), ("model", "warmstart")]:
        assert getattr(getattr(moved, section), field) == getattr(getattr(target, section), field), (section, field)
    assert dataclasses.asdict(moved.algo) == dataclasses.asdict(own.algo)
    assert _module().task_overrides(None) == []


def _row(mode: str, seed: int, successes: list[float]) -> dict:
    curve = [{"step": 10 * i, "generated_tokens": 1000 * i, "success": s} for i, s in enumerate(successes)]
    return {"mode": mode, "seed": seed, "gain": successes[-1] - successes[0], "start": successes[0],
            "final": successes[-1], "steps": 10.0 * (len(successes) - 1), "wall_s": 1.0, "trainer_s": 1.0,
            "fwd_bwd_tokens": 0, "fwd_tokens": 0, "warmup_tokens": 0, "goodput_tokens_per_s": 1.0,
            "time_to_target_s": 1.0, "curve": curve}


def test_the_report_judges_the_area_by_the_same_rule(capsys):
    """Both modes end at the same success; SAO gets there earlier on every seed: no difference in
    the final gain, SAO higher in the mean success over the budget (seeds 5-9's rule)."""
    bench = _module()
    rows = []
    for seed, jitter in enumerate([0.0, 0.01, 0.02, -0.01, 0.015]):
        rows.append(_row("sao", seed, [0.4, 0.8 + jitter, 0.9, 1.0]))
        rows.append(_row("grpo", seed, [0.4, 0.6 + jitter / 2, 0.8, 1.0]))
    bench.report(rows, ["sao", "grpo"])
    out = capsys.readouterr().out
    assert "| sao - grpo | 5 | +0.000 [+0.000, +0.000] | no difference shown |" in out
    area_line = next(line for line in out.splitlines() if line.startswith("| sao - grpo") and "SAO higher" in line)
    assert area_line.startswith("| sao - grpo | 5 | +0.1")
    assert "area SAO - GRPO +0.1" in out.splitlines()[-1]
