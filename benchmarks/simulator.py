"""Does the simulator predict tiderl? Measured runs against the discrete-event model's predictions.

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
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tiderl.config import load_config  # noqa: E402
from tiderl.recipe import train  # noqa: E402
from tiderl.rollout.base import SamplingParams  # noqa: E402
from tiderl.run import build_run  # noqa: E402
from tiderl.system.simulate import Cluster, Dist, Schedule, Workload, simulate  # noqa: E402

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 modes x 4 steps")
    parser.add_argument("--out", default="runs/bench_simulator")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
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
