"""`benchmarks/lora_engine.py --quick` runs both engines end to end on a tiny model (a smoke test:
no speed figure is asserted). What it can check on any model: the unmerged engine's log-probs are
exactly the trainer's, and the last line gives both engines' figures and the speed ratio."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_lora_engine_benchmark_quick_compares_both_engines_and_prints_the_ratio_last():
    pytest.importorskip("peft")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "lora_engine.py"), "--quick"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    unmerged = next(line for line in lines if line.startswith("| unmerged |"))
    assert "| 0.00e+00 / 0.00e+00 |" in unmerged  # exactly the trainer's log-probs
    assert sum(line.startswith("| merged |") for line in lines) == 1
    assert re.fullmatch(r"update [0-9.e-]+: mean gap to the trainer unmerged 0\.00e\+00 vs merged [0-9.e+-]+ "
                        r"nats/token; decode tok/s unmerged [0-9.]+ vs merged [0-9.]+ \(ratio [0-9.]+x\)",
                        lines[-1]), lines[-1]
