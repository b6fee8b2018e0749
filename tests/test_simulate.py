"""The discrete-event model of the pipeline (tiderl/lab/simulate.py): exact figures where
they can be worked out by hand, and the rules it shares with the real scheduler; and its command
line, `tiderl simulate`: every setting of the model has a flag that reaches it, bad values stop the
command with the flag named, and the output has every mode of the validated benchmark."""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import replace

import pytest

from tiderl.cli import _parser, main
from tiderl.lab import simulate_cli
from tiderl.lab.simulate import (
    Cluster,
    Dist,
    Schedule,
    Workload,
    compare,
    simulate,
    standard_modes,
    strongest_sync,
)

# One 10-token turn per episode, no tools; a decode step of 10 ms whatever the batch, so every
# episode takes 0.1 s; a 1 s optimizer step and no sync time.
FIXED = Workload(Dist("const", 1), Dist("const", 10), Dist("const", 0.0))
ONE_ENGINE = Cluster(engines=1, engine_max_seqs=64, decode_step_s=0.01, decode_step_per_seq_s=0.0,
                     train_step_s=1.0, sync_s=0.0)


def test_sync_step_time_is_rollout_plus_training():
    r = simulate(FIXED, ONE_ENGINE, Schedule(max_staleness=0, batch_size=8, steps=5))
    assert r.wall_s == pytest.approx(5 * (0.1 + 1.0))
    assert (r.trained, r.trained_tokens, r.generated_tokens) == (40, 400, 400)
    assert r.staleness == {0: 40} and r.dropped == 0 and r.waste_frac == 0.0
    assert r.trainer_idle_frac == pytest.approx(0.1 / 1.1)


def test_async_hides_rollout_behind_training():
    # With N = 1 the next batch is sampled while the trainer works: only the first rollout shows.
    r = simulate(FIXED, ONE_ENGINE, Schedule(max_staleness=1, batch_size=8, steps=5))
    assert r.wall_s == pytest.approx(0.1 + 5 * 1.0)
    assert r.dropped == 0 and max(r.staleness) <= 1


def test_engine_capacity_queues_sequences():
    # 8 episodes, room for 4 at a time: two waves of 0.1 s each.
    small = Cluster(engines=1, engine_max_seqs=4, decode_step_s=0.01, decode_step_per_seq_s=0.0,
                    train_step_s=1.0, sync_s=0.0)
    r = simulate(FIXED, small, Schedule(max_staleness=0, batch_size=8, steps=1))
    assert r.wall_s == pytest.approx(0.2 + 1.0)


def test_decode_steps_slow_down_with_batch():
    # 8 sequences on a step of 1 ms + 1 ms per sequence: 9 ms per token, 10 tokens.
    c = Cluster(engines=1, engine_max_seqs=64, decode_step_s=0.001, decode_step_per_seq_s=0.001,
                train_step_s=1.0, sync_s=0.0)
    r = simulate(FIXED, c, Schedule(max_staleness=0, batch_size=8, steps=1))
    assert r.wall_s == pytest.approx(0.09 + 1.0)


def test_overprovisioned_sync_trains_the_first_finishers_and_cancels_the_rest():
    schedule = Schedule(mode="overprovision", overprovision=2.0, batch_size=8, steps=3)
    r = simulate(FIXED, ONE_ENGINE, schedule)
    assert r.trained == 24 and r.cancelled == 3 * 8
    assert r.staleness == {0: 24}
    assert r.waste_frac == pytest.approx(0.5)


def test_colocated_engines_stop_while_the_trainer_works():
    shared = replace(ONE_ENGINE, colocated=True)
    sync = Schedule(max_staleness=0, batch_size=8, steps=5)
    # Sync engines are idle during training anyway: sharing devices costs nothing.
    assert simulate(FIXED, shared, sync).wall_s == pytest.approx(simulate(FIXED, ONE_ENGINE, sync).wall_s)
    # Async on shared devices only overlaps what was sampled before a step began.
    asynchronous = replace(sync, max_staleness=1)
    apart, together = simulate(FIXED, ONE_ENGINE, asynchronous), simulate(FIXED, shared, asynchronous)
    assert apart.wall_s < together.wall_s < simulate(FIXED, ONE_ENGINE, sync).wall_s


def test_staleness_bound_holds_on_a_heavy_tail():
    heavy = Workload(Dist("const", 3), Dist("lognormal", 20, 0.5), Dist("lognormal", 1.0, 1.5, 30))
    for n in (0, 1, 2):
        r = simulate(heavy, ONE_ENGINE, Schedule(max_staleness=n, batch_size=16, steps=20), seed=1)
        over = sum(count for s, count in r.staleness.items() if s > n)
        assert over == r.dropped  # judged too old = dropped, never trained
        assert r.trained == 16 * 20


def test_elastic_slots_grow_for_a_starving_trainer_within_bounds():
    slow_tools = Workload(Dist("const", 2), Dist("const", 10), Dist("const", 2.0))
    schedule = Schedule(max_staleness=4, batch_size=8, steps=15, slots=8, min_slots=8, max_slots=24,
                        elastic_interval_s=1.0)
    sim_fixed = simulate(slow_tools, ONE_ENGINE, Schedule(max_staleness=4, batch_size=8, steps=15, slots=8))
    sim_elastic = simulate(slow_tools, ONE_ENGINE, schedule)
    assert sim_elastic.slot_changes > 0
    assert sim_elastic.wall_s < sim_fixed.wall_s


def test_same_seed_same_run_and_modes_cover_the_baselines():
    heavy = Workload(Dist("const", 2), Dist("lognormal", 20, 0.5), Dist("lognormal", 0.5, 1.0, 10))
    a = simulate(heavy, ONE_ENGINE, Schedule(max_staleness=2, batch_size=8, steps=10), seed=3)
    b = simulate(heavy, ONE_ENGINE, Schedule(max_staleness=2, batch_size=8, steps=10), seed=3)
    assert a.row() == b.row()
    modes = standard_modes(Schedule(batch_size=8, steps=9))
    assert [m.name for m in modes] == ["sync", "sync-overprov", "sync-cancel-x1.5", "sync-cancel-x2", "sync-3B",
                                       "async-s1", "async-s2", "async-s4"]
    assert [m.synchronous for m in modes] == [True] * 5 + [False] * 3
    overprov, three_b = modes[1].schedule, modes[4].schedule
    assert (overprov.max_staleness, overprov.admission) == (0, 16)  # tiderl's: system.admission = 2B
    assert (three_b.batch_size, three_b.steps) == (24, 3)
    summaries = compare(heavy, ONE_ENGINE, modes, seeds=2)
    assert strongest_sync(summaries).synchronous


def test_distributions_parse_and_sample_their_mean():
    rng = random.Random(0)
    d = Dist.parse("lognormal:2.0:0.5")
    mean = sum(d.sample(rng) for _ in range(20000)) / 20000
    assert mean == pytest.approx(2.0, rel=0.03)
    assert Dist.parse("lognormal:1:1.5:30").cap == 30
    assert Dist.parse("3") == Dist("const", 3.0)
    assert Dist.parse("empirical:0.5,1.5,4") == Dist.empirical([0.5, 1.5, 4.0])
    with pytest.raises(ValueError, match="empirical:V1,V2"):
        Dist.parse("empirical:1,-2")
    with pytest.raises(ValueError, match="at most"):
        Dist.parse("lognormal:1:1:1:1")
    with pytest.raises(ValueError, match="kind:mean"):
        Dist.parse("lognormal:x")
    with pytest.raises(ValueError, match="use one of"):
        Dist.parse("pareto:1")


def test_turn_counts_round_stochastically_so_the_mean_is_kept():
    # 2.4 turns of 10 tokens: the mean over many episodes is 24 tokens, not round(2.4) x 10 = 20.
    w = Workload(Dist("const", 2.4), Dist("const", 10), Dist("const", 0.0))
    r = simulate(w, ONE_ENGINE, Schedule(max_staleness=0, batch_size=50, steps=20), seed=0)
    assert r.generated_tokens / r.trained == pytest.approx(24, rel=0.05)


def test_latency_on_the_last_turn_adds_one_wait_per_episode():
    w = Workload(Dist("const", 2), Dist("const", 10), Dist("const", 0.5))
    plain = simulate(w, ONE_ENGINE, Schedule(max_staleness=0, batch_size=4, steps=3))
    every_step = simulate(replace(w, latency_on_last_turn=True), ONE_ENGINE,
                          Schedule(max_staleness=0, batch_size=4, steps=3))
    assert plain.wall_s == pytest.approx(3 * (0.1 + 0.5 + 0.1 + 1.0))
    assert every_step.wall_s == pytest.approx(plain.wall_s + 3 * 0.5)


def test_empirical_distributions_resample_the_measured_values():
    d = Dist.empirical([0.5, 1.5, 4.0])
    rng = random.Random(0)
    draws = [d.sample(rng) for _ in range(3000)]
    assert set(draws) == {0.5, 1.5, 4.0} and d.mean == pytest.approx(2.0)
    assert sum(draws) / len(draws) == pytest.approx(2.0, rel=0.05)
    with pytest.raises(ValueError, match="empirical"):
        Dist.empirical([])


def test_measured_episode_profiles_replace_turns_and_turn_lengths():
    # One profile of a single 10-token turn is FIXED exactly; two turns of 5 and 5 are the same
    # tokens with one extra 0.2 s tool call between them.
    one = Workload(episodes=((10,),))
    assert simulate(one, ONE_ENGINE, Schedule(max_staleness=0, batch_size=8, steps=3)).wall_s == \
        pytest.approx(simulate(FIXED, ONE_ENGINE, Schedule(max_staleness=0, batch_size=8, steps=3)).wall_s)
    two = Workload(tool_latency_s=Dist("const", 0.2), episodes=((5, 5),))
    r = simulate(two, ONE_ENGINE, Schedule(max_staleness=0, batch_size=8, steps=1))
    assert r.wall_s == pytest.approx(0.1 + 0.2 + 1.0) and r.trained_tokens == 80
    with pytest.raises(ValueError, match="episodes"):
        Workload(episodes=((3, 0),))


def test_prefill_and_preparation_stop_decoding_and_delay_training():
    # 8 prefills of 10 ms block the engine before the 0.1 s of decoding; then 8 preparations of
    # 20 ms, one after another, before the batch may train.
    c = replace(ONE_ENGINE, prefill_s=0.01, prep_s=0.02)
    r = simulate(FIXED, c, Schedule(max_staleness=0, batch_size=8, steps=1))
    assert r.wall_s == pytest.approx(0.08 + 0.1 + 0.16 + 1.0)


def test_admission_above_the_batch_at_staleness_0_restarts_what_runs_on_old_weights():
    # tiderl's over-provisioned sync (max_staleness 0, system.admission 2B): the first B finishers
    # train; after the step the episodes still running on old weights restart, and those that
    # finished meanwhile are judged one version old and dropped.
    heavy = Workload(Dist("const", 2), Dist("const", 10), Dist("lognormal", 0.5, 1.0, 10), latency_on_last_turn=True)
    r = simulate(heavy, replace(ONE_ENGINE, colocated=True),
                 Schedule(max_staleness=0, batch_size=8, steps=6, admission=16), seed=3)
    assert r.trained == 48 and r.staleness[0] == 48
    assert r.restarted + r.dropped > 0 and set(r.staleness) <= {0, 1}
    assert r.dropped == r.staleness.get(1, 0)
    assert r.waste_of_completed_turns > 0 and r.completed_turn_tokens <= r.generated_tokens


def test_colocated_step_waits_for_the_decode_pass_under_way():
    # Admission 2B at staleness 0 on an engine of 4 places: the first 4 finish at 0.1 s, the other
    # 4 decode from 0.1 to 0.2 s. Apart, the step starts at 0.1 s; sharing the devices (tiderl's
    # synchronous loop), it starts when the pass under way ends.
    small = replace(ONE_ENGINE, engine_max_seqs=4)
    schedule = Schedule(max_staleness=0, batch_size=4, steps=1, admission=8)
    assert simulate(FIXED, small, schedule).wall_s == pytest.approx(0.1 + 1.0)
    assert simulate(FIXED, replace(small, colocated=True), schedule).wall_s == pytest.approx(0.2 + 1.0)


def test_lockstep_passes_hold_finished_turns_until_the_pass_ends():
    # Turns of 10 and 30 tokens in one pass: in lockstep (tiderl's synchronous loop) the short
    # ones' second turns wait for the long ones, so a step takes longer; a single profile with
    # tools slower than the gather's patience is the same either way.
    mixed = Workload(episodes=((10, 10), (30, 10)))
    sync = Schedule(max_staleness=0, batch_size=8, steps=3)
    plain = simulate(mixed, ONE_ENGINE, sync)
    lock = simulate(mixed, replace(ONE_ENGINE, colocated=True, lockstep=True), sync)
    assert lock.wall_s > plain.wall_s and lock.trained == plain.trained == 24
    same = Workload(tool_latency_s=Dist("const", 0.05), episodes=((10, 10),))
    for c in (ONE_ENGINE, replace(ONE_ENGINE, colocated=True, lockstep=True)):
        assert simulate(same, c, Schedule(max_staleness=0, batch_size=8, steps=1)).wall_s == \
            pytest.approx(0.1 + 0.05 + 0.1 + 1.0)
    # Overprovisioned and lockstep with preparations: runs to the end, trains B per step.
    heavy = Workload(tool_latency_s=Dist("lognormal", 0.01, 1.0), episodes=((10, 5), (20, 5, 5)))
    c = replace(ONE_ENGINE, colocated=True, lockstep=True, prefill_s=0.001, prep_s=0.002)
    r = simulate(heavy, c, Schedule(max_staleness=0, batch_size=8, steps=5, admission=16), seed=2)
    assert r.trained == 40 and set(r.staleness) <= {0, 1}


# -- tiderl simulate (tiderl/lab/simulate_cli.py) ------------------------------------------------
SMALL = ["--steps", "4", "--seeds", "2", "--batch-size", "4", "--tool-latency", "lognormal:0.2:1.0:5"]


def _args(*argv: str) -> argparse.Namespace:
    return _parser().parse_args(["simulate", *argv])


def test_every_model_field_has_a_flag():
    covered = {(owner, name) for _, owner, name, *_ in simulate_cli.FIELD_FLAGS + simulate_cli.BOOL_FLAGS}
    per_mode = {(Schedule, n) for n in ("mode", "max_staleness", "overprovision", "min_slots", "max_slots",
                                        "stale_policy", "stale_bound", "drain")}
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
    from tiderl.lab.simulate import SCENARIOS

    for name in SCENARIOS:
        assert main(["simulate", "--scenario", name, "--batch-size", "16", "--steps", "3", "--seeds", "1",
                     "--staleness", "2", "--cancel-factors", "none"]) == 0
        out = capsys.readouterr().out
        assert f"scenario {name}" in out and "tok/traj" in out and "async-s2" in out.splitlines()[-2]


def test_sync_loop_runs_every_sync_mode_as_tiderls_synchronous_loop(capsys):
    # Lockstep and colocated with rollout-side work, in every sync mode (the over-provisioned ones
    # included): every run ends and trains B per step.
    assert main(["simulate", *SMALL, "--sync-loop", "--prep-s", "0.01", "--prefill-s", "0.002"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("sync")]
    assert len(rows) == 5 and all("sync loop)" in row for row in rows)
