"""`benchmarks/visual_step_time.py`: its `--quick` mode runs the four visual runs end to end and
prints the figures and ratios on its last line (a smoke test: no timing is asserted)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("visual_step_time", ROOT / "benchmarks" / "visual_step_time.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules["visual_step_time"] = bench
_spec.loader.exec_module(bench)


def test_a_run_without_measured_steps_is_refused():
    with pytest.raises(SystemExit, match="--steps=2 must exceed --warmup=2"):
        bench.main(["--steps", "2", "--warmup", "2"])


@pytest.mark.slow
def test_quick_runs_sync_and_async_with_and_without_the_image_stage(cache, tmp_path, capsys):
    (last,) = bench.main(["--quick", f"model.cache_dir={cache}", f"run_dir={tmp_path / 'run'}"])
    out = capsys.readouterr().out
    for mode in ("sync", "async"):
        for stage in ("on", "off"):
            assert re.search(rf"seed 0 {mode}\s+stage {stage}\s*: \d+\.\d+ s/step", out), (mode, stage)
            assert f"| {mode} | {stage} |" in out
    assert "load before:" in out and "load after:" in out
    figures = re.findall(r"(\d+\.\d+) s/step (\d+\.\d+) tok/s", last)
    assert len(figures) == 4 and all(float(s) > 0 and float(g) > 0 for s, g in figures)
    assert re.search(r"async/sync s/step \d+\.\d+x, goodput \d+\.\d+x; stage on/off s/step sync \d+\.\d+x, "
                     r"async \d+\.\d+x$", last)
