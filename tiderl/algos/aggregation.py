"""Loss aggregation: how per-token losses become one scalar, for any layout and any micro-batching.

Every policy loss of the generic step first produces a per-token loss `l[b, t]` (0 off the action
tokens), then one of the modes below turns it into a scalar. Each mode is written as

    loss = (1 / normalizer) * sum_{action t} w_t * l_t

with a per-token weight `w_t` that depends only on the token's own sequence, and a `normalizer`
that is computed ONCE over the whole optimizer batch (`loss_normalizer`). A sequence is never
split across micro-batches, so the micro-batch losses add up exactly to the full-batch loss and the
accumulated gradient equals the full-batch gradient, for every mode (the convention of
`losses.py`, extended beyond the token mean).

| mode                      | w_t     | normalizer | meaning                                 |
| ------------------------- | ------- | ---------- | --------------------------------------- |
| `token-mean`              | 1       | N          | every token weighs the same (DAPO)      |
| `seq-mean-token-sum`      | 1       | S          | mean over sequences of the token sum    |
| `seq-mean-token-mean`     | 1 / n_s | S          | mean over sequences of the token mean   |
| `seq-mean-token-sum-norm` | 1       | S * L      | Dr.GRPO: token sum over a fixed budget  |

N counts the action tokens of the whole batch, S the sequences that have at least one action token
(a sequence without any has no loss to average), n_s the action tokens of sequence s.

Layout: tensors are `[R, L]`. A token's sequence is given by `seq_ids[R, L]` (long); when it is
None, every row is one sequence (the right-padded layout of `train.batching.collate`). Packed rows
(several trajectories in one row, `train.batching.pack_trajectories`) pass their `seq_ids`, and
the same formulas then give the same numbers as the padded layout.
"""

from __future__ import annotations

import torch

__all__ = [
    "LOSS_AGG_MODES",
    "row_seq_ids",
    "sequence_token_counts",
    "sequence_mean",
    "loss_normalizer",
    "token_weights",
    "aggregate",
]

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                  "seq-mean-token-sum-norm")


def _check_mode(mode: str) -> None:
    if mode not in LOSS_AGG_MODES:
        raise ValueError(
            f"unknown loss aggregation {mode!r}; use one of {', '.join(LOSS_AGG_MODES)}")


def row_seq_ids(action_mask: torch.Tensor) -> torch.Tensor:
    """seq_ids of the padded layout: seq_ids[b, t] = b (each row is one sequence)."""
    rows, length = action_mask.shape
    return torch.arange(rows, device=action_mask.device).unsqueeze(1).expand(rows, length)


def _dense_ids(action_mask: torch.Tensor, seq_ids: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(is_action, dense id per token in [0, S), S) over the sequences that own action tokens.

    Sequence ids may be any integers (global trajectory indices, -1 on padding); they are mapped
    to 0..S-1 by torch.unique so the per-sequence sums below are dense. Non-action tokens get id 0;
    callers only read ids where is_action holds.
    """
    is_action = action_mask > 0
    ids = row_seq_ids(action_mask) if seq_ids is None else seq_ids
    if ids.shape != action_mask.shape:
        raise ValueError(f"seq_ids {tuple(ids.shape)} must match action_mask "
                         f"{tuple(action_mask.shape)}")
    uniq, inverse = torch.unique(ids[is_action], return_inverse=True)
    dense = torch.zeros_like(ids)
    dense[is_action] = inverse
    return is_action, dense, int(uniq.numel())


def sequence_token_counts(action_mask: torch.Tensor, seq_ids: torch.Tensor | None = None,
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """n_{s(t)} at every token: the action-token count of the token's sequence (0 elsewhere)."""
    is_action, dense, n_seq = _dense_ids(action_mask, seq_ids)
    counts = torch.zeros(n_seq, dtype=dtype, device=action_mask.device)
    counts.index_add_(0, dense[is_action], torch.ones_like(dense[is_action], dtype=dtype))
    out = torch.zeros(action_mask.shape, dtype=dtype, device=action_mask.device)
    out[is_action] = counts[dense[is_action]]
    return out


def sequence_mean(x: torch.Tensor, action_mask: torch.Tensor,
                  seq_ids: torch.Tensor | None = None) -> torch.Tensor:
    """At every action token, the mean of x over the action tokens of its sequence (0 elsewhere).

        out[t] = (1 / n_{s(t)}) * sum_{action u in s(t)} x[u]

    Differentiable in x. GSPO's sequence log-ratio is `sequence_mean(logprobs - old_logprobs)`.
    Entries of x off the action tokens are never read (they may be inf).
    """
    is_action, dense, n_seq = _dense_ids(action_mask, seq_ids)
    safe = torch.where(is_action, x, torch.zeros_like(x))
    sums = torch.zeros(n_seq, dtype=x.dtype, device=x.device).index_add(
        0, dense[is_action], safe[is_action])
    counts = torch.zeros(n_seq, dtype=x.dtype, device=x.device).index_add(
        0, dense[is_action], torch.ones_like(safe[is_action]))
    means = sums / counts.clamp(min=1)
    return torch.where(is_action, means[dense], torch.zeros_like(safe))


def loss_normalizer(action_mask: torch.Tensor, mode: str, seq_ids: torch.Tensor | None = None,
                    norm_length: int = 0) -> float:
    """The normaliser of `mode` over the WHOLE optimizer batch (see the module table).

    token-mean: N = sum of action_mask > 0; seq-mean-token-sum / seq-mean-token-mean: S = number of
    sequences with an action token; seq-mean-token-sum-norm: S * norm_length (norm_length > 0).
    Returns 0.0 for an empty batch (the caller skips the step).
    """
    _check_mode(mode)
    if mode == "token-mean":
        return float((action_mask > 0).sum().item())
    _, _, n_seq = _dense_ids(action_mask, seq_ids)
    if mode == "seq-mean-token-sum-norm":
        if norm_length <= 0:
            raise ValueError("seq-mean-token-sum-norm needs norm_length > 0 (a fixed token budget "
                             "per sequence, e.g. the generation limit); set algo.loss_agg_length")
        return float(n_seq * norm_length)
    return float(n_seq)


def token_weights(action_mask: torch.Tensor, mode: str, seq_ids: torch.Tensor | None = None,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """w_t of `mode`: 1 / n_{s(t)} for seq-mean-token-mean, 1 otherwise; 0 off the action tokens."""
    _check_mode(mode)
    if mode == "seq-mean-token-mean":
        counts = sequence_token_counts(action_mask, seq_ids, dtype)
        return torch.where(counts > 0, 1.0 / counts.clamp(min=1), torch.zeros_like(counts))
    return (action_mask > 0).to(dtype)


def aggregate(token_loss: torch.Tensor, action_mask: torch.Tensor, mode: str,
              normalizer: float | int | torch.Tensor, seq_ids: torch.Tensor | None = None
              ) -> torch.Tensor:
    """(1 / normalizer) * sum_{action t} w_t * token_loss_t, with w_t from `token_weights`.

    `normalizer` must come from `loss_normalizer(..., mode, ...)` over the whole optimizer batch,
    not the micro-batch: that is what makes micro-batch losses add up to the batch loss.
    Off-action entries of token_loss are excluded with torch.where (they may be anything finite or
    not).
    """
    if float(normalizer) <= 0:
        raise ValueError(f"normalizer must be > 0 (from loss_normalizer over the whole batch); "
                         f"got {float(normalizer)}")
    w = token_weights(action_mask, mode, seq_ids, token_loss.dtype)
    # Select before multiplying: inf * 0 would be nan even where the weight is 0.
    safe = torch.where(w > 0, token_loss, torch.zeros_like(token_loss))
    return (safe * w).sum() / normalizer
