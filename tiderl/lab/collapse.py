"""What counts as a training collapse, fixed before any run is looked at.

A run collapses at the first point where either rule fires:

- **held-out**: at two consecutive evaluations, held-out success is below the start (the
  evaluation before training) or below half the best held-out success seen so far;
- **training reward**: the training reward's 10-step moving average stays below half of its
  running maximum for 20 consecutive steps (counted only once that maximum is above 0.05, so
  a run that never learned does not "collapse" from noise).

The rules are pure functions of the recorded curves, so every benchmark and every reader applies
the same ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

HELD_OUT_CONSECUTIVE = 2
REWARD_WINDOW = 10
REWARD_PATIENCE = 20
REWARD_FLOOR = 0.05


@dataclass(frozen=True)
class Collapse:
    """Where a run collapsed: the optimizer step, which rule fired, and why."""

    step: int
    rule: str
    why: str


def held_out_collapse(curve: Sequence[tuple[int, float]]) -> Collapse | None:
    """`curve`: (step, held-out success) in step order, the first entry before training."""
    if not curve:
        return None
    start = curve[0][1]
    best = start
    run = 0
    for step, success in curve[1:]:
        best = max(best, success)
        bad = success < start or success < 0.5 * best
        run = run + 1 if bad else 0
        if run >= HELD_OUT_CONSECUTIVE:
            return Collapse(step, "held-out", f"held-out {success:.3f} below the start {start:.3f} or half "
                            f"the best {best:.3f} at {HELD_OUT_CONSECUTIVE} consecutive evaluations")
    return None


def reward_collapse(rewards: Sequence[float]) -> Collapse | None:
    """`rewards`: the mean training reward of each optimizer step (step i + 1 at index i)."""
    peak, below = float("-inf"), 0
    for i in range(REWARD_WINDOW - 1, len(rewards)):
        avg = sum(rewards[i - REWARD_WINDOW + 1:i + 1]) / REWARD_WINDOW
        peak = max(peak, avg)
        below = below + 1 if peak > REWARD_FLOOR and avg < 0.5 * peak else 0
        if below >= REWARD_PATIENCE:
            return Collapse(i + 1, "reward", f"training reward ({REWARD_WINDOW}-step mean) {avg:.3f} below "
                            f"half its best {peak:.3f} for {REWARD_PATIENCE} steps")
    return None


def find_collapse(curve: Sequence[tuple[int, float]], rewards: Sequence[float]) -> Collapse | None:
    """The earlier of the two rules' collapses, or None."""
    found = [c for c in (held_out_collapse(curve), reward_collapse(rewards)) if c is not None]
    return min(found, key=lambda c: c.step) if found else None
