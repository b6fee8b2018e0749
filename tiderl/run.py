"""A run's parts, built from one config: tasks, tokenizer, engine, actor, critic, reference,
curiosity, and the two sides of the recipe's loop: the rollout pool and the trainer.

`build_run(cfg)` builds (or resumes) the parts; `open_pool` puts the rollout pool around a
backend; `Trainer` takes one optimizer step per batch, on the thread `TrainerThread` gives it. Which parts exist follows from the
algorithm options alone (`tiderl.algos.registry.needs_critic` / `needs_ref`): nothing here knows
which algorithm runs.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tiderl.algos.registry import needs_critic, needs_ref
from tiderl.algos.sampling import has_signal
from tiderl.config import RunConfig
from tiderl.envs.protocol import Task
from tiderl.envs.setup import Setup, load_setup
from tiderl.evaluate import evaluate_modes, held_out_metrics
from tiderl.metrics.logger import cut_metrics
from tiderl.models.loading import check_device, load_model, load_tokenizer
from tiderl.models.startup import check_model_and_budgets
from tiderl.rewards.curiosity import CuriosityShaper
from tiderl.rewards.model import ModelRewards
from tiderl.rewards.scoring import BatchScorer, ScoredBackend
from tiderl.rewards.tool_errors import penalize_no_call_turns, penalize_tool_errors
from tiderl.rollout import Engine, make_engine
from tiderl.rollout.weights import weights_checksum
from tiderl.system.buffer import ReadyBuffer
from tiderl.system.cores import RunThreads
from tiderl.system.ledger import LedgerLog, cut_back
from tiderl.system.pool import PoolSettings, RolloutBackend, RolloutPool
from tiderl.train.annotate import CriticSnapshot, ImagePixels, Preparation, RefLogprobs
from tiderl.train.checkpoint import MARKER, latest_checkpoint, load_checkpoint, prune_checkpoints, save_checkpoint
from tiderl.train.critic import ValueModel, freeze_matching
from tiderl.train.forward import logprob_temperature
from tiderl.train.learner import Learner
from tiderl.train.lora import policy_state
from tiderl.train.memory import enable_activation_checkpointing
from tiderl.train.precision import trainer_autocast
from tiderl.train.step import NonFiniteError, train_step
from tiderl.types import Trajectory

logger = logging.getLogger(__name__)


class TaskStream:
    """Endless shuffled passes over the training tasks (a new order every pass)."""

    def __init__(self, tasks: list[Task], seed: int):
        if not tasks:
            raise ValueError("no training tasks: check data.source and the environment's options (env.options.*)")
        self.tasks = tasks
        self.by_id = {t.task_id: t for t in tasks}
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

    def state_dict(self) -> dict[str, Any]:
        """Where the stream is: its random state and what is left of the current pass."""
        return {"rng": self.rng.getstate(), "order": list(self.order), "size": len(self.tasks)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["size"] != len(self.tasks):
            raise ValueError(f"the checkpoint's task stream has {state['size']} tasks, this run has "
                             f"{len(self.tasks)}: resume with the data.* settings it was trained with")
        self.rng.setstate(state["rng"])
        self.order = list(state["order"])

    def task(self, task_id: str) -> Task:
        """The training task with this id (to queue a checkpoint's attempts again)."""
        if task_id not in self.by_id:
            raise ValueError(f"the checkpoint names task {task_id!r}, which this run's training tasks lack: "
                             "resume with the data.* settings it was trained with")
        return self.by_id[task_id]


@dataclass
class Run:
    """Everything a run holds. Built by `build_run`; the recipe trains it."""

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
    resume_state: dict[str, Any] | None = None  # the checkpoint's trainer state, until train() uses it
    resumed_from: str = ""
    pool: RolloutPool | None = None  # the rollout pool of the latest train(): its state goes into checkpoints
    trainer: Any = None  # the running trainer of train(); data-parallel ranks write sharded checkpoints
    model_rewards: ModelRewards | None = None  # score training episodes: reward.model.path, reward.judge.url

    @property
    def make_env(self) -> Any:
        return self.setup.make_env

    def shape(self, trajectory: Trajectory) -> Trajectory:
        """The trajectory with the curiosity bonus of the current step, and the tool-error and
        no-call penalties when on. (The reward model's and judge's scores, `reward.*`, come first,
        off the event loop: `open_pool` wraps the backend in a `ScoredBackend`.)"""
        shaped = self.curiosity.shape(trajectory, self.step)
        if self.cfg.env.tool_error_penalty > 0:
            shaped = penalize_tool_errors(shaped, self.cfg.env.tool_error_penalty, self.cfg.env.max_turns)
        if self.cfg.env.no_call_penalty > 0:
            shaped = penalize_no_call_turns(shaped, self.cfg.env.no_call_penalty)
        return shaped


def resolve_model_path(cfg: RunConfig, setup: Setup) -> str:
    """The policy's model dir: `model.path`, or the embedded default (built once, cached)."""
    if cfg.model.path != "tiny":
        return cfg.model.path
    from tiderl.embedded.build import ensure_embedded_model

    return str(ensure_embedded_model(cfg, setup))


def build_run(cfg: RunConfig, setup: Setup | None = None) -> Run:
    """Load tasks, model, engine, critic, reference and optimizers for `cfg` (resuming from
    `train.resume` when set; `auto` = the latest complete checkpoint of run_dir, if any). The
    run dir and the device are checked before any work."""
    check_device(cfg.model.device)
    check_writable(Path(cfg.run_dir))
    torch.manual_seed(cfg.seed)
    setup = setup or load_setup(cfg)
    model_path = resolve_model_path(cfg, setup)
    tokenizer = load_tokenizer(model_path)
    policy = load_model(model_path, dtype=cfg.model.dtype, device=cfg.model.device)
    # Before any episode: the template shows the tools, the prompts fit the budgets.
    check_model_and_budgets(cfg, tokenizer, setup, getattr(policy.config, "max_position_embeddings", None),
                            model_path)
    t = cfg.train
    learner = dict(weight_decay=t.weight_decay, betas=(t.adam_beta1, t.adam_beta2), grad_clip=t.grad_clip)
    critic = None
    # A LoRA policy's base never changes: a LoRA critic and the KL reference hold its weights, not
    # copies (one copy in memory, not three). Data-parallel ranks build models of their own.
    shared = cfg.model.lora.r > 0 and cfg.train.parallel == "none"
    if needs_critic(cfg.algo):
        critic_model = (ValueModel.load(cfg.algo.value_init) if cfg.algo.value_init else ValueModel.from_policy(
            policy, share_weights=shared and cfg.model.critic_lora == "lora")).to(cfg.model.device)
        if cfg.algo.freeze_critic_attention:
            freeze_matching(critic_model, cfg.algo.critic_freeze_pattern)
        if cfg.model.critic_lora == "lora":  # adapters on the backbone (base frozen), the head trains fully
            from tiderl.train.lora import apply_critic_lora

            apply_critic_lora(critic_model, cfg.model.lora.r, cfg.model.lora.alpha, cfg.model.lora.target_modules)
        critic = Learner(critic_model, cfg.algo.critic_lr, **learner)
    ref = copy.deepcopy(policy, {id(p): p for p in policy.parameters()} if shared else {}).eval().requires_grad_(False) \
        if needs_ref(cfg.algo) else None
    if cfg.model.lora.r > 0:  # LoRA: only adapters train and sync; critic and reference stay full models
        from tiderl.train.lora import apply_lora

        policy = apply_lora(policy, cfg.model.lora.r, cfg.model.lora.alpha, cfg.model.lora.target_modules)
    run = Run(cfg, setup, tokenizer, make_engine(cfg, policy, tokenizer, seed=cfg.seed),
              Learner(policy, cfg.algo.actor_lr, **learner), critic, TaskStream(setup.train_tasks, cfg.seed),
              CuriosityShaper(cfg.curiosity), ref=ref, model_path=model_path,
              model_rewards=ModelRewards.from_config(cfg, tokenizer))
    if t.activation_checkpointing:  # after make_engine: the engine's copy never trains
        for trained in filter(None, (run.actor, run.critic)):
            enable_activation_checkpointing(trained.model)
    resume = t.resume
    if resume == "auto":
        found = latest_checkpoint(Path(cfg.run_dir) / "checkpoints")
        logger.info("train.resume=auto: %s", f"resuming from {found}" if found else "no complete checkpoint, starting")
        resume = str(found) if found else ""
    if resume:
        resume_run(run, Path(resume))
    return run


def resume_run(run: Run, path: Path) -> None:
    """Load checkpoint `path` into `run`: weights, optimizers, curiosity counts, every random
    state (torch, Python, NumPy, the engine's sampler, the task stream); the schedule waits in
    `run.resume_state` for `train()`. `metrics.jsonl` is cut back to the checkpoint's step."""
    state = load_checkpoint(path, run.actor, run.critic, ranks_load=run.cfg.train.parallel != "none")
    run.step, run.resume_state, run.resumed_from = int(state["step"]), state, str(path)
    curiosity = path / "curiosity.json"
    if curiosity.is_file():
        run.curiosity.load_state_dict(json.loads(curiosity.read_text()))
    if "tasks" in state:
        run.tasks.load_state_dict(state["tasks"])
        random.setstate(state["python_rng"])
        np.random.set_state(state["numpy_rng"])
        if state.get("engine_rng") is not None and hasattr(run.engine, "set_rng_state"):
            run.engine.set_rng_state(state["engine_rng"])
    cut_metrics(Path(run.cfg.run_dir) / "metrics.jsonl", run.step)
    sync_weights(run)


def check_writable(run_dir: Path) -> None:
    """Fail now, not at the first checkpoint, when run_dir cannot be written."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".tiderl-write-check-{id(run_dir)}"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise PermissionError(f"run_dir={run_dir} cannot be written ({exc.strerror or exc}). Fix: pass a "
                              "run_dir you can write (run_dir=DIR or --run-dir DIR).") from exc


def preparations_for(run: Run) -> list[Preparation]:
    """What a trajectory needs before it trains: its images' pixel inputs for a vision-language
    model, critic values (from a snapshot of the critic) with a critic, reference log-probs with KL."""
    cfg, pad = run.cfg, run.tokenizer.pad_token_id
    images = getattr(run.tokenizer, "image_processor", None)  # a vision-language model's (docs/multimodal.md)
    out: list[Preparation] = [] if images is None else [ImagePixels(images)]  # first: the others reuse its pixels
    if run.critic is not None:
        out.append(CriticSnapshot(run.critic.model, pad, cfg.train.micro_batch_tokens, cfg.model.device,
                                  image_processor=images))
    if run.ref is not None:
        out.append(RefLogprobs(run.ref, pad, cfg.train.micro_batch_tokens, cfg.model.device,
                               temperature=logprob_temperature(cfg.rollout.temperature), image_processor=images))
    return out


class Trainer:
    """One `train_step` of the configured algorithm per batch (`train`, blocking), then a refresh
    of every preparation that holds a copy of the critic; `weights()` is what the rollout side
    loads after a step."""

    def __init__(self, run: Run, preparations: list[Preparation]):
        self.run = run
        self.refreshers = [p for p in preparations if hasattr(p, "refresh")]

    def train(self, batch: list[Trajectory]) -> dict[str, float]:
        """One optimizer step on `batch` from version `run.step` (which it does not move)."""
        run, cfg, version = self.run, self.run.cfg, self.run.step
        try:
            with trainer_autocast(cfg.train.autocast, cfg.model.device):  # bf16 matmuls when train.autocast=bfloat16
                metrics = train_step(batch, run.actor, run.critic, run.ref, cfg.algo,
                                     pad_id=run.tokenizer.pad_token_id,
                                     micro_batch_tokens=cfg.train.micro_batch_tokens,
                                     train_actor=version >= cfg.algo.critic_warmup_steps,
                                     device=cfg.model.device, nonfinite=cfg.train.nonfinite,
                                     skip_zero_advantage=cfg.train.skip_zero_advantage,
                                     temperature=logprob_temperature(cfg.rollout.temperature),
                                     image_processor=getattr(run.tokenizer, "image_processor", None))
        except NonFiniteError as exc:
            raise NonFiniteError(f"step {version + 1} (env.name={cfg.env.name}): {exc}") from None
        if run.critic is not None:
            for p in self.refreshers:
                p.refresh(run.critic.model)
        return metrics

    def weights(self) -> dict[str, Any]:
        return policy_state(self.run.actor.model)  # the adapters alone for a LoRA policy

    def close(self) -> None:
        """Nothing to hand back: the actor is this process's own."""


class TrainerThread:
    """The trainer as the recipe's loop sees it: `await step(batch)` runs the blocking
    `trainer.train(batch)` on `executor` (the trainer's own thread, or the compute thread that
    synchronous training shares) and counts the step in `run.step`, which is `version`."""

    def __init__(self, run: Run, trainer: Any, executor: Any):
        self.run, self.trainer, self.executor = run, trainer, executor

    @property
    def version(self) -> int:
        return self.run.step

    async def step(self, batch: list[Trajectory]) -> dict[str, float]:
        metrics = await asyncio.get_running_loop().run_in_executor(self.executor, self.trainer.train, batch)
        self.run.step += 1
        return metrics

    def weights(self) -> Any:
        return self.trainer.weights()

    def close(self) -> None:
        self.trainer.close()


def open_pool(run: Run, backend: RolloutBackend, preparations: list[Preparation], threads: RunThreads) -> RolloutPool:
    """The rollout pool of `run` around `backend`: its tasks, reward shaping, preparations (on
    `threads`), ledger file, and, on resume, the checkpoint's schedule; `run.pool` from now on."""
    cfg, path = run.cfg, Path(run.cfg.run_dir) / "ledger.jsonl"
    # Dynamic sampling: a group of equal rewards teaches nothing. Reproducible runs prepare one
    # trajectory at a time: a batch's padded shape would depend on which trajectories happened to
    # be waiting, and that changes float sums in the last bits.
    informative = (lambda group: has_signal([t.reward for t in group])) if cfg.algo.dynamic_sampling else None
    buffer = ReadyBuffer(preparations, group_size=cfg.algo.group_size,
                         max_prep_batch=1 if cfg.train.reproducible else 64, thread_init=threads.prep_init,
                         accept_group=informative, executor=threads.compute)
    # On resume in the run dir that wrote it, the ledger is cut back to the checkpoint; the attempts
    # the cut removes count as lost.
    schedule = (run.resume_state or {}).pop("scheduler", None)
    lost: list[dict[str, Any]] = []
    if schedule is not None and schedule.get("ledger_offset") is not None \
            and run.resume_state.get("run_dir") == str(Path(cfg.run_dir).resolve()):
        lost = cut_back(path, schedule["ledger_offset"], run.step, run.resumed_from)
    if run.model_rewards is not None:  # scored in batches on a thread of their own (tiderl/rewards/scoring.py)
        backend = ScoredBackend(backend, BatchScorer.from_config(cfg, run.model_rewards))
    run.pool = RolloutPool(PoolSettings.from_config(cfg), lambda: run.tasks.take(1)[0], backend, buffer,
                           shape=run.shape, ledger_log=LedgerLog(path), start_version=run.step)
    if schedule is not None:
        run.pool.load_state_dict(schedule, run.tasks.task, lost)
    return run.pool


def save_run_checkpoint(run: Run, path: Path, meta: dict[str, Any] | None = None) -> Path:
    """The whole state of the run, atomically: actor, critic, optimizers, the curiosity counts
    (so a resume pays the same bonuses), every random state and the rollout pool's schedule (when
    one ran); `meta` goes into its marker. Call it between steps."""
    rng = getattr(run.engine, "rng_state", None)
    state = {"tasks": run.tasks.state_dict(), "python_rng": random.getstate(), "numpy_rng": np.random.get_state(),
             "engine_rng": rng() if rng is not None else None, "run_dir": str(Path(run.cfg.run_dir).resolve())}
    if run.pool is not None:  # the key keeps its first name, so earlier checkpoints still resume
        state["scheduler"] = run.pool.state_dict()
    elif run.resume_state is not None and "scheduler" in run.resume_state:
        state["scheduler"] = run.resume_state["scheduler"]  # resumed, not trained since
    shards = None
    if run.cfg.train.parallel != "none":  # the ranks hold the optimizer states: they write sharded/
        shards = getattr(run.trainer, "save_sharded", None)
        if shards is None:
            raise RuntimeError(f"a train.parallel={run.cfg.train.parallel} checkpoint is written by the trainer ranks, "
                               "and they are not running: save it during train() (train.checkpoint_every)")
    path = save_checkpoint(path, run.step, run.actor, run.critic, run.tokenizer, state=state,
                           curiosity=run.curiosity.state_dict(), meta={"algo": run.cfg.algo.name, **(meta or {})},
                           shards=shards)
    log = getattr(run.pool, "ledger_log", None)
    if log is not None:
        log.append({"ev": "checkpoint", "step": run.step, "path": str(path)})
    return path


class Checkpoints:
    """When the recipe saves: every `train.checkpoint_every` steps and every
    `train.checkpoint_every_s` seconds, as `run_dir/checkpoints/step_N`, keeping the newest
    `train.keep_last`; with `train.keep_best`, `checkpoints/best` whenever a step's held-out
    `eval/success` beats every earlier one (of this run, and of the run it resumes)."""

    def __init__(self, run: Run):
        self.run, self.root, self.last = run, Path(run.cfg.run_dir) / "checkpoints", time.monotonic()
        best = self.root / "best" / MARKER
        self.best = json.loads(best.read_text()).get("eval/success", -1.0) if run.resumed_from and best.is_file() \
            else -1.0

    def after_step(self, version: int, metrics: dict[str, float] | None = None) -> Path | None:
        t, score = self.run.cfg.train, (metrics or {}).get("eval/success")
        if t.keep_best and score is not None and score > self.best:
            self.best = score
            save_run_checkpoint(self.run, self.root / "best", {"eval/success": score})
        due = (t.checkpoint_every > 0 and version % t.checkpoint_every == 0) or (
            t.checkpoint_every_s > 0 and time.monotonic() - self.last >= t.checkpoint_every_s)
        if t.parallel != "none" and t.save_final and version >= t.steps:
            # The ranks stop when train() ends: a data-parallel run's final checkpoint is saved here.
            save_run_checkpoint(self.run, self.root / "final")
        if not due:
            return None
        path = save_run_checkpoint(self.run, self.root / f"step_{version}")
        self.last = time.monotonic()
        prune_checkpoints(self.root, t.keep_last)
        return path


class HeldOut:
    """`eval.every`: held-out evaluation during training, after the step's weights were published:
    `evaluate_modes` on the first `eval.n` held-out tasks with the run's engine (given the
    trainer's weights first when rollouts run elsewhere). Returns `held_out_metrics` and
    `time/eval_s` every `eval.every` steps and at the last one, {} at the others. At
    max_staleness=0, where nothing else samples meanwhile, the engine's sampler state is put back
    afterwards: training draws what it would have drawn without the evaluations."""

    def __init__(self, run: Run):
        self.run, self.every, self.tasks = run, run.cfg.eval.every, run.setup.eval_tasks[:run.cfg.eval.n or None]

    def __call__(self, version: int) -> dict[str, float]:
        if not self.every or (version % self.every and version < self.run.cfg.train.steps):
            return {}
        return self.evaluate(version)

    def before_training(self, logger: Any) -> None:
        """`eval.before`: log the starting weights' evaluation as step 0 (a new run, not a resume)."""
        if self.run.cfg.eval.before and self.run.step == 0:
            logger.log(0, self.evaluate(0), advance=False)

    def evaluate(self, version: int) -> dict[str, float]:
        """Evaluate the trainer's weights of `version` now (eval.before: the starting ones, 0)."""
        run, cfg = self.run, self.run.cfg
        if run.engine.version != version:
            getattr(run.trainer, "pull_actor", lambda: None)()  # data-parallel ranks hold the weights
            sync_weights(run)
        rng = getattr(run.engine, "rng_state", None)
        kept = rng() if rng is not None and cfg.system.max_staleness == 0 else None
        t0 = time.perf_counter()
        results = evaluate_modes(cfg, run.engine, run.tokenizer, run.make_env, self.tasks, run.setup.eval_chunk_size)
        if kept is not None:
            run.engine.set_rng_state(kept)
        return {**held_out_metrics(results), "time/eval_s": time.perf_counter() - t0}


def sync_weights(run: Run) -> None:
    """Hand the actor's weights to the run's engine as version `run.step`, and check they arrived."""
    state = policy_state(run.actor.model)
    run.engine.update_weights(state, version=run.step)
    sent, held = weights_checksum(state), run.engine.state_checksum()
    if sent != held:
        raise RuntimeError(f"weight sync to version {run.step} failed: the engine holds weights with checksum "
                           f"{held!r}, the trainer sent {sent!r}")
