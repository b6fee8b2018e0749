"""What a set of episodes achieved: success with its standard error, pass@k, and the batch
means logged at every training step (docs/metrics.md, docs/evaluation.md)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

from tiderl.types import Trajectory


def summarize(trajectories: list[Trajectory]) -> dict[str, Any]:
    """Success (with its standard error), F1, turns, tokens, tool errors and turns without a
    tool call (that got the environment's nudge) of a set of episodes.

    The standard error is the binomial one, sqrt(p (1 - p) / n); tool_errors_stderr is that of
    the mean tool errors an episode (so that a before/after difference has an interval).
    """
    n = len(trajectories)
    if n == 0:
        return {"n": 0}
    success = [float(t.env_info.get("success", 0.0)) for t in trajectories]
    p = sum(success) / n
    tool_errors = [float(t.env_info.get("tool_errors", 0)) for t in trajectories]
    return {
        "n": n,
        "success": p,
        "stderr": math.sqrt(p * (1 - p) / n),
        "f1": sum(float(t.env_info.get("f1", 0.0)) for t in trajectories) / n,
        "reward": sum(t.reward for t in trajectories) / n,
        "turns": sum(t.num_turns for t in trajectories) / n,
        "tokens": sum(len(t.tokens) for t in trajectories) / n,
        "action_tokens": sum(t.num_action_tokens for t in trajectories) / n,
        "tool_errors": sum(tool_errors) / n,
        "tool_errors_stderr": _stderr(tool_errors),
        "no_call_turns": sum(float(t.env_info.get("no_call_turns", 0)) for t in trajectories) / n,
        "stop_reasons": dict(Counter(t.stop_reason for t in trajectories)),
    }


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimate of one task from `n` samples of which `c` succeeded:
    1 - C(n - c, k) / C(n, k), the chance that k samples drawn without replacement from the n
    hold at least one success. With n = k it is 1 when any sample succeeded, else 0."""
    if not 1 <= k <= n or not 0 <= c <= n:
        raise ValueError(f"pass_at_k needs 1 <= k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def summarize_samples(groups: Sequence[Sequence[Trajectory]], k: int = 1) -> dict[str, Any]:
    """`summarize` over every episode of `groups` (one group of samples per task), with:

    - n: the number of tasks; episodes: the number of episodes; samples_per_task;
    - success: the mean over all episodes (with one sample per task, the fraction of tasks
      solved; with more, the unbiased pass@1);
    - stderr: the standard error of that mean over tasks, sqrt(mean_i (s_i - p)^2 / n) with s_i
      task i's success rate (the binomial sqrt(p (1 - p) / n) with one sample per task), so
      samples of one task are not counted as independent evidence; tool_errors_stderr likewise,
      over each task's mean tool errors;
    - f1: None when no episode reports one (the DB environment scores no F1);
    - when k > 1: pass_k = k, pass_at_k = the mean over tasks of `pass_at_k(n_i, c_i, k)` and
      pass_at_k_stderr, its standard error over tasks (same formula as stderr).
    Every group must hold at least k episodes.
    """
    groups = [list(g) for g in groups if g]
    episodes = [t for g in groups for t in g]
    out = summarize(episodes)
    if not episodes:
        return out
    rates = [sum(float(t.env_info.get("success", 0.0)) for t in g) / len(g) for g in groups]
    errors = [sum(float(t.env_info.get("tool_errors", 0)) for t in g) / len(g) for g in groups]
    out.update(n=len(groups), episodes=len(episodes), samples_per_task=max(len(g) for g in groups),
               stderr=_stderr(rates), tool_errors_stderr=_stderr(errors))
    if not any("f1" in t.env_info for t in episodes):
        out["f1"] = None
    if k > 1:
        values = []
        for g in groups:
            if len(g) < k:
                raise ValueError(f"pass@{k} needs at least {k} samples per task; task {g[0].task_id!r} has {len(g)}")
            values.append(pass_at_k(len(g), sum(bool(t.env_info.get("success")) for t in g), k))
        out.update(pass_k=k, pass_at_k=sum(values) / len(values), pass_at_k_stderr=_stderr(values))
    return out


def _stderr(values: Sequence[float]) -> float:
    """Standard error of the mean of per-task values: sqrt(mean (v - mean)^2 / n)."""
    n = len(values)
    mean = sum(values) / n
    return math.sqrt(sum((v - mean) ** 2 for v in values) / n / n)


def rollout_metrics(trajectories: list[Trajectory]) -> dict[str, float]:
    """Batch means of what the episodes of one training step achieved (see docs/metrics.md)."""
    s = summarize(trajectories)
    out = {
        "reward": s["reward"], "success": s["success"], "f1": s["f1"],
        "episode/turns": s["turns"], "episode/tokens": s["tokens"],
        "episode/action_tokens": s["action_tokens"], "episode/tool_errors": s["tool_errors"],
        "episode/no_call_turns": s["no_call_turns"],
    }
    for reason, count in s["stop_reasons"].items():
        out[f"episode/stop_{reason}"] = count / s["n"]
    return out
