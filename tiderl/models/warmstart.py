"""Supervised warm start of any model on the environment's own demonstrations (`tiderl warmstart`;
docs/real_models.md, "A warm start on the oracle's demonstrations").

RL learns nothing from a policy that is never rewarded (a batch without reward gives SAO
advantages of exactly zero), and a fetched model rarely is on AgentBench DB and MetaQA. So the
environment's scripted oracle (`setup.oracle`) solves a sample of training tasks (never held-out
ones); its turns are played through the agent loop with a scripted engine, so a demonstration
has the exact token layout of an RL episode, and only rewarded episodes are kept; the model is
fine-tuned on their assistant tokens (`supervised_finetune`, which warm-starts the embedded tiny
model too, with `model.lora` adapters merged on save and `train.activation_checkpointing` when
set) and saved as a plain Hugging Face directory, to be `model.path` of an RL run or `--model` of
eval.
"""

from __future__ import annotations

import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tiderl.agent.loop import ScriptedEngine
from tiderl.config import RunConfig
from tiderl.envs.protocol import Task
from tiderl.envs.setup import Setup, load_setup
from tiderl.evaluate import run_samples
from tiderl.models.loading import load_model, load_tokenizer, save_model_dir
from tiderl.rollout.base import SamplingParams
from tiderl.train.batching import Batch, collate, micro_batch_indices, slice_batch
from tiderl.train.forward import packed_token_logprobs, packs, token_logprobs
from tiderl.train.learner import Learner
from tiderl.types import Trajectory


def log_progress(message: str) -> None:
    print(message, flush=True)  # a warm start takes minutes: show progress even when piped


@dataclass
class WarmStartReport:
    """What `warm_start` did."""

    out: Path
    tasks: int  # training tasks the oracle was asked to solve
    demonstrations: int  # rewarded episodes kept
    assistant_tokens: int  # tokens the loss is on, summed over the demonstrations
    losses: list[float]
    seconds: float


def demonstrations(cfg: RunConfig, setup: Setup, tokenizer, count: int, seed: int) -> tuple[int, list[Trajectory]]:
    """Up to `count` training tasks (a seeded sample; all of them when there are fewer) played
    by the oracle; returns the number of tasks tried and the rewarded episodes."""
    if setup.oracle is None:
        raise ValueError(f"data.source={setup.name!r} has no scripted oracle to demonstrate its tasks. Fix: warm "
                         "start on an environment with one (kg, db, math), or train without a warm start")
    if not setup.train_tasks:
        raise ValueError(f"data.source={setup.name!r} has no training tasks to demonstrate (the held-out ones are "
                         "never used). Fix: check data.split and data.eval_size")
    tasks = random.Random(seed).sample(setup.train_tasks, min(count, len(setup.train_tasks)))
    scripts = [setup.oracle(task) for task in tasks]
    traces = scripted_traces(tokenizer, setup, tasks, scripts, cfg)
    return len(tasks), [t for t in traces if t.reward > 0 and sum(t.loss_mask) > 0]


def warm_start(cfg: RunConfig, out: str | Path, count: int = 256, epochs: float = 2.0, batch_size: int = 8,
               lr: float = 1e-4, setup: Setup | None = None, log=print) -> WarmStartReport:
    """Fine-tune `model.path` on up to `count` demonstrations for `epochs` passes (AdamW at
    `lr`, warm-up then cosine decay; `batch_size` demonstrations a step, micro-batches of
    `train.micro_batch_tokens`) and save it to `out` (which must not exist). With
    `model.lora.r > 0` only adapters train, and they are merged before saving."""
    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out} exists. Fix: pass a new --out directory (the warm start never overwrites).")
    model_path = cfg.model.path
    if model_path == "tiny":
        raise ValueError("model.path=tiny has its own warm start (model.warmstart). Fix: pass model.path=<a model dir>")
    start = time.perf_counter()
    setup = setup or load_setup(cfg)
    tokenizer = load_tokenizer(model_path)
    tried, demos = demonstrations(cfg, setup, tokenizer, count, cfg.seed)
    if not demos:
        raise ValueError(f"none of {tried} oracle episodes was rewarded, so there is nothing to learn from. Fix: "
                         "check the environment with `tiderl eval --oracle` (and env.max_total_tokens)")
    tokens = sum(sum(t.loss_mask) for t in demos)
    log(f"[tiderl] warm start: {len(demos)} rewarded demonstrations of {tried} training tasks, {tokens} assistant tokens")
    model = load_model(model_path, dtype=cfg.model.dtype, device=cfg.model.device)
    if cfg.model.lora.r > 0:
        from tiderl.train.lora import apply_lora

        model = apply_lora(model, cfg.model.lora.r, cfg.model.lora.alpha, cfg.model.lora.target_modules)
    if cfg.train.activation_checkpointing:
        from tiderl.train.memory import enable_activation_checkpointing

        enable_activation_checkpointing(model)
    steps = max(1, round(epochs * len(demos) / batch_size))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    losses = supervised_finetune(model, demos, pad_id, steps=steps, batch_size=batch_size, lr=lr, seed=cfg.seed,
                                 log=log, micro_batch_tokens=cfg.train.micro_batch_tokens,
                                 threads=torch.get_num_threads(), packed=packs(model))
    if cfg.model.lora.r > 0:
        model = model.merge_and_unload()
    model.eval()
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"  # a crashed run's leftover is never reused
    save_model_dir(model, tokenizer, tmp)
    tmp.rename(out)
    return WarmStartReport(out, tried, len(demos), tokens, losses, time.perf_counter() - start)


def scripted_traces(tokenizer, setup: Setup, tasks: list[Task], scripts: list[list[str]],
                    cfg: RunConfig) -> list[Trajectory]:
    """Play the scripts through the agent loop (`evaluate.run_samples`), so demonstrations have
    the RL token layout; a scripted engine per chunk of at most 128 tasks with distinct questions
    (it recognises an episode by its question)."""
    params = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens,
                            stop_token_ids=[tokenizer.eos_token_id])
    left = iter(scripts)  # the chunks come in task order
    groups = run_samples(lambda chunk: ScriptedEngine(tokenizer, {task.prompt: next(left) for task in chunk}),
                         tokenizer, setup.make_env, tasks, params, cfg.env, chunk_size=128)
    return [group[0] for group in groups]


def supervised_finetune(model: torch.nn.Module, traces: list[Trajectory], pad_id: int,
                        steps: int, batch_size: int, lr: float, seed: int,
                        log=log_progress, check=None, check_every: int = 0, decay: bool = True,
                        micro_batch_tokens: int = 8192, threads: int = 1, packed: bool = False,
                        image_processor=None) -> list[float]:
    """Cross-entropy on the assistant tokens of `traces` (AdamW, a linear warm-up over 5% of
    `steps`, then cosine decay over `steps`, or, with `decay=False`, a constant rate), in
    micro-batches of at most `micro_batch_tokens` padded tokens, on `threads` intra-op threads;
    `packed`: through `packed_token_logprobs` (no padding, logits only where the loss is, which
    for a 150k-token vocabulary is most of the memory). Traces with images need the VLM's
    `image_processor` (`train.batching.collate`); their micro-batches run unpacked.
    With `check`, `check(step)` runs after every `check_every` steps and at the last one, and
    training stops at the first True (so `steps` is a cap). Returns the loss of every step taken."""
    # One intra-op thread, whatever count an earlier step of the build left behind: a second one
    # gains this model little, costs much beside another process on a shared core, and makes the
    # model depend on the machine's load (docs/env_math.md, "Wall time"). A real model's warm
    # start passes the machine's thread count: its matrices are large.
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rng = random.Random(seed)
        # AdamW's default kernel, not the fused one: the embedded model builds as its cache key says.
        learner = Learner(model, lr, weight_decay=0.01, fused=False)
        warmup = max(1, steps // 20)
        schedule = torch.optim.lr_scheduler.LambdaLR(
            learner.optimizer, lambda s: min(1.0, (s + 1) / warmup)
            * (0.5 * (1 + math.cos(math.pi * min(s, steps) / max(steps, 1))) if decay else 1.0))
        losses = []
        for step in range(steps):
            batch = collate(rng.sample(traces, min(batch_size, len(traces))), pad_id, image_processor)
            total = batch.action_mask.sum()

            def loss_fn(mb: Batch, total: torch.Tensor = total) -> tuple[torch.Tensor, dict[str, float]]:
                if packed and mb.pixels is None:
                    lp, _ = packed_token_logprobs(model, mb.input_ids, mb.attention_mask, mb.action_mask)
                else:
                    lp, _ = token_logprobs(model, mb.input_ids, mb.attention_mask, pixels=mb.pixels)
                return -(lp * mb.action_mask).sum() / total, {}

            rows = micro_batch_indices(batch.attention_mask.sum(1).tolist(), micro_batch_tokens)
            loss_value = learner.step([slice_batch(batch, r) for r in rows], loss_fn)["loss"]
            schedule.step()
            losses.append(loss_value)
            if step % max(1, steps // 10) == 0 or step == steps - 1:
                log(f"[tiderl] warm-start step {step + 1}/{steps}: loss {loss_value:.4f}")
            due = (step + 1) % max(1, check_every) == 0 or step == steps - 1  # the cap's model is checked too
            if check is not None and due and check(step + 1):
                log(f"[tiderl] warm start stopped at step {step + 1} (copy check passed; loss {loss_value:.4f})")
                break
        return losses
    finally:
        torch.set_num_threads(before)
