"""`tiderl simulate`: the command line of the discrete-event model (`tiderl/lab/simulate.py`).

A scenario gives every setting; each flag overrides one (every field of `Workload`, `Cluster`
and `Schedule` has one). The command runs every mode `standard_modes` lists over several seeds
and prints, per mode, trained sampled tokens per second, step time, waste, trainer idle,
sampled tokens per trained trajectory, dropped/cancelled/restarted trajectories and the
staleness histogram, then how each async mode
compares with the strongest synchronous one. `--sweep FLAG V1 V2 ...` (FLAG without its dashes) repeats that for each
value of one flag and says where async's gain falls below 1.1x.

Bad values stop the command before anything runs, with the flag, the rule and an example.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from tiderl.lab.simulate import (
    SCENARIOS,
    Cluster,
    Dist,
    ModeSummary,
    Schedule,
    Workload,
    compare,
    policy_suffix,
    standard_modes,
    strongest_sync,
)
from tiderl.system.staleness import STALE_POLICIES

PAYS = 1.1  # the gain over the strongest sync below which async is said to stop paying


# -- value parsers: each names the rule and an example (argparse prefixes the flag) ----------
def _int_min(low: int, example: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low:
            raise argparse.ArgumentTypeError(f"must be a whole number >= {low} (got {text!r}), e.g. {example}")
        return value
    return parse


def _seconds(example: str, positive: bool = False) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < 0 or (positive and value == 0):
            rule = "> 0" if positive else ">= 0"
            raise argparse.ArgumentTypeError(f"must be a finite number of seconds {rule} (got {text!r}), "
                                             f"e.g. {example}")
        return value
    return parse


def _dist(text: str) -> Dist:
    try:
        return Dist.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"must be staleness levels >= 1 separated by commas (got {text!r}), "
                                         "e.g. --staleness 1,2,4")
    return tuple(sorted(set(values)))


def _policy_list(text: str) -> tuple[tuple[str, int, bool], ...]:
    values = []
    for item in (v.strip() for v in text.split(",") if v.strip()):
        item, drain, rest = item.partition("/")
        policy, _, slack = item.partition("+")
        if policy not in STALE_POLICIES or not (slack or "0").isdigit() or (drain and rest != "drain"):
            values = []
            break
        values.append((policy, int(slack or 0), bool(drain)))
    if not values:
        raise argparse.ArgumentTypeError(f"must be stale policies ({', '.join(STALE_POLICIES)}), each with an optional "
                                         f"+SLACK and /drain, separated by commas (got {text!r}), e.g. "
                                         "--stale-policies drop,mask+1,mask+1/drain")
    return tuple(dict.fromkeys(values))


def _factor_list(text: str) -> tuple[float, ...]:
    if text.strip().lower() in ("none", "0", ""):
        return ()
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        values = ()
    if not values or min(values) <= 1 or not all(math.isfinite(v) for v in values):
        raise argparse.ArgumentTypeError(f"must be factors > 1 separated by commas, or none (got {text!r}), "
                                         "e.g. --cancel-factors 1.5,2")
    return values


def _slot_range(text: str) -> tuple[int, int]:
    low, sep, high = text.partition("-")
    try:
        lo, hi = int(low), int(high)
    except ValueError:
        lo = hi = 0
    if not sep or lo < 1 or hi < lo:
        raise argparse.ArgumentTypeError(f"must be MIN-MAX slots with 1 <= MIN <= MAX (got {text!r}), "
                                         "e.g. --elastic 32-192")
    return lo, hi


def _episodes_file(text: str) -> tuple[tuple[int, ...], ...]:
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"no file {text!r}: give a JSON file of measured episodes, "
                                         "each a list of sampled tokens per turn, e.g. [[120, 40], [300]]")
    try:
        data = json.loads(path.read_text())
        profiles = tuple(tuple(int(t) for t in episode) for episode in data)
        Workload(episodes=profiles)
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(f"{text}: {exc}; the file must be a JSON list of episodes, each a "
                                         "list of sampled tokens (>= 1) per turn, e.g. [[120, 40], [300]]") from None
    if not profiles:
        raise argparse.ArgumentTypeError(f"{text}: no episode in it; e.g. [[120, 40], [300]]")
    return profiles


DIST_HELP = "kind:mean[:spread[:cap]] (const, lognormal, exponential, uniform) or empirical:V1,V2,..."

# (flag, dataclass, field, type, help). Every field of Workload, Cluster and Schedule that a
# comparison does not set per mode has a flag here (mode, max_staleness, overprovision and
# admission are set per mode; see the mode flags below).
FIELD_FLAGS: list[tuple[str, type, str, Callable[[str], Any], str]] = [
    ("--turns", Workload, "turns", _dist, f"model turns per episode: {DIST_HELP}, e.g. lognormal:8:0.5:40"),
    ("--tokens-per-turn", Workload, "tokens_per_turn", _dist,
     f"sampled tokens per model turn: {DIST_HELP}, e.g. lognormal:300:1.0:8192"),
    ("--tool-latency", Workload, "tool_latency_s", _dist,
     f"seconds per tool call: {DIST_HELP}, e.g. lognormal:2.0:1.5:120"),
    ("--episodes", Workload, "episodes", _episodes_file,
     ("JSON file of measured episodes (each a list of sampled tokens per turn, e.g. [[120, 40], [300]]); "
      "replaces --turns and --tokens-per-turn")),
    ("--engines", Cluster, "engines", _int_min(1, "--engines 256"), "inference engines, e.g. 256"),
    ("--engine-max-seqs", Cluster, "engine_max_seqs", _int_min(1, "--engine-max-seqs 64"),
     "sequences one engine decodes at once, e.g. 64"),
    ("--decode-step-s", Cluster, "decode_step_s", _seconds("--decode-step-s 0.02", positive=True),
     "seconds per decode step, the fixed part, e.g. 0.02"),
    ("--decode-step-per-seq-s", Cluster, "decode_step_per_seq_s", _seconds("--decode-step-per-seq-s 0.0003"),
     "seconds per decode step added by each sequence decoding, e.g. 0.0003"),
    ("--prefill-s", Cluster, "prefill_s", _seconds("--prefill-s 0.05"),
     "seconds an engine stops decoding to prefill each turn's prompt, e.g. 0.05"),
    ("--prep-s", Cluster, "prep_s", _seconds("--prep-s 0.2"),
     ("seconds an engine stops decoding to prepare each finished episode (critic values, reference "
      "log-probs) before it may train, e.g. 0.2")),
    ("--train-step-s", Cluster, "train_step_s", _seconds("--train-step-s 60"),
     "seconds per optimizer step, the fixed part, e.g. 60"),
    ("--train-s-per-token", Cluster, "train_s_per_token", _seconds("--train-s-per-token 2e-5"),
     "seconds per trained sampled token of a step, e.g. 2e-5"),
    ("--sync-s", Cluster, "sync_s", _seconds("--sync-s 5"), "seconds per weight sync to the engines, e.g. 5"),
    ("--patience-s", Cluster, "patience_s", _seconds("--patience-s 0.02"),
     "lockstep only: a pass waits while an episode's tool call is younger than this, e.g. 0.02"),
    ("--gather-s", Cluster, "gather_s", _seconds("--gather-s 0.1"),
     "lockstep only: the longest a pass waits for more turns, e.g. 0.1"),
    ("--batch-size", Schedule, "batch_size", _int_min(1, "--batch-size 512"), "trajectories per optimizer step, e.g. 512"),
    ("--steps", Schedule, "steps", _int_min(1, "--steps 40"), "optimizer steps per run, e.g. 40"),
    ("--slots", Schedule, "slots", _int_min(0, "--slots 1024"),
     "episodes in flight at most, every mode (0: the mode's own, (N+1)·B or K·B), e.g. 1024"),
    ("--admission", Schedule, "admission", _int_min(0, "--admission 1536"),
     ("async modes: episodes the staleness gate admits per version (tiderl's system.admission; "
      "0: (N+1)·B), e.g. 1536")),
    ("--elastic-interval-s", Schedule, "elastic_interval_s", _seconds("--elastic-interval-s 2", positive=True),
     "elastic modes: seconds between slot decisions, e.g. 2"),
]
BOOL_FLAGS = [
    ("--latency-on-last-turn", Workload, "latency_on_last_turn",
     "the last turn waits for a tool call too (tiderl's env.tool_latency delays every environment step)"),
    ("--colocated", Cluster, "colocated", "every mode: engines stop while the trainer trains and syncs"),
    ("--lockstep", Cluster, "lockstep",
     "every mode: engines decode in passes no turn joins once started (tiderl's synchronous loop)"),
]


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """The `simulate` subcommand on `sub` (an argparse subparsers object)."""
    sim = sub.add_parser(
        "simulate", help="predict throughput, staleness and waste of sync/async/elastic schedules at any "
        "scale (discrete-event model; docs/simulate.md)",
        description="Every mode of benchmarks/async_vs_sync.py (and more) on a modelled pipeline; a scenario "
        "gives every setting, each flag overrides one. Docs: docs/simulate.md.")
    sim.add_argument("--scenario", choices=sorted(SCENARIOS),
                     help="the starting settings (default tiny-lognormal; with --config agentic-cluster)")
    for flag, _, _, kind, what in FIELD_FLAGS:
        sim.add_argument(flag, type=kind, help=what, dest=_dest(flag))
    for flag, _, _, what in BOOL_FLAGS:
        sim.add_argument(flag, action="store_true", default=None, help=what, dest=_dest(flag))
    modes = sim.add_argument_group("modes (which schedules are compared)")
    modes.add_argument("--staleness", type=_int_list,
                       help="the async modes' staleness levels, e.g. 1,2,4 (default; with --config its "
                       "system.max_staleness)")
    modes.add_argument("--stale-policies", type=_policy_list,
                       help="the async modes' stale policies (tiderl's system.stale.policy), each with an optional "
                       "+SLACK: trained tokens may be N + SLACK versions old (system.stale.slack) while admission "
                       "stays at N; /drain: admission drains the run's end (system.stale.drain). async-sN drops what is too "
                       "stale; async-sN-mask+1 masks tokens older than N + 1; e.g. drop,mask,mask+1,mask+1/drain "
                       "(default drop; with --config its system.stale)")
    modes.add_argument("--sync-overprov-admission", type=_int_min(2, "--sync-overprov-admission 1024"),
                       help="sync-overprov: episodes admitted per version, above --batch-size (default 2 x "
                       "batch), e.g. 1024")
    modes.add_argument("--cancel-factors", type=_factor_list, default=(1.5, 2.0),
                       help="sync-cancel-xK modes: admit K x batch, train the first B, cancel the rest; "
                       "factors > 1, e.g. 1.5,2 (default), or none")
    modes.add_argument("--sync-batch-factor", type=_int_min(1, "--sync-batch-factor 3"), default=3,
                       help="sync-FB mode: sync at F x batch for a F-th of the steps (3, the default, is "
                       "the concurrency of async-s2; 1 leaves it out)")
    modes.add_argument("--sync-loop", action="store_true",
                       help="run the sync modes as tiderl's synchronous loop (devices shared with the trainer, "
                       "lockstep decoding), as benchmarks/simulator.py --validate models them")
    modes.add_argument("--elastic", type=_slot_range, metavar="MIN-MAX",
                       help="also each async mode with elastic slots between MIN and MAX, e.g. 32-192")
    recipe = sim.add_argument_group(
        "from a run config (tiderl/lab/cluster_model.py): predict a recipe's step time on GPUs")
    recipe.add_argument("--config", help="a run config (e.g. configs/cluster_qwen7b_sao.yaml): its servers, trainer "
                        "ranks, batch, steps, staleness, stale policy and tool latency set the model's; the "
                        "scenario gives the episodes' turns and tokens; flags still override")
    recipe.add_argument("--gpu", default="h100", help="with --config: a100, h100 (default) or h200")
    recipe.add_argument("--params", type=float, help="with --config: the model's parameters, e.g. 7.6e9 (default: "
                        "read from model.path's config.json)")
    recipe.add_argument("--mfu", type=float, default=0.35, help="with --config: the trainer's model-FLOPs "
                        "utilisation (default 0.35)")
    recipe.add_argument("--tokens-per-sampled", type=float, default=3.0, help="with --config: trained tokens "
                        "(prompt and observations too) per sampled token (default 3)")
    recipe.add_argument("--sync-gb-per-s", type=float, default=2.0, help="with --config: GB/s of a weight sync's "
                        "write and read (default 2: files on shared storage)")
    recipe.add_argument("--gpus-per-server", type=int, default=1, help="with --config: tensor-parallel GPUs per "
                        "inference server (default 1)")
    run = sim.add_argument_group("run")
    run.add_argument("--seeds", type=_int_min(1, "--seeds 3"), help="seeds per mode, e.g. 3 (default 3; --quick 2)")
    run.add_argument("--quick", action="store_true",
                     help="2 seeds and a third of the scenario's steps (at least 6), for a first look")
    run.add_argument("--sweep", nargs="+", metavar=("FLAG", "VALUE"),
                     help="run the comparison once per value of one flag and find where async's best gain "
                     f"over the strongest sync falls below {PAYS}x; FLAG without its dashes, e.g. --sweep "
                     "tool-latency lognormal:2:0.5 lognormal:2:1.5")
    run.add_argument("--json", help="also write every run's figures to this JSON file")
    sim.set_defaults(simulate_parser=sim)
    return sim


def settings(args: argparse.Namespace) -> tuple[Workload, Cluster, Schedule]:
    """The scenario's settings with every flag given applied."""
    workload, cluster, schedule = SCENARIOS[args.scenario or default_scenario(args)]
    if args.config:
        workload, cluster, schedule = recipe_settings(args, workload, schedule)
    parts = {Workload: workload, Cluster: cluster, Schedule: schedule}
    for flag, owner, name, *_ in FIELD_FLAGS + BOOL_FLAGS:
        value = getattr(args, _dest(flag))
        if value is not None:
            parts[owner] = replace(parts[owner], **{name: value})
    schedule = parts[Schedule]
    if args.quick and args.steps is None:
        schedule = replace(schedule, steps=max(6, schedule.steps // 3))
    return parts[Workload], parts[Cluster], schedule


def recipe_settings(args: argparse.Namespace, workload: Workload,
                    schedule: Schedule) -> tuple[Workload, Cluster, Schedule]:
    """--config: the run config's settings on --gpu (tiderl/lab/cluster_model.py); its staleness
    and stale policy become the compared async mode unless --staleness/--stale-policies say
    otherwise. ValueError naming the flag or the config's field."""
    from tiderl.config import load_config
    from tiderl.lab import cluster_model as cm

    try:
        cfg = load_config(args.config)
    except (ValueError, OSError) as exc:  # a ConfigError is a ValueError
        raise ValueError(f"--config {args.config}: {exc}") from None
    for flag, value in (("--mfu", args.mfu), ("--tokens-per-sampled", args.tokens_per_sampled),
                        ("--sync-gb-per-s", args.sync_gb_per_s), ("--gpus-per-server", args.gpus_per_server)):
        if not value > 0:
            raise ValueError(f"{flag} {value}: must be > 0, e.g. {flag} 1")
    shape = cm.model_shape(cfg, args.params)
    cluster = cm.cluster_from_config(cfg, args.gpu, shape, mfu=args.mfu, tokens_per_sampled=args.tokens_per_sampled,
                                     sync_gb_per_s=args.sync_gb_per_s, gpus_per_server=args.gpus_per_server)
    if args.staleness is None and cfg.system.max_staleness > 0:
        args.staleness = (cfg.system.max_staleness,)
    if args.stale_policies is None:
        args.stale_policies = (cm.stale_policy_of(cfg),)
    args.recipe = {"config": args.config, "gpu": args.gpu, "params": shape.params,
                   "max_staleness": cfg.system.max_staleness, "policy": cm.stale_policy_of(cfg)}
    return (cm.workload_from_config(cfg, workload), cluster, cm.schedule_from_config(cfg, schedule))


def recipe_line(args: argparse.Namespace, summaries: list[ModeSummary]) -> str:
    """The mode the --config recipe runs, and its predicted step time and throughput."""
    r = args.recipe
    n = r["max_staleness"]
    name = "sync" if n == 0 else f"async-s{n}" + policy_suffix(*r["policy"])
    mode = next((m for m in summaries if m.name == name), None)
    if mode is None:
        return f"recipe {r['config']}: its mode ({name}) was not among those compared"
    step, tps = mode.figure("step_s"), mode.figure("trained_tokens_per_s")
    return (f"recipe {r['config']} on {r['gpu']} ({r['params'] / 1e9:.1f}B parameters) runs {name}: predicted step "
            f"{step[0]:.1f} ± {step[1]:.1f} s, {tps[0]:.0f} trained sampled tokens/s")


def modes_of(args: argparse.Namespace, schedule: Schedule) -> list:
    if args.sync_overprov_admission is not None and args.sync_overprov_admission <= schedule.batch_size:
        raise ValueError(f"--sync-overprov-admission {args.sync_overprov_admission}: must be above the batch "
                         f"size ({schedule.batch_size}); e.g. --sync-overprov-admission {2 * schedule.batch_size}")
    for flag, value in (("--admission", schedule.admission), ("--slots", schedule.slots)):
        if 0 < value < schedule.batch_size:
            raise ValueError(f"{flag} {value}: below the batch size ({schedule.batch_size}) no batch could fill; "
                             f"use 0 (the mode's own) or >= {schedule.batch_size}, e.g. {flag} {3 * schedule.batch_size}")
    return standard_modes(schedule, staleness=args.staleness or (1, 2, 4), cancel_factors=args.cancel_factors,
                          overprov_admission=args.sync_overprov_admission or 0,
                          sync_batch_factor=args.sync_batch_factor, sync_loop=args.sync_loop, elastic=args.elastic,
                          stale_policies=args.stale_policies or (("drop", 0, False),))


def _dist_text(d: Dist) -> str:
    if d.kind == "empirical":
        return f"empirical({len(d.values)} values, mean {d.mean:g})"
    if d.kind == "const":
        return f"{d.mean:g}"
    return f"{d.kind}:{d.mean:g}:{d.spread:g}" + (f":{d.cap:g}" if math.isfinite(d.cap) else "")


def describe(workload: Workload, cluster: Cluster, schedule: Schedule) -> str:
    """Every setting, written as the flags that give it."""
    values: list[str] = []
    for flag, owner, name, *_ in FIELD_FLAGS:
        obj = {Workload: workload, Cluster: cluster, Schedule: schedule}[owner]
        value = getattr(obj, name)
        if name == "episodes":
            if value:
                values.append(f"--episodes ({len(value)} measured episodes)")
            continue
        values.append(f"{flag} {_dist_text(value) if isinstance(value, Dist) else f'{value:g}'}")
    for flag, owner, name, _ in BOOL_FLAGS:
        if getattr({Workload: workload, Cluster: cluster}[owner], name):
            values.append(flag)
    return " ".join(values)


def _hist_text(fractions: dict[int, float]) -> str:
    """'0:.50 1:.30 2:.15 3+:.05' (levels above 2 summed, fractions under 0.005 left out)."""
    parts = [f"{k}:{v:.2f}" for k, v in fractions.items() if k <= 2 and v >= 0.005]
    high = sum(v for k, v in fractions.items() if k > 2)
    return " ".join(parts + ([f"3+:{high:.2f}"] if high >= 0.005 else [])) or "-"


def gains(summaries: list[ModeSummary]) -> tuple[ModeSummary, dict[str, tuple[float, float, float]]]:
    """The strongest sync mode and, per async mode, its mean throughput over the strongest sync's
    and the smallest and largest per-seed ratio (the same seed in both)."""
    best = strongest_sync(summaries)
    base = best.figure("trained_tokens_per_s")[0]
    out = {}
    for m in summaries:
        if m.synchronous:
            continue
        per_seed = [a.trained_tokens_per_s / b.trained_tokens_per_s for a, b in zip(m.results, best.results)
                    if b.trained_tokens_per_s > 0]
        ratio = m.figure("trained_tokens_per_s")[0] / base if base else math.inf
        out[m.name] = (ratio, min(per_seed, default=ratio), max(per_seed, default=ratio))
    return best, out


def table(summaries: list[ModeSummary]) -> list[str]:
    """One line per mode: mean ± 95 % interval over the seeds."""
    width = max(len(m.label) for m in summaries) + 1
    header = (f"{'mode':<{width}} {'trained tok/s':>19} {'step s':>15} {'waste':>13} {'trainer idle':>13} "
              f"{'tok/traj':>8} {'len trained/finished':>20} {'KS D':>5} {'dropped':>8} {'cancel/restart':>14}  "
              "staleness (fraction per level)")
    lines = [header]
    for m in summaries:
        tps, step, waste, idle = (m.figure(f) for f in ("trained_tokens_per_s", "step_s", "waste_frac",
                                                         "trainer_idle_frac"))
        n = len(m.results)
        lines.append(
            f"{m.label:<{width}} {tps[0]:>10.1f} ± {tps[1]:<6.1f} {step[0]:>7.2f} ± {step[1]:<5.2f} "
            f"{waste[0]:>6.1%} ± {waste[1]:<4.1%} {idle[0]:>6.2f} ± {idle[1]:<4.2f} "
            f"{m.figure('tokens_per_trajectory')[0]:>8.0f} "
            f"{m.figure('trained_length')[0]:>10.0f}/{m.figure('finished_length')[0]:<9.0f} {m.figure('ks_d')[0]:>5.3f} "
            f"{sum(r.dropped for r in m.results) / n:>8.1f} "
            f"{sum(r.cancelled + r.restarted for r in m.results) / n:>14.1f}  {_hist_text(m.staleness_fractions())}")
    return lines


def length_line(summaries: list[ModeSummary]) -> str:
    """Each async mode's waste and trained episode length against the plain sync mode's (the
    unbiased reference: it trains every episode it starts)."""
    ref = next((m for m in summaries if m.name == "sync"), None) or strongest_sync(summaries)
    base = ref.figure("trained_length")[0]
    text = ", ".join(f"{m.name} waste {m.figure('waste_frac')[0]:.1%}, length "
                     f"{m.figure('trained_length')[0] / base if base else math.inf:.3f}x"
                     for m in summaries if not m.synchronous)
    return f"trained mean episode length / {ref.name}'s ({base:.0f} sampled tokens): {text}"


def gain_line(summaries: list[ModeSummary]) -> str:
    best, ratios = gains(summaries)
    text = ", ".join(f"{name} {r:.2f}x [{lo:.2f}-{hi:.2f}]" for name, (r, lo, hi) in ratios.items())
    return (f"async / strongest sync ({best.name}, {best.figure('trained_tokens_per_s')[0]:.1f} tok/s) trained "
            f"tokens per second, mean [per-seed min-max]: {text}")


def _rows(summaries: list[ModeSummary]) -> dict[str, Any]:
    return {m.label: [r.row() for r in m.results] for m in summaries}


def _sweep_values(args: argparse.Namespace) -> tuple[str, list[tuple[str, Any]]]:
    """The swept flag and its parsed values; ValueError naming --sweep on a bad one."""
    name, *texts = args.sweep
    flag = "--" + name.lstrip("-")
    parser: argparse.ArgumentParser = args.simulate_parser
    action = next((a for a in parser._actions if flag in a.option_strings), None)
    if action is None or action.nargs == 0 or flag in ("--sweep", "--json", "--seeds", "--quick"):
        raise ValueError(f"--sweep {name}: name a simulate flag that takes a value, without its dashes, e.g. "
                         "--sweep tool-latency lognormal:2:0.5 lognormal:2:1.5")
    if not texts:
        raise ValueError(f"--sweep {flag}: give one or more values after the flag, e.g. --sweep {flag} A B C")
    values = []
    for text in texts:
        try:
            values.append((text, action.type(text) if action.type else text))
        except argparse.ArgumentTypeError as exc:
            raise ValueError(f"--sweep {flag} {text}: {exc}") from None
        if action.choices and text not in action.choices:
            raise ValueError(f"--sweep {flag} {text}: use one of {', '.join(action.choices)}")
    return action.dest, values


def default_scenario(args: argparse.Namespace) -> str:
    return "agentic-cluster" if getattr(args, "config", None) else "tiny-lognormal"


def run(args: argparse.Namespace) -> int:
    """Run the comparison (or the sweep) `args` ask for and print it; 2 on a bad setting."""
    args.scenario = args.scenario or default_scenario(args)
    seeds = args.seeds or (2 if args.quick else 3)
    try:
        points = [("", args)]
        if args.sweep:
            dest, values = _sweep_values(args)
            points = [(text, argparse.Namespace(**{**vars(args), dest: value})) for text, value in values]
        plans = []
        for text, point_args in points:
            workload, cluster, schedule = settings(point_args)
            plans.append((text, workload, cluster, schedule, modes_of(point_args, schedule)))
    except ValueError as exc:
        print(f"tiderl simulate: {exc}", file=sys.stderr)
        return 2
    out_json: dict[str, Any] = {"scenario": args.scenario, "seeds": seeds, "points": []}
    swept: list[tuple[str, ModeSummary, dict]] = []
    for (text, workload, cluster, schedule, modes), (_, point_args) in zip(plans, points):
        t0 = time.perf_counter()
        summaries = compare(workload, cluster, modes, seeds=seeds)
        title = f"--{args.sweep[0].lstrip('-')} {text}: " if args.sweep else ""
        print(f"{title}scenario {args.scenario}, {seeds} seeds per mode ({time.perf_counter() - t0:.1f} s); "
              f"mean ± 95 % interval; tokens are sampled tokens\n  settings: {describe(workload, cluster, schedule)}")
        recipe = [recipe_line(point_args, summaries)] if getattr(point_args, "recipe", None) else []
        for line in table(summaries) + [length_line(summaries), gain_line(summaries)] + recipe + [""]:
            print(line)
        best, ratios = gains(summaries)
        swept.append((text, best, ratios))
        out_json["points"].append({"value": text, "settings": describe(workload, cluster, schedule),
                                   "strongest_sync": best.label, "gains": ratios, "runs": _rows(summaries)})
    if args.sweep:
        for line in sweep_summary("--" + args.sweep[0].lstrip("-"), swept):
            print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(out_json if args.sweep else out_json["points"][0], indent=1))
    return 0


def sweep_summary(flag: str, swept: list[tuple[str, ModeSummary, dict]]) -> list[str]:
    """One line per swept value (the strongest sync and async's best gain over it), then the
    first value, in the order given, at which the best gain is below `PAYS`."""
    lines = [f"sweep of {flag}: best async gain over the strongest sync (mean [per-seed min-max])"]
    first_below = None
    for text, best, ratios in swept:
        name, (r, lo, hi) = max(ratios.items(), key=lambda kv: kv[1][0])
        lines.append(f"  {flag} {text}: {name} {r:.2f}x [{lo:.2f}-{hi:.2f}] over {best.name} "
                     f"({best.figure('trained_tokens_per_s')[0]:.1f} tok/s)")
        if r < PAYS and first_below is None:
            first_below = text
    lines.append(f"async stops paying (best gain < {PAYS}x) at {flag} {first_below}" if first_below is not None
                 else f"async's best gain stays >= {PAYS}x at every value of {flag} swept")
    return lines
