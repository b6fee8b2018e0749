"""Small time-accounting helpers for the rollout pool's metrics."""

from __future__ import annotations

import time


class TimeWeighted:
    """The time integral of a piecewise-constant value (slots in use, a 0/1 'blocked' flag).

    `set(value)` records a change; `integral()` is the area under the value up to now, so two
    readings over an interval give its average.
    """

    def __init__(self, value: float = 0.0):
        self._value = value
        self._since = time.monotonic()
        self._area = 0.0

    def set(self, value: float) -> None:
        now = time.monotonic()
        self._area += self._value * (now - self._since)
        self._value, self._since = value, now

    @property
    def value(self) -> float:
        return self._value

    def integral(self) -> float:
        return self._area + self._value * (time.monotonic() - self._since)
