"""Seconds per step and goodput on the visual workload (issue 31): synchronous (staleness 0)
against asynchronous (staleness `--staleness`), each with and without the image stage.

The workload is the visual demo's (`configs/visual_sao_tiny.yaml`: SAO on `visual_grid`, every
turn's observation a rendered 64 px grid) with the tiny vision-language model built here at toy
size from the config (no hub; a two-step warm start, so the policy is close to its random
initialisation: this measures time, not learning). The image stage
(`tiderl.train.annotate.ImagePixels`) runs the image processor once per finished trajectory on
the buffer's preparation thread, and the critic snapshot's values and the optimizer step reuse
those pixel inputs; without it (`stage off`: the recipe's preparations less that one) each of
them processes the images again. Same model, tasks, algorithm and seed in the four runs of a
seed; their order rotates from seed to seed.

    .venv/bin/python benchmarks/visual_step_time.py             # 3 seeds x 4 runs, 10 steps of B = 8
    .venv/bin/python benchmarks/visual_step_time.py --quick     # 1 seed, 4 short steps (a smoke test)

Per run: median seconds per step (the first `--warmup` steps left out: they warm caches and
allocators, and the asynchronous runs fill their pipeline), median optimizer-step seconds
(`time/train_s`), goodput (sampled tokens of trained trajectories per second of the measured
steps, `system/trained_action_tokens`), `/proc/loadavg` before and after. Figures are means over
seeds with a 95 % t-interval; ratios are geometric means of the per-seed ratios with their
interval. Last line: s/step and goodput of the four modes, async/sync and stage on/off ratios.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))  # async_vs_sync: its statistics
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from async_vs_sync import interval, ratio  # noqa: E402
from tiderl.config import load_config  # noqa: E402
from tiderl.recipe import train  # noqa: E402
from tiderl.run import build_run, preparations_for  # noqa: E402
from tiderl.train.annotate import ImagePixels  # noqa: E402

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "visual_sao_tiny.yaml"
# The toy size: a smaller tiny VLM and warm start than the demo's (the benchmark builds it in
# seconds), its episodes shorter; the image size (64 px, 4 x 4 cells of 16 px) is the demo's.
TOY = ["model.tiny.hidden_size=64",
       "model.warmstart.num_traces=64", "model.warmstart.steps=2", "model.warmstart.batch_size=8",
       "algo.critic_warmup_steps=0", "log.progress=false", "log.tensorboard=false",
       "run_dir=runs/bench_visual_step_time"]
QUICK = ["env.max_turns=2", "rollout.max_new_tokens=16"]
MODES = ("sync", "async")


def loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def one_run(cfg, steps: int, warmup: int, stage: bool) -> dict[str, float]:
    """One training run; its measured steps' median s/step and optimizer-step s, and goodput."""
    run = build_run(cfg)  # (builds and caches the toy model of the seed first: not timed)
    load0 = loadavg()
    if stage:
        history, _ = train(run, steps)
    else:
        def without_stage(run):
            return [p for p in preparations_for(run) if not isinstance(p, ImagePixels)]
        with mock.patch("tiderl.recipe.preparations_for", without_stage):
            history, _ = train(run, steps)
    assert all(h.get("value/precomputed", 1.0) == 1.0 for h in history), "a step did not use the critic snapshot"
    measured = history[warmup:]
    seconds = sum(h["step_s"] for h in measured)
    tokens = history[-1]["system/trained_action_tokens"] - (history[warmup - 1]["system/trained_action_tokens"]
                                                            if warmup else 0)
    return {"step_s": statistics.median(h["step_s"] for h in measured),
            "train_s": statistics.median(h["time/train_s"] for h in measured),
            "goodput": tokens / seconds, "load": (load0 + loadavg()) / 2}


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the figures")
    parser.add_argument("--batch", type=int, default=8, help="trajectories per optimizer step (B)")
    parser.add_argument("--staleness", type=int, default=1, help="system.max_staleness of the asynchronous runs")
    parser.add_argument("--quick", action="store_true", help="1 seed, 4 steps of B = 4, short episodes")
    parser.add_argument("overrides", nargs="*", help="config overrides for every run (key=value)")
    args = parser.parse_args(argv)
    extra = []
    if args.quick:
        args.seeds, args.steps, args.warmup, args.batch, extra = 1, 4, 1, 4, QUICK
    if args.steps <= args.warmup:
        raise SystemExit(f"--steps={args.steps} must exceed --warmup={args.warmup}: no step would be measured")
    common = TOY + extra + [f"rollout.batch_size={args.batch}", f"train.steps={args.steps}"] + args.overrides
    cells = [(mode, stage) for mode in MODES for stage in (True, False)]
    rows: dict[tuple[str, bool], list[dict[str, float]]] = {c: [] for c in cells}
    t0 = time.perf_counter()
    print(f"load before: {Path('/proc/loadavg').read_text().split()[:3]}", flush=True)
    for seed in range(args.seeds):
        for mode, stage in cells[seed % 4:] + cells[: seed % 4]:  # the order rotates with the seed
            staleness = 0 if mode == "sync" else args.staleness
            cfg = load_config(CONFIG, common + [f"seed={seed}", f"system.max_staleness={staleness}"])
            r = one_run(cfg, args.steps, args.warmup, stage)
            rows[(mode, stage)].append(r)
            print(f"seed {seed} {mode:5s} stage {'on ' if stage else 'off'}: {r['step_s']:.3f} s/step, optimizer "
                  f"step {r['train_s']:.3f} s, goodput {r['goodput']:.1f} tok/s, load {r['load']:.1f}", flush=True)
    print(f"load after: {Path('/proc/loadavg').read_text().split()[:3]}; {time.perf_counter() - t0:.0f} s in all")

    def fmt(values: list[float], digits: int = 3) -> str:
        mean, half = interval(values)
        return f"{mean:.{digits}f} ± {half:.{digits}f}" if len(values) > 1 else f"{mean:.{digits}f}"

    def fmt_ratio(num: list[float], den: list[float]) -> str:
        g, lo, hi = ratio(num, den)
        return f"{g:.2f}x [{lo:.2f}, {hi:.2f}]" if len(num) > 1 else f"{g:.2f}x"

    print(f"\nvisual_grid, tiny VLM at toy size, SAO, B = {args.batch}, async = staleness {args.staleness}, "
          f"{args.seeds} seed(s), {args.steps - args.warmup} measured steps each")
    print("| mode | image stage | s/step | optimizer step s | goodput tok/s | loadavg |")
    print("| --- | --- | --- | --- | --- | --- |")
    for (mode, stage), rs in rows.items():
        print(f"| {mode} | {'on' if stage else 'off'} | {fmt([r['step_s'] for r in rs])} | "
              f"{fmt([r['train_s'] for r in rs])} | {fmt([r['goodput'] for r in rs], 1)} | "
              f"{min(r['load'] for r in rs):.1f}-{max(r['load'] for r in rs):.1f} |")
    col = {c: {k: [r[k] for r in rs] for k in ("step_s", "goodput")} for c, rs in rows.items()}
    figures = ", ".join(f"{m} stage {'on' if s else 'off'} {statistics.mean(col[(m, s)]['step_s']):.2f} s/step "
                        f"{statistics.mean(col[(m, s)]['goodput']):.1f} tok/s" for m, s in cells)
    last = (f"{figures}; async/sync s/step {fmt_ratio(col[('async', True)]['step_s'], col[('sync', True)]['step_s'])}, "
            f"goodput {fmt_ratio(col[('async', True)]['goodput'], col[('sync', True)]['goodput'])}; stage on/off "
            f"s/step sync {fmt_ratio(col[('sync', True)]['step_s'], col[('sync', False)]['step_s'])}, async "
            f"{fmt_ratio(col[('async', True)]['step_s'], col[('async', False)]['step_s'])}")
    print(last)
    return [last]


if __name__ == "__main__":
    main()
