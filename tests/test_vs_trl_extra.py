"""`benchmarks/vs_trl.py` names the extra it needs (`bench-trl`: trl, which brings datasets)
when a module of the TRL side is missing, before any work, instead of a ModuleNotFoundError."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("vs_trl", ROOT / "benchmarks" / "vs_trl.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


@pytest.mark.parametrize("missing", [("datasets",), ("trl", "datasets")])
def test_a_missing_module_names_the_extra_before_any_work(monkeypatch, capsys, missing):
    for module in missing:
        monkeypatch.setitem(sys.modules, module, None)  # find_spec answers None: not installed
    built: list[str] = []
    monkeypatch.setattr(bench, "build_model_dir", lambda *a, **k: built.append("model"))
    monkeypatch.setattr(bench, "measure", lambda *a, **k: built.append("run"))
    monkeypatch.setattr(sys, "argv", ["vs_trl.py", "--quick"])
    with pytest.raises(SystemExit) as stop:
        bench.main()
    assert stop.value.code == 2 and built == []
    err = capsys.readouterr().err
    assert f"{' and '.join(missing)} not installed" in err
    assert "`bench-trl` extra" in err and "pip install -e '.[bench-trl]'" in err


def test_nothing_is_reported_when_the_modules_are_there(monkeypatch):
    import types

    for module in bench.TRL_MODULES:
        stub = types.ModuleType(module)
        stub.__spec__ = importlib.util.spec_from_loader(module, loader=None)
        monkeypatch.setitem(sys.modules, module, stub)
    assert bench.missing_extra() == ""
