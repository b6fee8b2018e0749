"""Penalties for failed tool use (`env.tool_error_penalty`, `env.no_call_penalty`): dense signals
for a model that rarely succeeds yet, each a named reward part. Formulas, and why they help only
beside an outcome signal that is not all 0: docs/algorithms.md, "Reward shaping before the step".
Evaluation never shapes: held-out success stays the environment's.
"""

from __future__ import annotations

import dataclasses

from tiderl.types import Trajectory

__all__ = ["NO_CALL_PART", "PART", "penalize_no_call_turns", "penalize_tool_errors"]

PART = "tool_errors"
NO_CALL_PART = "no_call"


def penalize_tool_errors(trajectory: Trajectory, penalty: float, max_errors: int) -> Trajectory:
    """A copy of `trajectory` with reward_parts["tool_errors"] = -penalty * min(errors, max_errors)
    added to its reward. Raises ValueError when the environment does not report tool errors, or
    when the trajectory was already penalised."""
    errors = _count(trajectory, PART, "tool_errors",
                    f"env.tool_error_penalty={penalty} needs env_info['tool_errors'] from the environment, "
                    f"but task {trajectory.task_id!r} reported none. Fix: set env.tool_error_penalty=0, or "
                    "report the count of failed calls as env_info['tool_errors'] in the environment's final info")
    return _with_part(trajectory, PART, -penalty * min(errors, float(max_errors)))


def penalize_no_call_turns(trajectory: Trajectory, penalty: float) -> Trajectory:
    """A copy of `trajectory` with reward_parts["no_call"] = -penalty * no_call_turns added to its
    reward. Raises ValueError when env_info has no "no_call_turns" (the trajectory did not come
    from tiderl's agent loop), or when the trajectory was already penalised."""
    turns = _count(trajectory, NO_CALL_PART, "no_call_turns",
                   f"env.no_call_penalty={penalty} needs env_info['no_call_turns'], which tiderl's agent "
                   f"loop counts, but task {trajectory.task_id!r} has none (a trajectory recorded elsewhere, "
                   "e.g. by `tiderl serve`). Fix: set env.no_call_penalty=0")
    return _with_part(trajectory, NO_CALL_PART, -penalty * turns)


def _count(trajectory: Trajectory, part: str, key: str, missing: str) -> float:
    """env_info[key] as a number; ValueError(`missing`) without one, or when `part` is already
    in the trajectory's reward parts."""
    if part in trajectory.reward_parts:
        raise ValueError(f"trajectory {trajectory.task_id!r} already has a '{part}' reward part: "
                         "penalise each trajectory once")
    value = trajectory.env_info.get(key)
    if not isinstance(value, (int, float)):
        raise ValueError(missing)
    return float(value)


def _with_part(trajectory: Trajectory, part: str, value: float) -> Trajectory:
    return dataclasses.replace(trajectory, reward=trajectory.reward + value,
                               reward_parts={**trajectory.reward_parts, part: value})
