"""Policy and value losses as pure tensor functions.

Conventions: right-padded `[B, T]` tensors aligned with `Trajectory.tokens`, each row one
trajectory; log-probs of token t at position t; `action_mask` 1.0 on sampled tokens.
`logprobs` are the current weights' (with gradient); every other input is a constant. Inputs are
replaced by torch.where on non-action tokens BEFORE any arithmetic, so -inf padding can produce
neither nan losses nor nan gradients.

Policy losses are per token: each returns `(token_loss[B, T], metrics)`, the loss of every action
token and 0 on the others, which `aggregation.aggregate` turns into a scalar.

Ratios: r_t = exp(logprobs_t - old_t), where `old` is whatever the caller chose as the policy the
ratio is taken against: the engine's behaviour log-probs, or the trainer's recomputed (proximal)
log-probs. Clip bounds are [1 - eps_low, 1 + eps_high]; eps_low = 1 removes the lower bound.

Metrics are plain floats over the action tokens passed in (`_ratio_metrics`: ratio_mean,
ratio_max, ratio_min, approx_kl, num_action_tokens) plus each loss's own, listed on it; with no
action token the statistics are 0.0.

The losses `algo.policy_loss` names (`tiderl.algos.registry`) have one signature,
`fn(PolicyLossInputs, AlgoConfig) -> (token_loss, metrics)`: thin adapters at the end of this
module that read their hyperparameters from the config and name their metrics as logged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tiderl.algos.aggregation import sequence_mean

if TYPE_CHECKING:
    from tiderl.config import AlgoConfig

__all__ = ["PolicyLossInputs", "cispo_loss", "cispo_token_loss", "decoupled_ppo_loss",
           "decoupled_ppo_token_loss", "dis_loss", "dis_token_loss", "gspo_loss", "gspo_token_loss",
           "ppo_loss", "ppo_token_loss", "value_loss"]


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


def _frac(flags: torch.Tensor, n: float) -> float:
    return flags.sum().item() / max(n, 1.0)


def _masked(is_action: torch.Tensor, x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return torch.where(is_action, x.detach().to(like.dtype), torch.zeros_like(like))


def ppo_token_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
    dual_clip_c: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped surrogate (Schulman et al. 2017) with asymmetric "clip-higher" bounds (DAPO,
    Yu et al. 2025) and optional dual clip (Ye et al. 2020, arXiv 1912.09729):

        s_t = min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t)
        dual clip (c > 1), only where A_t < 0:  s_t = max(s_t, c A_t)
        token_loss_t = -s_t

    Without the dual clip a token with A < 0 and a huge ratio keeps the gradient -r A grad log pi
    however large r grows; the dual clip caps its objective at c A (constant, no gradient) once
    r > c. dual_clip_c = 0 turns it off.

    Metrics: clip_frac (tokens whose gradient the ordinary clip cuts: A > 0 and r > 1 + eps_high,
    or A < 0 and r < 1 - eps_low), dual_clip_frac (A < 0 and r > c), and the ratio metrics.
    """
    _check_eps(eps_low, eps_high)
    if dual_clip_c != 0.0 and dual_clip_c <= 1.0:
        raise ValueError(f"dual_clip_c must be > 1 (or 0 = off); got {dual_clip_c}")
    is_action = action_mask > 0
    zeros = torch.zeros_like(logprobs)
    log_ratio = torch.where(is_action, logprobs, zeros) - _masked(is_action, old_logprobs, logprobs)
    adv = _masked(is_action, advantages, logprobs)
    ratio = log_ratio.exp()
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv)
    dual = torch.zeros_like(is_action)
    if dual_clip_c > 0:
        bound = dual_clip_c * adv
        dual = is_action & (adv < 0) & (surrogate < bound)
        surrogate = torch.where(adv < 0, torch.maximum(surrogate, bound), surrogate)
    # adv is 0 off the action tokens, so the surrogate is already 0 there.
    token_loss = -surrogate

    metrics = _ratio_metrics(log_ratio, is_action)
    r = ratio.detach()
    cut = is_action & (((adv > 0) & (r > 1.0 + eps_high)) | ((adv < 0) & (r < 1.0 - eps_low)))
    metrics["clip_frac"] = _frac(cut, metrics["num_action_tokens"])
    metrics["dual_clip_frac"] = _frac(dual, metrics["num_action_tokens"])
    return token_loss, metrics


def decoupled_ppo_token_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
    weight_cap: float = 0.0,
    dual_clip_c: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Decoupled PPO (Hilton et al. 2022, arXiv 2110.00641; used asynchronously by AReaL, Fu et
    al. 2025, arXiv 2505.24298).

    The behaviour policy (the engine that sampled, possibly several versions ago) and the
    proximal policy (the trainer's weights at the start of this step, recomputed by the trainer)
    play separate roles: the trust region is taken around the proximal policy, and the importance
    weight pi_prox / pi_behav corrects for sampling by the behaviour policy:

        w_t = exp(proximal_t - behavior_t),   capped: w_t = min(w_t, weight_cap) if weight_cap > 0
        token_loss_t = w_t * ppo_token_loss(logprobs, proximal_logprobs, ...)_t

    w_t is a constant (no gradient). With proximal = behaviour (fully on-policy, no mismatch)
    w = 1 and this is PPO.

    Metrics: PPO's (ratios against the proximal policy) plus behavior_weight_mean,
    behavior_weight_max and behavior_weight_capped_frac (tokens where the cap bit).
    """
    if weight_cap < 0:
        raise ValueError(f"weight_cap must be >= 0 (0 = no cap); got {weight_cap}")
    is_action = action_mask > 0
    prox = _masked(is_action, proximal_logprobs, logprobs)
    weight = (prox - _masked(is_action, behavior_logprobs, logprobs)).exp()
    capped = torch.zeros_like(is_action)
    if weight_cap > 0:
        capped = is_action & (weight > weight_cap)
        weight = weight.clamp(max=weight_cap)
    weight = torch.where(is_action, weight, torch.zeros_like(weight))
    token_loss, metrics = ppo_token_loss(logprobs, prox, advantages, action_mask, eps_low,
                                         eps_high, dual_clip_c)
    n = metrics["num_action_tokens"]
    metrics["behavior_weight_mean"] = weight.sum().item() / max(n, 1.0)
    metrics["behavior_weight_max"] = weight.max().item() if n else 0.0
    metrics["behavior_weight_capped_frac"] = _frac(capped, n)
    return weight * token_loss, metrics


def cispo_token_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO (MiniMax-M1, arXiv 2506.13585): clip the importance weight, never drop a token.

        token_loss_t = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) * A_t * logprobs_t

    so every token's gradient is -clip(r) A grad log pi: a token whose ratio left the band still
    learns, with a bounded weight (PPO and DIS would give it no gradient). MiniMax sets no lower
    bound: eps_low = 1.

    Metrics: clip_frac (tokens whose weight was clipped, either side) and the ratio metrics.
    """
    _check_eps(eps_low, eps_high)
    is_action = action_mask > 0
    zeros = torch.zeros_like(logprobs)
    safe_lp = torch.where(is_action, logprobs, zeros)
    log_ratio = safe_lp.detach() - _masked(is_action, old_logprobs, logprobs)
    ratio = log_ratio.exp()
    weight = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    adv = _masked(is_action, advantages, logprobs)
    token_loss = -(weight * adv) * safe_lp

    metrics = _ratio_metrics(log_ratio, is_action)
    clipped = is_action & ((ratio > 1.0 + eps_high) | (ratio < 1.0 - eps_low))
    metrics["clip_frac"] = _frac(clipped, metrics["num_action_tokens"])
    return token_loss, metrics


def gspo_token_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO (Zheng et al. 2025, arXiv 2507.18071): the ratio and the clip are per SEQUENCE.

        s_i = exp( (1 / n_i) sum_{action t in i} (logprobs_t - old_t) )     (length-normalised)
        GSPO objective of sequence i:  min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)

    Written per token in the "GSPO-token" form: every action token t of sequence i carries

        s_it = sg(s_i) * exp(logprobs_t - sg(logprobs_t))        (value s_i, grad s_i grad log pi_t)
        token_loss_t = -min(s_it A_t, clip(s_it, 1 - eps_low, 1 + eps_high) A_t)

    When A_t = A_i on every token of the sequence (outcome-level advantages), the gradient of
    `seq-mean-token-mean` aggregation of these token losses equals the gradient of
    (1/S) sum_i -min(s_i A_i, clip(s_i) A_i), and the value is the same: the sequence-level
    GSPO loss. The clip decision is the sequence's (all its tokens share s_i). Per-token
    advantages (e.g. GAE) give GSPO-token. The paper's clip range is (3e-4, 4e-4).

    Each row is one sequence. Metrics: clip_frac (action tokens whose sequence's clip cuts the gradient: A > 0 and
    s > 1 + eps_high, or A < 0 and s < 1 - eps_low), seq_ratio_mean/max/min (over tokens), and the
    token ratio metrics.
    """
    _check_eps(eps_low, eps_high)
    is_action = action_mask > 0
    zeros = torch.zeros_like(logprobs)
    log_ratio = torch.where(is_action, logprobs, zeros) - _masked(is_action, old_logprobs, logprobs)
    seq_log_ratio = sequence_mean(log_ratio.detach(), action_mask)
    # The value is exp(seq_log_ratio) exactly (x - sg(x) = 0); the gradient is per token.
    s = torch.exp(seq_log_ratio + log_ratio - log_ratio.detach())
    adv = _masked(is_action, advantages, logprobs)
    surrogate = torch.minimum(s * adv, s.clamp(1.0 - eps_low, 1.0 + eps_high) * adv)
    token_loss = torch.where(is_action, -surrogate, zeros)

    metrics = _ratio_metrics(log_ratio, is_action)
    sd = s.detach()
    cut = is_action & (((adv > 0) & (sd > 1.0 + eps_high)) | ((adv < 0) & (sd < 1.0 - eps_low)))
    n = metrics["num_action_tokens"]
    metrics["clip_frac"] = _frac(cut, n)
    seq_vals = sd[is_action].double()
    metrics["seq_ratio_mean"] = seq_vals.mean().item() if n else 0.0
    metrics["seq_ratio_max"] = seq_vals.max().item() if n else 0.0
    metrics["seq_ratio_min"] = seq_vals.min().item() if n else 0.0
    return token_loss, metrics


def dis_token_loss(
    logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """SAO's direct double-sided importance sampling (SAO component 2, arXiv 2607.07508).

    r_t = exp(logprobs_t - behavior_logprobs_t), the ratio of the current policy to the rollout
    engine that sampled the token (no recomputed old policy). A token is kept iff

        1 - eps_low < r_t < 1 + eps_high        (strict on both sides)

        token_loss_t = -sg(r_t) * A_t * logprobs_t   if kept, else 0

    so under `token-mean` a kept token's gradient is -r_t * A_t * grad log pi / N (the same as
    PPO's inside its band), and a dropped token has exactly zero loss and zero gradient whatever
    the sign of A_t. PPO, by contrast, only cuts the side the advantage pushes towards.

    The band test is done in log space, log(1 - eps_low) < logprobs - behavior < log(1 + eps_high),
    with both bounds computed in float64 and rounded to the tensor's dtype: exp() of a log-prob
    difference does not reproduce a ratio bit-exactly, so comparing ratios would make the
    boundary cases (r exactly 1 - eps_low or 1 + eps_high) depend on rounding. In log space a
    log-ratio equal to log(1 - eps_low) is reliably dropped. eps_low = 1 means no lower bound.

    Metrics: dis_masked_frac (fraction of action tokens outside the band), dis_low_frac /
    dis_high_frac (below / above it) and the ratio metrics.
    """
    _check_eps(eps_low, eps_high)
    is_action = action_mask > 0
    zeros = torch.zeros_like(logprobs)
    log_ratio = torch.where(is_action, logprobs.detach(), zeros) - _masked(
        is_action, behavior_logprobs, logprobs)
    lower = -math.inf if eps_low >= 1.0 else math.log(1.0 - eps_low)
    upper = math.log(1.0 + eps_high)
    below = is_action & (log_ratio <= lower)
    above = is_action & (log_ratio >= upper)
    keep = is_action & ~below & ~above
    ratio = torch.where(keep, log_ratio.exp(), zeros)
    adv = torch.where(keep, advantages.detach().to(logprobs.dtype), zeros)
    token_loss = -(ratio * adv) * torch.where(keep, logprobs, zeros)

    metrics = _ratio_metrics(log_ratio, is_action)
    n = metrics["num_action_tokens"]
    metrics["dis_low_frac"] = _frac(below, n)
    metrics["dis_high_frac"] = _frac(above, n)
    metrics["dis_masked_frac"] = metrics["dis_low_frac"] + metrics["dis_high_frac"]
    return token_loss, metrics


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
    old_values, in a direction that reduced its error, gets no gradient. `normalizer` is the
    number of action tokens of the WHOLE optimizer batch, so micro-batch losses add up to the
    batch's token mean.

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


# --------------------------------------------------------------------------------------------
# The losses `algo.policy_loss` names (tiderl.algos.registry), with one signature.


@dataclass
class PolicyLossInputs:
    """One micro-batch's inputs to a policy loss, all [b, t].

    logprobs: current weights' log-probs (with gradient).
    old_logprobs: what the ratio is taken against: the engine's behaviour log-probs, or the
        trainer's recompute (`registry.recomputes_old_logprobs`; decoupled_ppo's proximal policy).
    behavior_logprobs: the engine's log-probs as sampled.
    advantages: from the estimator, over the whole batch (whitened if configured).
    action_mask: 1 on sampled tokens.
    """

    logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    behavior_logprobs: torch.Tensor
    advantages: torch.Tensor
    action_mask: torch.Tensor


def _named(metrics: dict[str, float], prefix: str) -> dict[str, float]:
    """Metric keys as logged: "<prefix>/<name>" (a "<prefix>_" already in the name is dropped);
    num_action_tokens is bookkeeping for the caller, not a metric."""
    return {f"{prefix}/{k.removeprefix(prefix + '_')}": v for k, v in metrics.items()
            if k != "num_action_tokens"}


def dis_loss(inp: PolicyLossInputs, cfg: AlgoConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """`dis_token_loss` against the behaviour log-probs. SAO's metrics keep their names:
    dis/masked_frac, dis/low_frac, dis/high_frac, dis/ratio_mean|max|min, dis/approx_kl."""
    loss, m = dis_token_loss(inp.logprobs, inp.behavior_logprobs, inp.advantages, inp.action_mask,
                             cfg.eps_low, cfg.eps_high)
    return loss, _named(m, "dis")


def ppo_loss(inp: PolicyLossInputs, cfg: AlgoConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """`ppo_token_loss` against `old_logprobs` (clip eps_low/eps_high, dual_clip_c)."""
    loss, m = ppo_token_loss(inp.logprobs, inp.old_logprobs, inp.advantages, inp.action_mask,
                             cfg.eps_low, cfg.eps_high, cfg.dual_clip_c)
    return loss, _named(m, "policy")


def decoupled_ppo_loss(inp: PolicyLossInputs, cfg: AlgoConfig
                       ) -> tuple[torch.Tensor, dict[str, float]]:
    """`decoupled_ppo_token_loss` with `old_logprobs` as the proximal policy."""
    loss, m = decoupled_ppo_token_loss(inp.logprobs, inp.old_logprobs, inp.behavior_logprobs,
                                       inp.advantages, inp.action_mask, cfg.eps_low, cfg.eps_high,
                                       cfg.behavior_weight_cap, cfg.dual_clip_c)
    return loss, _named(m, "policy")


def cispo_loss(inp: PolicyLossInputs, cfg: AlgoConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """`cispo_token_loss` against `old_logprobs`."""
    loss, m = cispo_token_loss(inp.logprobs, inp.old_logprobs, inp.advantages, inp.action_mask,
                               cfg.eps_low, cfg.eps_high)
    return loss, _named(m, "policy")


def gspo_loss(inp: PolicyLossInputs, cfg: AlgoConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """`gspo_token_loss` against `old_logprobs`."""
    loss, m = gspo_token_loss(inp.logprobs, inp.old_logprobs, inp.advantages, inp.action_mask,
                              cfg.eps_low, cfg.eps_high)
    return loss, _named(m, "policy")
