"""A run's parts, built from one config: tasks, tokenizer, engine, actor, critic, reference,
curiosity, and the trainer side the scheduler drives.

`build_run(cfg)` builds (or resumes) them; `Trainer` is what the scheduler calls for each
optimizer step. Which parts exist follows from the algorithm options alone
(`tiderl.algos.registry.needs_critic` / `needs_ref`): nothing here knows which algorithm runs.
"""

from __future__ import annotations

import copy
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tiderl.algos.registry import needs_critic, needs_ref
from tiderl.config import RunConfig
from tiderl.envs.protocol import Task
from tiderl.envs.setup import Setup, load_setup
from tiderl.models.loading import load_model, load_tokenizer
from tiderl.rewards.curiosity import CuriosityShaper
from tiderl.rollout import Engine, make_engine
from tiderl.rollout.weights import weights_checksum
from tiderl.train.annotate import CriticSnapshot, Preparation, RefLogprobs
from tiderl.train.checkpoint import load_checkpoint, save_checkpoint
from tiderl.train.critic import ValueModel, freeze_matching
from tiderl.train.learner import Learner
from tiderl.train.lora import policy_state
from tiderl.train.precision import trainer_autocast
from tiderl.train.step import train_step
from tiderl.types import Trajectory


class TaskStream:
    """Endless shuffled passes over the training tasks (a new order every pass)."""

    def __init__(self, tasks: list[Task], seed: int):
        if not tasks:
            raise ValueError("no training tasks: check data.source and data.hops")
        self.tasks = tasks
        self.rng = random.Random(seed)
        self.order: list[int] = []

    def take(self, n: int) -> list[Task]:
        out = []
        for _ in range(n):
            if not self.order:
                self.order = list(range(len(self.tasks)))
                self.rng.shuffle(self.order)
            out.append(self.tasks[self.order.pop()])
        return out


@dataclass
class Run:
    """Everything a run holds. Built by `build_run`; the recipe steps it through the scheduler."""

    cfg: RunConfig
    setup: Setup
    tokenizer: Any
    engine: Engine  # the driver's engine: local rollouts and evaluation sample with it
    actor: Learner
    critic: Learner | None  # None when the algorithm has no critic
    tasks: TaskStream
    curiosity: CuriosityShaper  # shapes rewards (when enabled) and counts knowledge units
    ref: torch.nn.Module | None = None  # frozen initial policy, when the algorithm has a KL term
    step: int = 0
    model_path: str = ""

    @property
    def make_env(self) -> Any:
        return self.setup.make_env

    def shape(self, trajectory: Trajectory) -> Trajectory:
        """The trajectory with the curiosity bonus of the current step."""
        return self.curiosity.shape(trajectory, self.step)


def resolve_model_path(cfg: RunConfig, setup: Setup) -> str:
    """The policy's model dir: `model.path`, or the embedded default (built once, cached)."""
    if cfg.model.path != "tiny":
        return cfg.model.path
    from tiderl.models.embedded import ensure_embedded_model

    return str(ensure_embedded_model(cfg, setup))


def build_run(cfg: RunConfig, setup: Setup | None = None) -> Run:
    """Load tasks, model, engine, critic, reference and optimizers for `cfg` (resuming from
    `train.resume` when set)."""
    torch.manual_seed(cfg.seed)
    setup = setup or load_setup(cfg)
    model_path = resolve_model_path(cfg, setup)
    tokenizer = load_tokenizer(model_path)
    policy = load_model(model_path, dtype=cfg.model.dtype, device=cfg.model.device)
    t = cfg.train
    learner = dict(weight_decay=t.weight_decay, betas=(t.adam_beta1, t.adam_beta2), grad_clip=t.grad_clip)
    critic = None
    if needs_critic(cfg.algo):
        critic_model = (ValueModel.load(cfg.algo.value_init) if cfg.algo.value_init
                        else ValueModel.from_policy(policy)).to(cfg.model.device)
        if cfg.algo.freeze_critic_attention:
            freeze_matching(critic_model, cfg.algo.critic_freeze_pattern)
        critic = Learner(critic_model, cfg.algo.critic_lr, **learner)
    ref = copy.deepcopy(policy).eval().requires_grad_(False) if needs_ref(cfg.algo) else None
    if cfg.model.lora.r > 0:  # LoRA: only adapters train and sync; critic and reference stay full models
        from tiderl.train.lora import apply_lora

        policy = apply_lora(policy, cfg.model.lora.r, cfg.model.lora.alpha, cfg.model.lora.target_modules)
    run = Run(cfg, setup, tokenizer, make_engine(cfg, policy, tokenizer, seed=cfg.seed),
              Learner(policy, cfg.algo.actor_lr, **learner), critic, TaskStream(setup.train_tasks, cfg.seed),
              CuriosityShaper(cfg.curiosity), ref=ref, model_path=model_path)
    if t.resume:
        run.step = load_checkpoint(t.resume, run.actor, critic)
        state = Path(t.resume) / "curiosity.json"
        if state.is_file():
            run.curiosity.load_state_dict(json.loads(state.read_text()))
        sync_weights(run)
    return run


def preparations_for(run: Run) -> list[Preparation]:
    """What a trajectory needs before it trains, for the run's algorithm: critic values (from a
    snapshot of the critic) when it has a critic, reference log-probs when it has a KL term."""
    cfg, pad = run.cfg, run.tokenizer.pad_token_id
    out: list[Preparation] = []
    if run.critic is not None:
        out.append(CriticSnapshot(run.critic.model, pad, cfg.train.micro_batch_tokens, cfg.model.device))
    if run.ref is not None:
        out.append(RefLogprobs(run.ref, pad, cfg.train.micro_batch_tokens, cfg.model.device))
    return out


class Trainer:
    """The scheduler's trainer side: one `train_step` of the configured algorithm per batch,
    then a refresh of every preparation that holds a copy of the critic."""

    def __init__(self, run: Run, preparations: list[Preparation]):
        self.run = run
        self.refreshers = [p for p in preparations if hasattr(p, "refresh")]

    def step(self, batch: list[Trajectory], version: int) -> dict[str, float]:
        run, cfg = self.run, self.run.cfg
        with trainer_autocast(cfg.train.autocast, cfg.model.device):  # bf16 matmuls when train.autocast=bfloat16
            metrics = train_step(batch, run.actor, run.critic, run.ref, cfg.algo, pad_id=run.tokenizer.pad_token_id,
                                 micro_batch_tokens=cfg.train.micro_batch_tokens,
                                 train_actor=version >= cfg.algo.critic_warmup_steps, device=cfg.model.device)
        if run.critic is not None:
            for p in self.refreshers:
                p.refresh(run.critic.model)
        return metrics

    def state_dict(self) -> dict[str, Any]:
        return policy_state(self.run.actor.model)  # the adapters alone for a LoRA policy

    def checksum(self, state_dict: dict[str, Any]) -> float:
        return weights_checksum(state_dict)


def save_run_checkpoint(run: Run, path: Path) -> Path:
    """Actor, critic, optimizers and the curiosity counts (so a resume pays the same bonuses)."""
    path = save_checkpoint(path, run.step, run.actor, run.critic, run.tokenizer)
    (path / "curiosity.json").write_text(json.dumps(run.curiosity.state_dict()))
    return path


def sync_weights(run: Run) -> None:
    """Hand the actor's weights to the run's engine as version `run.step`, and check they arrived."""
    state = policy_state(run.actor.model)
    run.engine.update_weights(state, version=run.step)
    sent, held = weights_checksum(state), run.engine.state_checksum()
    if sent != held:
        raise RuntimeError(f"weight sync to version {run.step} failed: the engine holds weights with checksum "
                           f"{held!r}, the trainer sent {sent!r}")
