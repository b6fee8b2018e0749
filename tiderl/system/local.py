"""The local backend: episodes as coroutines in this process, over the run's own engine.

Episodes are asyncio coroutines (`tiderl.agent.loop.play_episode`); the engine decodes on its
own thread behind a `BatchingEngine`, the trainer steps on another, preparations (critic values,
reference log-probs) run on a third. Torch releases the GIL inside its kernels, so decoding,
training and preparation overlap on a multi-core machine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tiderl.agent.loop import play_episode
from tiderl.aio import cores, thread_budget
from tiderl.envs.protocol import Task
from tiderl.rollout.base import Engine, SamplingParams, sampling_params
from tiderl.rollout.client import BatchingEngine
from tiderl.system.latency import training_env_factory
from tiderl.types import Trajectory

if TYPE_CHECKING:
    from tiderl.run import Run


class LocalRollout:
    """The RolloutBackend over one in-process engine."""

    def __init__(self, engine: Engine, tokenizer: Any, make_env: Any, params: SamplingParams,
                 max_turns: int, max_total_tokens: int, max_batch_size: int, thread_init: Any = None,
                 executor: Any = None, wait_for_all_s: float = 0.0):
        self.engine = engine
        self.tokenizer = tokenizer
        self.make_env = make_env
        self.params = params
        self.max_turns = max_turns
        self.max_total_tokens = max_total_tokens
        # wait_for_all_s > 0: every batch waits (up to that long) for every running episode, so
        # batches, and the sampler's stream, never depend on timing (train.reproducible).
        timing = dict(patience_s=wait_for_all_s, gather_s=wait_for_all_s) if wait_for_all_s > 0 else {}
        self.client = BatchingEngine(engine, max_batch_size, thread_init=thread_init, executor=executor, **timing)

    @classmethod
    def from_run(cls, run: "Run", preparations: list[Any], executor: Any = None) -> "LocalRollout":
        """Rollouts of `run` on `run.engine`, with the configured simulated tool latency; decoding
        runs on `executor` when the recipe shares one compute thread (synchronous training)."""
        cfg = run.cfg
        return cls(run.engine, run.tokenizer, training_env_factory(cfg, run.make_env),
                   sampling_params(cfg.rollout, run.tokenizer.eos_token_id, greedy=False),
                   cfg.env.max_turns, cfg.env.max_total_tokens, cfg.rollout.engine_batch_size,
                   # Beside the trainer (asynchronous training): half the cores unless configured.
                   thread_init=thread_budget(cfg.system.decode_threads or max(1, cores() // 2)), executor=executor,
                   wait_for_all_s=cfg.system.wait_timeout_s if cfg.train.reproducible else 0.0)

    @property
    def version(self) -> int:
        return self.engine.version

    async def start(self) -> None:
        self.client.start()

    async def close(self) -> None:
        await self.client.close()

    async def run_episode(self, task: Task, group_id: str) -> Trajectory:
        return await play_episode(self.client, self.tokenizer, self.make_env, task, self.params,
                                  self.max_turns, self.max_total_tokens, group_id=group_id)

    async def update_weights(self, state_dict: dict[str, Any], version: int) -> float:
        await self.client.update_weights(state_dict, version)
        return await self.client.call(self.engine.state_checksum)

    def report(self) -> dict[str, Any]:
        """The backend's part of the run summary."""
        return {"decode_batches": self.client.batches, "decode_requests": self.client.requests,
                "decode_busy_s": round(self.client.busy_s, 3)}
