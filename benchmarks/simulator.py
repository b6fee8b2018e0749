"""Does the simulator predict tiderl? Measured runs against the discrete-event model's predictions.

`--validate` (the main check): every mode of `benchmarks/async_vs_sync.py` (sync, sync-overprov,
sync-3B, async-s1/s2/s4) on its workloads (default none, ln1.0, longgen; 1 seed, 21 steps of
B=8), each run predicted by the simulator fed only what that same run measured about its
components (episode profiles, environment-step times, decode step time by batch size, prefill,
preparation, train and sync times; see `calibrate`), compared on what it was not fed: trained
sampled tokens/s, waste, trainer idle fraction and the staleness histogram. Runs go to
`--out`/results.json and are resumed from there; `--results FILE` compares existing runs only.
The last line is the median |relative error| of throughput over the runs.

    nice -n 10 .venv/bin/python benchmarks/simulator.py --validate            # ~35 min on 2 loaded cores
    nice -n 10 .venv/bin/python benchmarks/simulator.py --validate --quick    # 2 workloads x 3 modes x 4 steps

Without `--validate` (the first, narrower check):

Each mode (synchronous, and asynchronous at staleness 1 and 2) is run for real on the embedded
default with the heavy-tailed tool latency of `async_vs_sync.py`. The simulator is then given
only the component speeds of that same run — the mean optimizer-step and weight-sync times it
logged, the mean turns and sampled tokens per episode, the configured tool-latency distribution,
and the engine's time per turn at batch 1 and 16 probed on the run's own model — and predicts the
pipeline's behaviour: seconds per step, trainer idle fraction, dropped trajectories and the
largest staleness. The figures it did not see are the ones compared.

    .venv/bin/python benchmarks/simulator.py            # 3 modes x 16 steps: about 10 minutes here
    .venv/bin/python benchmarks/simulator.py --quick    # 2 modes x 4 steps: about 2 minutes

The last line is the mean absolute relative error of the predicted step time over the modes.
What this does not show: the model's fit at scales this machine cannot run (that is what it is
for, and what cannot be checked here), and prefill is folded into the probed time per turn.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tiderl.config import load_config
from tiderl.recipe import train
from tiderl.rollout.base import SamplingParams
from tiderl.run import build_run
from tiderl.lab.simulate import Cluster, Dist, Schedule, Workload, simulate

TOOL_LATENCY = Dist("lognormal", 1.0, 1.5, 30.0)
WORKLOAD = [
    "env.tool_latency=lognormal", f"env.tool_latency_s={TOOL_LATENCY.mean}",
    f"env.tool_latency_spread={TOOL_LATENCY.spread}", f"env.tool_latency_max_s={TOOL_LATENCY.cap:g}",
    "system.trainer_threads=1", "system.decode_threads=1", "log.progress=false", "log.tensorboard=false",
    "algo.critic_warmup_steps=0",
]


def probe_turn_time(engine, prompt_len: int, new_tokens: int, batch: int, repeats: int = 3) -> float:
    """Median seconds for the engine to produce one turn of `new_tokens` tokens for `batch`
    sequences with `prompt_len`-token prompts (prefill included, as each tiderl turn pays it)."""
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens)
    prompts = [[(7 * i + j) % 200 + 3 for j in range(prompt_len)] for i in range(batch)]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        engine.generate(prompts, params)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(staleness: int, steps: int, batch: int, out: Path, seed: int) -> dict:
    cfg = load_config("configs/kg_sao_tiny.yaml", WORKLOAD + [
        f"system.max_staleness={staleness}", f"rollout.batch_size={batch}", f"train.steps={steps}",
        f"seed={seed}", f"run_dir={out / f'staleness_{staleness}'}"])
    run = build_run(cfg)
    t0 = time.perf_counter()
    history, summary = train(run, steps)
    wall = time.perf_counter() - t0
    turns = statistics.mean(r["episode/turns"] for r in history)
    action = statistics.mean(r["episode/action_tokens"] for r in history)
    context = statistics.mean(r["episode/tokens"] for r in history)
    per_turn = max(1, round(action / turns))
    prompt_len = max(1, round(context * 0.6))  # a turn's context grows through the episode
    t1 = probe_turn_time(run.engine, prompt_len, per_turn, 1)
    t16 = probe_turn_time(run.engine, prompt_len, per_turn, 16)
    per_seq = max(0.0, (t16 - t1) / 15)
    return {
        "staleness": staleness, "steps": steps, "batch": batch, "wall_s": wall,
        "step_s": wall / steps, "trainer_idle": summary["trainer_idle_frac"],
        "dropped": summary["ledger"]["dropped_stale"],
        "max_staleness_seen": max(int(k) for k in summary["staleness_histogram"]),
        "calibration": {
            "turns": turns, "tokens_per_turn": per_turn, "train_step_s": statistics.mean(r["time/train_s"] for r in history),
            "sync_s": statistics.mean(r["time/sync_s"] for r in history),
            "decode_step_s": max(1e-6, (t1 - per_seq) / per_turn), "decode_step_per_seq_s": per_seq / per_turn,
        },
    }


def predict(m: dict, seeds: int) -> dict:
    c = m["calibration"]
    # env.tool_latency delays every environment step, the final answer's included.
    workload = Workload(Dist("const", c["turns"]), Dist("const", c["tokens_per_turn"]), TOOL_LATENCY,
                        latency_on_last_turn=True)
    cluster = Cluster(engines=1, engine_max_seqs=1024, decode_step_s=c["decode_step_s"],
                      decode_step_per_seq_s=c["decode_step_per_seq_s"], train_step_s=c["train_step_s"],
                      sync_s=c["sync_s"])
    schedule = Schedule(max_staleness=m["staleness"], batch_size=m["batch"], steps=m["steps"])
    runs = [simulate(workload, cluster, schedule, seed) for seed in range(seeds)]
    return {"step_s": statistics.mean(r.step_s for r in runs),
            "step_s_spread": (min(r.step_s for r in runs), max(r.step_s for r in runs)),
            "trainer_idle": statistics.mean(r.trainer_idle_frac for r in runs),
            "dropped": statistics.mean(r.dropped for r in runs),
            "max_staleness_seen": max(max(r.staleness) for r in runs)}


# ---------------------------------------------------------------- --validate: every async_vs_sync mode

VALIDATE_MODES = "sync,sync-overprov,sync-3B,async-s1,async-s2,async-s4"


def fit_line(points: list[tuple[float, float, float]]) -> tuple[float, float]:
    """Weighted least squares y = a + b·x over (x, y, weight) points, with a, b >= 0: a flat
    line through the weighted mean when the slope comes out negative or x never varies, a line
    through the origin when the intercept does."""
    total = sum(w for _, _, w in points)
    mx = sum(x * w for x, _, w in points) / total
    my = sum(y * w for _, y, w in points) / total
    var = sum(w * (x - mx) ** 2 for x, _, w in points)
    slope = sum(w * (x - mx) * (y - my) for x, y, w in points) / var if var > 0 else 0.0
    if slope < 0:
        return my, 0.0
    if my - slope * mx < 0:
        return 0.0, sum(w * x * y for x, y, w in points) / sum(w * x * x for x, _, w in points)
    return my - slope * mx, slope


def calibrate(row: dict) -> tuple[Workload, Cluster, Schedule]:
    """The simulator's inputs for one async_vs_sync run, all measured in that run (`row["measured"]`):
    episode profiles (sampled tokens per turn of every finished episode), the wall time of every
    environment step, the decode step time as a line in the number of sequences decoding, the
    prefill time per turn, the preparation time per trajectory, the train time as a line in the
    batch's sampled tokens, and the mean weight-sync time. Nothing the comparison measures
    (throughput, waste, idle, staleness) goes in."""
    m = row["measured"]
    if not m["profiles"]:
        raise ValueError(f"{row['workload']} {row['mode']}: no finished episode recorded; re-run it")
    # A step's own time (drawn latency + the environment's work) where the run recorded it; the
    # time an episode waited for it on the event loop otherwise (older runs).
    steps_s = m.get("env_step_own_s") or m["env_step_s"] or [0.0]
    workload = Workload(tool_latency_s=Dist.empirical(steps_s), latency_on_last_turn=True,
                        episodes=tuple(tuple(p) for p in m["profiles"]))
    decode = [(int(n), s / c, c) for n, (c, s) in m["decode_steps"].items() if int(n) > 0 and c > 0]
    a, b = fit_line(decode)
    steps = m["steps"]
    t0, t_tok = fit_line([(s["action_tokens"], s["train_s"], 1.0) for s in steps])
    prepared = max(1, row["trained"] + row["dropped"])
    cluster = Cluster(engines=1, engine_max_seqs=m["engine_max_seqs"], decode_step_s=max(a, 1e-6),
                      decode_step_per_seq_s=b, train_step_s=t0, train_s_per_token=t_tok,
                      sync_s=statistics.mean(s["sync_s"] for s in steps),
                      colocated=row["mode"].startswith("sync"), lockstep=row["mode"].startswith("sync"),
                      prefill_s=m["admit_s"] / max(1, m["decode_requests"]),
                      prep_s=sum(s["prep_s"] for s in steps) / prepared)
    schedule = Schedule(mode="async", max_staleness=int(row["mode"][7:]) if row["mode"].startswith("async-s") else 0,
                        batch_size=row["batch"], steps=row["steps"], admission=m.get("admission", 0))
    return workload, cluster, schedule


def staleness_fractions(hist: dict) -> dict[int, float]:
    total = sum(hist.values()) or 1
    return {int(k): v / total for k, v in sorted(hist.items(), key=lambda kv: int(kv[0]))}


def hist_text(fractions: dict[int, float]) -> str:
    """'0:.50 1:.30 2+:.20' (levels above 2 summed)."""
    low = {k: v for k, v in fractions.items() if k <= 2}
    high = sum(v for k, v in fractions.items() if k > 2)
    parts = [f"{k}:{v:.2f}" for k, v in low.items() if v >= 0.005]
    return " ".join(parts + ([f"3+:{high:.2f}"] if high >= 0.005 else []))


def predict_row(row: dict, seeds: int, without_rollout_costs: bool = False) -> dict:
    """The simulator's figures for one measured run: means over `seeds` simulated seeds.
    `without_rollout_costs`: prefill and preparation left out (the model before they were added)."""
    workload, cluster, schedule = calibrate(row)
    if without_rollout_costs:
        cluster = replace(cluster, prefill_s=0.0, prep_s=0.0)
    runs = [simulate(workload, cluster, schedule, seed) for seed in range(seeds)]
    hist: dict[int, float] = {}
    for r in runs:
        for k, v in staleness_fractions(r.staleness).items():
            hist[k] = hist.get(k, 0.0) + v / seeds
    return {"trained_tok_s": statistics.mean(r.trained_tokens_per_s for r in runs),
            "trained_tok_s_range": (min(r.trained_tokens_per_s for r in runs), max(r.trained_tokens_per_s for r in runs)),
            "waste": statistics.mean(r.waste_of_completed_turns for r in runs),
            "trainer_idle": statistics.mean(r.trainer_idle_frac for r in runs),
            "wall_s": statistics.mean(r.wall_s for r in runs), "staleness": hist,
            "inputs": {"decode_step_s": cluster.decode_step_s, "decode_step_per_seq_s": cluster.decode_step_per_seq_s,
                       "prefill_s": cluster.prefill_s, "prep_s": cluster.prep_s, "train_step_s": cluster.train_step_s,
                       "train_s_per_token": cluster.train_s_per_token, "sync_s": cluster.sync_s,
                       "env_step_s_mean": workload.tool_latency_s.mean,
                       "episode_tokens_mean": statistics.mean(sum(p) for p in workload.episodes)}}


def total_variation(a: dict[int, float], b: dict[int, float]) -> float:
    return 0.5 * sum(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


def validation_report(rows: list[dict], seeds: int, without_rollout_costs: bool = False) -> list[str]:
    """Predicted against measured for every run in `rows` (async_vs_sync's results.json); the last
    line is the median |relative error| of throughput over the runs."""
    lines, errors = [], []
    header = (f"{'mode':<14}{'trained tok/s m / p (rel err)':>32}{'waste m / p':>14}{'idle m / p':>13}"
              f"{'staleness TV':>13}  staleness measured | predicted")
    for w in dict.fromkeys(r["workload"] for r in rows):
        rs = [r for r in rows if r["workload"] == w and "measured" in r]
        if not rs:
            continue
        loads = [x for r in rs for x in r["load"]]
        title = (f"workload {w}: {len(rs)} runs, loadavg {min(loads):.1f}-{max(loads):.1f}; predictions are "
                 f"the mean of {seeds} simulated seeds")
        lines += [title, header, "-" * len(header)]
        for r in rs:
            p = predict_row(r, seeds, without_rollout_costs)
            err = (p["trained_tok_s"] - r["trained_tok_s"]) / r["trained_tok_s"]
            errors.append((w, r["mode"], err))
            measured_hist = staleness_fractions(r["staleness_hist"])
            lines.append(
                f"{r['mode']:<14}{r['trained_tok_s']:>12.0f} / {p['trained_tok_s']:>5.0f} ({err:+6.1%})"
                f"{r['waste']:>8.3f} / {p['waste']:.3f}{r['trainer_idle']:>7.2f} / {p['trainer_idle']:.2f}"
                f"{total_variation(measured_hist, p['staleness']):>13.2f}  {hist_text(measured_hist)} | "
                f"{hist_text(p['staleness'])}")
            r["predicted"] = {k: v for k, v in p.items()}
        lines.append("")
    if not errors:
        return ["no run with measured inputs: run benchmarks/async_vs_sync.py (this version) first"]
    abs_errors = sorted(abs(e) for _, _, e in errors)
    per_mode = ", ".join(f"{w}/{m} {e:+.0%}" for w, m, e in errors)
    lines.append(f"simulator vs measured, {len(errors)} runs: median |relative error| of trained tokens/s "
                 f"{statistics.median(abs_errors):.1%} (max {abs_errors[-1]:.1%}; {per_mode})")
    return lines


def validate(args: argparse.Namespace) -> None:
    """Run async_vs_sync's missing runs into --out (resumable), then compare every run with the
    simulator's prediction from its own measured inputs."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import async_vs_sync as bench

    out = Path(args.out)
    results = Path(args.results) if args.results else out / "results.json"
    rows = json.loads(results.read_text()) if results.is_file() else []
    if not args.results:
        if args.quick:
            args.workloads, args.modes, args.steps, args.eval_n = "none,ln1.0", "sync,sync-overprov,async-s2", 4, 10
        names = args.modes.split(",")
        modes = [m for m in bench.MODES if m.name in names]
        workloads = args.workloads.split(",")
        unknown = [w for w in workloads if w not in bench.WORKLOADS] + [n for n in names if n not in
                                                                          {m.name for m in bench.MODES}]
        if unknown:
            raise SystemExit(f"--workloads/--modes: unknown {unknown}; workloads {', '.join(bench.WORKLOADS)}, "
                             f"modes {', '.join(m.name for m in bench.MODES)}")
        out.mkdir(parents=True, exist_ok=True)
        model = str(bench.embedded_model_dir(build_run(load_config(bench.CONFIG, ["log.progress=false"])).cfg))
        done = {(r["workload"], r["mode"], r["seed"]) for r in rows}
        evaluated: dict = {}
        for w in workloads:
            for mode in modes:
                if (w, mode.name, 0) in done:
                    continue
                rows.append(bench.run_mode(mode, w, 0, args.batch, args.steps, max(1, args.steps // 3), args.eval_n,
                                           out, evaluated, model))
                print(f"  ran {w} {mode.name}: {rows[-1]['trained_tok_s']:.0f} tok/s, load {rows[-1]['load']}",
                      flush=True)
                results.write_text(json.dumps(rows, indent=1))
        rows = [r for r in rows if r["workload"] in workloads and r["mode"] in names]
    lines = validation_report(rows, args.sim_seeds, args.without_rollout_costs)
    (out / "validation.json").parent.mkdir(parents=True, exist_ok=True)
    (out / "validation.json").write_text(json.dumps(
        [{k: r[k] for k in ("workload", "mode", "seed", "trained_tok_s", "waste", "trainer_idle", "staleness_hist",
                            "load", "predicted")} for r in rows if "predicted" in r], indent=1, default=str))
    for line in lines:
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 modes x 4 steps (with --validate: 2 workloads "
                        "x 3 modes x 4 steps)")
    parser.add_argument("--out", default=None, help="default runs/bench_simulator (--validate: "
                        "runs/bench_simulator_validate)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--validate", action="store_true",
                        help="every async_vs_sync mode, predicted from the distributions measured in the same run")
    parser.add_argument("--results", default="", help="--validate: compare the runs of this async_vs_sync "
                        "results.json instead of running")
    parser.add_argument("--workloads", default="none,ln1.0,longgen", help="--validate: async_vs_sync workloads")
    parser.add_argument("--modes", default=VALIDATE_MODES, help="--validate: async_vs_sync modes")
    parser.add_argument("--steps", type=int, default=21, help="--validate: steps at batch B (sync-3B: a third)")
    parser.add_argument("--batch", type=int, default=8, help="--validate: B")
    parser.add_argument("--eval-n", type=int, default=30, help="--validate: held-out tasks per evaluation")
    parser.add_argument("--sim-seeds", type=int, default=20, help="--validate: simulated seeds per prediction")
    parser.add_argument("--without-rollout-costs", action="store_true",
                        help="--validate: leave prefill and preparation time out of the model (an ablation)")
    args = parser.parse_args()
    if args.validate:
        args.out = args.out or "runs/bench_simulator_validate"
        validate(args)
        return
    args.out = args.out or "runs/bench_simulator"
    modes, steps, batch = ([0, 2], 4, 8) if args.quick else ([0, 1, 2], 16, 16)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    build_run(load_config("configs/kg_sao_tiny.yaml", ["log.progress=false"]))  # build/cache the model
    rows = []
    for n in modes:
        m = measure(n, steps, batch, out, args.seed)
        m["predicted"] = predict(m, seeds=20)
        rows.append(m)
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    print(f"{steps} steps x {batch} trajectories per mode; tool latency {TOOL_LATENCY}; load "
          f"{os.getloadavg()[0]:.1f}; predictions are the mean of 20 simulated seeds (min-max in brackets)")
    print(f"{'mode':<10}{'step s measured':>16}{'predicted':>24}{'trainer idle m/p':>18}"
          f"{'dropped m/p':>13}{'max stale m/p':>15}")
    errors = []
    for r in rows:
        p = r["predicted"]
        errors.append(abs(p["step_s"] - r["step_s"]) / r["step_s"])
        lo, hi = p["step_s_spread"]
        name = "sync" if r["staleness"] == 0 else f"async {r['staleness']}"
        print(f"{name:<10}{r['step_s']:>16.2f}{p['step_s']:>10.2f} [{lo:5.2f}-{hi:5.2f}]"
              f"{r['trainer_idle']:>10.2f}/{p['trainer_idle']:.2f}{r['dropped']:>8}/{p['dropped']:.1f}"
              f"{r['max_staleness_seen']:>10}/{p['max_staleness_seen']}")
    per_mode = ", ".join(f"{'sync' if r['staleness'] == 0 else 'async ' + str(r['staleness'])} "
                         f"{e:.0%}" for r, e in zip(rows, errors))
    print(f"simulator step-time error vs measured: mean {statistics.mean(errors):.0%} ({per_mode})")


if __name__ == "__main__":
    main()
