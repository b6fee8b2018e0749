"""Small time-accounting helpers for the rollout pool's metrics."""

from __future__ import annotations

import time


class TimeWeighted:
    """The time integral of a piecewise-constant value (slots in use, a 0/1 'blocked' flag).

    `set(value)` records a change; `integral()` is the area under the value up to now;
    `mean_since(t0, area0)` turns two readings into the average over an interval.
    """

    def __init__(self, value: float = 0.0, clock=time.monotonic):
        self._clock = clock
        self._value = value
        self._since = clock()
        self._area = 0.0

    def set(self, value: float) -> None:
        now = self._clock()
        self._area += self._value * (now - self._since)
        self._value, self._since = value, now

    @property
    def value(self) -> float:
        return self._value

    def integral(self) -> float:
        return self._area + self._value * (self._clock() - self._since)


def overlap_s(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total time covered by both interval lists (each list's intervals must not overlap)."""
    total, j = 0.0, 0
    b = sorted(b)
    for start, end in sorted(a):
        while j < len(b) and b[j][1] <= start:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            total += max(0.0, min(end, b[k][1]) - max(start, b[k][0]))
            k += 1
    return total
