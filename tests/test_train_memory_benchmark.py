"""`benchmarks/train_memory.py --quick` runs both modes end to end (a smoke test: no memory or
timing figure is asserted, only that both modes ran and the last line gives the ratios)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_train_memory_benchmark_quick_runs_both_modes_and_prints_ratios_last():
    pytest.importorskip("peft")  # the benchmark puts LoRA adapters on policy and critic
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "train_memory.py"), "--quick"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert sum(line.startswith("  keep activations:") for line in lines) == 1
    assert sum(line.startswith("  checkpointing:") for line in lines) == 1
    assert re.fullmatch(r"step growth keep [0-9.]+ GB vs checkpointing [0-9.]+ GB \(ratio [0-9.]+x less\); "
                        r"step [0-9.]+ s vs [0-9.]+ s \(ratio [0-9.]+x the time\); peak [0-9.]+ vs [0-9.]+ GB",
                        lines[-1]), lines[-1]
