"""Seconds per synchronous training step: tiderl's one training path at `system.max_staleness=0`
against the simplest lock-step loop built from the same parts, on an idle machine and with one
core taken by another process.

The baseline (`lockstep`) is what a synchronous RL loop is at its plainest and fastest here: play
a batch of episodes (`play_episodes`: every turn of every episode decoded in one batch, in the
calling thread), one `train_step`, hand the weights to the engine, repeat; no rollout pool, no
buffer, all torch work in one thread with one thread per core, as in tiderl's former lock-step
loop. The one path (`recipe`) is `tiderl.recipe.train` with its rollout pool's slots, readiness
buffer and verified weight sync, its torch threads chosen by `system.trainer_threads` (default:
the cores other processes leave free). Same model, tasks, algorithm and seed; interleaved
repeats.

    .venv/bin/python benchmarks/step_time.py            # GRPO 2 x 8 per step, 20 steps, 3 repeats
    .venv/bin/python benchmarks/step_time.py --quick    # 6 steps, 1 repeat (a smoke test)
    .venv/bin/python benchmarks/step_time.py --prep     # time saved by pipelining the preparations

Last line: recipe / lockstep seconds per step, idle and loaded (below 1.0 = the one path is
faster). What it does not show: asynchronous speed-ups (staleness > 0; see async_vs_sync.py).

`--prep` measures what ref/critic pipelining saves: the same asynchronous run (staleness 1, 16
trajectories per step) with its preparations (critic values from the critic snapshot, reference
log-probs) run ahead by the buffer, overlapped with training and rollout (`pipelined`), and with
none (`serial`: the optimizer step computes the same values and log-probs itself, on the
trainer's critical path). Same passes, same tokens; SAO (critic values) and GRPO with its KL term
(reference log-probs); interleaved repeats. Per configuration it prints the median seconds per
step and per optimizer step (`time/train_s`) of both, and the seconds saved per step (serial -
pipelined, median over the paired repeats); last line: seconds saved per step for each.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from tiderl.agent.loop import play_episodes
from tiderl.config import load_config
from tiderl.recipe import train
from tiderl.rollout.base import sampling_params
from tiderl.run import build_run, sync_weights
from tiderl.train.step import train_step

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


def recipe(cfg, steps: int) -> list[float]:
    """`tiderl.recipe.train` at max_staleness 0; returns the seconds of each step."""
    history, _ = train(build_run(cfg), steps)
    return [h["step_s"] for h in history]


# --prep: the preparation-pipelining comparison (configs and their overrides).
PREP_CONFIGS = {"sao": ("configs/sao.yaml", ["rollout.batch_size=16"]),
                "grpo": ("configs/grpo.yaml", ["algo.group_size=8", "rollout.batch_size=16"])}
PREP_COMMON = ["system.max_staleness=1", "log.progress=false", "log.tensorboard=false",
               "run_dir=runs/bench_step_time_prep"]


def prep_run(cfg, steps: int, serial: bool) -> tuple[list[float], list[float]]:
    """One asynchronous run; returns the seconds of each step and of each optimizer step. serial:
    no preparations run ahead, so `train_step` computes critic values and reference log-probs
    itself (the work a non-pipelined trainer does), by handing the recipe an empty list."""
    run = build_run(cfg)
    if serial:
        with mock.patch("tiderl.recipe.preparations_for", lambda run: []):
            history, _ = train(run, steps)
        assert not any(h.get("value/precomputed") or h.get("kl/ref_precomputed") for h in history)
    else:
        history, _ = train(run, steps)
        assert all(h.get("value/precomputed", 1.0) == 1.0 and h.get("kl/ref_precomputed", 1.0) == 1.0
                   for h in history), "pipelined run: a step did not use the buffer's preparations"
    return [h["step_s"] for h in history], [h["time/train_s"] for h in history]


def prep_main(args: argparse.Namespace) -> None:
    """The `--prep` comparison (module docstring)."""
    saved: dict[str, list[float]] = {}
    rows: dict[tuple[str, str], tuple[list[float], list[float]]] = {}
    print(f"load before: {Path('/proc/loadavg').read_text().split()[:3]}")
    for name, (path, overrides) in PREP_CONFIGS.items():
        cfg = load_config(path, PREP_COMMON + overrides + args.overrides)
        build_run(cfg)  # build and cache the embedded model before anything is timed
        for _ in range(args.repeats):
            medians = {}
            for mode in ("serial", "pipelined"):
                step_s, train_s = prep_run(cfg, args.steps, mode == "serial")
                step_s, train_s = step_s[2:], train_s[2:]  # the first steps warm caches and allocators
                got = rows.setdefault((name, mode), ([], []))
                got[0].extend(step_s)
                got[1].extend(train_s)
                medians[mode] = statistics.median(step_s)
                print(f"{name:5s} {mode:9s} median {medians[mode]:.3f} s/step, optimizer step "
                      f"{statistics.median(train_s):.3f} s", flush=True)
            saved.setdefault(name, []).append(medians["serial"] - medians["pipelined"])
    print(f"load after: {Path('/proc/loadavg').read_text().split()[:3]}")
    print("\n| config | preparations | s/step median | optimizer step s median | steps |")
    print("| --- | --- | --- | --- | --- |")
    for (name, mode), (step_s, train_s) in rows.items():
        print(f"| {name} | {mode} | {statistics.median(step_s):.3f} | {statistics.median(train_s):.3f} | {len(step_s)} |")
    print("\nseconds saved per step by pipelining (serial - pipelined, median over repeats): " + ", ".join(
        f"{name} {statistics.median(v):+.3f} s ({statistics.median(v) / statistics.median(rows[(name, 'serial')][0]):+.0%})"
        for name, v in saved.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/grpo.yaml")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--prep", action="store_true", help="pipelined against serial preparations (docstring)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.repeats = 6, 1
    if args.prep:
        prep_main(args)
        return
    cfg = load_config(args.config, OVERRIDES + args.overrides)
    build_run(cfg)  # build and cache the embedded model before anything is timed
    rows: dict[tuple[str, str], list[float]] = {}
    for load in ("idle", "loaded"):
        hog = None
        if load == "loaded":  # another process keeps one core busy for the whole measurement
            hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            for _ in range(args.repeats):
                for name, fn in (("lockstep", lockstep), ("recipe", recipe)):
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
    ratio = {load: statistics.median(rows[("recipe", load)]) / statistics.median(rows[("lockstep", load)])
             for load in ("idle", "loaded")}
    print(f"\nrecipe/lockstep s/step: idle {ratio['idle']:.2f}x, one core busy {ratio['loaded']:.2f}x")


if __name__ == "__main__":
    main()
