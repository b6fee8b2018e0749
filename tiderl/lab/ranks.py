"""Data-parallel ranks on this machine for the tests and benchmarks of `tiderl.train.parallel`
(training runs its ranks as Ray actors, `tiderl.system.ray_trainer`)."""

from __future__ import annotations

import multiprocessing as mp
import socket
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist

from tiderl.train.parallel import init_rank


def _rank_main(rank: int, world_size: int, init_method: str, device: str, fn: Any, args: tuple[Any, ...],
               errors: Any) -> None:
    try:
        torch.set_num_threads(1)
        init_rank(rank, world_size, init_method, f"cuda:{rank}" if device == "cuda" else device)
        fn(rank, world_size, *args)
        # Every rank reaches the end before any tears the group down (rank 0 hosts the group's
        # store). Without it a rank once aborted at exit on a loaded machine (SIGABRT, "terminate
        # called without an active exception"); not reproduced since, so the cause is a guess.
        dist.barrier()
    except BaseException as exc:  # noqa: BLE001 - reported to the launcher, which raises it
        errors.put((rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn_ranks(fn: Any, world_size: int, *args: Any, timeout_s: float = 300.0, device: str = "cpu") -> None:
    """Run `fn(rank, world_size, *args)` in `world_size` fresh processes (multiprocessing spawn)
    that form a process group on this machine (gloo; NCCL when `device` is 'cuda', one GPU a rank);
    raise if any rank fails or the ranks take longer than `timeout_s`. `fn` must be importable by
    name (a module-level function)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, f"tcp://127.0.0.1:{port}", device, fn, args, errors))
             for r in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
        p.join()
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    if failures:
        raise RuntimeError("data-parallel ranks failed: " + "\n".join(f"rank {r}: {e}" for r, e in sorted(failures)))
    if alive:
        raise TimeoutError(f"{len(alive)} of {world_size} ranks still ran after {timeout_s:g}s")
    bad = [p.exitcode for p in procs if p.exitcode != 0]
    if bad:
        raise RuntimeError(f"data-parallel ranks exited with codes {[p.exitcode for p in procs]}")
