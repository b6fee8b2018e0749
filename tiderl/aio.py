"""Concurrency helpers shared by the background loops (engine client, buffer, rollout pool)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any


async def cancel_and_wait(task: asyncio.Task | None) -> None:
    """Cancel a background task and wait until it has stopped (its CancelledError is absorbed)."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def thread_budget(threads: int) -> Callable[[], None]:
    """An executor initializer that gives its thread `threads` torch intra-op threads (0 = one
    per core). Torch keeps the count per calling thread, so the decode, trainer and preparation
    threads each get their own budget instead of all spinning up one per core at once."""
    count = threads if threads > 0 else cores()

    def init() -> None:
        import torch

        torch.set_num_threads(count)

    return init


class FreeCores:
    """How many of this process's cores other processes leave free, measured from /proc/stat.

    `count()` compares the busy time of the allowed cores with this process's own CPU time since
    the previous call: cores - round(the cores others kept busy), at least 1 (`cores` where /proc
    is missing). Why: one torch OpenMP thread on a core another process holds stalls its whole
    team at every parallel region (docs/architecture.md, "Threads").
    """

    def __init__(self, total: int | None = None, interval_s: float = 0.5):
        self.allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        self.cores = total or cores()
        self.interval_s = interval_s
        self.tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._last = self._sample()
        self._count = self.cores

    def _sample(self) -> tuple[float, float, float] | None:
        """(wall s, busy s of the allowed cores, this process's CPU s), or None without /proc."""
        try:
            busy = 0
            with open("/proc/stat") as f:
                for line in f:
                    name, *fields = line.split()
                    if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in self.allowed:
                        values = [int(v) for v in fields]
                        busy += sum(values) - values[3] - values[4]  # all but idle and iowait
            return time.monotonic(), busy / self.tick, time.process_time()
        except (OSError, ValueError, IndexError):
            return None

    def count(self) -> int:
        now = self._sample()
        if now is None or self._last is None or now[0] - self._last[0] < self.interval_s:
            return self._count
        wall = now[0] - self._last[0]
        others = max(0.0, (now[1] - self._last[1]) - (now[2] - self._last[2])) / wall
        self._last = now
        self._count = max(1, self.cores - int(others + 0.5))
        return self._count


class InlineExecutor(Executor):
    """An executor that runs each call at once, in the calling thread (the event loop's): for
    synchronous training, where decoding, preparation and training never overlap and one torch
    thread team is fastest (docs/architecture.md, "Threads"). With `threads=0` each call first
    sets torch's thread count to the cores other processes leave free (`FreeCores`); with
    `threads > 0` it stays fixed."""

    def __init__(self, threads: int = 0):
        self.free = FreeCores() if threads <= 0 else None
        if threads > 0:
            thread_budget(threads)()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        if self.free is not None:
            import torch

            count = self.free.count()
            if count != torch.get_num_threads():
                torch.set_num_threads(count)
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            future.set_exception(exc)
        return future
