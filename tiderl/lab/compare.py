"""Comparing training runs fairly: paired differences with confidence intervals, time to a
target accuracy, and the tokens the trainer's passes process (docs/metrics.md, "Comparing runs").

Pure functions over numbers and configs; the learning benchmark (`benchmarks/learning.py`) is
their main user.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from tiderl.algos import registry

# Two-sided 95 % quantiles of Student's t, by degrees of freedom (1..30); above 30 the normal's.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
         2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
         2.052, 2.048, 2.045, 2.042)


def t_quantile_95(df: int) -> float:
    """The 0.975 quantile of Student's t with `df` degrees of freedom (df >= 1)."""
    if df < 1:
        raise ValueError(f"t_quantile_95 needs df >= 1, got {df}")
    return _T975[df - 1] if df <= len(_T975) else 1.960


def mean_ci(values: Sequence[float]) -> dict[str, float]:
    """Mean, standard error (sample sd / sqrt(n)) and the two-sided 95 % t interval of `values`.
    With one value the standard error and the interval half-width are NaN (unknown, not zero)."""
    n = len(values)
    if n == 0:
        raise ValueError("mean_ci needs at least one value")
    mean = sum(values) / n
    if n == 1:
        return {"n": 1, "mean": mean, "se": math.nan, "lo": math.nan, "hi": math.nan}
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    se = sd / math.sqrt(n)
    half = t_quantile_95(n - 1) * se
    return {"n": n, "mean": mean, "se": se, "lo": mean - half, "hi": mean + half}


def paired_difference(a: dict[Any, float], b: dict[Any, float]) -> dict[str, float]:
    """`mean_ci` of a[k] - b[k] over the keys (seeds) both have: a paired comparison, so the
    seed-to-seed spread that both runs share (task order, initial weights) cancels."""
    keys = sorted(set(a) & set(b))
    if not keys:
        raise ValueError("paired_difference: the two sets of runs share no seed")
    return mean_ci([a[k] - b[k] for k in keys])


def verdict(ci: dict[str, float], higher: str = "SAO higher", lower: str = "SAO lower",
            neither: str = "no difference shown") -> str:
    """The learning benchmark's rule, fixed before its runs: `higher` when the 95 % interval of a
    difference (a `mean_ci`) lies above 0, `lower` when it lies below 0, else `neither`; "too few
    seeds" without an interval."""
    if math.isnan(ci["se"]):
        return "too few seeds"
    return higher if ci["lo"] > 0 else lower if ci["hi"] < 0 else neither


def first_reaching(curve: Sequence[dict[str, float]], target: float, key: str = "success",
                   at: str = "train_s") -> float:
    """The `at` value (e.g. training seconds, generated tokens) of the first point of `curve`
    whose `key` is >= `target`; inf when no point reaches it (time to accuracy)."""
    for point in curve:
        if point[key] >= target:
            return float(point[at])
    return math.inf


def mean_over_tokens(curve: Sequence[dict[str, float]], key: str = "success",
                     at: str = "generated_tokens") -> float:
    """The mean of `key` over a run: the trapezoid area under (`at`, `key`) from the first point to
    the last, divided by that span (the area under a held-out curve per generated token). One
    point (or a zero span) gives that point's value."""
    xs, ys = [float(p[at]) for p in curve], [float(p[key]) for p in curve]
    if not xs:
        raise ValueError("mean_over_tokens needs at least one point")
    span = xs[-1] - xs[0]
    if span <= 0:
        return ys[-1]
    return sum((x1 - x0) * (y0 + y1) / 2 for x0, x1, y0, y1 in zip(xs, xs[1:], ys, ys[1:])) / span


def trainer_token_passes(algo: Any, sequence_tokens: int, train_actor: bool) -> dict[str, int]:
    """Tokens the trainer's passes process in one step of the algorithm `algo` (an AlgoConfig) on
    trajectories of `sequence_tokens` tokens in all (prompt, turns and observations; padding not
    counted). `fwd_bwd`: tokens through a forward and backward pass (the critic's
    `critic_updates` updates, the actor's `actor_updates` when it trains); `fwd`: tokens through a
    no-grad forward pass (critic values before the update, again after it with
    `advantage_values=after`, reference log-probs with a KL term, recomputed old log-probs),
    whether the asynchronous buffer ran them ahead or the step itself."""
    fwd_bwd = fwd = 0
    if registry.needs_critic(algo):
        fwd += sequence_tokens * (2 if algo.advantage_values == "after" else 1)
        fwd_bwd += sequence_tokens * algo.critic_updates
    if registry.needs_ref(algo):
        fwd += sequence_tokens
    if registry.recomputes_old_logprobs(algo):
        fwd += sequence_tokens
    if train_actor:
        fwd_bwd += sequence_tokens * algo.actor_updates
    return {"fwd_bwd": fwd_bwd, "fwd": fwd}
