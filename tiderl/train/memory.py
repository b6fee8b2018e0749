"""Trading compute for memory in training passes (`train.activation_checkpointing`, docs/scale.md):
each decoder layer of the policy and of the critic's backbone keeps only its input for the
backward pass and runs its forward again there. Gradients are the same up to float rounding.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch

from tiderl.train.forward import attention_implementation


def _replay_with_the_same_attention(config: Any) -> tuple[contextlib.AbstractContextManager[None], ...]:
    """Checkpoint contexts (forward, recompute): the recompute runs under the attention kernel
    the forward ran under, which packed training has switched back by then (docs/scale.md)."""
    return contextlib.nullcontext(), attention_implementation(config, config._attn_implementation)


def enable_activation_checkpointing(model: torch.nn.Module) -> torch.nn.Module:
    """Turn on activation checkpointing of `model`'s decoder layers (in place; returns `model`).

    `model` is a Hugging Face causal LM, a peft wrapper of one, or a tiderl `ValueModel` (its
    backbone is checkpointed). Non-reentrant checkpointing, so frozen inputs (LoRA's frozen
    embeddings) need no `requires_grad` workaround. It acts in training mode with gradients
    only: engines and no-grad passes run the layers once, as before. Raises a ValueError naming
    the fix for a model that does not support it."""
    inner = getattr(model, "backbone", model)  # a ValueModel's backbone; peft wrappers pass the calls through
    enable = getattr(inner, "activation_checkpointing_enable", None)  # transformers >= 5
    keyword = "activation_checkpointing_kwargs"
    if enable is None:
        enable, keyword = getattr(inner, "gradient_checkpointing_enable", None), "gradient_checkpointing_kwargs"
    config = getattr(inner, "config", None)
    if enable is None or config is None or not getattr(inner, "supports_gradient_checkpointing", False):
        raise ValueError(f"train.activation_checkpointing: {type(inner).__name__} does not support activation "
                         "checkpointing (not a Hugging Face model with checkpointable layers). Fix: set "
                         "train.activation_checkpointing=false")
    # A partial, not a closure: copies of the model (deepcopy, Ray's pickling) then point it at
    # their own config.
    enable(**{keyword: {"use_reentrant": False,
                        "context_fn": functools.partial(_replay_with_the_same_attention, config)}})
    return model
