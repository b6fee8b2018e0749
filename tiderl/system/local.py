"""The local backend: episodes as coroutines in this process, over the run's own engine, which
decodes on its own thread behind a `BatchingEngine` (docs/architecture.md, "Threads").
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from tiderl.agent.loop import play_episode
from tiderl.aio import cores
from tiderl.envs.protocol import Task
from tiderl.rollout.base import Engine, SamplingParams, sampling_params
from tiderl.rollout.client import BatchingEngine
from tiderl.system.cores import CorePlan, available_cores, resolve_cores
from tiderl.system.latency import training_env_factory
from tiderl.types import Trajectory

if TYPE_CHECKING:
    from tiderl.run import Run


class LocalRollout:
    """The RolloutBackend over one in-process engine."""

    def __init__(self, engine: Engine, tokenizer: Any, make_env: Any, params: SamplingParams,
                 max_turns: int, max_total_tokens: int, max_batch_size: int, thread_init: Any = None,
                 executor: Any = None, wait_for_all_s: float = 0.0, core_plan: CorePlan | None = None,
                 release: bool = False):
        self.engine = engine
        self.release = release  # rollout.options.release_memory: the engine frees the device while the trainer steps
        self.tokenizer = tokenizer
        self.make_env = make_env
        self.params = params
        self.max_turns = max_turns
        self.max_total_tokens = max_total_tokens
        # wait_for_all_s > 0: every batch waits (up to that long) for every running episode, so
        # batches, and the sampler's stream, never depend on timing (train.reproducible).
        timing = dict(patience_s=wait_for_all_s, gather_s=wait_for_all_s) if wait_for_all_s > 0 else {}
        self.client = BatchingEngine(engine, max_batch_size, thread_init=thread_init, executor=executor, **timing)
        self.core_plan = core_plan or CorePlan()
        self.decoded_tokens = 0  # sampled tokens of every completed model turn, trained or not
        self.cut_tokens = 0  # of those, the ones of episodes cancelled before they finished

    @classmethod
    def from_run(cls, run: "Run", preparations: list[Any], executor: Any = None) -> "LocalRollout":
        """Rollouts of `run` on `run.engine`, with the configured simulated tool latency; decoding
        runs on `executor` when the recipe shares one compute thread (synchronous training)."""
        cfg = run.cfg
        # The recipe resolves the same plan for the trainer and preparation threads.
        plan = resolve_cores(cfg.system.cores, available_cores(), synchronous=cfg.system.max_staleness == 0)
        # Beside the trainer (asynchronous training): its pinned cores, else half the cores, unless configured.
        threads = plan.threads_for("rollout", cfg.system.decode_threads, max(1, cores() // 2))
        return cls(run.engine, run.tokenizer, training_env_factory(cfg, run.make_env),
                   sampling_params(cfg.rollout, run.tokenizer.eos_token_id, greedy=False),
                   cfg.env.max_turns, cfg.env.max_total_tokens, cfg.rollout.engine_batch_size,
                   thread_init=plan.thread_init("rollout", threads), executor=executor,
                   wait_for_all_s=cfg.system.wait_timeout_s if cfg.train.reproducible else 0.0, core_plan=plan,
                   release=getattr(cfg.rollout.options, "release_memory", False))

    @property
    def version(self) -> int:
        return self.engine.version

    async def start(self) -> None:
        self.client.start()

    async def close(self) -> None:
        await self.client.close()

    async def run_episode(self, task: Task, group_id: str) -> Trajectory:
        client = TurnCounting(self.client)
        try:
            return await play_episode(client, self.tokenizer, self.make_env, task, self.params,
                                      self.max_turns, self.max_total_tokens, group_id=group_id)
        except asyncio.CancelledError:
            self.cut_tokens += client.tokens
            raise
        finally:
            self.decoded_tokens += client.tokens

    async def release_memory(self) -> None:
        if self.release:
            await self.client.call(self.engine.release_memory)

    async def update_weights(self, state_dict: dict[str, Any], version: int) -> float:
        await self.client.update_weights(state_dict, version)
        return await self.client.call(self.engine.state_checksum)

    def report(self) -> dict[str, Any]:
        """The backend's part of the run summary."""
        return {"decode_batches": self.client.batches, "decode_requests": self.client.requests,
                "decode_busy_s": round(self.client.busy_s, 3), "decoded_tokens": self.decoded_tokens,
                "decode_cores": list(self.core_plan.rollout),
                "decode_threads": self.core_plan.pinned_threads.get("rollout", [])}


class TurnCounting:
    """An engine client as one episode sees it, counting the sampled tokens of the episode's
    completed turns (`tokens`): an episode later dropped, restarted or cut off has decoded them all
    the same, which is how a run's waste (decoded but never trained) is measured. A turn cancelled
    mid-decode is not counted."""

    def __init__(self, client: Any):
        self._client = client
        self.tokens = 0

    async def generate(self, prompt: list[int], params: SamplingParams, **images: Any) -> Any:
        completion = await self._client.generate(prompt, params, **images)  # images: docs/multimodal.md
        self.tokens += len(completion.token_ids)
        return completion

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)
