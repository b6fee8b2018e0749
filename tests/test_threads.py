"""Thread budgets of the one training path: synchronous training runs all torch work in the
event loop's thread (`InlineExecutor`), with as many torch threads as other processes leave
cores free (`FreeCores`)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time

import pytest

from tiderl.aio import FreeCores, InlineExecutor, thread_budget


def test_inline_executor_runs_in_the_calling_thread_and_passes_errors_on():
    executor = InlineExecutor(threads=1)

    async def main():
        loop = asyncio.get_running_loop()
        where = await loop.run_in_executor(executor, threading.get_ident)
        with pytest.raises(ZeroDivisionError):
            await loop.run_in_executor(executor, lambda: 1 / 0)
        return where

    assert asyncio.run(main()) == threading.get_ident()


def test_thread_budget_is_per_thread():
    import torch
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1, initializer=thread_budget(1)) as one:
        assert one.submit(torch.get_num_threads).result() == 1


@pytest.mark.skipif(not os.path.exists("/proc/stat") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs /proc/stat and at least two cores")
def test_free_cores_leave_out_a_core_another_process_keeps_busy():
    free = FreeCores(interval_s=0.2)
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        free.count()  # starts an interval with the other process already running
        time.sleep(1.0)
        assert free.count() <= free.cores - 1
    finally:
        hog.kill()
        hog.wait()


def test_weight_checksum_does_not_depend_on_the_thread_budget():
    """Trainer and engine compute the checksum on threads with different torch thread counts."""
    import torch
    from concurrent.futures import ThreadPoolExecutor

    from tiderl.rollout.weights import weights_checksum

    state = {"w": torch.randn(1_000_003, generator=torch.Generator().manual_seed(0)), "b": torch.ones(7)}
    sums = set()
    for threads in (1, 2, 3):
        with ThreadPoolExecutor(1, initializer=thread_budget(threads)) as pool:
            sums.add(pool.submit(weights_checksum, state).result())
    assert len(sums) == 1
