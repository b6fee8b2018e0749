"""`tiderl train | eval | demo | build-model | config`.

Every command takes `--config FILE` plus dotted overrides (`algo.critic_lr=5e-6`) and accepts
`--dry-run` to print the resolved config and exit.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from tiderl.config import ConfigError, RunConfig, describe, dump_yaml, load_config


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tiderl", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help)
        p.add_argument("--config", help="YAML config file (see configs/)")
        p.add_argument("--run-dir", help="shortcut for run_dir=...")
        p.add_argument("--dry-run", action="store_true", help="print the resolved config, exit")
        p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. algo.critic_lr=5e-6")
        return p

    add("train", "train a policy with SAO")
    ev = add("eval", "evaluate a policy on held-out tasks")
    ev.add_argument("--model", help="model dir or checkpoint's actor/ dir (default: model.path)")
    ev.add_argument("--json", help="also write the results to this JSON file")
    add("demo", "build the embedded model, evaluate, train with SAO, evaluate again")
    add("build-model", "build (or find) the cached embedded default model and print its path")
    sub.add_parser("config", help="print every config key with its default and meaning")
    return parser


def _load(args: argparse.Namespace) -> RunConfig:
    overrides = list(args.overrides)
    if args.run_dir:
        overrides.append(f"run_dir={args.run_dir}")
    return load_config(args.config, overrides)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "config":
        for key, help, default in describe():
            print(f"{key} = {default!r}\n    {help}")
        return 0
    try:
        cfg = _load(args)
    except ConfigError as exc:
        print(f"tiderl: config error: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(dump_yaml(cfg), end="")
        return 0
    if args.command == "train":
        return cmd_train(cfg)
    if args.command == "eval":
        return cmd_eval(cfg, args.model, args.json)
    if args.command == "demo":
        return cmd_demo(cfg)
    if args.command == "build-model":
        from tiderl.data import load_kg_setup
        from tiderl.loop import resolve_model_path

        print(resolve_model_path(cfg, load_kg_setup(cfg.data)))
        return 0
    return 1


def cmd_train(cfg: RunConfig) -> int:
    from tiderl.loop import build_run, train
    from tiderl.train.checkpoint import save_checkpoint

    run = build_run(cfg)
    train(run)
    path = save_checkpoint(Path(cfg.run_dir) / "checkpoints" / "final", run.step, run.actor,
                           run.critic, run.tokenizer)
    print(f"checkpoint: {path}")
    return 0


def _eval_both(cfg: RunConfig, engine: Any, tokenizer: Any, make_env: Any,
               tasks: list) -> dict[str, Any]:
    from tiderl.evaluate import evaluate

    out = {}
    if cfg.eval.greedy:
        out["greedy"] = evaluate(engine, tokenizer, make_env, tasks, cfg.env, cfg.rollout, True)
    if cfg.eval.sampled:
        out["sampled"] = evaluate(engine, tokenizer, make_env, tasks, cfg.env, cfg.rollout, False)
    return out


def cmd_eval(cfg: RunConfig, model: str | None, json_path: str | None) -> int:
    import torch

    from tiderl.data import env_factory, load_kg_setup
    from tiderl.evaluate import format_table
    from tiderl.loop import resolve_model_path
    from tiderl.models.loading import load_model, load_tokenizer
    from tiderl.rollout.torch_engine import TorchEngine

    torch.manual_seed(cfg.seed)
    setup = load_kg_setup(cfg.data)
    path = model or resolve_model_path(cfg, setup)
    tokenizer = load_tokenizer(path)
    engine = TorchEngine(load_model(path, cfg.model.dtype, cfg.model.device).eval(), tokenizer,
                         device=cfg.model.device, seed=cfg.seed,
                         max_batch_size=cfg.rollout.engine_batch_size)
    results = _eval_both(cfg, engine, tokenizer, env_factory(cfg.env, setup),
                         setup.eval_tasks)
    print(format_table([(f"{setup.name} {mode}", r) for mode, r in results.items()]))
    print(json.dumps({"model": str(path), "data": setup.name, "results": results}, indent=2))
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=2))
    return 0


def cmd_demo(cfg: RunConfig) -> int:
    """Evaluate the warm-started policy, train it with SAO, evaluate again, write summary.json."""
    from tiderl.evaluate import format_table
    from tiderl.loop import build_run, train
    from tiderl.train.checkpoint import save_checkpoint

    t0 = time.perf_counter()
    run = build_run(cfg)
    run_dir = Path(cfg.run_dir)
    tasks = run.setup.eval_tasks
    print(f"[tiderl] model {run.model_path}\n[tiderl] {len(run.setup.train_tasks)} training "
          f"tasks, {len(tasks)} held-out tasks ({run.setup.name})")
    before = _eval_both(cfg, run.engine, run.tokenizer, run.make_env, tasks)
    print(format_table([(f"before {m}", r) for m, r in before.items()]))
    t_train = time.perf_counter()
    history = train(run)
    train_s = time.perf_counter() - t_train
    after = _eval_both(cfg, run.engine, run.tokenizer, run.make_env, tasks)
    ckpt = save_checkpoint(run_dir / "checkpoints" / "final", run.step, run.actor, run.critic,
                           run.tokenizer)
    wall = time.perf_counter() - t0
    primary = "greedy" if "greedy" in before else "sampled"
    generated = sum(h["episode/action_tokens"] * cfg.rollout.batch_size for h in history)
    trained = sum(h["episode/tokens"] * cfg.rollout.batch_size for h in history)
    summary = {
        "success_before": before[primary]["success"],
        "success_after": after[primary]["success"],
        "n_eval": before[primary]["n"],
        "stderr_before": before[primary]["stderr"],
        "stderr_after": after[primary]["stderr"],
        "eval_mode": primary,
        "steps": run.step,
        "trajectories": run.step * cfg.rollout.batch_size,
        "generated_tokens": int(generated),
        "trained_tokens": int(trained),
        "train_s": train_s,
        "wall_s": wall,
        "before": before,
        "after": after,
        "checkpoint": str(ckpt),
        "data": run.setup.name,
    }
    path = run_dir / "summary.json"
    path.write_text(json.dumps(summary, indent=2))
    rows = []
    for mode in before:
        rows += [(f"before {mode}", before[mode]), (f"after  {mode}", after[mode])]
    print()
    print(format_table(rows))
    gain = summary["success_after"] - summary["success_before"]
    se = (summary["stderr_before"] ** 2 + summary["stderr_after"] ** 2) ** 0.5
    print(f"\nheld-out success ({primary}, n={summary['n_eval']}): "
          f"{summary['success_before']:.3f} ± {summary['stderr_before']:.3f} -> "
          f"{summary['success_after']:.3f} ± {summary['stderr_after']:.3f} "
          f"(gain {gain:+.3f} = {gain / se if se > 0 else float('inf'):.1f} standard errors)")
    print(f"steps {run.step}, trajectories {summary['trajectories']}, generated tokens "
          f"{summary['generated_tokens']}, trained tokens {summary['trained_tokens']}, "
          f"train {train_s:.0f}s, wall {wall:.0f}s")
    print(f"summary: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
