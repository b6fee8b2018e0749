"""Held-out evaluation: run the policy on tasks it never trained on and report success."""

from __future__ import annotations

import math
from typing import Any, Callable

from tiderl.agent.loop import run_episodes
from tiderl.config import EnvConfig, RolloutConfig
from tiderl.envs.protocol import Env, Task
from tiderl.rollout.base import Engine, SamplingParams
from tiderl.types import Trajectory


def sampling_params(rollout: RolloutConfig, eos_id: int, greedy: bool) -> SamplingParams:
    """Rollout sampling (or greedy decoding), stopping at the end-of-turn token."""
    return SamplingParams(
        temperature=0.0 if greedy else rollout.temperature,
        top_p=1.0 if greedy else rollout.top_p,
        max_new_tokens=rollout.max_new_tokens,
        stop_token_ids=[eos_id],
    )


def summarize(trajectories: list[Trajectory]) -> dict[str, Any]:
    """Success (with its standard error), F1, turns, tokens and tool errors of a set of episodes.

    The standard error is the binomial one, sqrt(p (1 - p) / n).
    """
    n = len(trajectories)
    if n == 0:
        return {"n": 0}
    success = [float(t.env_info.get("success", 0.0)) for t in trajectories]
    p = sum(success) / n
    out: dict[str, Any] = {
        "n": n,
        "success": p,
        "stderr": math.sqrt(p * (1 - p) / n),
        "f1": sum(float(t.env_info.get("f1", 0.0)) for t in trajectories) / n,
        "reward": sum(t.reward for t in trajectories) / n,
        "turns": sum(t.num_turns for t in trajectories) / n,
        "tokens": sum(len(t.tokens) for t in trajectories) / n,
        "action_tokens": sum(t.num_action_tokens for t in trajectories) / n,
        "tool_errors": sum(float(t.env_info.get("tool_errors", 0)) for t in trajectories) / n,
        "stop_reasons": _counts(t.stop_reason for t in trajectories),
    }
    return out


def evaluate(
    engine: Engine,
    tokenizer: Any,
    make_env: Callable[[], Env],
    tasks: list[Task],
    env_cfg: EnvConfig,
    rollout: RolloutConfig,
    greedy: bool,
) -> dict[str, Any]:
    """Run every task once and summarise, overall and per number of hops."""
    params = sampling_params(rollout, tokenizer.eos_token_id, greedy)
    trajectories = run_episodes(engine, tokenizer, make_env, tasks, params,
                                max_turns=env_cfg.max_turns,
                                max_total_tokens=env_cfg.max_total_tokens)
    result = summarize(trajectories)
    result["mode"] = "greedy" if greedy else f"sampled(T={rollout.temperature})"
    by_hops: dict[str, list[Trajectory]] = {}
    for task, traj in zip(tasks, trajectories):
        by_hops.setdefault(str(task.meta.get("hops", "?")), []).append(traj)
    result["by_hops"] = {h: summarize(ts) for h, ts in sorted(by_hops.items())}
    return result


def _counts(items: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for item in items:
        counts[item] = counts.get(item, 0) + 1
    return counts


def format_table(rows: list[tuple[str, dict[str, Any]]]) -> str:
    """A plain-text table of evaluation results, one row per (label, result)."""
    header = f"{'eval':<22}{'n':>5}{'success':>10}{'± se':>8}{'f1':>7}{'turns':>7}{'tokens':>8}"
    lines = [header, "-" * len(header)]
    for label, r in rows:
        lines.append(
            f"{label:<22}{r['n']:>5}{r['success']:>10.3f}{r['stderr']:>8.3f}{r['f1']:>7.3f}"
            f"{r['turns']:>7.2f}{r['tokens']:>8.1f}"
        )
    return "\n".join(lines)
