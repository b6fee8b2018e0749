"""`benchmarks/async_vs_sync.py`: its modes, its statistics and one tiny run end to end (a smoke
test: no timing is asserted)."""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("async_vs_sync", ROOT / "benchmarks" / "async_vs_sync.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules["async_vs_sync"] = bench  # its dataclasses look their module up
_spec.loader.exec_module(bench)


def test_modes_run_at_the_concurrency_the_docstring_states():
    modes = {m.name: m for m in bench.MODES}
    b = 16
    assert {n: m.concurrency(b) for n, m in modes.items()} == {
        "sync": 16, "sync-overprov": 32, "sync-3B": 48, "async-s1": 32, "async-s2": 48, "async-s4": 80}
    assert modes["sync-3B"].concurrency(b) == modes["async-s2"].concurrency(b)
    assert "system.admission=32" in modes["sync-overprov"].overrides(b)
    assert "rollout.batch_size=48" in modes["sync-3B"].overrides(b)


def test_interval_and_paired_ratio():
    mean, half = bench.interval([1.0, 2.0, 3.0])
    assert mean == 2.0 and math.isclose(half, 4.30 * 1.0 / math.sqrt(3))
    g, lo, hi = bench.ratio([4.0, 4.0], [2.0, 2.0])
    assert math.isclose(g, 2.0) and math.isclose(lo, 2.0) and math.isclose(hi, 2.0)
    g, lo, hi = bench.ratio([2.0, 8.0], [1.0, 2.0])
    assert math.isclose(g, math.sqrt(8.0)) and lo < g < hi


def _row(mode: str, seed: int, ttt: float, tok: float) -> dict:
    return {"workload": "none", "mode": mode, "seed": seed, "concurrency": 16, "time_to_target_s": ttt,
            "censored": False, "trained_tok_s": tok, "waste": 0.1, "final": 0.4, "dropped": 0, "restarted": 0,
            "unsettled": 0, "staleness_hist": {"0": 16}, "load": [1.0, 1.0]}


def test_headline_compares_async_with_the_strongest_sync_mode():
    rows = [r for s in range(3) for r in (_row("sync", s, 100.0, 10.0), _row("sync-overprov", s, 50.0, 20.0),
                                          _row("async-s2", s, 25.0, 30.0))]
    lines = bench.report(rows, ["none"], bench.MODES)
    assert lines[-1].startswith("none: async-s2 vs strongest sync (sync-overprov), 3 seeds: time to target 2.00x")
    assert "trained tokens/s 1.50x" in lines[-1]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the asynchronous plan needs 2 cores")
def test_one_tiny_asynchronous_run_reports_its_figures_and_placement(tmp_path):
    mode = next(m for m in bench.MODES if m.name == "async-s1")
    row = bench.run_mode(mode, "none", seed=0, b=4, steps=2, eval_every=2, eval_n=4, out=tmp_path, evaluated={})
    assert row["steps"] == 2 and row["trained"] == 8
    assert 0.0 <= row["waste"] < 1.0 and row["decoded_tokens"] >= row["trained_sampled_tokens"] > 0
    assert [p["step"] for p in row["curve"]] == [0, 2]
    plan = row["core_plan"]
    assert set(plan) == {"trainer", "rollout", "prep"} and not set(plan["trainer"]) & set(plan["rollout"])
    for component, cores in row["ran_on"].items():  # threads seen running only where they were pinned
        assert set(cores) <= set(plan[component]), (component, cores, plan)
