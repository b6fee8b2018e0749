"""Sampling-side helpers of DAPO (Yu et al. 2025, arXiv 2503.14476), as pure functions: dynamic
sampling (`informative_groups`, `has_signal`: a group whose rewards are all equal has zero advantage
under any group baseline) and the soft overlong penalty (`overlong_penalty`). docs/algorithms.md,
"Sampling-side shaping", has the formulas.
"""

from __future__ import annotations

import torch

from tiderl.algos.advantages import group_stats

__all__ = ["informative_groups", "overlong_penalty"]


def informative_groups(rewards: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """keep[B]: True where the trajectory's group has rewards that are not all equal.

    A group of one is never informative (there is nothing to compare with). Equality is exact
    (float64 std == 0), as rewards are usually 0/1 outcomes.
    """
    _, std, _ = group_stats(rewards, group_index)
    return std > 0


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer: int, factor: float = 1.0
                     ) -> torch.Tensor:
    """factor * R_len(l), float32 [B], <= 0: R_len(l) = 0 for l <= max_length - buffer,
    ((max_length - buffer) - l) / buffer up to max_length, -1 beyond (l: action tokens)."""
    if buffer <= 0 or max_length <= buffer:
        raise ValueError(f"need 0 < buffer < max_length; got buffer={buffer}, "
                         f"max_length={max_length}")
    length = lengths.double()
    start = max_length - buffer
    soft = (start - length) / buffer
    r = torch.where(length <= start, torch.zeros_like(length),
                    torch.where(length <= max_length, soft, torch.full_like(length, -1.0)))
    return (factor * r).float()


def has_signal(rewards: "list[float] | tuple[float, ...]") -> bool:
    """DAPO's dynamic-sampling test for one group's rewards, as plain numbers: the group teaches
    something iff its rewards are not all equal (`informative_groups` is the batched form)."""
    return len(set(rewards)) > 1
