"""Explicit core budgets per component (`system.cores`): which cores decoding, training and
preparation run on (docs/architecture.md, "Threads: who runs torch where").
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from tiderl.aio import InlineExecutor, cores

COMPONENTS = ("trainer", "rollout", "prep")
FIELD = "system.cores"


def available_cores() -> list[int]:
    """The cores this process may run on, in order."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def _parse_ids(text: str, component: str) -> tuple[int, ...]:
    ids: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.partition("-")
        try:
            span = range(int(first), int(last if dash else first) + 1)
        except ValueError:
            span = range(0)
        if not span:  # not a number, or a descending range
            raise ValueError(f"{FIELD}: {component}={text!r} is not a core list. Fix: write core ids as "
                             "'0', '0,2' or '0-3', e.g. trainer=0;rollout=1")
        ids.update(span)
    return tuple(sorted(ids))


def parse_plan(spec: str) -> dict[str, tuple[int, ...]]:
    """`trainer=0-1;rollout=2,3` -> {component: core ids}. Raises ValueError naming the field."""
    plan: dict[str, tuple[int, ...]] = {}
    for item in spec.split(";"):
        if not item.strip():
            continue
        name, sep, ids = item.partition("=")
        name = name.strip()
        if not sep or name not in COMPONENTS:
            raise ValueError(f"{FIELD}: {item.strip()!r} names no component. Fix: use 'shared', 'auto' or "
                             f"component=cores pairs joined by ';' with components {', '.join(COMPONENTS)}, "
                             "e.g. trainer=0;rollout=1")
        if name in plan:
            raise ValueError(f"{FIELD}: {name} is given twice. Fix: name each component once")
        plan[name] = _parse_ids(ids, name)
    missing = [c for c in ("trainer", "rollout") if c not in plan]
    if missing:
        raise ValueError(f"{FIELD}: {spec!r} gives no cores to {' and '.join(missing)}. "
                         "Fix: name both, e.g. trainer=0;rollout=1")
    return plan


@dataclass
class CorePlan:
    """Which cores each component runs on (empty: not pinned) and the threads pinned so far."""

    trainer: tuple[int, ...] = ()
    rollout: tuple[int, ...] = ()
    prep: tuple[int, ...] = ()
    pinned_threads: dict[str, list[int]] = field(default_factory=dict)  # component -> native thread ids

    def cores_of(self, component: str) -> tuple[int, ...]:
        if component not in COMPONENTS:
            raise ValueError(f"unknown component {component!r}; one of {COMPONENTS}")
        return getattr(self, component)

    def threads_for(self, component: str, configured: int, default: int) -> int:
        """A component's torch thread count: `configured` if > 0, else its core count when it is
        pinned, else `default`."""
        if configured > 0:
            return configured
        return len(self.cores_of(component)) or default

    def thread_init(self, component: str, threads: int) -> Callable[[], None]:
        """An executor initializer: pins the calling thread to the component's cores (when it has
        any), records its native id, and gives it `threads` torch threads (0 = one per core it may
        run on)."""
        cores = self.cores_of(component)
        lock = threading.Lock()

        def init() -> None:
            tid = threading.get_native_id()
            if cores:
                os.sched_setaffinity(tid, cores)
            with lock:
                self.pinned_threads.setdefault(component, []).append(tid)
            import torch

            torch.set_num_threads(threads if threads > 0 else len(os.sched_getaffinity(tid)))

        return init

    def describe(self) -> dict[str, list[int]]:
        """{component: cores} for the run summary ({} when nothing is pinned)."""
        return {c: list(self.cores_of(c)) for c in COMPONENTS if self.cores_of(c)}


def resolve_cores(spec: str, available: Sequence[int], synchronous: bool) -> CorePlan:
    """The plan `system.cores=spec` gives on `available` cores (docs/architecture.md).

    Synchronous training runs every component on one compute thread, so each component of the
    plan gets the union of the cores it names (or nothing, for `auto`/`shared`).
    """
    spec = spec.strip()
    avail = sorted(available)
    if spec in ("shared", ""):
        return CorePlan()
    if spec == "auto":
        if synchronous or len(avail) < 2:
            return CorePlan()
        cut = len(avail) - len(avail) // 2
        trainer, rollout = tuple(avail[:cut]), tuple(avail[cut:])
        return CorePlan(trainer=trainer, rollout=rollout, prep=rollout)
    plan = parse_plan(spec)
    outside = sorted({c for ids in plan.values() for c in ids} - set(avail))
    if outside:
        raise ValueError(f"{FIELD}: cores {outside} are not available to this process (it may run on "
                         f"{avail}). Fix: use only those, or 'auto'")
    plan.setdefault("prep", plan["rollout"])
    if synchronous:
        union = tuple(sorted({c for ids in plan.values() for c in ids}))
        return CorePlan(trainer=union, rollout=union, prep=union)
    return CorePlan(**plan)


@dataclass
class RunThreads:
    """The threads a run's torch work runs on, from `system.*` (docs/architecture.md, "Threads"):
    synchronous training runs all of it on `compute` (an `InlineExecutor`); asynchronous training
    gives the trainer and the preparations threads of their own (`compute` is then None)."""

    plan: CorePlan
    compute: Executor | None
    trainer: Executor
    prep_init: Callable[[], None]

    @classmethod
    def from_config(cls, system: Any) -> "RunThreads":
        synchronous = system.max_staleness == 0
        plan = resolve_cores(system.cores, available_cores(), synchronous=synchronous)
        prep_init = plan.thread_init("prep", plan.threads_for("prep", system.prep_threads, 0))
        if synchronous:
            compute = InlineExecutor(plan.threads_for("trainer", system.trainer_threads, 0))
            return cls(plan, compute, compute, prep_init)
        half = max(1, cores() - cores() // 2)
        init = plan.thread_init("trainer", plan.threads_for("trainer", system.trainer_threads, half))
        return cls(plan, None, ThreadPoolExecutor(1, thread_name_prefix="tiderl-train", initializer=init), prep_init)

    def shutdown(self) -> None:
        self.trainer.shutdown(wait=True)


@contextmanager
def pinned_thread(cores: Sequence[int]) -> Iterator[None]:
    """Run the body with the calling thread pinned to `cores` (nothing when empty), restoring its
    previous mask afterwards. Threads it starts meanwhile inherit the mask."""
    if not cores:
        yield
        return
    tid = threading.get_native_id()
    before = os.sched_getaffinity(tid)
    os.sched_setaffinity(tid, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(tid, before)
