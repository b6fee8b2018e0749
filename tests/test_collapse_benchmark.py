"""benchmarks/collapse.py: the overrides after its options reach every run's config (how its runs
take rollouts from a bf16 server, the engine/trainer mismatch issue 33 calls for)."""

from __future__ import annotations

import argparse

import pytest

from support import load_benchmark


def _module():
    return load_benchmark("collapse")


def test_every_run_takes_the_command_lines_overrides(tmp_path):
    bench = _module()
    bf16 = ["rollout.engine=http", "rollout.options.launch=1", "rollout.options.server=vllm",
            "rollout.options.server_dtype=bfloat16", "rollout.options.probe_tolerance=0.5"]
    args = argparse.Namespace(steps=250, eval_n=100, override=bf16)
    for algo, staleness in bench.MODES:
        cfg = bench.run_config(algo, staleness, 3, args, "tiny", tmp_path)
        name, loss = ("grpo", "decoupled_ppo") if algo == "decoupled" else (algo, cfg.algo.policy_loss)
        assert (cfg.algo.name, cfg.algo.policy_loss, cfg.system.max_staleness, cfg.seed) == (name, loss, staleness, 3)
        assert cfg.rollout.engine == "http" and cfg.rollout.options.server_dtype == "bfloat16"
        assert cfg.rollout.options.probe_tolerance == 0.5 and cfg.rollout.options.server == "vllm"
    plain = bench.run_config("sao", 8, 0, argparse.Namespace(steps=250, eval_n=100, override=[]), "tiny", tmp_path)
    assert plain.rollout.engine == "torch"


def test_fishers_exact_test_and_the_power_it_gives_five_seeds():
    bench = _module()
    # Two-sided Fisher's exact test on 2x2 tables (values by hand: C(10,5) = 252, 12/252, 42/252).
    assert bench.fisher_exact_p(5, 5, 0, 5) == pytest.approx(2 / 252)
    assert bench.fisher_exact_p(4, 5, 0, 5) == pytest.approx(12 / 252)
    assert bench.fisher_exact_p(3, 5, 0, 5) == pytest.approx(42 / 252)
    assert bench.fisher_exact_p(0, 5, 0, 5) == 1.0 and bench.fisher_exact_p(1, 2, 0, 2) == 1.0
    assert bench.fisher_exact_p(2, 5, 1, 5) == bench.fisher_exact_p(1, 5, 2, 5)  # symmetric
