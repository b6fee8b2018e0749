"""Mixed precision of the trainer: bf16 autocast over fp32 master weights (`train.autocast`)."""

from __future__ import annotations

import contextlib
from typing import ContextManager

import torch


def trainer_autocast(autocast: str, device: str) -> ContextManager[object]:
    """The context a training step runs in: `torch.autocast` to bfloat16 on `device`'s type
    (matmuls in bf16, weights, gradients and AdamW state stay in their own dtype, fp32 by
    default; log-probs and losses are computed in fp32 by `train.forward`), or nothing."""
    if autocast == "none":
        return contextlib.nullcontext()
    if autocast != "bfloat16":
        raise ValueError(f"train.autocast: {autocast!r} is not one of none, bfloat16")
    return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)
