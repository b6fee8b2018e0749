"""Rewards from models, off the rollout pool's event loop and in batches (docs/rewards.md, "Where"
and "Errors"): `ScoredBackend` wraps the rollout backend so that a finished episode waits, as a
coroutine, for `BatchScorer` to score it with the episodes that finish close together, on a worker
thread of its own. A batch that fails or takes over `reward.timeout_s` fails each of its episodes
as an attempt of its task.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tiderl.rewards.model import ModelRewards
from tiderl.types import Trajectory

__all__ = ["BatchScorer", "ScoredBackend"]


class BatchScorer:
    """Scores trajectories with `rewards` on one worker thread, `batch_size` at a time at most
    `wait_s` after the first of a batch arrived; each caller awaits its own (`score`)."""

    def __init__(self, rewards: ModelRewards, batch_size: int, wait_s: float, timeout_s: float) -> None:
        self.rewards, self.batch_size, self.wait_s, self.timeout_s = rewards, batch_size, wait_s, timeout_s
        self.batch_sizes: list[int] = []  # trajectories per scored batch, in order
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tiderl-reward")
        self._pending: list[tuple[Trajectory, asyncio.Future[Trajectory]]] = []
        self._timer: asyncio.TimerHandle | None = None

    @classmethod
    def from_config(cls, cfg: Any, rewards: ModelRewards) -> BatchScorer:
        r = cfg.reward
        sizes = [o.batch_size for o, on in ((r.model, r.model.path), (r.judge, r.judge.url)) if on]
        return cls(rewards, max(sizes, default=1), r.batch_wait_s, r.timeout_s)

    async def score(self, trajectories: list[Trajectory]) -> list[Trajectory]:
        """`trajectories` shaped by the model rewards, scored with whatever else is waiting."""
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in trajectories]
        self._pending += zip(trajectories, futures)
        if len(self._pending) >= self.batch_size:
            self._flush()
        elif self._timer is None:
            self._timer = loop.call_later(self.wait_s, self._flush)
        try:
            results = await asyncio.wait_for(asyncio.gather(*futures, return_exceptions=True), self.timeout_s or None)
        except asyncio.TimeoutError:
            ids = ", ".join(t.task_id for t in trajectories)
            raise RuntimeError(f"scoring the reward of task(s) {ids} took over reward.timeout_s={self.timeout_s} s. "
                               "Fix: raise reward.timeout_s, or lower reward.model.batch_size / check the judge's "
                               "server") from None
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return list(results)

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._pending = self._pending, []
        if not batch:
            return
        self.batch_sizes.append(len(batch))
        work = asyncio.get_running_loop().run_in_executor(self._executor, self.rewards.shape, [t for t, _ in batch])

        def settle(done: asyncio.Future[list[Trajectory]]) -> None:
            error = done.exception() if not done.cancelled() else asyncio.CancelledError()
            for i, (_, future) in enumerate(batch):
                if future.done():  # its caller stopped waiting (timeout, cancelled episode)
                    continue
                if error is not None:
                    future.set_exception(error)
                else:
                    future.set_result(done.result()[i])

        work.add_done_callback(settle)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class ScoredBackend:
    """A rollout backend (`tiderl.system.pool.RolloutBackend`) whose episodes come back scored by
    a `BatchScorer`; everything else is the wrapped backend's."""

    def __init__(self, backend: Any, scorer: BatchScorer) -> None:
        self.backend, self.scorer = backend, scorer

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)

    @property
    def version(self) -> int:
        return self.backend.version

    async def run_episode(self, task: Any, group_id: str) -> Trajectory | list[Trajectory]:
        result = await self.backend.run_episode(task, group_id)
        scored = await self.scorer.score(result if isinstance(result, list) else [result])
        return scored if isinstance(result, list) else scored[0]

    async def close(self) -> None:
        try:
            await self.backend.close()
        finally:
            self.scorer.close()
