"""benchmarks/collapse.py: the overrides after its options reach every run's config (how its runs
take rollouts from a bf16 server, the engine/trainer mismatch issue 33 calls for)."""

from __future__ import annotations

import argparse

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
        assert (cfg.algo.name, cfg.system.max_staleness, cfg.seed) == (algo, staleness, 3)
        assert cfg.rollout.engine == "http" and cfg.rollout.options.server_dtype == "bfloat16"
        assert cfg.rollout.options.probe_tolerance == 0.5 and cfg.rollout.options.server == "vllm"
    plain = bench.run_config("sao", 8, 0, argparse.Namespace(steps=250, eval_n=100, override=[]), "tiny", tmp_path)
    assert plain.rollout.engine == "torch"
