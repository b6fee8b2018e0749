"""Learning side by side: SAO versus GRPO, DAPO and PPO on the knowledge-graph task.

Every run starts from the same warm-started policy, trains asynchronously (local backend,
staleness 2) with the same number of trajectories per optimizer step (SAO and PPO: 64 prompts
x 1 rollout; GRPO: 8 x 8; DAPO: 4 x 16) and stops at the same generated-token budget. Held-out
greedy success (tasks never trained on) is measured every few steps, against generated tokens.

Writes `<out>/curves.csv` and `<out>/curves.png`; prints final held-out success mean ± std per
algorithm over the seeds and whether any run collapsed (its final success fell below half its
best); last line: SAO final success / GRPO final success.

    .venv/bin/python benchmarks/learning.py             # 4 algorithms x 3 seeds, under 60 min here
    .venv/bin/python benchmarks/learning.py --quick     # 1 seed, tiny budget, about 5 min
    .venv/bin/python benchmarks/learning.py --long      # SAO, 1000 steps at staleness 4: collapse?
    .venv/bin/python benchmarks/learning.py --config configs/metaqa_sao_tiny.yaml   # MetaQA task
    .venv/bin/python benchmarks/learning.py --resume    # finish an interrupted run (same options)

Runs go seed by seed (every algorithm on seed 0, then seed 1, ...), and the CSV and JSON are
rewritten after each one, so an interrupted benchmark keeps what it finished.

The embedded model is built once (about 5 minutes) and cached; run times exclude that.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
from pathlib import Path

from common import train_to_budget  # sets up the import path and torch threads

from tiderl.config import load_config
from tiderl.run import resolve_model_path

PRESETS = {"sao": "configs/sao.yaml", "grpo": "configs/grpo.yaml", "dapo": "configs/dapo.yaml",
           "ppo": "configs/ppo.yaml"}
COMMON = ["system.backend=local", "log.progress=false", "log.tensorboard=false", "system.trainer_threads=1", "system.decode_threads=1"]


def task_overrides(task_config: str | None) -> list[str]:
    """Move the presets onto another task: its data, env, model shape and warm-start."""
    if task_config is None:
        return []
    base = load_config(task_config)
    keys = {"data.source": base.data.source, "data.hops": base.data.hops,
            "data.num_train_tasks": base.data.num_train_tasks,
            "env.max_total_tokens": base.env.max_total_tokens,
            "rollout.max_new_tokens": base.rollout.max_new_tokens,
            "model.tiny.vocab_size": base.model.tiny.vocab_size,
            "model.warmstart.num_traces": base.model.warmstart.num_traces,
            "model.warmstart.steps": base.model.warmstart.steps}
    return [f"{k}={json.dumps(v) if isinstance(v, list) else v}" for k, v in keys.items()]


def run_one(algo: str, seed: int, args: argparse.Namespace, model_path: str, out: Path) -> dict:
    cfg = load_config(PRESETS[algo], COMMON + task_overrides(args.config) + [
        f"model.path={model_path}", f"seed={seed}", f"system.max_staleness={args.staleness}",
        f"rollout.batch_size={args.batch}", f"train.steps={args.max_steps}",
        f"data.eval_size={args.eval_n}", f"run_dir={out / f'{algo}_seed{seed}'}",
    ] + args.override)
    row = train_to_budget(cfg, args.token_budget, args.eval_every, args.eval_n, {"algo": algo, "seed": seed})
    return {k: v for k, v in row.items() if k not in ("history", "run", "held_out", "held_out_episodes")}


def finished_runs(out: Path) -> list[dict]:
    """The runs a previous invocation with the same `--out` finished (`--resume`)."""
    path = out / "runs.json"
    return json.loads(path.read_text()) if path.exists() else []


def write_results(rows: list[dict], out: Path) -> None:
    """Write `curves.csv` (one line per held-out measurement) and `runs.json` (one per run)."""
    with open(out / "curves.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["algo", "seed", "step", "generated_tokens", "success", "stderr"])
        writer.writeheader()
        for row in rows:
            writer.writerows(row["curve"])
    (out / "runs.json").write_text(json.dumps(rows, indent=2))


def plot(rows: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no PNG written")
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = {"sao": "tab:blue", "grpo": "tab:orange", "dapo": "tab:green", "ppo": "tab:red"}
    labelled: set[str] = set()
    for row in rows:
        xs = [p["generated_tokens"] for p in row["curve"]]
        ys = [p["success"] for p in row["curve"]]
        first = row["algo"] not in labelled  # one legend entry per algorithm, not per seed
        labelled.add(row["algo"])
        ax.plot(xs, ys, color=colors.get(row["algo"], "gray"), alpha=0.8, label=row["algo"] if first else None)
    ax.set_xlabel("generated tokens")
    ax.set_ylabel("held-out greedy success")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 seed, small budget (~5 min)")
    parser.add_argument("--long", action="store_true", help="SAO only, 1000 steps at staleness 4")
    parser.add_argument("--config", default=None, help="another task (e.g. configs/metaqa_sao_tiny.yaml)")
    parser.add_argument("--algos", default="sao,grpo,dapo,ppo")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--out", default="runs/bench_learning")
    parser.add_argument("--eval-every", type=int, default=None,
                        help="optimizer steps between held-out measurements (default 5; 2 quick; 50 long)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the runs already in <out>/runs.json and run only the missing ones")
    parser.add_argument("override", nargs="*", help="extra dotted config overrides for every run")
    args = parser.parse_args()
    requested_eval_every = args.eval_every
    args.staleness, args.batch, args.eval_n = 2, 64, 200
    args.token_budget, args.max_steps, args.eval_every = 100_000, 1000, 5
    algos, seeds = args.algos.split(","), [int(s) for s in args.seeds.split(",")]
    if args.quick:
        seeds, args.batch, args.eval_n, args.token_budget, args.eval_every = seeds[:1], 32, 100, 12_000, 2
    if args.long:
        algos, seeds, args.staleness, args.batch = ["sao"], seeds[:1], 4, 32
        args.token_budget, args.max_steps, args.eval_every = float("inf"), 1000, 50
    if requested_eval_every is not None:
        args.eval_every = requested_eval_every
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    base = load_config(PRESETS["sao"], task_overrides(args.config) + ["log.progress=false"])
    from tiderl.envs.setup import load_setup

    model_path = resolve_model_path(base, load_setup(base))  # built once, shared by every run
    print(f"model {model_path}; staleness {args.staleness}; {args.batch} trajectories per step; "
          f"budget {args.token_budget} generated tokens; seeds {seeds}")

    rows = finished_runs(out) if args.resume else []
    done = {(r["algo"], r["seed"]) for r in rows}
    for seed in seeds:  # seed-major: an interrupted benchmark still has every algorithm
        for algo in algos:
            if (algo, seed) in done:
                print(f"  {algo} seed {seed}: kept from {out / 'runs.json'}")
                continue
            rows.append(run_one(algo, seed, args, model_path, out))
            write_results(rows, out)  # after every run, so an interruption loses one run at most
    write_results(rows, out)  # every finished run stays on disk, selected or not
    rows = [r for r in rows if r["algo"] in algos and r["seed"] in seeds]
    plotted = plot(rows, out / "curves.png")

    print(f"\n{'algorithm':<10}{'runs':>5}{'steps':>7}{'wall s':>8}{'final held-out':>20}{'collapsed':>11}")
    finals = {}
    for algo in algos:
        mine = [r for r in rows if r["algo"] == algo]
        f = [r["final"] for r in mine]
        finals[algo] = statistics.mean(f)
        sd = statistics.stdev(f) if len(f) > 1 else 0.0
        collapsed = sum(r["collapsed"] for r in mine)
        print(f"{algo:<10}{len(mine):>5}{statistics.mean(r['steps'] for r in mine):>7.0f}"
              f"{statistics.mean(r['wall_s'] for r in mine):>8.0f}{finals[algo]:>13.3f} ± {sd:.3f}"
              f"{('yes (' + str(collapsed) + ')') if collapsed else 'no':>11}")
    print(f"curves: {out / 'curves.csv'}" + (f", {out / 'curves.png'}" if plotted else ""))
    if args.long:
        r = rows[0]
        print(f"SAO {r['steps']} steps at staleness {args.staleness} in {r['wall_s'] / 60:.1f} min: "
              f"collapse {'yes' if r['collapsed'] else 'no'} (best {r['best']:.3f}, final {r['final']:.3f})")
    elif "sao" in finals and "grpo" in finals:
        ratio = finals["sao"] / finals["grpo"] if finals["grpo"] > 0 else float("inf")
        print(f"SAO final / GRPO final held-out success: {finals['sao']:.3f} / {finals['grpo']:.3f} = {ratio:.2f}")


if __name__ == "__main__":
    main()
