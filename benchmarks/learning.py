"""Learning at an equal budget: SAO against GRPO and PPO (and SAO without its critic warm-up), on
paired seeds, with intervals.

Every run of one seed starts from the same warm-started policy (the model is built once and
shared; the seed sets task order, sampling and the critic's fresh head), trains asynchronously
(local backend, staleness 2) with 64 trajectories per optimizer step (SAO and PPO: 64 prompts x 1
rollout; GRPO: 8 x 8; DAPO: 4 x 16) and stops at the same budget of generated (sampled) tokens.
Every token counts, SAO's critic-only warm-up steps included: the `sao_w0` mode is SAO with
`algo.critic_warmup_steps=0`, the ablation. Held-out greedy success (200 questions whose topic
entities no training question mentions) is measured before training (once: every run starts from
the same policy and greedy decoding is deterministic), every `--eval-every` steps and at the end;
the time those measurements take is left out of every time below.

Per mode it prints: the held-out gain over the start (mean and 95 % t interval over seeds),
steps, training wall time, trainer seconds (time inside optimizer steps), trainer token passes
(tokens through forward+backward and through no-grad forward passes), the tokens spent in the
warm-up, goodput (trained action tokens per second of training wall time) and time to accuracy
(training seconds until held-out success first reaches start + `TARGET_GAIN`). Then the paired
differences of the gains, SAO - GRPO, SAO - PPO and SAO - SAO without warm-up (the same seed
pairs the runs), each with its 95 % interval and the verdict of the rule below. Last line: the
SAO - GRPO and SAO - PPO differences.

Verdict rule (fixed before any run): a paired difference is "SAO higher" when its 95 % interval
lies above 0, "SAO lower" when it lies below 0, else "no difference shown"; a mode "learns" when
the interval of its gain lies above 0. With held-out points along the way (`--eval-every`), the
same rule also judges the mean held-out success over the budget (the area under the curve per
generated token, `tiderl.lab.compare.mean_over_tokens`): how early a mode learns, not only where
it ends.

    .venv/bin/python benchmarks/learning.py             # sao, sao_w0, grpo, ppo x 5 seeds
    .venv/bin/python benchmarks/learning.py --quick     # 2 seeds, tiny budget (a smoke test)
    .venv/bin/python benchmarks/learning.py --algos sao,grpo,dapo,ppo --seeds 0,1,2,3,4
    .venv/bin/python benchmarks/learning.py --long      # SAO, 1000 steps at staleness 4: collapse?
    .venv/bin/python benchmarks/learning.py --config configs/metaqa_sao_tiny.yaml   # MetaQA task
    .venv/bin/python benchmarks/learning.py --resume    # finish an interrupted run (same options)
    .venv/bin/python benchmarks/learning.py --merge runs/a,runs/b   # join runs made in parallel, then report

Runs go seed by seed (every mode on seed 0, then seed 1, ...), and `<out>/runs.json` and
`<out>/curves.csv` are rewritten after each one, so an interrupted benchmark keeps what it
finished. The embedded model is built once (about 5 minutes) and cached; times exclude that.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

import common  # noqa: F401  (sets up the import path and torch threads)

from tiderl.agent.loop import play_episodes
from tiderl.config import load_config
from tiderl.lab.compare import (
    first_reaching,
    mean_ci,
    mean_over_tokens,
    paired_difference,
    trainer_token_passes,
    verdict,
)
from tiderl.metrics.summary import summarize
from tiderl.recipe import train
from tiderl.rollout.base import sampling_params
from tiderl.run import build_run, resolve_model_path

# mode -> (preset config, extra overrides)
MODES = {
    "sao": ("configs/sao.yaml", []),
    "sao_w0": ("configs/sao.yaml", ["algo.critic_warmup_steps=0"]),
    "grpo": ("configs/grpo.yaml", []),
    "dapo": ("configs/dapo.yaml", []),
    "ppo": ("configs/ppo.yaml", []),
    # Issue 35: synchronous SAO against asynchronous SAO under the stale policy that keeps long
    # episodes (tokens more than 4 versions old masked, not whole episodes dropped; admission
    # drains the run's end), at equal trained tokens (--budget-of trained).
    "sao_sync": ("configs/sao.yaml", ["system.max_staleness=0"]),
    "sao_mask": ("configs/sao.yaml", ["system.stale.policy=mask", "system.stale.slack=2", "system.stale.drain=true"]),
}
# Paired differences the report prints (first - second); the last line gives those marked True.
PAIRS = [("sao", "grpo", True), ("sao", "ppo", True), ("sao", "dapo", False), ("sao", "sao_w0", False),
         ("sao_mask", "sao_sync", True), ("sao", "sao_sync", False), ("sao_mask", "sao", False)]
COMMON = ["system.backend=local", "log.progress=false", "log.tensorboard=false", "system.trainer_threads=1",
          "system.decode_threads=1"]
TARGET_GAIN = 0.05  # time to accuracy: held-out success first >= start + this
SKIP_KEYS = ("nonfinite/skipped_step", "skipped_no_signal", "skipped_no_action_tokens")


def task_overrides(task_config: str | None) -> list[str]:
    """Move the presets onto another task: its environment (name, options, turns, budget, prompt),
    data source, answer length, model shape and warm-start; the presets keep their algorithms."""
    if task_config is None:
        return []
    base = load_config(task_config)
    keys = {"env.name": base.env.name, "env.options": dataclasses.asdict(base.env.options),
            "env.max_turns": base.env.max_turns, "env.max_total_tokens": base.env.max_total_tokens,
            "env.system_prompt": base.env.system_prompt, "data.source": base.data.source,
            "rollout.max_new_tokens": base.rollout.max_new_tokens,
            "model.tiny": dataclasses.asdict(base.model.tiny), "model.warmstart": dataclasses.asdict(base.model.warmstart)}
    # (JSON is YAML: quoted text stays text, and a whole mapping replaces the preset's, no key of it left)
    return [f"{k}={json.dumps(v) if isinstance(v, (str, list, dict)) else v}" for k, v in keys.items()]


def run_one(mode: str, seed: int, args: argparse.Namespace, model_path: str, out: Path) -> dict[str, Any]:
    """Train one mode on one seed to the token budget; returns its row (no trajectories)."""
    preset, extra = MODES[mode]
    cfg = load_config(preset, COMMON + task_overrides(args.config) + [
        f"model.path={model_path}", f"seed={seed}", f"system.max_staleness={args.staleness}",
        f"rollout.batch_size={args.batch}", f"train.steps={args.max_steps}",
        f"data.eval_size={args.eval_n}", f"run_dir={out / f'{mode}_seed{seed}'}",
    ] + extra + args.override)
    run = build_run(cfg)
    tasks = run.setup.eval_tasks[:args.eval_n]
    greedy = sampling_params(cfg.rollout, run.tokenizer.eos_token_id, greedy=True)
    curve: list[dict[str, Any]] = []
    acc = {"eval_s": 0.0, "trainer_s": 0.0, "fwd_bwd_tokens": 0, "fwd_tokens": 0, "trained_action_tokens": 0,
           "warmup_tokens": 0}
    t0 = time.perf_counter()

    def held_out(step: int, generated: int) -> None:
        start = time.perf_counter()
        r = summarize(play_episodes(run.engine, run.tokenizer, run.make_env, tasks, greedy,
                                    cfg.env.max_turns, cfg.env.max_total_tokens))
        train_s = start - t0 - acc["eval_s"] if step else 0.0
        acc["eval_s"] += time.perf_counter() - start
        curve.append({"mode": mode, "seed": seed, "step": step, "generated_tokens": generated,
                      "trained_action_tokens": acc["trained_action_tokens"], "train_s": round(train_s, 2),
                      "success": r["success"], "stderr": r["stderr"]})
        print(f"  {mode} seed {seed} step {step:4d} generated {generated:7d}: held-out {r['success']:.3f}",
              flush=True)

    if args.start is None:  # every run starts from the same policy: its greedy result is one number
        held_out(0, 0)
        args.start = {k: curve[0][k] for k in ("success", "stderr")}
    else:
        curve.append({"mode": mode, "seed": seed, "step": 0, "generated_tokens": 0, "trained_action_tokens": 0,
                      "train_s": 0.0, **args.start})
    t0 = time.perf_counter()
    acc["eval_s"] = 0.0

    def observe(version: int, metrics: dict[str, float], batch: list) -> None:
        acc["trainer_s"] += metrics.get("time/train_s", 0.0)
        if not any(metrics.get(k) for k in SKIP_KEYS):
            actor = version - 1 >= cfg.algo.critic_warmup_steps  # this step trained from version - 1
            passes = trainer_token_passes(cfg.algo, sum(len(t.tokens) for t in batch), actor)
            acc["fwd_bwd_tokens"] += passes["fwd_bwd"]
            acc["fwd_tokens"] += passes["fwd"]
            action = sum(t.num_action_tokens for t in batch)
            acc["trained_action_tokens"] += action
            if not actor:
                acc["warmup_tokens"] += action
        if args.eval_every and version % args.eval_every == 0:
            held_out(version, int(metrics["system/generated_tokens"]))

    def spent(m: dict[str, float]) -> float:
        return acc["trained_action_tokens"] if args.budget_of == "trained" else m["system/generated_tokens"]

    history, summary = train(run, cfg.train.steps, observer=observe, stop=lambda m: spent(m) >= args.token_budget)
    wall = time.perf_counter() - t0 - acc["eval_s"]
    generated = int(history[-1]["system/generated_tokens"])
    if curve[-1]["step"] != len(history):
        held_out(len(history), generated)
    start, final = curve[0]["success"], curve[-1]["success"]
    best = max(p["success"] for p in curve)
    lag = {str(k): v for k, v in summary.get("critic_lag_histogram", {}).items()}  # JSON keys
    return {"mode": mode, "seed": seed, "steps": len(history), "wall_s": wall, "generated_tokens": generated,
            **{k: v for k, v in acc.items() if k != "eval_s"}, "eval_s": acc["eval_s"],
            "goodput_tokens_per_s": acc["trained_action_tokens"] / wall,
            "start": start, "final": final, "gain": final - start, "best": best, "collapsed": final < 0.5 * best,
            "time_to_target_s": first_reaching(curve, start + TARGET_GAIN),
            "tokens_to_target": first_reaching(curve, start + TARGET_GAIN, at="generated_tokens"),
            "dropped": summary["ledger"]["dropped_stale"], "critic_lag_histogram": lag,
            "throughput": {k.split("/")[1]: v for k, v in history[-1].items() if k.startswith("throughput/")},
            "curve": curve}


def finished_runs(out: Path) -> list[dict[str, Any]]:
    """The runs a previous invocation with the same `--out` finished (`--resume`)."""
    path = out / "runs.json"
    return json.loads(path.read_text()) if path.exists() else []


def write_results(rows: list[dict[str, Any]], out: Path) -> None:
    """Write `curves.csv` (one line per held-out measurement) and `runs.json` (one per run)."""
    fields = ["mode", "seed", "step", "generated_tokens", "trained_action_tokens", "train_s", "success", "stderr"]
    with open(out / "curves.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            writer.writerows(row["curve"])
    (out / "runs.json").write_text(json.dumps(rows, indent=2))


def plot(rows: list[dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no PNG written")
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = {"sao": "tab:blue", "sao_w0": "tab:cyan", "grpo": "tab:orange", "dapo": "tab:green", "ppo": "tab:red"}
    labelled: set[str] = set()
    for row in rows:
        first = row["mode"] not in labelled  # one legend entry per mode, not per seed
        labelled.add(row["mode"])
        ax.plot([p["generated_tokens"] for p in row["curve"]], [p["success"] for p in row["curve"]],
                color=colors.get(row["mode"], "gray"), alpha=0.8, label=row["mode"] if first else None)
    ax.set_xlabel("generated tokens")
    ax.set_ylabel("held-out greedy success")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def interval(ci: dict[str, float]) -> str:
    if math.isnan(ci["se"]):
        return f"{ci['mean']:+.3f} (1 seed: no interval)"
    return f"{ci['mean']:+.3f} [{ci['lo']:+.3f}, {ci['hi']:+.3f}]"


def report(rows: list[dict[str, Any]], modes: list[str]) -> None:
    """Print the per-mode table, the paired differences and the last line."""
    print(f"\n| mode | seeds | gain over start (95 % CI) | start | final | steps | train wall s | trainer s "
          f"| fwd+bwd Mtok | fwd Mtok | warm-up tok | goodput tok/s | to +{TARGET_GAIN:.2f}: s (reached) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    gains: dict[str, dict[int, float]] = {}
    for mode in modes:
        mine = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["seed"])
        if not mine:
            continue
        gains[mode] = {r["seed"]: r["gain"] for r in mine}
        ci = mean_ci(list(gains[mode].values()))
        reached = [r["time_to_target_s"] for r in mine if math.isfinite(r["time_to_target_s"])]
        to_target = f"{statistics.median(reached):.0f} ({len(reached)}/{len(mine)})" if reached else f"- (0/{len(mine)})"

        def m(key: str, mine: list[dict[str, Any]] = mine) -> float:
            return statistics.mean(r[key] for r in mine)

        print(f"| {mode} | {len(mine)} | {interval(ci)} | {m('start'):.3f} | {m('final'):.3f} | {m('steps'):.1f} "
              f"| {m('wall_s'):.0f} | {m('trainer_s'):.0f} | {m('fwd_bwd_tokens') / 1e6:.2f} | {m('fwd_tokens') / 1e6:.2f} "
              f"| {m('warmup_tokens'):.0f} | {m('goodput_tokens_per_s'):.0f} | {to_target} |")
    starts = {(r["seed"], r["start"]) for r in rows if r["mode"] in modes}
    if len({s for _, s in starts}) > 1:
        print(f"note: start success differs between runs ({sorted(starts)}): the greedy held-out result of the "
              "shared initial policy should be one number")
    have = [m for m in modes if any("throughput" in r for r in rows if r["mode"] == m)]
    if have:  # the scheduler's own figures (wall since it started, no evaluation inside)
        print("\n| mode | goodput tok/s | goodput tok/s/unit | trained sequence tok/s | generated tok/s "
              "| trained traj/s |")
        print("| --- | --- | --- | --- | --- | --- |")
        for mode in have:
            t = [r["throughput"] for r in rows if r["mode"] == mode and "throughput" in r]

            def mt(key: str, t: list[dict[str, float]] = t) -> float:
                return statistics.mean(x[key] for x in t)

            print(f"| {mode} | {mt('goodput_tokens_per_s'):.1f} | {mt('goodput_tokens_per_s_per_unit'):.1f} "
                  f"| {mt('trained_sequence_tokens_per_s'):.1f} | {mt('generated_tokens_per_s'):.1f} "
                  f"| {mt('goodput_trajectories_per_s'):.3f} |")
    print("\n| paired difference of gains | seeds | mean [95 % CI] | verdict |")
    print("| --- | --- | --- | --- |")
    last = []
    for first, other, headline in PAIRS:
        if first in gains and other in gains:
            ci = paired_difference(gains[first], gains[other])
            print(f"| {first} - {other} | {ci['n']} | {interval(ci)} | {verdict(ci, f'{first.upper()} higher', f'{first.upper()} lower')} |")
            if headline:
                last.append(f"{first.upper()} - {other.upper()} {interval(ci)} "
                            f"({verdict(ci, f'{first.upper()} higher', f'{first.upper()} lower')})")
    for mode, g in gains.items():
        print(f"{mode}: {verdict(mean_ci(list(g.values())), 'learns', 'gets worse', 'no gain shown')}")
    # The second rule (fixed 2026-12-05, before the place_value runs of seeds 5-9 that confirm or
    # refute what seeds 0-4 suggested): the mean held-out success over the budget, the area under
    # the curve per generated token; same verdict on its paired differences.
    areas = {mode: {r["seed"]: mean_over_tokens(r["curve"]) for r in rows if r["mode"] == mode}
             for mode in gains if all(len(r["curve"]) > 2 for r in rows if r["mode"] == mode)}
    if areas:
        print("\n| mean held-out success over the budget (area per token) | seeds | mean [95 % CI] | verdict |")
        print("| --- | --- | --- | --- |")
        for mode, a in areas.items():
            print(f"| {mode} | {len(a)} | {interval(mean_ci(list(a.values())))} | |")
        for first, other, headline in PAIRS:
            if first in areas and other in areas:
                ci = paired_difference(areas[first], areas[other])
                said = verdict(ci, f"{first.upper()} higher", f"{first.upper()} lower")
                print(f"| {first} - {other} | {ci['n']} | {interval(ci)} | {said} |")
                if headline:
                    last.append(f"area {first.upper()} - {other.upper()} {interval(ci)} ({said})")
    if last:
        print("gain differences (95 % CI over paired seeds): " + "; ".join(last))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 seeds, tiny budget (a smoke test)")
    parser.add_argument("--long", action="store_true", help="SAO only, 1000 steps at staleness 4")
    parser.add_argument("--config", default=None, help="another task (e.g. configs/metaqa_sao_tiny.yaml)")
    parser.add_argument("--algos", default="sao,sao_w0,grpo,ppo", help=f"modes, from {', '.join(MODES)}")
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--budget", type=float, default=None, help="token budget (default 100000)")
    parser.add_argument("--budget-of", choices=("generated", "trained"), default="generated",
                        help="what the budget counts: generated (sampled) tokens, or trained action tokens "
                             "(equal trained tokens: the async-vs-sync comparison of issue 35)")
    parser.add_argument("--batch", type=int, default=None, help="trajectories per optimizer step (default 64)")
    parser.add_argument("--out", default="runs/bench_learning")
    parser.add_argument("--eval-every", type=int, default=None,
                        help="optimizer steps between held-out measurements, 0 = start and end only "
                             "(default 10; 50 long)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the runs already in <out>/runs.json and run only the missing ones")
    parser.add_argument("--merge", default="",
                        help="comma-separated --out folders of earlier invocations (e.g. one per seed, run in "
                             "parallel): their runs join <out>/runs.json and count as finished")
    parser.add_argument("override", nargs="*", help="extra dotted config overrides for every run")
    args = parser.parse_args()
    requested_eval_every, requested_batch = args.eval_every, args.batch
    args.staleness, args.batch, args.eval_n = 2, 64, 200
    args.token_budget, args.max_steps, args.eval_every = 100_000, 1000, 10
    modes, seeds = args.algos.split(","), [int(s) for s in args.seeds.split(",")]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"--algos: unknown mode(s) {unknown}; choose from {list(MODES)}")
    if args.quick:
        seeds, args.batch, args.eval_n, args.token_budget, args.eval_every = seeds[:2], 16, 40, 3_000, 0
    if args.long:
        modes, seeds, args.staleness, args.batch = ["sao"], seeds[:1], 4, 32
        args.token_budget, args.max_steps, args.eval_every = float("inf"), 1000, 50
    if args.budget is not None:
        args.token_budget = args.budget
    if requested_batch is not None:
        args.batch = requested_batch
    if requested_eval_every is not None:
        args.eval_every = requested_eval_every
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    # The overrides too: one that changes the task (env.options.hops) must warm-start the shared
    # model on that task; the build key leaves out those that do not (tool latency, the algorithm).
    base = load_config(MODES["sao"][0], task_overrides(args.config) + ["log.progress=false"] + args.override)
    from tiderl.envs.setup import load_setup

    model_path = resolve_model_path(base, load_setup(base))  # built once, shared by every run
    print(f"model {model_path}; staleness {args.staleness}; {args.batch} trajectories per step; budget "
          f"{args.token_budget} {args.budget_of} tokens; modes {modes}; seeds {seeds}; held-out n={args.eval_n} "
          f"every {args.eval_every or 'end'} steps")

    rows = finished_runs(out) if args.resume else []
    for folder in filter(None, args.merge.split(",")):
        have = {(r["mode"], r["seed"]) for r in rows}
        for r in finished_runs(Path(folder)):
            if (r["mode"], r["seed"]) in have:
                continue
            metrics = Path(folder) / f"{r['mode']}_seed{r['seed']}" / "metrics.jsonl"
            if "throughput" not in r and metrics.is_file():  # rows of an older version of this script
                last = json.loads(metrics.read_text().splitlines()[-1])
                r["throughput"] = {k.split("/")[1]: v for k, v in last.items() if k.startswith("throughput/")}
            rows.append(r)
    # The start (step 0) is measured once and shared: every run starts from the policy at model_path.
    args.start = {k: rows[0]["curve"][0][k] for k in ("success", "stderr")} if rows else None
    done = {(r["mode"], r["seed"]) for r in rows}
    for seed in seeds:  # seed-major: an interrupted benchmark still has every mode of its seeds
        for mode in modes:
            if (mode, seed) in done:
                print(f"  {mode} seed {seed}: kept from {out / 'runs.json'}")
                continue
            rows.append(run_one(mode, seed, args, model_path, out))
            write_results(rows, out)  # after every run, so an interruption loses one run at most
    write_results(rows, out)
    rows = [r for r in rows if r["mode"] in modes and r["seed"] in seeds]
    plotted = plot(rows, out / "curves.png")
    lags: dict[str, int] = {}
    for r in rows:
        for k, v in r["critic_lag_histogram"].items():
            lags[k] = lags.get(k, 0) + v
    if lags:
        lags = dict(sorted(lags.items(), key=lambda kv: int(kv[0])))
        print(f"critic value lag (versions behind -> trajectories, all critic runs): {lags}")
    if args.long:
        r = rows[0]
        print(f"SAO {r['steps']} steps at staleness {args.staleness} in {r['wall_s'] / 60:.1f} min: "
              f"collapse {'yes' if r['collapsed'] else 'no'} (best {r['best']:.3f}, final {r['final']:.3f})")
    print(f"curves: {out / 'curves.csv'}" + (f", {out / 'curves.png'}" if plotted else ""))
    report(rows, modes)


if __name__ == "__main__":
    main()
