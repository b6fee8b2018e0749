"""Elastic rollout capacity: grow or shrink the rollout side from measured readiness
(docs/elastic.md). One pure function, `decide`, which the rollout pool and the discrete-event model
(`tiderl/lab/simulate.py`) both call, so what the simulator predicts is what a run does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


class CapacityRemoved(RuntimeError):
    """The worker serving an episode was removed by an elastic shrink before the episode ended.

    The rollout pool queues the task again without using one of its retries and counts the attempt
    as `requeued` in the ledger (a shrink is the run's own decision, not a fault)."""


@dataclass(frozen=True)
class LoadSignals:
    """What the rollout pool measured over the last interval."""

    trainer_idle_frac: float  # fraction of the interval the trainer waited for a batch
    ready: int  # finished trajectories waiting for the trainer at the interval's end
    gate_blocked_frac: float  # fraction of it with free rollout capacity the staleness gate would not fill
    batch_size: int  # trajectories per optimizer step
    booting: int = 0  # units added and not yet serving (a worker still starting)


@dataclass(frozen=True)
class Bounds:
    """The units `decide` may choose from, and what set each end."""

    low: int
    high: int
    low_why: str = ""
    high_why: str = ""

    def clamp(self, units: int) -> int:
        return min(self.high, max(self.low, units))


def capacity_bounds(batch_size: int, max_staleness: int, slots_per_unit: int,
                    min_units: int, max_units: int) -> Bounds:
    """[low, high] units for a run with this batch size and staleness bound: what one batch needs
    and what the staleness gate can admit, each within the configured [min_units, max_units], which
    wins when they disagree (docs/elastic.md, "Bounds"); the `*_why` strings say what set each end."""
    if slots_per_unit < 1 or min_units < 1 or max_units < min_units:
        raise ValueError(f"capacity bounds need slots_per_unit >= 1 and 1 <= min_units <= max_units; got "
                         f"slots_per_unit={slots_per_unit}, min_units={min_units}, max_units={max_units}")
    need = math.ceil(batch_size / slots_per_unit)
    admit = math.ceil((max_staleness + 1) * batch_size / slots_per_unit)
    if need > max_units:
        low, low_why = max_units, f"configured max {max_units} (one batch of {batch_size} needs {need})"
    elif need >= min_units:
        low, low_why = need, f"one batch of {batch_size} needs {need} x {slots_per_unit} slots"
    else:
        low, low_why = min_units, f"configured min {min_units}"
    if admit < low:
        high, high_why = low, low_why
    elif admit <= max_units:
        high, high_why = admit, (f"the staleness gate admits (max_staleness+1) x batch = "
                                 f"{(max_staleness + 1) * batch_size} trajectories")
    else:
        high, high_why = max_units, f"configured max {max_units}"
    return Bounds(low, high, low_why, high_why)


@dataclass(frozen=True)
class Policy:
    """The thresholds and hysteresis of `decide`. A balanced pipeline (trainer mostly busy, about
    one batch waiting) sits between the thresholds and does not oscillate."""

    starved_idle_frac: float = 0.2  # trainer idle this much of the interval: it is waiting for data
    gate_bound_frac: float = 0.5  # capacity idle this much because the staleness gate refuses new tasks
    patience: int = 2  # intervals in a row a vote must hold before the units change
    cooldown: int = 2  # intervals after a change during which no vote is counted
    step_frac: float = 0.25  # a shrink removes this fraction of the units (at least 1)
    max_grow: float = 4.0  # a grow multiplies the units by at most this (a boot is slow: one step)


@dataclass(frozen=True)
class Memory:
    """What `decide` remembers between intervals: `streak` > 0 counts grow votes in a row,
    < 0 shrink votes in a row; `cooldown` intervals are left before votes count again."""

    streak: int = 0
    cooldown: int = 0


@dataclass(frozen=True)
class Decision:
    units: int
    reason: str  # '' when unchanged
    memory: Memory


def vote(load: LoadSignals, policy: Policy = Policy()) -> tuple[int, str]:
    """+1 (grow), -1 (shrink) or 0, and why, from one interval's readiness (docs/elastic.md)."""
    b = load.batch_size
    idle, blocked = load.trainer_idle_frac, load.gate_blocked_frac
    if idle > policy.starved_idle_frac and load.ready < b and blocked <= policy.gate_bound_frac:
        return 1, f"the trainer waited {idle:.0%} of the interval with {load.ready} ready (< batch {b})"
    if load.ready >= 2 * b:
        return -1, f"{load.ready} finished trajectories wait (>= 2 batches of {b})"
    if blocked > policy.gate_bound_frac and idle <= policy.starved_idle_frac:
        return -1, (f"the staleness gate kept rollout capacity idle {blocked:.0%} of the interval "
                    f"while the trainer was busy")
    return 0, ""


def decide(units: int, bounds: Bounds, load: LoadSignals, memory: Memory = Memory(),
           policy: Policy = Policy()) -> Decision:
    """The units for the next interval, the reason for a change ('' when none) and the memory
    to pass to the next call.

    Units outside `bounds` are brought inside at once. Otherwise a change needs `patience`
    matching votes in a row (outside a cooldown, and for growing with nothing booting) and moves
    by the sizes of docs/elastic.md, never past a bound; a vote at the bound it points to
    changes nothing and is not kept (it would fire the moment the bound moved)."""
    if units < bounds.low:
        return Decision(bounds.low, f"grow {units}->{bounds.low}: below the lower bound ({bounds.low_why})",
                        Memory(0, policy.cooldown))
    if units > bounds.high:
        return Decision(bounds.high, f"shrink {units}->{bounds.high}: above the upper bound ({bounds.high_why})",
                        Memory(0, policy.cooldown))
    if memory.cooldown > 0:
        return Decision(units, "", Memory(0, memory.cooldown - 1))
    direction, why = vote(load, policy)
    if direction > 0 and units >= bounds.high or direction < 0 and units <= bounds.low:
        direction = 0
    if direction == 0:
        return Decision(units, "", Memory())
    if direction > 0 and load.booting > 0:
        return Decision(units, "", memory)  # the capacity on its way has not shown its effect yet
    streak = memory.streak + direction if memory.streak * direction > 0 else direction
    if abs(streak) < policy.patience:
        return Decision(units, "", Memory(streak, 0))
    if direction > 0:
        factor = min(policy.max_grow, 1.0 / max(1e-9, 1.0 - load.trainer_idle_frac))
        new = bounds.clamp(max(units + 1, math.ceil(units * factor - 1e-9)))
    else:
        new = bounds.clamp(units - max(1, round(units * policy.step_frac)))
    verb = "grow" if new > units else "shrink"
    return Decision(new, f"{verb} {units}->{new}: {why} ({abs(streak)} intervals in a row)",
                    Memory(0, policy.cooldown))
