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
