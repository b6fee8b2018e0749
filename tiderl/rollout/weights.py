"""Weight fingerprints: how the trainer checks that a weight sync arrived."""

from __future__ import annotations

from collections.abc import Mapping

import torch


def weights_checksum(state_dict: Mapping[str, torch.Tensor]) -> float:
    """A cheap fingerprint of a set of weights: sum over tensors of sum(x) + sum(x**2) in float64.

    Keys are visited in sorted order so the float sum is reproducible. Trainer and engine can
    each compute it on their side to check a weight sync; the squares make a sign flip visible.
    """
    total = 0.0
    for name in sorted(state_dict):
        values = state_dict[name].detach().to(torch.float64)
        total += float(values.sum()) + float(values.square().sum())
    return total
