"""The embedded default policy: a tiny Qwen2 model warm-started on tiderl's own tool-use traces.

Built once per (shape, warm start, environment and its options, data) and cached as a normal
Hugging Face model dir under the user's cache (`$TIDERL_CACHE` or `~/.cache/tiderl`), from the
environment's `warm_start` (`tiderl.envs.registration.WarmStart`); an environment without one has
no embedded model (a clear error names the fix). Building it:

1. demonstrations: `warm_start.demonstrations` draws training tasks and the assistant turns that
   solve them, wrong in a systematic way at chosen rates, so the warm-started policy succeeds
   sometimes, not always, under sampling *and* greedy decoding: what RL can fix;
2. a byte-level BPE tokenizer trained on the texts of those episodes, with the ChatML template;
3. the demonstrations as token sequences, played through the agent loop by a scripted engine, so
   supervised data and RL rollouts share one token layout;
4. supervised fine-tuning on the assistant tokens: `warmstart.steps` steps, or, with
   `warmstart.copy_check_threshold` > 0, until the model passes the warm start's copy check
   (greedy answers to training questions kept out of the demonstrations), `warmstart.steps`
   being the cap.

An environment whose messages show images (`Observation`s) gets the tiny vision-language model
instead (`tiderl.embedded.tiny_vlm`, the same `model.tiny` sizes; docs/multimodal.md), warm-started
the same way on its demonstrations with their images.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import time
import warnings
from dataclasses import asdict
from pathlib import Path

import torch

from tiderl.agent.tool_parser import parse_hermes_tool_calls
from tiderl.config import RunConfig
from tiderl.embedded.tiny import init_tiny_model, tiny_qwen2_config, train_tokenizer
from tiderl.embedded.tiny_vlm import init_tiny_vlm, make_processor, tiny_vlm_config, train_vlm_tokenizer
from tiderl.envs.protocol import Env, Observation, Task, message_text
from tiderl.envs.registration import WarmStart, environment
from tiderl.envs.setup import Setup
from tiderl.models.fetch import cache_root
from tiderl.models.loading import count_parameters, save_model_dir
from tiderl.models.startup import StartupError
from tiderl.models.vision import ChatProcessor
from tiderl.models.warmstart import log_progress, scripted_traces, supervised_finetune


# Bump when the build recipe changes, so stale caches are not reused.
BUILD_VERSION = 1


def warm_start(cfg: RunConfig) -> WarmStart:
    """The warm start of the environment `env.name` names; StartupError naming the fix when it
    has none."""
    found = getattr(environment(cfg.env.name), "warm_start", None)
    if found is None:
        raise StartupError(f"env.name={cfg.env.name} has no embedded tiny model (model.path=tiny): the environment "
                           "gives no warm start. Fix: set model.path=DIR to a Hugging Face model directory "
                           "(tiderl eval: --model DIR; `tiderl models fetch`), or give the environment a "
                           "warm_start (docs/extending.md)")
    return found


def build_key(cfg: RunConfig) -> str:
    """A hash of everything the build depends on."""
    start = warm_start(cfg)
    recipe = {
        "version": BUILD_VERSION,
        "tiny": _tiny_recipe(cfg),
        "warmstart": _warmstart_recipe(cfg),
        # Only what shapes the demonstrations and their texts: not where data lives, not the eval
        # sample, not simulated latency (a benchmark must not rebuild the model per latency setting).
        "data": {"source": cfg.data.source, "seed": cfg.data.seed},
        "env": {k: getattr(cfg.env, k) for k in ("name", "max_turns", "max_total_tokens", "max_items",
                                                 "max_observation_chars", "system_prompt")},
        "options": {k: v for k, v in asdict(cfg.env.options).items() if k not in start.unkeyed_options},
        "seed": cfg.seed,
    }
    modules = start.key_modules
    if modules:
        # Task generators that still change: a changed generator or demonstration script must not
        # reuse a model warm-started on the old one (it silently did once).
        recipe["source"] = _source_digest(modules)
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]


def _tiny_recipe(cfg: RunConfig) -> dict:
    """The model's shape; the vision-language model's pixel shuffle only when it is not the default
    2 (so the keys, and caches, of every build from before it existed stay what they were)."""
    recipe = asdict(cfg.model.tiny)
    if recipe["image_scale_factor"] == 2:
        del recipe["image_scale_factor"]
    return recipe


def _warmstart_recipe(cfg: RunConfig) -> dict:
    """The warm-start settings a build depends on: the copy check's only when it is on (so the
    keys, and caches, of builds without it stay what they were before it existed)."""
    recipe = asdict(cfg.model.warmstart)
    if cfg.model.warmstart.copy_check_threshold <= 0:
        for key in ("copy_check_threshold", "copy_check_every", "copy_check_size"):
            del recipe[key]
    else:  # the schedule the check brings (`supervised_finetune(decay=False)`)
        recipe["schedule"] = "constant until the copy check passes"
    return recipe


def _source_digest(modules: tuple[str, ...]) -> str:
    """sha256 of the named modules' source files, in order (without importing them)."""
    import importlib.util

    digest = hashlib.sha256()
    for name in modules:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            raise RuntimeError(f"cannot find the source of {name} to key the embedded model's cache")
        digest.update(Path(spec.origin).read_bytes())
    return digest.hexdigest()[:16]


def embedded_model_dir(cfg: RunConfig) -> Path:
    """Where the embedded model of `cfg` is cached: <cache>/models/<env>-tiny-<source>-<key>."""
    family = "".join(c if c.isalnum() or c in "_." else "-" for c in cfg.env.name)
    return cache_root(cfg.model.cache_dir) / "models" / f"{family}-tiny-{cfg.data.source}-{build_key(cfg)}"


def ensure_embedded_model(cfg: RunConfig, setup: Setup, log=log_progress) -> Path:
    """Return the cached embedded model dir, building it first if it is missing (StartupError
    naming the fix when the environment has no embedded model)."""
    path = embedded_model_dir(cfg)
    if (path / "tiderl_build.json").is_file():
        return path
    log(f"[tiderl] building the embedded default model into {path} (cached afterwards)")
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    report = build_embedded_model(cfg, setup, tmp, log=log)
    (tmp / "tiderl_build.json").write_text(json.dumps(report, indent=2))
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(tmp, path)
    except OSError:  # another process finished the same build first; theirs is identical
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def corpus_texts(env: Env, tasks: list[Task], scripts: list[list[str]], shown: list | None = None) -> list[str]:
    """Every text the tokenizer will see: tool schema, system prompt, questions, turns, observations
    (the text of those that show images; their images are appended to `shown` when given)."""
    texts = [env.system_prompt(), json.dumps(env.tool_schemas()),
             "system", "user", "assistant", "Tools:", "<tool_response>", "</tool_response>"]
    def add(messages: list) -> None:
        texts.extend(message_text(m) for m in messages)
        if shown is not None:
            shown.extend(i for m in messages if isinstance(m, Observation) for i in m.images)

    for task, script in zip(tasks, scripts):
        add([env.reset(task)])
        for turn in script:
            texts.append(turn)
            result = env.step(parse_hermes_tool_calls(turn))
            add(result.observations)
            if result.done:
                break
    return texts


def build_embedded_model(cfg: RunConfig, setup: Setup, out_dir: Path, log=log_progress) -> dict:
    """Build tokenizer and model, warm-start them, save to `out_dir`. Returns a build report."""
    t_start = time.perf_counter()
    ws, tiny = cfg.model.warmstart, cfg.model.tiny
    rng = random.Random(cfg.seed)
    try:
        tasks, scripts, entries = warm_start(cfg).demonstrations(setup, cfg, rng)
    except ValueError as exc:  # this configuration of the environment has no tiny model
        raise StartupError(f"env.name={cfg.env.name}: {exc}") from None
    env = setup.make_env()

    shown: list = []
    texts = corpus_texts(env, tasks, scripts, shown)
    torch.manual_seed(cfg.seed)
    if shown:  # the environment shows images: the tiny vision-language model
        model, tokenizer = _tiny_vlm(cfg, texts)
    else:
        tokenizer = train_tokenizer(texts, vocab_size=tiny.vocab_size)
        config = tiny_qwen2_config(len(tokenizer), hidden_size=tiny.hidden_size,
                                   num_layers=tiny.num_layers, num_heads=tiny.num_heads,
                                   num_kv_heads=tiny.num_kv_heads,
                                   max_position_embeddings=tiny.max_positions)
        config.pad_token_id = tokenizer.pad_token_id
        config.eos_token_id = tokenizer.eos_token_id
        model = init_tiny_model(config, cfg.seed)

    traces = scripted_traces(tokenizer, setup, tasks, scripts, cfg)
    demo_success = sum(float(t.env_info.get("success", 0)) for t in traces) / len(traces)
    log(f"[tiderl] {len(traces)} demonstrations, {demo_success:.2f} of them succeed; "
        f"tokenizer {len(tokenizer)} tokens; model "
        f"{count_parameters(model) / 1e6:.2f}M parameters")
    check, check_report = None, {}
    if ws.copy_check_threshold > 0:
        if shown:
            raise StartupError("model.warmstart.copy_check_threshold: the copy check answers without images, so it "
                               f"cannot check env.name={cfg.env.name}, whose messages show images. Fix: set "
                               "model.warmstart.copy_check_threshold=0")
        check, check_report = _copy_check(cfg, setup, tokenizer, model, log)
    losses = supervised_finetune(model, traces, tokenizer.pad_token_id, ws.steps, ws.batch_size,
                                 ws.lr, cfg.seed, log=log, check=check, check_every=ws.copy_check_every,
                                 decay=check is None, image_processor=getattr(tokenizer, "image_processor", None))
    model.eval()
    if check_report:
        check_report["steps"] = len(losses)
        if not check_report["passed"]:
            message = (f"the warm start hit its cap of model.warmstart.steps={ws.steps} steps before the copy "
                       f"check passed (every kind >= {ws.copy_check_threshold}; last per-kind rates "
                       f"{check_report['history'][-1]['per_kind'] if check_report['history'] else 'none'}): "
                       "the model does not copy reliably, so RL on it may not learn. Fix: raise "
                       "model.warmstart.steps, or lower model.warmstart.copy_check_threshold")
            log(f"[tiderl] WARNING: {message}")
            warnings.warn(message, RuntimeWarning, stacklevel=2)
    save_model_dir(model, tokenizer, out_dir)
    return {
        "build_version": BUILD_VERSION,
        "demonstrations": len(traces),
        "demonstration_success": demo_success,
        **entries,
        "sft_loss_first": losses[0], "sft_loss_last": losses[-1], "sft_steps": len(losses),
        **({"copy_check": check_report} if check_report else {}),
        "parameters": count_parameters(model),
        "build_s": time.perf_counter() - t_start,
        "key": build_key(cfg),
    }


def _tiny_vlm(cfg: RunConfig, texts: list[str]) -> tuple[torch.nn.Module, ChatProcessor]:
    """The tiny vision-language model of `model.tiny`'s sizes and its processor (as a tokenizer)."""
    tiny = cfg.model.tiny
    tokenizer = train_vlm_tokenizer(texts, vocab_size=tiny.vocab_size)
    # model.tiny.image_scale_factor=4: one token a picture holding every patch in its own slot, so the
    # model can learn where things are (docs/multimodal.md, "The visual demo").
    scale = tiny.image_scale_factor
    config = tiny_vlm_config(tokenizer, hidden_size=tiny.hidden_size, num_layers=tiny.num_layers,
                             num_heads=tiny.num_heads, num_kv_heads=tiny.num_kv_heads,
                             max_position_embeddings=tiny.max_positions, scale_factor=scale)
    return init_tiny_vlm(config, cfg.seed), ChatProcessor(make_processor(tokenizer, scale_factor=scale))


def _copy_check(cfg: RunConfig, setup: Setup, tokenizer, model: torch.nn.Module, log=log_progress):
    """The warm start's stopping rule: `(check(step) -> passed, report)`. `check` answers the
    environment's copy-check questions greedily with `model` and passes when, for every kind of
    question, at least `warmstart.copy_check_threshold` of the answers are copied variants;
    `report` records every check and whether one passed."""
    from collections import defaultdict

    ws, copy_check = cfg.model.warmstart, warm_start(cfg).copy_check
    if copy_check is None:
        raise StartupError(f"model.warmstart.copy_check_threshold: env.name={cfg.env.name}'s warm start has no copy "
                           "check. Fix: set model.warmstart.copy_check_threshold=0")
    try:
        tasks, scripts, copied = copy_check(setup, cfg)
    except ValueError as exc:
        raise StartupError(str(exc)) from None
    prompts = [t.tokens[:t.loss_mask.index(1)] for t in scripted_traces(tokenizer, setup, tasks, scripts, cfg)]
    report = {"threshold": ws.copy_check_threshold, "questions": len(tasks), "passed": False, "history": []}

    def check(step: int) -> bool:
        turns = greedy_turns(model, prompts, tokenizer.pad_token_id, tokenizer.eos_token_id,
                             cfg.rollout.max_new_tokens)
        right, total = defaultdict(int), defaultdict(int)
        for task, turn in zip(tasks, turns):
            kind = task.meta["kind"]
            total[kind] += 1
            right[kind] += copied(task, tokenizer.decode(turn, skip_special_tokens=True))
        per_kind = {k: round(right[k] / total[k], 3) for k in sorted(total)}
        overall = sum(right.values()) / len(tasks)
        passed = min(per_kind.values()) >= ws.copy_check_threshold
        report["history"].append({"step": step, "overall": round(overall, 3), "per_kind": per_kind})
        report["passed"] = passed
        log(f"[tiderl] copy check at step {step}: {overall:.3f} copied (lowest kind "
            f"{min(per_kind.values()):.3f}, needs {ws.copy_check_threshold}){': passed' if passed else ''}")
        return passed

    return check, report


@torch.no_grad()
def greedy_turns(model: torch.nn.Module, prompts: list[list[int]], pad_id: int, eos_id: int,
                 max_new_tokens: int, batch_size: int = 128) -> list[list[int]]:
    """The greedy continuation of each prompt (left-padded batches), up to and without eos."""
    was_training = model.training
    model.eval()
    out: list[list[int]] = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        generated = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                   do_sample=False, eos_token_id=eos_id, pad_token_id=pad_id)
        for row in generated[:, width:].tolist():
            out.append(row[:row.index(eos_id)] if eos_id in row else row)
    model.train(was_training)
    return out
