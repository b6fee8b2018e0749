"""Weight fingerprints: how the trainer checks that a weight sync arrived."""

from __future__ import annotations

from collections.abc import Mapping

import torch


def weights_checksum(state_dict: Mapping[str, torch.Tensor]) -> float:
    """A cheap fingerprint of a set of weights: sum over tensors of sum(x) + sum(x**2) in float64.

    Keys are visited in sorted order and each tensor is summed by NumPy (pairwise, one thread),
    so the result does not depend on the thread that computes it: torch's parallel reduction
    adds in an order that follows the calling thread's torch thread count, and the trainer and
    the engine compute this on threads with different budgets. Trainer and engine each compute
    it on their side to check a weight sync; the squares make a sign flip visible.
    """
    total = 0.0
    for name in sorted(state_dict):
        values = state_dict[name].detach().to(device="cpu", dtype=torch.float64).numpy()
        total += float(values.sum()) + float((values * values).sum())
    return total
