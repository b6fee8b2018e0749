"""Forward passes that the losses need: per-token log-probs (and entropies) of the policy, values of
the critic.

Both return right-padded `[B, T]` float32 tensors aligned with the tokens: position t holds the
quantity for token t (the log-prob of sampling token t; the value of the state just before token
t). Position 0 has no predecessor and holds 0.
"""

from __future__ import annotations

import torch

from tiderl.algos.regularizers import entropy_from_logits

__all__ = ["token_logprobs", "token_values"]


def _shift(x: torch.Tensor) -> torch.Tensor:
    """[B, T - 1] quantities of positions 1..T-1 -> [B, T] with 0 at position 0."""
    return torch.cat([torch.zeros_like(x[:, :1]), x], dim=1)


def token_logprobs(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
    with_entropy: bool = False, entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(token t | tokens < t) under `model` (temperature 1) at every position t, and with
    `with_entropy` the entropy H(softmax(z_{t-1})) there (None otherwise).

    The entropy carries no gradient (a metric) unless `entropy_grad` (for an entropy bonus), which
    implies `with_entropy`. Uses gather minus logsumexp rather than a full log_softmax so that
    large vocabularies do not need a second `[B, T, V]` tensor.
    """
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    logits = logits[:, :-1].float()
    picked = logits.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    logprobs = _shift(picked - torch.logsumexp(logits, dim=-1))
    entropy = None
    if with_entropy or entropy_grad:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = _shift(entropy_from_logits(logits))
    return logprobs, entropy


def token_values(
    critic: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """The critic's V(state before token t) at every position t (a `train.critic.ValueModel`)."""
    v = critic(input_ids=input_ids, attention_mask=attention_mask)
    return _shift(v[:, :-1].float())
