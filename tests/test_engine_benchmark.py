"""`benchmarks/engine.py --quick` runs end to end (a smoke test: no timing is asserted)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_engine_benchmark_quick_prints_its_ratios_last():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "engine.py"), "--quick"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    # Every engine sampled exactly the scripted tokens (the benchmark asserts it per run).
    assert sum(" tokens in " in line for line in lines) == 3
    assert re.fullmatch(r"tiny: engine/hf [0-9.]+x, engine/engine-before [0-9.]+x; "
                        r"weight sync [0-9.]+M: [0-9.]+ s -> [0-9.]+ s", lines[-1]), lines[-1]
