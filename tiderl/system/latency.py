"""Simulated tool latency: wrap any environment so each step takes a drawn amount of time.

Agentic workloads are long-tailed: most tool calls return quickly, a few take very long. The
benchmarks and tests reproduce that on one machine with this wrapper instead of a real slow
service. Distributions (mean `m` seconds, `spread` as documented per kind, optional cap):

- fixed:     always `m`;
- uniform:   uniform on [m (1 - spread), m (1 + spread)] (spread clipped to [0, 1]);
- lognormal: exp(N(mu, sigma^2)) with sigma = spread and mu = ln m - sigma^2 / 2, so that the
             mean is `m` and the tail grows with sigma (sigma 1.5: the slowest 1% ~ 11x m).
"""

from __future__ import annotations

import asyncio
import math
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from tiderl.envs.protocol import Action, Env, StepResult, Task

LATENCY_KINDS = ("none", "fixed", "uniform", "lognormal")


def draw_latency(kind: str, mean_s: float, spread: float, max_s: float, rng: random.Random) -> float:
    """One latency in seconds from the distribution `kind` (see the module docstring)."""
    if kind == "none" or mean_s <= 0:
        return 0.0
    if kind == "fixed":
        value = mean_s
    elif kind == "uniform":
        half = min(max(spread, 0.0), 1.0) * mean_s
        value = rng.uniform(mean_s - half, mean_s + half)
    elif kind == "lognormal":
        sigma = max(spread, 0.0)
        value = rng.lognormvariate(math.log(mean_s) - sigma * sigma / 2, sigma)
    else:
        raise ValueError(f"unknown latency kind {kind!r}; use one of {LATENCY_KINDS}")
    return min(value, max_s) if max_s > 0 else value


class LatencyEnv:
    """An Env that behaves exactly like `inner` but each `step` first waits a drawn latency.

    `step` sleeps (blocking its thread); `astep` awaits `asyncio.sleep` and then runs the
    inner step, so thousands of concurrent episodes wait without a thread each.
    `total_latency_s` sums what this episode waited.
    """

    def __init__(self, inner: Env, draw: Callable[[], float]):
        self.inner = inner
        self.draw = draw
        self.total_latency_s = 0.0

    def system_prompt(self) -> str:
        return self.inner.system_prompt()

    def tool_schemas(self) -> list[dict[str, Any]]:
        return self.inner.tool_schemas()

    def reset(self, task: Task) -> str:
        return self.inner.reset(task)

    def step(self, action: Action) -> StepResult:
        time.sleep(self._next())
        return self._tag(self.inner.step(action))

    async def astep(self, action: Action) -> StepResult:
        await asyncio.sleep(self._next())
        return self._tag(self.inner.step(action))

    def finish(self, reason: str) -> StepResult:
        return self._tag(self.inner.finish(reason))

    def _next(self) -> float:
        delay = self.draw()
        self.total_latency_s += delay
        return delay

    def _tag(self, result: StepResult) -> StepResult:
        if result.done:
            result.info["tool_latency_s"] = self.total_latency_s
        return result


def with_latency(make_env: Callable[[], Env], kind: str, mean_s: float, spread: float,
                 max_s: float = 0.0, seed: int = 0) -> Callable[[], Env]:
    """`make_env` wrapped so every environment it makes waits simulated latencies.

    Each environment draws from its own generator, seeded by (seed, creation index), so a run's
    latencies do not depend on which episode happens to step first.
    """
    if kind == "none":
        return make_env
    if kind not in LATENCY_KINDS:
        raise ValueError(f"unknown latency kind {kind!r}; use one of {LATENCY_KINDS}")
    counter = iter(range(1 << 62))
    lock = threading.Lock()

    def make() -> Env:
        with lock:
            index = next(counter)
        rng = random.Random(seed * 1_000_003 + index)
        return LatencyEnv(make_env(), lambda: draw_latency(kind, mean_s, spread, max_s, rng))

    return make


def training_env_factory(cfg: Any, make_env: Callable[[], Env], seed: int | None = None) -> Callable[[], Env]:
    """`make_env` with the simulated tool latency `cfg.env` configures (training episodes only),
    drawn from a generator seeded by `seed` (default `cfg.seed`)."""
    e = cfg.env
    return with_latency(make_env, e.tool_latency, e.tool_latency_s, e.tool_latency_spread,
                        e.tool_latency_max_s, seed=cfg.seed if seed is None else seed)
