"""The RL loop, top to bottom: rollout, train, hand the weights back to the engine.

This loop is synchronous: every step samples a fresh batch with the newest weights, trains on it,
then syncs. The asynchronous scheduler changes only *where it waits* (the rollout call becomes
"take the next ready trajectories", the sync becomes non-blocking); the components stay the same.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from tiderl.agent.loop import run_episodes
from tiderl.algos.sampling import has_signal
from tiderl.algos.step import algo_step, group_size, needs_critic, needs_ref
from tiderl.config import RunConfig, dump_yaml
from tiderl.data import KGSetup, env_factory, load_kg_setup
from tiderl.envs.protocol import Env, Task
from tiderl.evaluate import sampling_params, summarize
from tiderl.metrics.logger import MetricsLogger
from tiderl.models.loading import load_model, load_tokenizer
from tiderl.rewards.curiosity import CuriosityShaper, CuriositySettings
from tiderl.rewards.curiosity import batch_metrics as curiosity_metrics
from tiderl.rollout.torch_engine import TorchEngine, weights_checksum
from tiderl.train.checkpoint import load_checkpoint, save_checkpoint
from tiderl.train.critic import ValueModel, freeze_matching
from tiderl.train.learner import Learner
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
    """Everything a run holds. Built by `build_run`; the loop only reads and steps it."""

    cfg: RunConfig
    setup: KGSetup
    tokenizer: Any
    engine: TorchEngine
    actor: Learner
    critic: Learner | None  # None when the algorithm has no critic
    make_env: Callable[[], Env]
    tasks: TaskStream
    step: int = 0
    model_path: str = ""
    ref: torch.nn.Module | None = None  # frozen initial policy, when the algorithm uses a KL term
    curiosity: CuriosityShaper | None = None  # shapes rewards and counts knowledge units

    def shape(self, trajectory: Trajectory) -> Trajectory:
        """The trajectory with the curiosity bonus of the current step (unchanged without one)."""
        return self.curiosity.shape(trajectory, self.step) if self.curiosity else trajectory


def resolve_model_path(cfg: RunConfig, setup: KGSetup) -> str:
    """The policy's model dir: `model.path`, or the embedded default (built once, cached)."""
    if cfg.model.path != "tiny":
        return cfg.model.path
    from tiderl.models.embedded import ensure_embedded_model

    return str(ensure_embedded_model(cfg, setup))


def build_run(cfg: RunConfig, setup: KGSetup | None = None) -> Run:
    """Load data, model, engine, critic and optimizers for `cfg` (resuming if asked)."""
    if cfg.train.threads > 0:
        torch.set_num_threads(cfg.train.threads)
    torch.manual_seed(cfg.seed)
    setup = setup or load_kg_setup(cfg.data)
    model_path = resolve_model_path(cfg, setup)
    tokenizer = load_tokenizer(model_path)
    policy = load_model(model_path, dtype=cfg.model.dtype, device=cfg.model.device)
    engine = TorchEngine(policy, tokenizer, device=cfg.model.device,
                         seed=cfg.seed, max_batch_size=cfg.rollout.engine_batch_size)
    t = cfg.train
    betas = (t.adam_beta1, t.adam_beta2)
    critic = None
    if needs_critic(cfg.algo):
        critic_model = (ValueModel.load(cfg.algo.value_init) if cfg.algo.value_init
                        else ValueModel.from_policy(policy)).to(cfg.model.device)
        if cfg.algo.freeze_critic_attention:
            freeze_matching(critic_model, cfg.algo.critic_freeze_pattern)
        critic = Learner(critic_model, cfg.algo.critic_lr, t.weight_decay, betas, t.grad_clip)
    ref = None
    if needs_ref(cfg.algo):
        ref = copy.deepcopy(policy).eval().requires_grad_(False)
    actor = Learner(policy, cfg.algo.actor_lr, t.weight_decay, betas, t.grad_clip)
    # Always built: with curiosity off it pays nothing but still counts the units agents reach.
    curiosity = CuriosityShaper(CuriositySettings(**dataclasses.asdict(cfg.curiosity)))
    run = Run(cfg, setup, tokenizer, engine, actor, critic, make_env=env_factory(cfg.env, setup),
              tasks=TaskStream(setup.train_tasks, cfg.seed), model_path=model_path, ref=ref,
              curiosity=curiosity)
    if t.resume:
        run.step = load_checkpoint(t.resume, actor, critic)
        state = Path(t.resume) / "curiosity.json"
        if state.is_file():
            curiosity.load_state_dict(json.loads(state.read_text()))
        sync_weights(run)
    return run


def rollout(run: Run, tasks: list[Task], group: int = 1) -> list[Trajectory]:
    """Sample `group` episodes per task with the engine's current weights; the episodes of one
    task share a group_id unique to this call (`<task_id>#<serial>`)."""
    cfg = run.cfg
    params = sampling_params(cfg.rollout, run.tokenizer.eos_token_id, greedy=False)
    copies, group_ids = [], {}
    for task in tasks:
        gid = f"{task.task_id}#{next(_GROUP_SERIAL)}"
        for _ in range(group):
            c = dataclasses.replace(task)
            group_ids[id(c)] = gid
            copies.append(c)
    return run_episodes(run.engine, run.tokenizer, run.make_env, copies, params,
                        max_turns=cfg.env.max_turns, max_total_tokens=cfg.env.max_total_tokens,
                        group_id_fn=lambda t: group_ids[id(t)])


_GROUP_SERIAL = itertools.count()


def sample_batch(run: Run) -> tuple[list[Trajectory], dict[str, float]]:
    """One optimizer step's trajectories: `batch_size / group_size` tasks, `group_size` episodes
    each. With DAPO's dynamic sampling, groups whose rewards are all equal are set aside and
    more are drawn, up to 4 batches' worth of draws (then the step trains on what it has)."""
    cfg = run.cfg
    g = group_size(cfg.algo)
    want = cfg.rollout.batch_size
    kept: list[Trajectory] = []
    drawn = 0
    while len(kept) < want and drawn < 4 * want:
        fresh = [run.shape(t) for t in rollout(run, run.tasks.take((want - len(kept)) // g), g)]
        drawn += len(fresh)
        if not cfg.algo.dynamic_sampling:
            kept.extend(fresh)
            continue
        for start in range(0, len(fresh), g):
            members = fresh[start:start + g]
            if has_signal([m.reward for m in members]):
                kept.extend(members)
    extra = {"sampling/drawn": float(drawn)} if cfg.algo.dynamic_sampling else {}
    return (kept or fresh), extra


def train_step(run: Run, trajectories: list[Trajectory]) -> dict[str, float]:
    """One optimizer step of the configured algorithm on `trajectories`."""
    cfg = run.cfg
    return algo_step(trajectories, run.actor, run.critic, run.ref, cfg.algo,
                     pad_id=run.tokenizer.pad_token_id,
                     micro_batch_tokens=cfg.train.micro_batch_tokens,
                     train_actor=run.step >= cfg.algo.critic_warmup_steps,
                     device=cfg.model.device)


def train(run: Run, steps: int | None = None) -> list[dict[str, Any]]:
    """Run optimizer steps of the configured algorithm from `run.step` up to `train.steps` (or
    `steps` more), lock-step or on the asynchronous scheduler (`system.backend`). Returns the
    metrics of every step."""
    cfg = run.cfg
    last = cfg.train.steps if steps is None else run.step + steps
    if cfg.system.backend != "inline":
        return _train_async(run, last - run.step)
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_yaml(cfg))
    logger = MetricsLogger(run_dir, last - run.step, cfg.log.tensorboard, cfg.log.progress)
    history = []
    try:
        while run.step < last:
            t0 = time.perf_counter()
            trajectories, sampling = sample_batch(run)
            t1 = time.perf_counter()
            metrics = train_step(run, trajectories)
            metrics.update(sampling)
            t2 = time.perf_counter()
            run.step += 1
            sync_weights(run)
            t3 = time.perf_counter()
            metrics.update(rollout_metrics(trajectories))
            metrics.update(curiosity_metrics(trajectories))
            generated = sum(t.num_action_tokens for t in trajectories)
            metrics.update({
                "policy_version": run.step,
                "time/rollout_s": t1 - t0, "time/train_s": t2 - t1, "time/sync_s": t3 - t2,
                "step_s": t3 - t0,
                "throughput/generated_tokens_per_s": generated / max(t1 - t0, 1e-9),
                "throughput/trained_tokens_per_s":
                    sum(len(t.tokens) for t in trajectories) / max(t2 - t1, 1e-9),
            })
            logger.log(run.step, metrics)
            history.append(metrics)
            every = cfg.train.checkpoint_every
            if every > 0 and run.step % every == 0:
                save_run_checkpoint(run, run_dir / "checkpoints" / f"step_{run.step}")
    finally:
        logger.close()
    return history


def _train_async(run: Run, steps: int) -> list[dict[str, Any]]:
    """The same training on the asynchronous scheduler (`system.backend` local or ray); the
    run's totals (ledger, staleness histogram, slot changes) go to `run_dir/system.json`."""
    from tiderl.system.local import train_async

    if run.cfg.system.backend == "ray":
        from tiderl.system.ray_backend import train_ray

        history, summary = train_ray(run, steps)
    else:
        history, summary = train_async(run, steps)
    (Path(run.cfg.run_dir) / "system.json").write_text(json.dumps(summary, indent=2))
    return history


def save_run_checkpoint(run: Run, path: Path) -> Path:
    """Actor, critic, optimizers and the curiosity counts (so a resume pays the same bonuses)."""
    path = save_checkpoint(path, run.step, run.actor, run.critic, run.tokenizer)
    if run.curiosity is not None:
        (path / "curiosity.json").write_text(json.dumps(run.curiosity.state_dict()))
    return path


def sync_weights(run: Run) -> None:
    """Hand the actor's weights to the engine as version `run.step`, and check they arrived."""
    state = run.actor.model.state_dict()
    run.engine.update_weights(state, version=run.step)
    sent, held = weights_checksum(state), run.engine.state_checksum()
    if sent != held:
        raise RuntimeError(
            f"weight sync to version {run.step} failed: the engine holds weights with checksum "
            f"{held!r}, the trainer sent {sent!r}"
        )


def rollout_metrics(trajectories: list[Trajectory]) -> dict[str, float]:
    """Batch means of what the episodes achieved (see docs/metrics.md)."""
    s = summarize(trajectories)
    out = {
        "reward": s["reward"], "success": s["success"], "f1": s["f1"],
        "episode/turns": s["turns"], "episode/tokens": s["tokens"],
        "episode/action_tokens": s["action_tokens"], "episode/tool_errors": s["tool_errors"],
    }
    for reason, count in s["stop_reasons"].items():
        out[f"episode/stop_{reason}"] = count / s["n"]
    return out
