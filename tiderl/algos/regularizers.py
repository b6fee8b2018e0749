"""Regularisers: KL to a frozen reference model, and the entropy bonus.

KL estimators (Schulman, "Approximating KL Divergence", 2020), with x_t = log pi(a_t|s_t) - log
pi_ref(a_t|s_t): k1 = x, k2 = x^2 / 2, k3 = exp(-x) - 1 + x (clamped: `k3_clamped`). How they enter
training (`algo.kl_in_reward`) and why the k3 clamp bounds value and gradient: docs/algorithms.md,
"Regularisers".
"""

from __future__ import annotations

import math

import torch

__all__ = ["KL_ESTIMATORS", "K3_CLAMP", "kl_estimate", "k3_clamped", "kl_reward_penalty", "entropy_from_logits"]

KL_ESTIMATORS = ("k1", "k2", "k3")
K3_CLAMP = 10.0  # the default of algo.kl_k3_clamp


def k3_clamped(x: torch.Tensor, clamp: float = K3_CLAMP) -> torch.Tensor:
    """min(k3(max(x, x_low)), clamp) with k3(x) = exp(-x) - 1 + x and x_low = -log(2 clamp + 2):
    k3 itself wherever k3(x) <= clamp, else `clamp` with zero gradient; |value| <= clamp and
    |gradient| <= clamp + log(2 clamp + 2) (docs/algorithms.md)."""
    if not clamp > 0 or math.isinf(clamp):
        raise ValueError(f"the k3 clamp must be a positive finite number, got {clamp}; use e.g. {K3_CLAMP}")
    x = torch.clamp(x, min=-math.log(2.0 * clamp + 2.0))
    return torch.clamp(torch.expm1(-x) + x, max=clamp)  # expm1 keeps small |x| accurate


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, action_mask: torch.Tensor,
                estimator: str = "k3", k3_clamp: float = K3_CLAMP) -> torch.Tensor:
    """Per-token KL estimate (k1, k2 or k3 of the module docstring) on action tokens, 0 elsewhere; k3 clamped at
    `k3_clamp` (`k3_clamped`).

    Differentiable in `logprobs`; `ref_logprobs` is treated as a constant. Off-action inputs are
    replaced by 0 before any arithmetic (padding may hold -inf).
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; use one of k1, k2, k3")
    is_action = action_mask > 0
    zeros = torch.zeros_like(logprobs)
    x = torch.where(is_action, logprobs, zeros) - torch.where(
        is_action, ref_logprobs.detach().to(logprobs.dtype), zeros)
    if estimator == "k1":
        k = x
    elif estimator == "k2":
        k = 0.5 * x * x
    else:
        k = k3_clamped(x, k3_clamp)
    return torch.where(is_action, k, zeros)


def kl_reward_penalty(token_rewards: torch.Tensor, old_logprobs: torch.Tensor,
                      ref_logprobs: torch.Tensor, action_mask: torch.Tensor, kl_coef: float,
                      estimator: str = "k1", k3_clamp: float = K3_CLAMP) -> tuple[torch.Tensor, torch.Tensor]:
    """r'_t = r_t - kl_coef * k(old_logprobs, ref_logprobs)_t on action tokens (r elsewhere).

    `old_logprobs` are the log-probs of the policy that sampled the data (the engine's, or the
    trainer's recompute); everything here is a constant (no gradient). Returns (r', kl[B, T]).
    """
    with torch.no_grad():
        kl = kl_estimate(old_logprobs.detach(), ref_logprobs, action_mask, estimator, k3_clamp)
        return token_rewards - kl_coef * kl.to(token_rewards.dtype), kl


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """H = logsumexp(z) - sum_v softmax(z)_v * z_v over the last dim; differentiable.

    Computed in float32 or wider. [..., V] -> [...].
    """
    z = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(dim=-1)
