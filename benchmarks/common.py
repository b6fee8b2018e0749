"""Shared by the benchmarks: train one configured run to a generated-token budget, measuring
held-out greedy success along the way."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one torch thread per worker thread (2 cores here)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tiderl.agent.loop import play_episodes  # noqa: E402
from tiderl.config import RunConfig  # noqa: E402
from tiderl.metrics.summary import summarize  # noqa: E402
from tiderl.recipe import train  # noqa: E402
from tiderl.rollout.base import sampling_params  # noqa: E402
from tiderl.run import build_run  # noqa: E402


def train_to_budget(cfg: RunConfig, token_budget: float, eval_every: int, eval_n: int,
                    label: dict[str, Any], deadline: float = float("inf")) -> dict[str, Any]:
    """Train `cfg` asynchronously until `token_budget` generated tokens (or `train.steps`, or the
    wall-clock `deadline`, a `time.time()`), evaluating held-out greedy success before training,
    every `eval_every` steps and at the end.

    Returns the run's row: `label` plus steps, wall time (training only), generated tokens,
    final and best held-out success, `collapsed` (final < half the best), the curve, the last
    held-out result and its (task, trajectory) pairs, the training history and the run.
    """
    run = build_run(cfg)
    tasks = run.setup.eval_tasks[:eval_n]
    curve: list[dict[str, Any]] = []
    last: dict[str, Any] = {}

    params = sampling_params(cfg.rollout, run.tokenizer.eos_token_id, greedy=True)

    def held_out(step: int, generated: int) -> None:
        trajectories = play_episodes(run.engine, run.tokenizer, run.make_env, tasks, params,
                                     cfg.env.max_turns, cfg.env.max_total_tokens)
        r = summarize(trajectories)
        last["result"], last["trajectories"] = r, trajectories
        curve.append({**label, "step": step, "generated_tokens": generated,
                      "success": r["success"], "stderr": r["stderr"]})
        tag = " ".join(f"{k} {v}" for k, v in label.items())
        print(f"  {tag} step {step:4d} generated {generated:8d}: held-out {r['success']:.3f}", flush=True)

    held_out(0, 0)

    def observe(version: int, metrics: dict, batch: list) -> None:
        if version % eval_every == 0:
            held_out(version, int(metrics["system/generated_tokens"]))

    t0 = time.perf_counter()
    history, summary = train(run, cfg.train.steps, observer=observe,
                             stop=lambda m: m["system/generated_tokens"] >= token_budget or time.time() >= deadline)
    wall = time.perf_counter() - t0
    generated = int(history[-1]["system/generated_tokens"])
    if curve[-1]["step"] != len(history):
        held_out(len(history), generated)
    best = max(p["success"] for p in curve)
    final = curve[-1]["success"]
    return {**label, "steps": len(history), "wall_s": wall, "generated_tokens": generated,
            "final": final, "best": best, "collapsed": final < 0.5 * best,
            "dropped": summary["ledger"]["dropped_stale"], "curve": curve,
            "held_out": last["result"], "held_out_episodes": list(zip(tasks, last["trajectories"])),
            "history": history, "run": run}
