"""The readiness-aware buffer: finished trajectories wait here until their preparations (critic
values, reference log-probs) have run, on their own thread, overlapped with training and rollout
(docs/architecture.md, "Readiness").
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor

from tiderl.aio import cancel_and_wait
from tiderl.train.annotate import Preparation
from tiderl.types import Trajectory


class ReadyBuffer:
    """FIFO of ready trajectories (or groups), fed through the preparations.

    `put(t)` queues a finished trajectory for preparation; `take(n, timeout_s)` waits until `n`
    ready trajectories (whole groups when `group_size > 1`, so `n` must be a multiple of it)
    are there and returns them in the order they became ready. `prep_busy` records the
    (start, end) time of every preparation batch, for measuring overlap with training.
    """

    def __init__(self, preparations: list[Preparation], group_size: int = 1, max_prep_batch: int = 64,
                 thread_init: Callable[[], None] | None = None, executor: Executor | None = None,
                 accept_group: Callable[[list[Trajectory]], bool] | None = None):
        if group_size < 1:
            raise ValueError(f"group_size={group_size} must be >= 1")
        self.preparations = preparations
        self.group_size = group_size
        self.max_prep_batch = max_prep_batch
        self._waiting: list[Trajectory] = []  # finished, not yet prepared
        self._ready: list[Trajectory] = []  # prepared; whole groups when group_size > 1
        self._partial: OrderedDict[str, list[Trajectory]] = OrderedDict()
        self._changed = asyncio.Event()
        self._wake_prep = asyncio.Event()
        # Preparations run on their own thread, or on a compute thread the caller shares.
        self._own_executor = executor is None
        self._executor = executor or ThreadPoolExecutor(1, thread_name_prefix="tiderl-prep", initializer=thread_init)
        self._task: asyncio.Task[None] | None = None
        self._error: BaseException | None = None
        self._abort: BaseException | None = None  # raised by take(): the run cannot go on
        self._preparing: list[Trajectory] = []  # taken from _waiting, being prepared
        self.prep_busy: list[tuple[float, float]] = []
        # Complete groups failing `accept_group` (e.g. all rewards equal, for dynamic sampling)
        # are handed to `on_reject` instead of the trainer; the pool settles and counts them.
        self.accept_group = accept_group
        self.on_reject: Callable[[list[Trajectory]], None] = lambda group: None

    @property
    def ready_count(self) -> int:
        return len(self._ready)

    @property
    def waiting_count(self) -> int:
        """Finished trajectories not yet ready (being prepared, or in an incomplete group)."""
        return len(self._waiting) + sum(len(g) for g in self._partial.values())

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._prep_loop(), name="tiderl-prep")

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        if self._own_executor:
            self._executor.shutdown(wait=True)

    def put(self, trajectory: Trajectory) -> None:
        self._waiting.append(trajectory)
        self._wake_prep.set()

    def abort(self, error: BaseException) -> None:
        """Make every `take` (now and later) raise `error`."""
        self._abort = error
        self._changed.set()

    def contents(self) -> list[Trajectory]:
        """Every finished trajectory held (ready, being prepared, waiting, in incomplete
        groups), oldest first: what a checkpoint saves."""
        partial = [t for group in self._partial.values() for t in group]
        return [*self._ready, *partial, *self._preparing, *self._waiting]

    def restore(self, trajectories: list[Trajectory]) -> None:
        """Put a checkpoint's `contents()` back; they are prepared again (annotations from the
        restored critic) before they are ready."""
        for t in trajectories:
            t.annotations.clear()
            self.put(t)

    async def take(self, n: int, timeout_s: float, describe: Callable[[], str] = lambda: "") -> list[Trajectory]:
        """The first `n` ready trajectories; raises TimeoutError (saying what it waited for)
        when they are not there within `timeout_s`."""
        if n % self.group_size:
            raise ValueError(f"take({n}) must be a multiple of group_size={self.group_size}")
        deadline = time.monotonic() + timeout_s
        while len(self._ready) < n:
            if self._abort is not None:
                raise self._abort
            if self._error is not None:
                raise RuntimeError(f"a preparation failed: {self._error!r}") from self._error
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"waited {timeout_s:.0f}s for {n} ready trajectories; {len(self._ready)} ready, "
                    f"{self.waiting_count} being prepared or in incomplete groups. {describe()}. Fix: if episodes "
                    "are slow rather than stuck (a real model decoding on a busy CPU), raise system.wait_timeout_s")
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout=min(left, 1.0))
        batch, self._ready = self._ready[:n], self._ready[n:]
        return batch

    async def _prep_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake_prep.wait()
            self._wake_prep.clear()
            while self._waiting:
                batch, self._waiting = self._waiting[: self.max_prep_batch], self._waiting[self.max_prep_batch:]
                self._preparing = batch
                if self.preparations:
                    t0 = time.perf_counter()
                    try:
                        await loop.run_in_executor(self._executor, self._prepare, batch)
                    except Exception as exc:  # noqa: BLE001 - surfaced to the trainer's take()
                        self._error = exc
                        self._changed.set()
                        return
                    self.prep_busy.append((t0, time.perf_counter()))
                for trajectory in batch:
                    self._admit(trajectory)
                self._preparing = []
                self._changed.set()

    def _prepare(self, batch: list[Trajectory]) -> None:
        for preparation in self.preparations:
            preparation(batch)

    def _admit(self, trajectory: Trajectory) -> None:
        if self.group_size == 1:
            self._ready.append(trajectory)
            return
        group = self._partial.setdefault(trajectory.group_id, [])
        group.append(trajectory)
        if len(group) == self.group_size:
            complete = self._partial.pop(trajectory.group_id)
            if self.accept_group is not None and not self.accept_group(complete):
                self.on_reject(complete)
            else:
                self._ready.extend(complete)
