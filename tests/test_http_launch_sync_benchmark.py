"""`benchmarks/http_launch_sync.py --quick --lora 4` launches tiderl's engine servers once per
weight sync (files plus reload, the gloo broadcast, the adapters alone), syncs and decodes through
each, and prints each way against files plus reload last (a smoke test: no speed is asserted; each
sync passed the probe or the run would have raised)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_sync_benchmark_runs_every_way_and_prints_the_ratios_last():
    pytest.importorskip("peft")
    pytest.importorskip("httpx")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "http_launch_sync.py"), "--quick", "--lora", "4",
                           "--servers", "1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    for way in ("files plus reload, merged", "gloo broadcast, merged", "adapters alone"):
        assert sum(f"LoRA r=4, {way})" in line and "decode" in line for line in lines) == 1, (way, lines)
    number = r"[0-9.]+"
    assert re.fullmatch(rf"against files plus reload: 0\.1M collective sync {number} s / {number} s = {number}x, "
                        rf"decode {number}x; 0\.1M adapters sync {number} s / {number} s = {number}x, decode {number}x",
                        lines[-1]), lines[-1]
