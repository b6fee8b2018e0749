"""Elastic rollout capacity: grow or shrink the number of rollout slots from measured load.

The decision is a pure function of a few signals measured over the last interval, so it can be
tested against a synthetic load and its reason logged with every change.
"""

from __future__ import annotations

from dataclasses import dataclass

# Thresholds, chosen so that a balanced pipeline (trainer mostly busy, about one batch waiting)
# sits between them and does not oscillate.
STARVED_IDLE_FRAC = 0.2  # trainer idle this much of the interval: it is waiting for data
GATE_BOUND_FRAC = 0.5  # slots idle this much because the staleness bound refuses new tasks


@dataclass
class LoadSignals:
    """What the scheduler measured over the last interval.

    trainer_idle_frac: fraction of the interval the trainer waited for a batch.
    ready: finished trajectories waiting for the trainer (queue depth) at the interval's end.
    gate_blocked_frac: fraction of the interval with a free slot that the staleness gate would
        not fill.
    batch_size: trajectories per optimizer step.
    """

    trainer_idle_frac: float
    ready: int
    gate_blocked_frac: float
    batch_size: int


def decide_slots(slots: int, min_slots: int, max_slots: int, load: LoadSignals) -> tuple[int, str]:
    """The slot count for the next interval and the reason ('' when unchanged).

    - grow by a quarter (at least 1) up to `max_slots` when the trainer starves
      (idle > 20% of the interval) with less than a batch ready, and the staleness gate is not
      what holds the slots back (more slots would only wait at the gate);
    - shrink by a quarter (at least 1) down to `min_slots` when finished work piles up (two
      batches or more ready: the extra slots only make trajectories staler), or when the gate
      keeps slots idle more than half the interval (capacity that cannot be used);
    - otherwise keep.
    """
    step = max(1, slots // 4)
    starved = load.trainer_idle_frac > STARVED_IDLE_FRAC and load.ready < load.batch_size
    if starved and load.gate_blocked_frac <= GATE_BOUND_FRAC and slots < max_slots:
        new = min(max_slots, slots + step)
        return new, (f"grow {slots}->{new}: trainer idle {load.trainer_idle_frac:.0%} with "
                     f"{load.ready} ready (< batch {load.batch_size})")
    if slots > min_slots:
        if load.ready >= 2 * load.batch_size:
            new = max(min_slots, slots - step)
            return new, (f"shrink {slots}->{new}: {load.ready} finished trajectories wait "
                         f"(>= 2 batches of {load.batch_size})")
        if load.gate_blocked_frac > GATE_BOUND_FRAC:
            new = max(min_slots, slots - step)
            return new, (f"shrink {slots}->{new}: staleness gate kept slots idle "
                         f"{load.gate_blocked_frac:.0%} of the interval")
    return slots, ""
