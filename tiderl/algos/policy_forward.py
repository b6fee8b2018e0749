"""Forward passes the generic algorithm step needs beyond `tiderl.train.forward`.

- `policy_logprobs`: per-token log-probs plus entropy that can carry gradient (for the entropy
  bonus), for the padded layout (2-D attention mask) and the packed layout (block-diagonal 4-D
  mask and position ids restarting per trajectory, `train.batching.PackedBatch`).
- `critic_values`: the critic's per-token values in either layout.

Alignment as in `train.forward`: position t holds the quantity for token t (the log-prob of
sampling token t, the value of the state just before it). The first token of every sequence
has no predecessor in its own sequence and holds 0: position 0 of a padded row, and every
position whose position id is 0 in a packed row (there the logits would belong to the previous
trajectory's last token).
"""

from __future__ import annotations

import torch

from tiderl.algos.regularizers import entropy_from_logits

__all__ = ["policy_logprobs", "critic_values"]


def _sequence_starts(input_ids: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
    starts = torch.zeros(input_ids.shape, dtype=torch.bool, device=input_ids.device)
    starts[:, 0] = True
    if position_ids is not None:
        starts |= position_ids == 0
    return starts


def policy_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    entropy: str = "none",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(token t | tokens < t) at every position t, and optionally the entropy there.

    logprob_t = z_{t-1}[x_t] - logsumexp(z_{t-1}) with z the logits (float32), 0 at sequence
    starts. entropy: "none" (returns None), "detached" (computed without gradient, for metrics)
    or "grad" (differentiable, for an entropy bonus); entropy_t = H(softmax(z_{t-1})).

    `attention_mask` is the usual [B, T] mask for the padded layout, or the boolean
    [R, 1, L, L] block-diagonal causal mask of a packed batch (`PackedBatch.attention_mask()`),
    in which case `position_ids` must be given too.
    """
    if entropy not in ("none", "detached", "grad"):
        raise ValueError(f"entropy must be 'none', 'detached' or 'grad'; got {entropy!r}")
    if attention_mask.dim() == 4 and position_ids is None:
        raise ValueError("a packed (4-D) attention mask needs position_ids restarting per sequence")
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   use_cache=False).logits
    logits = logits[:, :-1].float()
    targets = input_ids[:, 1:]
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    starts = _sequence_starts(input_ids, position_ids)
    zero = torch.zeros(input_ids.shape[0], 1, dtype=torch.float32, device=input_ids.device)
    out = torch.cat([zero, picked - lse], dim=1)
    out = torch.where(starts, torch.zeros_like(out), out)
    ent = None
    if entropy != "none":
        with torch.set_grad_enabled(entropy == "grad" and torch.is_grad_enabled()):
            ent = torch.cat([zero, entropy_from_logits(logits)], dim=1)
            ent = torch.where(starts, torch.zeros_like(ent), ent)
    return out, ent


def critic_values(
    critic: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """V(state before token t) at every position t (0 at sequence starts), float32.

    Padded layout: calls `critic(input_ids, attention_mask)` (a `train.critic.ValueModel`).
    Packed layout: a ValueModel's forward takes no position ids, so its `backbone` and `head`
    are called directly with the 4-D mask and the restarting position ids.
    """
    if position_ids is None:
        v = critic(input_ids=input_ids, attention_mask=attention_mask)
    else:
        hidden = critic.backbone(input_ids=input_ids, attention_mask=attention_mask,
                                 position_ids=position_ids, use_cache=False).last_hidden_state
        v = critic.head(hidden.to(critic.head.weight.dtype)).squeeze(-1)
    zero = torch.zeros(input_ids.shape[0], 1, dtype=torch.float32, device=input_ids.device)
    out = torch.cat([zero, v[:, :-1].float()], dim=1)
    return torch.where(_sequence_starts(input_ids, position_ids), torch.zeros_like(out), out)
