"""Loss aggregation: how per-token losses become one scalar, for any micro-batching.

Every mode is loss = (1 / normalizer) * sum_{action t} w_t * l_t, with w_t depending only on the
token's own sequence (`token_weights`) and the normalizer computed ONCE over the whole optimizer
batch (`loss_normalizer`), so micro-batch losses add up to the batch loss. The table of modes is
in docs/algorithms.md ("Loss aggregation"). Tensors are `[B, T]`, right-padded, one sequence a row
(`train.batching.collate`).
"""

from __future__ import annotations

import torch

__all__ = ["LOSS_AGG_MODES", "sequence_token_counts", "sequence_mean", "loss_normalizer", "token_weights",
           "aggregate"]

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                  "seq-mean-token-sum-norm")


def _check_mode(mode: str) -> None:
    if mode not in LOSS_AGG_MODES:
        raise ValueError(
            f"unknown loss aggregation {mode!r}; use one of {', '.join(LOSS_AGG_MODES)}")


def sequence_token_counts(action_mask: torch.Tensor, dtype: torch.dtype = torch.float32
                          ) -> torch.Tensor:
    """n_{s(t)} at every token: the action-token count of the token's sequence (0 elsewhere)."""
    is_action = action_mask > 0
    counts = is_action.to(dtype).sum(dim=1, keepdim=True).expand(action_mask.shape)
    return torch.where(is_action, counts, torch.zeros_like(counts))


def sequence_mean(x: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """At every action token, the mean of x over the action tokens of its sequence (0 elsewhere).

        out[t] = (1 / n_{s(t)}) * sum_{action u in s(t)} x[u]

    Differentiable in x. GSPO's sequence log-ratio is `sequence_mean(logprobs - old_logprobs)`.
    Entries of x off the action tokens are never read (they may be inf).
    """
    is_action = action_mask > 0
    safe = torch.where(is_action, x, torch.zeros_like(x))
    counts = is_action.to(x.dtype).sum(dim=1, keepdim=True).clamp(min=1)
    means = safe.sum(dim=1, keepdim=True) / counts
    return torch.where(is_action, means.expand_as(safe), torch.zeros_like(safe))


def loss_normalizer(action_mask: torch.Tensor, mode: str, norm_length: int = 0) -> float:
    """The normaliser of `mode` over the WHOLE optimizer batch (docs/algorithms.md has the table).

    token-mean: N = sum of action_mask > 0; seq-mean-token-sum / seq-mean-token-mean: S = number of
    sequences with an action token; seq-mean-token-sum-norm: S * norm_length (norm_length > 0).
    Returns 0.0 for an empty batch (the caller skips the step).
    """
    _check_mode(mode)
    if mode == "token-mean":
        return float((action_mask > 0).sum().item())
    n_seq = int((action_mask > 0).any(dim=1).sum().item())
    if mode == "seq-mean-token-sum-norm":
        if norm_length <= 0:
            raise ValueError("seq-mean-token-sum-norm needs norm_length > 0 (a fixed token budget "
                             "per sequence, e.g. the generation limit); set algo.loss_agg_length")
        return float(n_seq * norm_length)
    return float(n_seq)


def token_weights(action_mask: torch.Tensor, mode: str, dtype: torch.dtype = torch.float32
                  ) -> torch.Tensor:
    """w_t of `mode`: 1 / n_{s(t)} for seq-mean-token-mean, 1 otherwise; 0 off the action tokens."""
    _check_mode(mode)
    if mode == "seq-mean-token-mean":
        counts = sequence_token_counts(action_mask, dtype)
        return torch.where(counts > 0, 1.0 / counts.clamp(min=1), torch.zeros_like(counts))
    return (action_mask > 0).to(dtype)


def aggregate(token_loss: torch.Tensor, action_mask: torch.Tensor, mode: str,
              normalizer: float | int | torch.Tensor) -> torch.Tensor:
    """(1 / normalizer) * sum_{action t} w_t * token_loss_t, with w_t from `token_weights`.

    `normalizer` must come from `loss_normalizer(..., mode, ...)` over the whole optimizer batch,
    not the micro-batch: that is what makes micro-batch losses add up to the batch loss.
    Off-action entries of token_loss are excluded with torch.where (they may be anything finite or
    not).
    """
    if float(normalizer) <= 0:
        raise ValueError(f"normalizer must be > 0 (from loss_normalizer over the whole batch); "
                         f"got {float(normalizer)}")
    w = token_weights(action_mask, mode, token_loss.dtype)
    # Select before multiplying: inf * 0 would be nan even where the weight is 0.
    safe = torch.where(w > 0, token_loss, torch.zeros_like(token_loss))
    return (safe * w).sum() / normalizer
