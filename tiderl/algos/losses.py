"""Policy and value losses as pure tensor functions.

Conventions (shared with `advantages.py`): right-padded `[B, T]` tensors aligned with
`Trajectory.tokens`; log-probs are already aligned (log-prob of token t at position t);
`action_mask` is 1.0 on sampled tokens.

Normaliser: every loss is a SUM over the action tokens of the (micro-)batch divided by a
caller-given `normalizer`, which should be the number of action tokens in the WHOLE optimizer
batch. Summing the losses (and so the gradients) of the micro-batches then gives exactly the
token mean over the batch; tokens dropped by a clip or band still count in the denominator
(SAO, arXiv 2607.07508: token mean over all action tokens, masked ones included).

Each loss returns `(loss, metrics)`. Metrics are plain floats over the action tokens of the
tensors passed in, plus `num_action_tokens`, so the caller can weight micro-batch metrics by it.
When there is no action token, the statistics are 0.0 and `num_action_tokens` is 0.

Masked-out positions may hold anything (e.g. -inf log-probs on padding): inputs are replaced by
torch.where BEFORE any arithmetic, so neither the forward value nor a gradient can become nan.
"""

from __future__ import annotations


import torch

__all__ = ["dis_policy_loss", "ppo_clip_policy_loss", "value_loss"]


def _check_normalizer(normalizer: float | int | torch.Tensor) -> None:
    if float(normalizer) <= 0:
        raise ValueError(
            f"normalizer must be > 0 (the number of action tokens in the whole optimizer batch); "
            f"got {float(normalizer)}"
        )


def _check_eps(eps_low: float, eps_high: float) -> None:
    if not (0.0 < eps_low <= 1.0) or not eps_high > 0.0:
        raise ValueError(
            f"need 0 < eps_low <= 1 and eps_high > 0 (SAO uses (0.3, 5.0) or (0.8, 3.0)); "
            f"got eps_low={eps_low}, eps_high={eps_high}"
        )


def _ratio_metrics(log_ratio: torch.Tensor, is_action: torch.Tensor) -> dict[str, float]:
    """ratio_mean/max/min and approx_kl over action tokens (log_ratio = log pi_theta - log pi_old).

    approx_kl is the k3 estimator of KL(pi_old || pi_theta) from tokens sampled by pi_old:
    mean of (r - 1) - log r, which is >= 0 per token and unbiased.
    """
    n = int(is_action.sum().item())
    if n == 0:
        return {"ratio_mean": 0.0, "ratio_max": 0.0, "ratio_min": 0.0, "approx_kl": 0.0,
                "num_action_tokens": 0.0}
    lr = log_ratio.detach()[is_action].double()
    ratio = lr.exp()
    return {
        "ratio_mean": ratio.mean().item(),
        "ratio_max": ratio.max().item(),
        "ratio_min": ratio.min().item(),
        "approx_kl": ((ratio - 1.0) - lr).mean().item(),
        "num_action_tokens": float(n),
    }


def dis_policy_loss(
    logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
    normalizer: float | int | torch.Tensor,
) -> tuple[torch.Tensor, dict[str, float]]:
    """SAO's direct double-sided importance sampling loss (SAO component 2, arXiv 2607.07508).

    r_t = exp(logprobs_t - behavior_logprobs_t), the ratio of the current policy to the rollout
    engine that sampled the token (no recomputed old policy). A token is kept iff

        1 - eps_low < r_t < 1 + eps_high        (strict on both sides)

    and the loss is

        loss = -(1 / normalizer) * sum_{t kept} sg(r_t) * A_t * logprobs_t

    so a kept token's gradient is -r_t * A_t * grad log pi / normalizer (the same as PPO's inside
    its band), and a dropped token has exactly zero loss and zero gradient whatever the sign of
    A_t. PPO, by contrast, only cuts the side the advantage pushes towards.

    The band test is done in log space, log(1 - eps_low) < logprobs - behavior < log(1 + eps_high),
    with both bounds computed in float64 and rounded to the tensor's dtype: exp() of a log-prob
    difference does not reproduce a ratio bit-exactly, so comparing ratios would make the
    boundary cases (r exactly 1 - eps_low or 1 + eps_high) depend on rounding. In log space a
    log-ratio equal to log(1 - eps_low) is reliably dropped. eps_low = 1 means no lower bound.

    Args:
        logprobs: [B, T] log-probs under the current weights (requires grad).
        behavior_logprobs: [B, T] log-probs stored by the rollout engine (treated as constants).
        advantages: [B, T] (treated as constants).
        action_mask: [B, T], 1 on sampled tokens.
        eps_low, eps_high: band half-widths, 0 < eps_low <= 1, eps_high > 0.
        normalizer: number of action tokens in the whole optimizer batch.
    Returns:
        loss (0-dim tensor) and metrics: dis_masked_frac (fraction of action tokens outside the
        band), dis_low_frac / dis_high_frac (below / above it), ratio_mean, ratio_max, ratio_min,
        approx_kl (k3, see `_ratio_metrics`), num_action_tokens.
    """
    _check_normalizer(normalizer)
    # The per-token form lives with the other token losses; imported here to avoid a cycle.
    from tiderl.algos.policy_losses import dis_token_loss

    token_loss, metrics = dis_token_loss(logprobs, behavior_logprobs, advantages, action_mask,
                                         eps_low, eps_high)
    return token_loss.sum() / normalizer, metrics


def ppo_clip_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
    normalizer: float | int | torch.Tensor,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped surrogate with asymmetric clip (Schulman et al. 2017; "clip-higher" bounds).

    r_t = exp(logprobs_t - old_logprobs_t),

        loss = (1 / normalizer) * sum_{action t} -min(r_t * A_t, clip(r_t, 1 - eps_low, 1 + eps_high) * A_t)

    The gradient is cut only where the clip is active on the side the advantage pushes:
    A_t > 0 and r_t > 1 + eps_high, or A_t < 0 and r_t < 1 - eps_low. A token with A_t < 0 and a
    huge ratio still gets the full gradient -r_t * A_t * grad log pi (unlike `dis_policy_loss`).
    `old_logprobs` may be the rollout engine's (behavior) or the trainer's recomputed (proximal)
    log-probs; either is treated as a constant.

    Returns:
        loss (0-dim tensor) and metrics: clip_frac (fraction of action tokens whose gradient the
        clip cuts, as defined above), ratio_mean, ratio_max, ratio_min, approx_kl,
        num_action_tokens.
    """
    _check_eps(eps_low, eps_high)
    _check_normalizer(normalizer)
    is_action = action_mask > 0
    zeros = torch.zeros_like(logprobs)
    log_ratio = torch.where(is_action, logprobs - old_logprobs.detach(), zeros)
    adv = torch.where(is_action, advantages.detach().to(logprobs.dtype), zeros)
    ratio = log_ratio.exp()
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv
    # adv is 0 off the action tokens, so those contribute exactly 0 without another mask.
    loss = -torch.minimum(unclipped, clipped).sum() / normalizer

    metrics = _ratio_metrics(log_ratio, is_action)
    r = ratio.detach()
    cut = is_action & (((adv > 0) & (r > 1.0 + eps_high)) | ((adv < 0) & (r < 1.0 - eps_low)))
    metrics["clip_frac"] = cut.sum().item() / max(metrics["num_action_tokens"], 1.0)
    return loss, metrics


def value_loss(
    values: torch.Tensor,
    returns: torch.Tensor,
    action_mask: torch.Tensor,
    normalizer: float | int | torch.Tensor,
    old_values: torch.Tensor | None = None,
    clip_eps: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Squared-error critic loss, optionally PPO-style clipped.

    Unclipped:  loss = (1 / normalizer) * sum_{action t} 0.5 * (V_t - R_t)^2
    Clipped (old_values and clip_eps both given; SAO does not say whether it clips, so this is an
    option):
        V_clip_t = old_t + clip(V_t - old_t, -clip_eps, clip_eps)
        loss = (1 / normalizer) * sum_{action t} 0.5 * max((V_t - R_t)^2, (V_clip_t - R_t)^2)

    The max keeps the pessimistic term, so a value that moved more than clip_eps away from
    old_values, in a direction that reduced its error, gets no gradient.

    Returns:
        loss (0-dim tensor) and metrics: value_mean, return_mean, value_clip_frac (fraction of
        action tokens where the clipped term is strictly the larger one; 0.0 when not clipping),
        num_action_tokens.
    """
    if (old_values is None) != (clip_eps is None):
        raise ValueError("value clipping needs both old_values and clip_eps (or neither)")
    if clip_eps is not None and clip_eps <= 0:
        raise ValueError(f"clip_eps must be > 0; got {clip_eps}")
    _check_normalizer(normalizer)
    is_action = action_mask > 0
    zeros = torch.zeros_like(values)
    v = torch.where(is_action, values, zeros)
    ret = torch.where(is_action, returns.detach().to(values.dtype), zeros)
    err = (v - ret) ** 2
    clipped_active = torch.zeros_like(is_action)
    if old_values is not None and clip_eps is not None:
        old = torch.where(is_action, old_values.detach().to(values.dtype), zeros)
        v_clip = old + (v - old).clamp(-clip_eps, clip_eps)
        err_clip = (v_clip - ret) ** 2
        clipped_active = is_action & (err_clip > err)
        err = torch.maximum(err, err_clip)
    loss = 0.5 * err.sum() / normalizer

    n = int(is_action.sum().item())
    denom = max(n, 1)
    metrics = {
        "value_mean": v.detach().sum().item() / denom,
        "return_mean": ret.sum().item() / denom,
        "value_clip_frac": clipped_active.sum().item() / denom,
        "num_action_tokens": float(n),
    }
    return loss, metrics
