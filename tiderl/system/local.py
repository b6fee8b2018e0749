"""The local backend: the asynchronous scheduler in one process.

Episodes are asyncio coroutines (`play_episode`); the engine decodes on its own thread through a
`BatchingEngine`; the trainer steps on another thread; preparations (critic values) run on a
third. Torch releases the GIL inside its kernels, so decoding, training and preparation overlap
on a multi-core machine.
"""

from __future__ import annotations

import asyncio
import copy
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from tiderl.agent.loop import play_episode
from tiderl.algos.sampling import has_signal
from tiderl.algos.step import algo_step, group_size
from tiderl.config import RunConfig, dump_yaml
from tiderl.envs.protocol import Task
from tiderl.evaluate import sampling_params
from tiderl.metrics.logger import MetricsLogger
from tiderl.rollout.base import SamplingParams
from tiderl.rollout.torch_engine import TorchEngine, weights_checksum
from tiderl.system.buffer import Preparation, ReadyBuffer
from tiderl.system.engine_client import BatchingEngine
from tiderl.system.latency import with_latency
from tiderl.system.scheduler import Scheduler, SchedulerSettings
from tiderl.train.batching import collate, micro_batch_indices, slice_batch
from tiderl.train.forward import token_logprobs, token_values
from tiderl.types import Trajectory

if TYPE_CHECKING:
    from tiderl.loop import Run


class LocalRollout:
    """Episodes as coroutines over one in-process engine (the RolloutBackend protocol)."""

    def __init__(self, engine: TorchEngine, tokenizer: Any, make_env: Any, params: SamplingParams,
                 max_turns: int, max_total_tokens: int, max_batch_size: int):
        self.engine = engine
        self.tokenizer = tokenizer
        self.make_env = make_env
        self.params = params
        self.max_turns = max_turns
        self.max_total_tokens = max_total_tokens
        self.client = BatchingEngine(engine, max_batch_size)

    @property
    def version(self) -> int:
        return self.engine.version

    async def start(self) -> None:
        self.client.start()

    async def close(self) -> None:
        await self.client.close()

    async def run_episode(self, task: Task, group_id: str) -> Trajectory:
        return await play_episode(self.client.generate, self.tokenizer, self.make_env, task, self.params,
                                  self.max_turns, self.max_total_tokens, group_id=group_id)

    async def update_weights(self, state_dict: dict[str, Any], version: int) -> float:
        await self.client.update_weights(state_dict, version)
        return await self.client.call(self.engine.state_checksum)


@torch.no_grad()
def annotate_per_token(trajectories: list[Trajectory], key: str, forward: Callable[[Any], torch.Tensor],
                       pad_id: int, micro_batch_tokens: int, device: str) -> None:
    """Run `forward(micro_batch) -> [b, t]` over the trajectories (right-padded, in micro-batches
    of at most `micro_batch_tokens`) and store each row's first len(tokens) entries as
    `annotations[key]`."""
    batch = collate(trajectories, pad_id)
    lengths = [len(t.tokens) for t in trajectories]
    for rows in micro_batch_indices(lengths, micro_batch_tokens):
        out = forward(slice_batch(batch, rows).to(device)).float().cpu()
        for i, row in enumerate(rows):
            trajectories[row].annotations[key] = out[i, : lengths[row]].tolist()


class CriticSnapshot:
    """A copy of the critic for the preparation thread, refreshed after every trainer step, so
    values are computed while the trainer updates the live critic (ref/critic pipelining)."""

    def __init__(self, critic: torch.nn.Module, pad_id: int, micro_batch_tokens: int, device: str):
        self.model = copy.deepcopy(critic).eval().requires_grad_(False)
        self.pad_id = pad_id
        self.micro_batch_tokens = micro_batch_tokens
        self.device = device
        self.lock = threading.Lock()

    def refresh(self, critic: torch.nn.Module) -> None:
        with self.lock:
            self.model.load_state_dict(critic.state_dict())

    def __call__(self, trajectories: list[Trajectory]) -> None:
        """Put `annotations["values"]` (one critic value per token) on each trajectory."""

        def values(mb: Any) -> torch.Tensor:
            with self.lock:
                return token_values(self.model, mb.input_ids, mb.attention_mask)

        annotate_per_token(trajectories, "values", values, self.pad_id, self.micro_batch_tokens, self.device)


class RefLogprobs:
    """Reference-model log-probs of every token, as a preparation (`annotations["ref_logprobs"]`):
    the reference is frozen, so its forward pass can run any time before the step."""

    def __init__(self, ref: torch.nn.Module, pad_id: int, micro_batch_tokens: int, device: str):
        self.ref = ref
        self.pad_id = pad_id
        self.micro_batch_tokens = micro_batch_tokens
        self.device = device

    def __call__(self, trajectories: list[Trajectory]) -> None:
        """Put `annotations["ref_logprobs"]` (0 on forced tokens) on each trajectory."""

        def logprobs(mb: Any) -> torch.Tensor:
            return token_logprobs(self.ref, mb.input_ids, mb.attention_mask)[0] * mb.action_mask

        annotate_per_token(trajectories, "ref_logprobs", logprobs, self.pad_id, self.micro_batch_tokens,
                           self.device)


class RunTrainer:
    """The TrainerSide of a tiderl Run: one `algo_step` of the configured algorithm per batch."""

    def __init__(self, run: "Run", snapshot: CriticSnapshot | None = None):
        self.run = run
        self.snapshot = snapshot

    def step(self, batch: list[Trajectory], version: int) -> dict[str, float]:
        run, cfg = self.run, self.run.cfg
        metrics = algo_step(batch, run.actor, run.critic, run.ref, cfg.algo,
                            pad_id=run.tokenizer.pad_token_id,
                            micro_batch_tokens=cfg.train.micro_batch_tokens,
                            train_actor=version >= cfg.algo.critic_warmup_steps,
                            device=cfg.model.device)
        if self.snapshot is not None and run.critic is not None:
            self.snapshot.refresh(run.critic.model)
        return metrics

    def state_dict(self) -> dict[str, Any]:
        return self.run.actor.model.state_dict()

    def checksum(self, state_dict: dict[str, Any]) -> float:
        return weights_checksum(state_dict)


def default_preparations(run: "Run") -> tuple[list[Preparation], CriticSnapshot | None]:
    """What a trajectory needs before it is ready, for the run's algorithm: SAO's critic values
    (from a snapshot of the critic) and, with a KL term, reference log-probs."""
    cfg = run.cfg
    preparations: list[Preparation] = []
    snapshot = None
    if cfg.algo.name == "sao" and run.critic is not None:
        snapshot = CriticSnapshot(run.critic.model, run.tokenizer.pad_token_id,
                                  cfg.train.micro_batch_tokens, cfg.model.device)
        preparations.append(snapshot)
    if run.ref is not None:
        preparations.append(RefLogprobs(run.ref, run.tokenizer.pad_token_id,
                                        cfg.train.micro_batch_tokens, cfg.model.device))
    return preparations, snapshot


def informative_group(group: list[Trajectory]) -> bool:
    """DAPO's dynamic sampling: a group whose rewards are all equal carries no signal."""
    return has_signal([t.reward for t in group])


def scheduler_settings(cfg: RunConfig) -> SchedulerSettings:
    s = cfg.system
    return SchedulerSettings(
        batch_size=cfg.rollout.batch_size, max_staleness=s.max_staleness, partial_rollout=s.partial_rollout,
        slots=s.slots, min_slots=s.min_slots, max_slots=s.max_slots, elastic_interval_s=s.elastic_interval_s,
        max_task_retries=s.max_task_retries, wait_timeout_s=s.wait_timeout_s,
        group_size=group_size(cfg.algo),
    )


def training_env_factory(cfg: RunConfig, make_env: Any) -> Any:
    """The run's environment factory with the configured simulated tool latency."""
    e = cfg.env
    return with_latency(make_env, e.tool_latency, e.tool_latency_s, e.tool_latency_spread,
                        e.tool_latency_max_s, seed=cfg.seed)


def train_async(run: "Run", steps: int, rollout: Any = None,
                preparations: list[Preparation] | None = None,
                observer: Callable[[int, dict[str, float], list[Trajectory]], None] | None = None,
                stop: Callable[[dict[str, float]], bool] | None = None,
                ) -> tuple[list[dict[str, float]], dict[str, Any]]:
    """Train `steps` optimizer steps with the asynchronous scheduler; returns (history, summary).

    `rollout` defaults to a LocalRollout over `run.engine`; the Ray backend passes its own.
    `observer(version, metrics, batch)` is called after every step (tests, custom logging);
    `stop(metrics)` may end the run early (e.g. at a generated-token budget).
    """
    from tiderl.loop import rollout_metrics, save_run_checkpoint
    from tiderl.rewards.curiosity import batch_metrics as curiosity_metrics

    cfg = run.cfg
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_yaml(cfg))
    if rollout is None:
        params = sampling_params(cfg.rollout, run.tokenizer.eos_token_id, greedy=False)
        rollout = LocalRollout(run.engine, run.tokenizer, training_env_factory(cfg, run.make_env), params,
                               cfg.env.max_turns, cfg.env.max_total_tokens, cfg.rollout.engine_batch_size)
    snapshot = None
    if preparations is None:
        preparations, snapshot = default_preparations(run)
    trainer = RunTrainer(run, snapshot)
    logger = MetricsLogger(run_dir, steps, cfg.log.tensorboard, cfg.log.progress)

    def on_step(version: int, metrics: dict[str, float], batch: list[Trajectory]) -> None:
        metrics.update(rollout_metrics(batch))
        metrics.update(curiosity_metrics(batch))
        run.step = version
        logger.log(version, metrics)
        if observer is not None:
            observer(version, metrics, batch)
        every = cfg.train.checkpoint_every
        if every > 0 and version % every == 0:
            # Between steps: the trainer thread is idle until the scheduler's next take.
            save_run_checkpoint(run, run_dir / "checkpoints" / f"step_{version}")

    async def main() -> tuple[list[dict[str, float]], dict[str, Any]]:
        loop = asyncio.get_running_loop()
        settings = scheduler_settings(cfg)
        # Environments without `astep` run their steps on the default executor: give it a
        # thread per slot so slow tools do not queue behind each other.
        loop.set_default_executor(ThreadPoolExecutor(max(settings.initial_slots(), cfg.system.max_slots) + 4))
        buffer = ReadyBuffer(preparations, group_size=settings.group_size,
                             accept_group=informative_group if cfg.algo.dynamic_sampling else None)
        scheduler = Scheduler(settings, lambda: run.tasks.take(1)[0], rollout, trainer, buffer,
                              on_step=on_step, start_version=run.step, shape=run.shape)
        await rollout.start()
        try:
            history = await scheduler.run(steps, stop)
        finally:
            await rollout.close()
        return history, scheduler.summary()

    try:
        return asyncio.run(main())
    finally:
        logger.close()

