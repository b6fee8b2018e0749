"""Asynchronous versus synchronous training on a long-tail agentic workload.

Same model (the embedded default), tasks, seed and number of trained trajectories in every mode;
only `system.max_staleness` changes: 0 is synchronous (on-policy: a batch is sampled, trained,
then the next is sampled), 1/2/4 let rollout run ahead of training. Every tool call waits a
log-normal simulated latency (heavy tail), and the tiny policy's turns vary in length.

Prints one row per mode (wall time of training, goodput, trainer and rollout idle fractions,
dropped/retried counts, held-out greedy success with its standard error) and, on the last line,
the async/sync speed-up at equal trained trajectories.

    .venv/bin/python benchmarks/async_vs_sync.py            # full: about 12 minutes here
    .venv/bin/python benchmarks/async_vs_sync.py --quick    # about 2 minutes

The embedded model is built once (about 5 minutes) and cached; the run's figures exclude that.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

# One torch thread per worker thread: the engine and the trainer each get a core (2 here).
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tiderl.config import load_config  # noqa: E402
from tiderl.evaluate import evaluate  # noqa: E402
from tiderl.recipe import train  # noqa: E402
from tiderl.run import build_run  # noqa: E402

WORKLOAD = [
    # Heavy-tailed tool latency: mean 1 s, sigma 1.5 (median 0.32 s; 1 call in 100 over 10 s).
    "env.tool_latency=lognormal", "env.tool_latency_s=1.0", "env.tool_latency_spread=1.5",
    "env.tool_latency_max_s=30",
    "system.trainer_threads=1", "system.decode_threads=1", "log.progress=false", "log.tensorboard=false",
    "algo.critic_warmup_steps=2",
]


def run_mode(staleness: int, steps: int, batch: int, eval_n: int, out_dir: Path, seed: int) -> dict:
    cfg = load_config("configs/kg_sao_tiny.yaml", WORKLOAD + [
        "system.backend=local", f"system.max_staleness={staleness}",
        f"rollout.batch_size={batch}", f"train.steps={steps}", f"seed={seed}",
        f"data.eval_size={eval_n}", f"run_dir={out_dir / f'staleness_{staleness}'}",
    ])
    run = build_run(cfg)
    t0 = time.perf_counter()
    _, summary = train(run, steps)
    wall = time.perf_counter() - t0
    tasks = run.setup.eval_tasks[:eval_n]
    # Held-out evaluation without simulated latency: it measures the policy, not the tools.
    result = evaluate(run.engine, run.tokenizer, run.make_env, tasks, cfg.env, cfg.rollout, greedy=True)
    ledger = summary["ledger"]
    return {
        "staleness": staleness, "wall_s": wall, "trained": ledger["trained"],
        "goodput_traj_s": ledger["trained"] / wall,
        "goodput_tok_s": summary["goodput_tokens_per_s"],
        "trainer_idle": summary["trainer_idle_frac"], "rollout_idle": summary["rollout_idle_frac"],
        "dropped": ledger["dropped_stale"], "retried": ledger["retried"], "failed": ledger["failed"],
        "success": result["success"], "stderr": result["stderr"], "n_eval": result["n"],
        "staleness_hist": summary["staleness_histogram"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a 2-minute version (fewer steps and modes)")
    parser.add_argument("--out", default="runs/bench_async_vs_sync")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.quick:
        modes, steps, batch, eval_n = [0, 2], 5, 16, 100
    else:
        modes, steps, batch, eval_n = [0, 1, 2, 4], 20, 32, 200
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"workload: {' '.join(WORKLOAD[:4])}; {steps} steps x {batch} trajectories per mode")
    build_run(load_config("configs/kg_sao_tiny.yaml", ["log.progress=false"]))  # build/cache the model

    rows = [run_mode(s, steps, batch, eval_n, out, args.seed) for s in modes]
    header = (f"{'mode':<14}{'wall s':>8}{'traj/s':>8}{'tok/s':>8}{'trainer idle':>13}{'rollout idle':>13}"
              f"{'dropped':>8}{'retried':>8}{'held-out success':>18}")
    print(header)
    print("-" * len(header))
    for r in rows:
        name = "sync (s=0)" if r["staleness"] == 0 else f"async s={r['staleness']}"
        print(f"{name:<14}{r['wall_s']:>8.1f}{r['goodput_traj_s']:>8.2f}{r['goodput_tok_s']:>8.0f}"
              f"{r['trainer_idle']:>13.2f}{r['rollout_idle']:>13.2f}{r['dropped']:>8}{r['retried']:>8}"
              f"{r['success']:>11.3f} ± {r['stderr']:.3f}")
    (out / "results.json").write_text(json.dumps(rows, indent=2))
    sync = rows[0]
    parts = [f"s={r['staleness']} {sync['wall_s'] / r['wall_s']:.2f}x" for r in rows[1:]]
    best = max(rows[1:], key=lambda r: sync["wall_s"] / r["wall_s"])
    print(f"async/sync speed-up at {sync['trained']} trained trajectories: "
          f"{sync['wall_s'] / best['wall_s']:.2f}x (best, s={best['staleness']}); " + ", ".join(parts))


if __name__ == "__main__":
    main()
