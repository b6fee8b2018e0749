"""`tiderl simulate`: every setting of the model has a flag that reaches it, bad values stop the
command with the flag named, and the output has every mode of the validated benchmark."""

from __future__ import annotations

import argparse
import json

import pytest

from tiderl.cli import _parser, main
from tiderl.system import simulate_cli
from tiderl.system.simulate import Cluster, Dist, Schedule, Workload

SMALL = ["--steps", "4", "--seeds", "2", "--batch-size", "4", "--tool-latency", "lognormal:0.2:1.0:5"]


def _args(*argv: str) -> argparse.Namespace:
    return _parser().parse_args(["simulate", *argv])


def test_every_model_field_has_a_flag():
    covered = {(owner, name) for _, owner, name, *_ in simulate_cli.FIELD_FLAGS + simulate_cli.BOOL_FLAGS}
    per_mode = {(Schedule, n) for n in ("mode", "max_staleness", "overprovision", "min_slots", "max_slots")}
    for owner in (Workload, Cluster, Schedule):
        for name in owner.__dataclass_fields__:
            assert (owner, name) in covered | per_mode, f"{owner.__name__}.{name} has no tiderl simulate flag"


def test_flags_reach_the_model():
    args = _args("--scenario", "agentic-cluster", "--turns", "lognormal:4:0.5:20", "--tokens-per-turn", "200",
                 "--tool-latency", "empirical:0.5,1.5", "--latency-on-last-turn", "--engines", "128",
                 "--engine-max-seqs", "16", "--decode-step-s", "0.01", "--decode-step-per-seq-s", "0.001",
                 "--prefill-s", "0.05", "--prep-s", "0.2", "--train-step-s", "30", "--train-s-per-token", "1e-5",
                 "--sync-s", "4", "--patience-s", "0.03", "--gather-s", "0.2", "--colocated", "--lockstep",
                 "--batch-size", "256", "--steps", "7", "--slots", "900", "--admission", "700",
                 "--elastic-interval-s", "3")
    w, c, s = simulate_cli.settings(args)
    assert w == Workload(Dist("lognormal", 4, 0.5, 20), Dist("const", 200), Dist.empirical([0.5, 1.5]), True)
    assert c == Cluster(128, 16, 0.01, 0.001, 30, 1e-5, 4, True, 0.05, 0.2, True, 0.03, 0.2)
    assert (s.batch_size, s.steps, s.slots, s.admission, s.elastic_interval_s) == (256, 7, 900, 700, 3.0)
    # Unset flags keep the scenario's values.
    w, c, s = simulate_cli.settings(_args("--scenario", "agentic-cluster", "--engines", "200"))
    assert c.engines == 200 and c.train_step_s == 60.0 and s.batch_size == 512


def test_mode_flags_choose_the_modes(tmp_path):
    args = _args("--batch-size", "8", "--staleness", "2,8", "--cancel-factors", "none", "--sync-batch-factor", "4",
                 "--sync-overprov-admission", "12", "--sync-loop", "--elastic", "8-40")
    modes = simulate_cli.modes_of(args, simulate_cli.settings(args)[2])
    assert [m.name for m in modes] == ["sync", "sync-overprov", "sync-4B", "async-s2", "async-s8",
                                       "async-s2-elastic", "async-s8-elastic"]
    assert modes[1].schedule.admission == 12 and modes[2].schedule.batch_size == 32
    assert all(m.sync_loop == m.synchronous for m in modes)
    assert modes[-1].schedule.min_slots == 8 and modes[-1].schedule.max_slots == 40
    profiles = tmp_path / "episodes.json"
    profiles.write_text(json.dumps([[120, 40], [300]]))
    assert simulate_cli.settings(_args("--episodes", str(profiles)))[0].episodes == ((120, 40), (300,))


@pytest.mark.parametrize("argv, flag, fix", [
    (["--engines", "0"], "--engines", "e.g. --engines 256"),
    (["--batch-size", "many"], "--batch-size", "whole number >= 1"),
    (["--decode-step-s", "0"], "--decode-step-s", "> 0"),
    (["--sync-s", "-1"], "--sync-s", ">= 0"),
    (["--train-s-per-token", "nan"], "--train-s-per-token", "finite"),
    (["--tool-latency", "weird:1"], "--tool-latency", "use one of"),
    (["--turns", "lognormal:x"], "--turns", "kind:mean"),
    (["--staleness", "0,2"], "--staleness", "e.g. --staleness 1,2,4"),
    (["--cancel-factors", "0.5"], "--cancel-factors", "factors > 1"),
    (["--elastic", "40-8"], "--elastic", "MIN <= MAX"),
    (["--episodes", "/no/such/file.json"], "--episodes", "JSON file"),
    (["--seeds", "0"], "--seeds", ">= 1"),
])
def test_bad_values_fail_naming_the_flag_and_the_fix(capsys, argv, flag, fix):
    with pytest.raises(SystemExit) as exc:
        main(["simulate", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and fix in err


def test_cross_flag_errors_name_the_flag(capsys, tmp_path):
    assert main(["simulate", "--batch-size", "8", "--sync-overprov-admission", "8"]) == 2
    assert "--sync-overprov-admission 8: must be above the batch size (8)" in capsys.readouterr().err
    assert main(["simulate", "--batch-size", "8", "--admission", "4"]) == 2
    assert "--admission 4: below the batch size (8)" in capsys.readouterr().err
    assert main(["simulate", "--batch-size", "8", "--slots", "7"]) == 2
    assert "--slots 7: below the batch size (8)" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("[[3, 0]]")
    with pytest.raises(SystemExit):
        main(["simulate", "--episodes", str(bad)])
    assert "argument --episodes" in capsys.readouterr().err
    assert main(["simulate", "--sweep", "colocated", "x"]) == 2
    assert "--sweep colocated: name a simulate flag that takes a value" in capsys.readouterr().err
    assert main(["simulate", "--sweep", "engines", "4", "0"]) == 2
    assert "--sweep --engines 0: must be a whole number >= 1" in capsys.readouterr().err


def test_output_has_every_mode_with_its_figures(capsys, tmp_path):
    out_file = tmp_path / "sim.json"
    assert main(["simulate", *SMALL, "--elastic", "4-20", "--json", str(out_file)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    names = ["sync", "sync-overprov", "sync-cancel-x1.5", "sync-cancel-x2", "sync-3B", "async-s1", "async-s2",
             "async-s4", "async-s1-elastic", "async-s2-elastic", "async-s4-elastic"]
    header = next(i for i, line in enumerate(lines) if line.startswith("mode"))
    for word in ("trained tok/s", "waste", "trainer idle", "staleness"):
        assert word in lines[header]
    rows = lines[header + 1: header + 1 + len(names)]
    assert [row.split()[0] for row in rows] == names
    assert all("0:" in row for row in rows)  # a staleness histogram on every row
    assert lines[-1].startswith("async / strongest sync (") and "async-s4-elastic" in lines[-1]
    data = json.loads(out_file.read_text())
    assert len(data["runs"]) == len(names) and all(len(runs) == 2 for runs in data["runs"].values())
    assert set(data["gains"]) == {n for n in names if n.startswith("async")}


def test_sweep_reports_each_value_and_where_async_stops_paying(capsys):
    assert main(["simulate", *SMALL, "--cancel-factors", "none", "--staleness", "2",
                 "--sweep", "tool-latency", "0", "lognormal:0.5:1.5:10"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    start = lines.index("sweep of --tool-latency: best async gain over the strongest sync (mean [per-seed min-max])")
    assert lines[start + 1].startswith("  --tool-latency 0: async-s2 ")
    assert lines[start + 2].startswith("  --tool-latency lognormal:0.5:1.5:10: async-s2 ")
    gains = [float(line.split("async-s2 ")[1].split("x")[0]) for line in lines[start + 1: start + 3]]
    last = lines[start + 3]
    if min(gains) < simulate_cli.PAYS:
        first = "0" if gains[0] < simulate_cli.PAYS else "lognormal:0.5:1.5:10"
        assert last == f"async stops paying (best gain < 1.1x) at --tool-latency {first}"
    else:
        assert last.startswith("async's best gain stays >= 1.1x")


def test_every_scenario_runs_and_reports_tokens_per_trajectory(capsys):
    from tiderl.system.simulate import SCENARIOS

    for name in SCENARIOS:
        assert main(["simulate", "--scenario", name, "--batch-size", "16", "--steps", "3", "--seeds", "1",
                     "--staleness", "2", "--cancel-factors", "none"]) == 0
        out = capsys.readouterr().out
        assert f"scenario {name}" in out and "tok/traj" in out and "async-s2" in out.splitlines()[-2]
