"""Fakes of the rollout pool's two neighbours, for tests of the pool and the loop without a model:
`FakeRollout` (a backend whose episodes are asyncio sleeps) and `FakeTrainer` (a trainer that
records its batches), plus `run_pool`, which drives them through the recipe's own loop.

A fake episode's first half of its sampled tokens carries the weight version when it started and
the rest the version when it ended, as a partial rollout would.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from typing import Any

from tiderl.envs.protocol import Task
from tiderl.recipe import loop
from tiderl.rollout.weights import published_checksum
from tiderl.system.buffer import ReadyBuffer
from tiderl.system.pool import PoolSettings, RolloutPool
from tiderl.types import NO_VERSION, Trajectory


def fake_trajectory(task: Task, group_id: str, v_start: int, v_end: int, reward: float = 0.0,
                    length: int = 2) -> Trajectory:
    """A prompt token, then `length` sampled tokens: the first half (rounded down) on `v_start`."""
    half = length // 2
    return Trajectory(tokens=[5] + [6] * length, loss_mask=[0] + [1] * length,
                      behavior_logprobs=[0.0] + [-1.0] * length,
                      policy_version=[NO_VERSION] + [v_start] * half + [v_end] * (length - half), reward=reward,
                      task_id=task.task_id, group_id=group_id, env_info={"success": reward}, stop_reason="answer")


class FakeRollout:
    """A backend whose episodes sleep `duration(task_id)` seconds (or, when `wait(task_id)` gives
    an asyncio.Event, until it is set) and sample `length(task_id)` tokens. `fail(task_id,
    attempt)` may return "worker" (raise) or "env" (stop_reason error) to simulate faults. A
    cancelled episode counts the first half of its tokens in `cut_tokens`, as if cut mid-way."""

    def __init__(self, duration: Callable[[str], float] = lambda _: 0.0,
                 fail: Callable[[str, int], str] = lambda *_: "",
                 reward: Callable[[str], float] = lambda _: 0.0,
                 wait: Callable[[str], asyncio.Event | None] = lambda _: None,
                 length: Callable[[str], int] = lambda _: 2):
        self.duration = duration
        self.fail = fail
        self.reward = reward
        self.wait = wait
        self.length = length
        self.cut_tokens = 0
        self.version = 0
        self.attempts: dict[str, int] = {}
        self.starts: list[tuple[str, int, float]] = []  # (task_id, version at start, time)
        self.finishes: list[tuple[str, float]] = []

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def report(self) -> dict[str, Any]:
        return {"fake": True}

    async def run_episode(self, task: Task, group_id: str) -> Trajectory:
        attempt = self.attempts.get(task.task_id, 0)
        self.attempts[task.task_id] = attempt + 1
        v_start = self.version
        self.starts.append((task.task_id, v_start, time.monotonic()))
        event = self.wait(task.task_id)
        try:
            if event is not None:
                await event.wait()
            await asyncio.sleep(self.duration(task.task_id))
        except asyncio.CancelledError:
            self.cut_tokens += self.length(task.task_id) // 2
            raise
        self.finishes.append((task.task_id, time.monotonic()))
        kind = self.fail(task.task_id, attempt)
        if kind == "worker":
            raise ConnectionError("rollout worker died")
        t = fake_trajectory(task, group_id, v_start, self.version, self.reward(task.task_id),
                            self.length(task.task_id))
        if kind == "env":
            t.stop_reason = "error"
            t.env_info["error"] = "RuntimeError('tool crashed')"
        return t

    async def update_weights(self, weights: Any, version: int) -> float:
        self.version = version
        return published_checksum(weights)


class FakeTrainer:
    """Blocks `step_s()` seconds per step on a thread (as a real step does) and records every
    batch with the version it trained from; `after(version)` runs after each step."""

    def __init__(self, step_s: Callable[[], float] = lambda: 0.0,
                 metrics: Callable[[int], dict[str, float]] = lambda _: {"loss": 0.0}):
        self.step_s = step_s
        self.metrics = metrics
        self.version = 0
        self.batches: list[tuple[int, list[Trajectory], float, float]] = []
        self.after: Callable[[int], None] = lambda version: None

    async def step(self, batch: list[Trajectory]) -> dict[str, float]:
        t0 = time.monotonic()
        seconds = self.step_s()
        if seconds:
            await asyncio.to_thread(time.sleep, seconds)
        self.batches.append((self.version, list(batch), t0, time.monotonic()))
        out = dict(self.metrics(self.version))
        self.version += 1
        self.after(self.version)
        return out

    def weights(self) -> dict[str, Any]:
        return {}

    def close(self) -> None: ...


def tasks() -> Callable[[], Task]:
    counter = itertools.count()

    def next_task() -> Task:
        i = next(counter)
        return Task(task_id=f"t{i}", prompt=f"q{i}", answer=None)

    return next_task


def run_pool(settings: PoolSettings, rollout: Any, trainer: Any, steps: int,
             buffer: ReadyBuffer | None = None, next_task: Callable[[], Task] | None = None,
             ) -> tuple[RolloutPool, list[dict[str, float]]]:
    """`steps` steps of the recipe's loop over a pool of `rollout`; returns the closed pool and
    each step's metrics."""
    async def main() -> tuple[RolloutPool, list[dict[str, float]]]:
        pool = RolloutPool(settings, next_task or tasks(), rollout, buffer or ReadyBuffer([], settings.group_size))
        return pool, await loop(pool, trainer, steps, lambda *_: False)

    return asyncio.run(main())


def check_ledger(pool: RolloutPool) -> None:
    """Every attempt is in exactly one bucket."""
    summary = pool.summary()["ledger"]
    assert summary["started"] == sum(v for k, v in summary.items() if k != "started"), summary
    assert pool.unsettled() >= 0
