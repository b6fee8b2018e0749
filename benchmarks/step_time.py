"""Seconds per synchronous training step: tiderl's one training path at `system.max_staleness=0`
against the simplest lock-step loop built from the same parts, on an idle machine and with one
core taken by another process.

The baseline (`lockstep`) is what a synchronous RL loop is at its plainest and fastest here: play
a batch of episodes (`play_episodes`: every turn of every episode decoded in one batch, in the
calling thread), one `train_step`, hand the weights to the engine, repeat; no scheduler, no
buffer, all torch work in one thread with one thread per core, as in tiderl's former lock-step
loop. The one path (`scheduler`) is `tiderl.recipe.train` with its rollout slots, readiness
buffer and verified weight sync, its torch threads chosen by `system.trainer_threads` (default:
the cores other processes leave free). Same model, tasks, algorithm and seed; interleaved
repeats.

    .venv/bin/python benchmarks/step_time.py            # GRPO 2 x 8 per step, 20 steps, 3 repeats
    .venv/bin/python benchmarks/step_time.py --quick    # 6 steps, 1 repeat (a smoke test)

Last line: scheduler / lockstep seconds per step, idle and loaded (below 1.0 = the one path is
faster). What it does not show: asynchronous speed-ups (staleness > 0; see async_vs_sync.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from tiderl.agent.loop import play_episodes  # noqa: E402
from tiderl.config import load_config  # noqa: E402
from tiderl.recipe import train  # noqa: E402
from tiderl.rollout.base import sampling_params  # noqa: E402
from tiderl.run import build_run, sync_weights  # noqa: E402
from tiderl.train.step import train_step  # noqa: E402

OVERRIDES = ["algo.group_size=8", "rollout.batch_size=16", "log.progress=false", "log.tensorboard=false",
             "run_dir=runs/bench_step_time"]


def lockstep(cfg, steps: int) -> list[float]:
    """The plainest synchronous loop; returns the seconds of each step."""
    run = build_run(cfg)
    torch.set_num_threads(os.cpu_count() or 1)  # one per core: the plain loop's default
    params = sampling_params(cfg.rollout, run.tokenizer.eos_token_id, greedy=False)
    g, times = cfg.algo.group_size, []
    for _ in range(steps):
        t0 = time.perf_counter()
        tasks = [t for t in run.tasks.take(cfg.rollout.batch_size // g) for _ in range(g)]
        ids = [f"{t.task_id}#{run.step}" for t in tasks]
        batch = [run.shape(t) for t in play_episodes(run.engine, run.tokenizer, run.make_env, tasks, params,
                                                     cfg.env.max_turns, cfg.env.max_total_tokens, group_ids=ids,
                                                     threads=torch.get_num_threads())]
        train_step(batch, run.actor, run.critic, run.ref, cfg.algo, run.tokenizer.pad_token_id,
                   cfg.train.micro_batch_tokens, train_actor=True, device=cfg.model.device)
        run.step += 1
        sync_weights(run)
        times.append(time.perf_counter() - t0)
    return times


def scheduler(cfg, steps: int) -> list[float]:
    """`tiderl.recipe.train` at max_staleness 0; returns the seconds of each step."""
    history, _ = train(build_run(cfg), steps)
    return [h["step_s"] for h in history]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/grpo.yaml")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.repeats = 6, 1
    cfg = load_config(args.config, OVERRIDES + args.overrides)
    build_run(cfg)  # build and cache the embedded model before anything is timed
    rows: dict[tuple[str, str], list[float]] = {}
    for load in ("idle", "loaded"):
        hog = None
        if load == "loaded":  # another process keeps one core busy for the whole measurement
            hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            for _ in range(args.repeats):
                for name, fn in (("lockstep", lockstep), ("scheduler", scheduler)):
                    times = fn(cfg, args.steps)[2:]  # the first steps warm caches and allocators
                    rows.setdefault((name, load), []).extend(times)
                    print(f"{load:6s} {name:9s} median {statistics.median(times):.3f} s/step", flush=True)
        finally:
            if hog is not None:
                hog.kill()
    print("\n| loop | machine | s/step median | p10-p90 | steps |")
    print("| --- | --- | --- | --- | --- |")
    for (name, load), times in rows.items():
        q = statistics.quantiles(times, n=10) if len(times) >= 2 else times * 9
        print(f"| {name} | {load} | {statistics.median(times):.3f} | {q[0]:.3f}-{q[-1]:.3f} | {len(times)} |")
    ratio = {load: statistics.median(rows[("scheduler", load)]) / statistics.median(rows[("lockstep", load)])
             for load in ("idle", "loaded")}
    print(f"\nscheduler/lockstep s/step: idle {ratio['idle']:.2f}x, one core busy {ratio['loaded']:.2f}x")


if __name__ == "__main__":
    main()
