"""Supervised warm start of any model on the environment's own demonstrations (`tiderl warmstart`;
docs/real_models.md, "A warm start on the oracle's demonstrations").

RL learns nothing from a policy that is never rewarded (a batch without reward gives SAO
advantages of exactly zero), and a fetched model rarely is on AgentBench DB and MetaQA. So the
environment's scripted oracle (`setup.oracle`) solves a sample of training tasks (never held-out
ones); its turns are played through the agent loop with a scripted engine, so a demonstration
has the exact token layout of an RL episode, and only rewarded episodes are kept; the model is
fine-tuned on their assistant tokens (`tiderl.models.embedded.supervised_finetune`, with
`model.lora` adapters merged on save and `train.activation_checkpointing` when set) and saved as
a plain Hugging Face directory, to be `model.path` of an RL run or `--model` of eval.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tiderl.config import RunConfig
from tiderl.envs.setup import Setup, load_setup
from tiderl.models.embedded import scripted_traces, supervised_finetune
from tiderl.models.loading import load_model, load_tokenizer, save_model_dir
from tiderl.train.forward import packs
from tiderl.types import Trajectory


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
