"""Regularisers: KL to a frozen reference model, and the entropy bonus.

KL estimators (Schulman, "Approximating KL Divergence", 2020). For tokens sampled from the policy
pi, with log-ratio x_t = log pi(a_t|s_t) - log pi_ref(a_t|s_t), the per-token estimates of
KL(pi || pi_ref) are

    k1 = x                    unbiased, can be negative per token
    k2 = x^2 / 2              biased, >= 0, low variance
    k3 = exp(-x) - 1 + x      unbiased, >= 0, low variance (GRPO's choice)

They enter training in one of two ways (`algo.kl_in_reward`):
- as a loss term, kl_coef * aggregate(k(logprobs, ref_logprobs)), differentiated through the
  current log-probs (GRPO, DeepSeekMath);
- as a per-token reward penalty, r_t - kl_coef * k(old_logprobs, ref_logprobs), a constant that
  the advantage estimator sees (PPO for RLHF, REINFORCE++).

Entropy of the policy at a position with logits z: H = logsumexp(z) - sum_v softmax(z)_v z_v,
which equals -sum_v p_v log p_v without forming log p for every vocabulary entry.
"""

from __future__ import annotations

import torch

__all__ = ["KL_ESTIMATORS", "kl_estimate", "kl_reward_penalty", "entropy_from_logits"]

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, action_mask: torch.Tensor,
                estimator: str = "k3") -> torch.Tensor:
    """Per-token KL estimate (module formulas) on action tokens, 0 elsewhere.

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
        k = torch.expm1(-x) + x  # exp(-x) - 1 + x; expm1 keeps small |x| accurate
    return torch.where(is_action, k, zeros)


def kl_reward_penalty(token_rewards: torch.Tensor, old_logprobs: torch.Tensor,
                      ref_logprobs: torch.Tensor, action_mask: torch.Tensor, kl_coef: float,
                      estimator: str = "k1") -> tuple[torch.Tensor, torch.Tensor]:
    """r'_t = r_t - kl_coef * k(old_logprobs, ref_logprobs)_t on action tokens (r elsewhere).

    `old_logprobs` are the log-probs of the policy that sampled the data (the engine's, or the
    trainer's recompute); everything here is a constant (no gradient). Returns (r', kl[B, T]).
    """
    with torch.no_grad():
        kl = kl_estimate(old_logprobs.detach(), ref_logprobs, action_mask, estimator)
        return token_rewards - kl_coef * kl.to(token_rewards.dtype), kl


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """H = logsumexp(z) - sum_v softmax(z)_v * z_v over the last dim; differentiable.

    Computed in float32 or wider. [..., V] -> [...].
    """
    z = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(dim=-1)
