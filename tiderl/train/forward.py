"""Forward passes that the losses need: per-token log-probs of the policy, values of the critic.

Both return `[B, T]` tensors aligned with the tokens: position t holds the quantity for token t
(the log-prob of sampling token t; the value of the state just before token t). Position 0 has
no predecessor and holds 0.
"""

from __future__ import annotations

import torch


def token_logprobs(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of every token under `model` (temperature 1), and optionally the entropy.

    Uses gather minus logsumexp rather than a full log_softmax so that large vocabularies do not
    need a second `[B, T, V]` tensor.
    """
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    logits = logits[:, :-1].float()
    targets = input_ids[:, 1:]
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    out = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)
    out[:, 1:] = picked - lse
    entropy = None
    if with_entropy:
        with torch.no_grad():
            probs = torch.softmax(logits, dim=-1)
            ent = lse - (probs * logits).sum(-1)
            entropy = torch.zeros_like(out)
            entropy[:, 1:] = ent
    return out, entropy


def token_values(
    critic: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """The critic's V(state before token t) at every position t."""
    v = critic(input_ids=input_ids, attention_mask=attention_mask)
    out = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)
    out[:, 1:] = v[:, :-1].float()
    return out
