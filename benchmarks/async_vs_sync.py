"""Asynchronous versus synchronous training, each mode on the resources it would get.

Every mode trains SAO on the embedded task (same initial policy, tasks, learning rates; the
seeds vary task order, sampling and the critic's initialisation) for the same number of trained
trajectories (`--steps` x B), with `system.cores=auto`: synchronous modes keep
one compute thread on every core (decoding and training never overlap, so each phase has the
whole machine, as a lock-step loop does); asynchronous modes pin the trainer to the first half of
the cores and rollout (decoding, episodes, preparations) to the rest, as a disaggregated
deployment places them. The modes and their concurrency (episodes running at once):

| mode             | settings                                          | batch | concurrency |
| ---------------- | ------------------------------------------------- | ----- | ----------- |
| sync             | max_staleness=0                                   | B     | B           |
| sync-overprov    | max_staleness=0, admission=2B: the first B        | B     | 2B          |
|                  | finishers train, the rest restart on new weights   |       |             |
| sync-3B          | max_staleness=0, batch 3B, a third of the steps    | 3B    | 3B          |
| async-s1/s2/s4   | max_staleness=N (partial rollouts continue)        | B     | (N+1)B      |

sync-3B has the concurrency of async-s2. Workloads (`--workloads`): `none` (no tool latency:
decoding and training compete for the cores), `fixed1` (every tool call 1 s), `ln0.5`, `ln1.0`,
`ln1.5` (log-normal tool latency, mean 1 s, sigma 0.5/1.0/1.5, capped at 30 s).

Rules, fixed here before any run:
- The clock is the training wall time from the start of `train` (setup excluded). Held-out
  evaluation is not on it: the policy weights are copied every `--eval-every` steps and at the
  end, and evaluated after the run (greedy, no tool latency, `--eval-n` held-out tasks), in
  order up to the first copy at the target, and the last one.
- Target: the held-out success of the initial policy (same seed) + 0.10. Time to target = the
  clock at the first evaluated step at or above it; a run that never reaches it counts with its
  whole clock and is marked censored ('>').
- Sampled tokens trained per second = sampled (loss-masked) tokens of trained trajectories /
  clock. Waste = 1 - trained sampled tokens / decoded sampled tokens: every completed model turn
  counts as decoded, so dropped-as-stale, restarted, filtered and still-unsettled episodes (in
  flight or buffered when the run stops) all count as waste.
- Figures are means over `--seeds` seeds with a 95 % t-interval. The headline compares async-s2
  (chosen here, before running) with the STRONGEST sync mode of the same workload: the one with
  the lowest mean time to target. The ratio (sync / async, > 1 = async faster) is the geometric
  mean over seeds of the per-seed ratio, with a 95 % t-interval on its logarithm.

Seeds run interleaved (seed 0: every mode, then seed 1, ...; the mode order rotates) so all
modes see the same background load; `/proc/loadavg` is recorded beside every run, and each run
checks where its threads actually ran (`/proc/self/task/*/stat`, sampled every 0.2 s).

    .venv/bin/python benchmarks/async_vs_sync.py --quick                 # smoke test, ~2 min
    .venv/bin/python benchmarks/async_vs_sync.py --workloads none,ln1.0  # 3 seeds x 60 steps

Results go to `--out`/results.json (every run, its curve, ledger and placement) as they come;
`--resume` runs only what is missing there, `--report-only` prints the tables again.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# One torch thread per worker thread unless a component's budget says otherwise.
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tiderl.config import load_config
from tiderl.evaluate import evaluate
from tiderl.models.embedded import embedded_model_dir
from tiderl.recipe import train
from tiderl.rollout.weights import weights_checksum
from tiderl.run import build_run
from tiderl.system.cores import thread_cpu

CONFIG = "configs/kg_sao_tiny.yaml"
TARGET_GAIN = 0.10  # held-out success above the initial policy's
HEADLINE_ASYNC = "async-s2"
BASE = ["system.backend=local", "system.cores=auto", "log.progress=false", "log.tensorboard=false",
        "algo.critic_warmup_steps=2"]
WORKLOADS = {
    "none": ["env.tool_latency=none"],
    "fixed1": ["env.tool_latency=fixed", "env.tool_latency_s=1.0"],
    **{f"ln{s}": ["env.tool_latency=lognormal", "env.tool_latency_s=1.0", f"env.tool_latency_spread={s}",
                  "env.tool_latency_max_s=30"] for s in (0.5, 1.0, 1.5)},
}


@dataclass(frozen=True)
class Mode:
    name: str
    staleness: int
    batch_factor: int = 1  # batch = factor x B, steps = steps / factor (equal trajectories)
    admission_factor: int = 0  # admission = factor x B (0: the default (N+1) x batch)

    def concurrency(self, b: int) -> int:
        return self.admission_factor * b or (self.staleness + 1) * self.batch_factor * b

    def overrides(self, b: int) -> list[str]:
        out = [f"system.max_staleness={self.staleness}", f"rollout.batch_size={self.batch_factor * b}"]
        if self.admission_factor:
            out.append(f"system.admission={self.admission_factor * b}")
        return out


MODES = [Mode("sync", 0), Mode("sync-overprov", 0, admission_factor=2), Mode("sync-3B", 0, batch_factor=3),
         Mode("async-s1", 1), Mode("async-s2", 2), Mode("async-s4", 4)]


class PlacementSampler:
    """Samples, every `interval_s`, the core each thread of this process last ran on."""

    def __init__(self, interval_s: float = 0.2):
        self.interval_s = interval_s
        self.seen: dict[int, set[int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            for name in os.listdir("/proc/self/task"):
                got = thread_cpu(int(name))
                if got is not None:
                    self.seen.setdefault(int(name), set()).add(got[0])

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def core_busy() -> dict[int, float]:
    """Busy seconds of every core so far (/proc/stat)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    with open("/proc/stat") as f:
        for line in f:
            name, *fields = line.split()
            if name.startswith("cpu") and name[3:].isdigit():
                values = [int(v) for v in fields]
                out[int(name[3:])] = (sum(values) - values[3] - values[4]) / tick
    return out


def loadavg() -> float:
    return float(open("/proc/loadavg").read().split()[0])


def run_mode(mode: Mode, workload: str, seed: int, b: int, steps: int, eval_every: int, eval_n: int,
             out: Path, evaluated: dict[Any, float], model: str = "tiny") -> dict[str, Any]:
    """Train one mode from the policy at `model`; returns its row (figures, curve, ledger, placement)."""
    mode_steps = max(1, steps // mode.batch_factor)
    cfg = load_config(CONFIG, BASE + WORKLOADS[workload] + mode.overrides(b) + [f"model.path={model}",
        f"train.steps={mode_steps}", f"seed={seed}", f"data.eval_size={eval_n}",
        f"run_dir={out / workload / f'{mode.name}_seed{seed}'}"])
    run = build_run(cfg)
    snapshots: list[tuple[int, float, dict[str, Any]]] = []
    trained_sampled = [0]
    t0 = [0.0]

    def snapshot(step: int, clock: float) -> None:
        snapshots.append((step, clock, {k: v.detach().clone() for k, v in run.actor.model.state_dict().items()}))

    def observe(version: int, metrics: dict[str, float], batch: list) -> None:
        clock = time.perf_counter() - t0[0]
        trained_sampled[0] += sum(sum(t.loss_mask) for t in batch)
        if version % eval_every == 0 or version == mode_steps:
            snapshot(version, clock)

    snapshot(0, 0.0)
    busy0, load0 = core_busy(), loadavg()
    placement = PlacementSampler()
    placement.start()
    try:
        t0[0] = time.perf_counter()
        history, summary = train(run, mode_steps, observer=observe)
        wall = time.perf_counter() - t0[0]
    finally:
        placement.stop()
    busy1, load1 = core_busy(), loadavg()

    # Held-out evaluation, off the clock (cached by weights: step 0 is shared by a seed's modes), of
    # the snapshots in order up to the first one at the target, and of the last one.
    tasks = run.setup.eval_tasks[:eval_n]
    curve: list[dict[str, Any]] = []
    hit = None
    for i, (step, clock, state) in enumerate(snapshots):
        if hit is not None and i < len(snapshots) - 1:
            continue
        key = (weights_checksum(state), tuple(t.task_id for t in tasks))
        if key not in evaluated:
            run.engine.update_weights(state, run.engine.version + 1)
            evaluated[key] = evaluate(run.engine, run.tokenizer, run.make_env, tasks, cfg.env, cfg.rollout,
                                      greedy=True)["success"]
        curve.append({"step": step, "clock_s": clock, "success": evaluated[key]})
        if hit is None and i > 0 and curve[-1]["success"] >= curve[0]["success"] + TARGET_GAIN:
            hit = curve[-1]
    start = curve[0]["success"]
    target = start + TARGET_GAIN

    ledger, backend = summary["ledger"], summary["backend"]
    decoded = backend["decoded_tokens"]
    threads = {**summary["cores"]["threads"], **({"rollout": backend["decode_threads"]}
                                                 if backend.get("decode_threads") else {})}
    ran_on = {c: sorted(set().union(*(placement.seen.get(t, set()) for t in tids))) for c, tids in threads.items()}
    return {
        "workload": workload, "mode": mode.name, "seed": seed, "steps": len(history),
        "batch": mode.batch_factor * b, "concurrency": mode.concurrency(b), "wall_s": wall,
        "start": start, "target": target, "final": curve[-1]["success"],
        "time_to_target_s": hit["clock_s"] if hit else wall, "censored": hit is None,
        "trained_tok_s": trained_sampled[0] / wall, "trained_sampled_tokens": trained_sampled[0],
        "decoded_tokens": decoded, "waste": 1 - trained_sampled[0] / decoded if decoded else 0.0,
        "dropped": ledger["dropped_stale"], "restarted": ledger["restarted"], "unsettled": ledger["unsettled"],
        "trained": ledger["trained"], "staleness_hist": summary["staleness_histogram"],
        "trainer_idle": summary["trainer_idle_frac"], "core_plan": summary["cores"]["plan"], "ran_on": ran_on,
        "core_busy_frac": {c: round((busy1[c] - busy0[c]) / wall, 3) for c in busy1},
        "load": [load0, load1], "curve": curve,
    }


def interval(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95 % t-interval (0 for one value)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, 0.0
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    t = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57}.get(n - 1, 1.96)
    return mean, t * sd / math.sqrt(n)


def fmt(values: list[float], digits: int = 1) -> str:
    mean, half = interval(values)
    return f"{mean:.{digits}f} ± {half:.{digits}f}" if len(values) > 1 else f"{mean:.{digits}f}"


def ratio(num: list[float], den: list[float]) -> tuple[float, float, float]:
    """Geometric mean of num_i / den_i (paired by seed) with its 95 % interval."""
    logs = [math.log(a / b) for a, b in zip(num, den)]
    mean, half = interval(logs)
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def report(rows: list[dict[str, Any]], workloads: list[str], modes: list[Mode]) -> list[str]:
    lines = []
    header = (f"{'mode':<15}{'conc.':>6}{'time to target s':>20}{'cens.':>6}{'trained tok/s':>16}"
              f"{'waste':>15}{'held-out final':>18}{'dropped/restarted/unsettled':>30}  staleness")
    headline = []
    for w in workloads:
        by_mode = {m.name: [r for r in rows if r["workload"] == w and r["mode"] == m.name] for m in modes}
        by_mode = {k: sorted(v, key=lambda r: r["seed"]) for k, v in by_mode.items() if v}
        if not by_mode:
            continue
        loads = [x for v in by_mode.values() for r in v for x in r["load"]]
        lines += [f"workload {w} (loadavg during runs {min(loads):.1f}-{max(loads):.1f})", header, "-" * len(header)]
        for name, rs in by_mode.items():
            hist: dict[str, int] = {}
            for r in rs:
                for k, v in r["staleness_hist"].items():
                    hist[str(k)] = hist.get(str(k), 0) + v
            lines.append(
                f"{name:<15}{rs[0]['concurrency']:>6}{fmt([r['time_to_target_s'] for r in rs]):>20}"
                f"{sum(r['censored'] for r in rs):>4}/{len(rs)}{fmt([r['trained_tok_s'] for r in rs], 0):>16}"
                f"{fmt([r['waste'] for r in rs], 3):>15}{fmt([r['final'] for r in rs], 3):>18}"
                f"{fmt([r['dropped'] for r in rs], 0) + ' / ' + fmt([r['restarted'] for r in rs], 0) + ' / ' + fmt([r['unsettled'] for r in rs], 0):>30}"
                f"  {hist}")
        sync = {k: v for k, v in by_mode.items() if k.startswith("sync")}
        if HEADLINE_ASYNC in by_mode and sync:
            strongest = min(sync, key=lambda k: interval([r["time_to_target_s"] for r in sync[k]])[0])
            seeds = sorted({r["seed"] for r in by_mode[HEADLINE_ASYNC]} & {r["seed"] for r in sync[strongest]})
            a = {r["seed"]: r for r in by_mode[HEADLINE_ASYNC]}
            s = {r["seed"]: r for r in sync[strongest]}
            g, lo, hi = ratio([s[i]["time_to_target_s"] for i in seeds], [a[i]["time_to_target_s"] for i in seeds])
            tg, tlo, thi = ratio([a[i]["trained_tok_s"] for i in seeds], [s[i]["trained_tok_s"] for i in seeds])
            censored = sum(s[i]["censored"] + a[i]["censored"] for i in seeds)
            headline.append(
                f"{w}: {HEADLINE_ASYNC} vs strongest sync ({strongest}), {len(seeds)} seeds: time to target "
                f"{g:.2f}x [95% {lo:.2f}-{hi:.2f}]" + (f" ({censored} censored runs)" if censored else "")
                + f"; trained tokens/s {tg:.2f}x [{tlo:.2f}-{thi:.2f}]")
        lines.append("")
    return lines + headline


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke test: one workload, three modes, one seed")
    parser.add_argument("--workloads", default="none,fixed1,ln0.5,ln1.0,ln1.5")
    parser.add_argument("--modes", default=",".join(m.name for m in MODES))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps at batch B (sync-3B: a third)")
    parser.add_argument("--batch", type=int, default=16, help="B")
    parser.add_argument("--eval-every", type=int, default=6)
    parser.add_argument("--eval-n", type=int, default=200)
    parser.add_argument("--out", default="runs/bench_async_vs_sync")
    parser.add_argument("--report-only", action="store_true", help="print the tables of --out/results.json")
    parser.add_argument("--resume", action="store_true",
                        help="keep the runs already in --out/results.json and run only the missing ones")
    args = parser.parse_args()
    if args.quick:
        args.workloads, args.modes, args.seeds = "ln0.5", "sync,sync-overprov,async-s2", 1
        args.steps, args.batch, args.eval_every, args.eval_n = 4, 8, 2, 20
    workloads = args.workloads.split(",")
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        parser.error(f"--workloads: unknown {unknown}; use some of {', '.join(WORKLOADS)}")
    names = args.modes.split(",")
    modes = [m for m in MODES if m.name in names]
    if len(modes) != len(names):
        parser.error(f"--modes: use some of {', '.join(m.name for m in MODES)}")
    out = Path(args.out)
    if args.report_only:
        for line in report(json.loads((out / "results.json").read_text()), workloads, modes):
            print(line)
        return
    out.mkdir(parents=True, exist_ok=True)
    # Every seed starts from the same policy (the embedded model built with seed 0, cached); the
    # seeds vary the run: task order, sampling, critic initialisation.
    model = str(embedded_model_dir(build_run(load_config(CONFIG, ["log.progress=false"])).cfg))
    print(f"{args.steps} steps x B={args.batch} per mode (sync-3B: {args.steps // 3} x {3 * args.batch}); "
          f"{args.seeds} seeds; held-out n={args.eval_n} every {args.eval_every} steps; cores {sorted(os.sched_getaffinity(0))}",
          flush=True)
    results = out / "results.json"
    rows: list[dict[str, Any]] = json.loads(results.read_text()) if args.resume and results.is_file() else []
    done = {(r["workload"], r["mode"], r["seed"]) for r in rows}
    evaluated: dict[Any, float] = {}
    for w in workloads:
        for seed in range(args.seeds):
            order = modes[seed % len(modes):] + modes[:seed % len(modes)]  # rotate: no mode always first
            for mode in order:
                if (w, mode.name, seed) in done:
                    continue
                r = run_mode(mode, w, seed, args.batch, args.steps, args.eval_every, args.eval_n, out, evaluated,
                             model)
                rows.append(r)
                reached = f"at {r['time_to_target_s']:.1f} s" if not r["censored"] else "not reached"
                print(f"  {w} {mode.name} seed {seed}: wall {r['wall_s']:.1f} s, target {r['target']:.3f} {reached}, final "
                      f"{r['final']:.3f}, {r['trained_tok_s']:.0f} tok/s, waste {r['waste']:.3f}, plan "
                      f"{r['core_plan']}, ran on {r['ran_on']}, load {r['load']}", flush=True)
                results.write_text(json.dumps(rows, indent=1))
    for line in report(rows, workloads, modes):
        print(line)


if __name__ == "__main__":
    main()
