"""`benchmarks/simulator.py --validate`: how a measured async_vs_sync run becomes the simulator's
inputs (nothing the comparison measures goes in), and the comparison's report."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_simulator", ROOT / "benchmarks" / "simulator.py")
sim_bench = importlib.util.module_from_spec(_spec)
sys.modules["bench_simulator"] = sim_bench
_spec.loader.exec_module(sim_bench)


def test_fit_line_recovers_a_line_and_never_returns_a_negative_slope():
    a, b = sim_bench.fit_line([(n, 0.002 + 0.0005 * n, n) for n in range(1, 9)])
    assert a == pytest.approx(0.002) and b == pytest.approx(0.0005)
    a, b = sim_bench.fit_line([(1, 3.0, 1.0), (2, 1.0, 1.0)])
    assert (a, b) == (pytest.approx(2.0), 0.0)
    assert sim_bench.fit_line([(4, 1.5, 2.0)]) == (pytest.approx(1.5), 0.0)
    a, b = sim_bench.fit_line([(1, 1.0, 1.0), (2, 3.0, 1.0)])  # y = -1 + 2x: through the origin instead
    assert a == 0.0 and b == pytest.approx(7 / 5)


def _row(mode: str, batch: int = 4, steps: int = 3) -> dict:
    return {
        "workload": "none", "mode": mode, "seed": 0, "batch": batch, "steps": steps, "trained": batch * steps,
        "dropped": 2, "trained_tok_s": 100.0, "waste": 0.1, "trainer_idle": 0.5, "staleness_hist": {"0": 12},
        "load": [1.0, 1.0],
        "measured": {
            "profiles": [[10, 5], [20]], "env_step_s": [0.01, 0.03],
            "decode_steps": {"1": [10, 0.025], "4": [20, 0.1], "0": [3, 0.0]},  # 2.5 ms and 5 ms per step
            "admit_s": 0.3, "decode_requests": 30, "engine_max_seqs": 64, "admission": 8 if mode == "sync-overprov" else 0,
            "steps": [{"train_s": 1.0 + 0.01 * t, "sync_s": 0.1, "prep_s": 0.7, "action_tokens": t, "tokens": 3 * t}
                      for t in (10, 20, 30)],
        },
    }


def test_calibration_uses_only_what_the_run_measured_about_its_components():
    workload, cluster, schedule = sim_bench.calibrate(_row("async-s2"))
    assert workload.episodes == ((10, 5), (20,)) and workload.latency_on_last_turn
    assert workload.tool_latency_s.kind == "empirical" and workload.tool_latency_s.mean == pytest.approx(0.02)
    # 2.5 ms at 1 sequence, 5 ms at 4: 1/600 s + 1/1200 s per sequence.
    assert cluster.decode_step_s + cluster.decode_step_per_seq_s == pytest.approx(0.0025)
    assert cluster.decode_step_s + 4 * cluster.decode_step_per_seq_s == pytest.approx(0.005)
    assert cluster.train_step_s == pytest.approx(1.0) and cluster.train_s_per_token == pytest.approx(0.01)
    assert cluster.prefill_s == pytest.approx(0.01) and cluster.prep_s == pytest.approx(2.1 / 14)
    assert cluster.sync_s == pytest.approx(0.1) and not cluster.colocated
    assert (schedule.max_staleness, schedule.batch_size, schedule.steps, schedule.admission) == (2, 4, 3, 0)
    _, cluster, schedule = sim_bench.calibrate(_row("sync-overprov"))
    assert cluster.colocated and (schedule.max_staleness, schedule.admission) == (0, 8)


def test_report_prints_every_run_and_the_median_error_last():
    rows = [_row("sync"), _row("async-s1")]
    lines = sim_bench.validation_report(rows, seeds=2)
    assert sum(line.startswith(("sync ", "async-s1 ")) for line in lines) == 2
    assert lines[-1].startswith("simulator vs measured, 2 runs: median |relative error| of trained tokens/s")
    assert all("predicted" in r for r in rows)
    assert sim_bench.validation_report([{k: v for k, v in rows[0].items() if k != "measured"}], 2)[0].startswith(
        "no run with measured inputs")
