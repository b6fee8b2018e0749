"""Critic-free advantage estimators: group baselines (GRPO, Dr.GRPO, RLOO) and REINFORCE++.

Outcome-level estimators work on one scalar reward per trajectory, `rewards[B]`, and a group index
`group_index[B]` (long, 0..G-1) that says which trajectories are rollouts of the same prompt
(`Trajectory.group_id`, turned into indices by `group_index_of`). They return one advantage per
trajectory; `broadcast_to_tokens` puts it on every action token of the trajectory.

Group statistics over group g with n_g members (population mean, Bessel-corrected std):

    mean_g = (1 / n_g) sum_{j in g} r_j
    std_g  = sqrt( sum_{j in g} (r_j - mean_g)^2 / (n_g - 1) ),   std_g = 0 when n_g = 1

A group of one (or a group whose rewards are all equal) has no relative signal: every estimator
below gives it advantage 0, which is exactly what its formula says for n_g = 1.

Sources: GRPO, Shao et al. 2024 (DeepSeekMath, arXiv 2402.03300); Dr.GRPO, Liu et al. 2025
("Understanding R1-Zero-Like Training", arXiv 2503.20783); RLOO, Ahmadian et al. 2024 ("Back to
Basics", arXiv 2402.14740); REINFORCE++, Hu 2025 (arXiv 2501.03262). Each formula is written out
on its function.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from tiderl.algos.advantages import masked_whiten, skip_observation_gae

__all__ = [
    "group_index_of",
    "group_stats",
    "grpo_advantages",
    "dr_grpo_advantages",
    "rloo_advantages",
    "broadcast_to_tokens",
    "discounted_returns",
    "reinforce_pp_advantages",
]


def group_index_of(group_ids: Sequence[Hashable]) -> torch.Tensor:
    """Dense group indices in order of first appearance: ["b", "a", "b"] -> [0, 1, 0]."""
    seen: dict[Hashable, int] = {}
    return torch.tensor([seen.setdefault(g, len(seen)) for g in group_ids], dtype=torch.long)


def _check(rewards: torch.Tensor, group_index: torch.Tensor) -> None:
    if rewards.dim() != 1 or group_index.shape != rewards.shape:
        raise ValueError(f"rewards and group_index must both be [B]; got {tuple(rewards.shape)} "
                         f"and {tuple(group_index.shape)}")


def group_stats(rewards: torch.Tensor, group_index: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per trajectory: (mean_g, std_g, n_g) of its group, as defined in the module docstring.

    Computed in float64 so that a group of equal rewards has std exactly 0.
    """
    _check(rewards, group_index)
    r = rewards.detach().double()
    n_groups = int(group_index.max().item()) + 1 if rewards.numel() else 0
    count = torch.zeros(n_groups, dtype=torch.float64, device=r.device).index_add(
        0, group_index, torch.ones_like(r))
    total = torch.zeros_like(count).index_add(0, group_index, r)
    mean = total / count.clamp(min=1)
    centred = r - mean[group_index]
    sq = torch.zeros_like(count).index_add(0, group_index, centred * centred)
    std = torch.where(count > 1, (sq / (count - 1).clamp(min=1)).sqrt(), torch.zeros_like(sq))
    return mean[group_index], std[group_index], count[group_index]


def grpo_advantages(rewards: torch.Tensor, group_index: torch.Tensor, eps: float = 1e-6
                    ) -> torch.Tensor:
    """GRPO (outcome supervision): A_i = (r_i - mean_g) / (std_g + eps).

    eps keeps a zero-variance group finite (its numerators are all 0, so its advantages are 0).
    Returns float32 [B].
    """
    mean, std, _ = group_stats(rewards, group_index)
    return ((rewards.double() - mean) / (std + eps)).float()


def dr_grpo_advantages(rewards: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """Dr.GRPO: A_i = r_i - mean_g (no division by the group std, which biases towards groups
    that are nearly all right or all wrong). Returns float32 [B]."""
    mean, _, _ = group_stats(rewards, group_index)
    return (rewards.double() - mean).float()


def rloo_advantages(rewards: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """RLOO: A_i = r_i - (1 / (n_g - 1)) sum_{j in g, j != i} r_j = n_g / (n_g - 1) (r_i - mean_g).

    The baseline of each sample is the mean of the OTHER samples of its group, so it is
    independent of the sample itself (unbiased). n_g = 1 has no other sample: A_i = 0.
    Returns float32 [B].
    """
    mean, _, count = group_stats(rewards, group_index)
    scale = torch.where(count > 1, count / (count - 1).clamp(min=1), torch.zeros_like(count))
    return (scale * (rewards.double() - mean)).float()


def broadcast_to_tokens(seq_advantages: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """A[b, t] = seq_advantages[b] on action tokens, 0 elsewhere (float32 [B, T])."""
    if seq_advantages.shape != (action_mask.shape[0],):
        raise ValueError(f"seq_advantages must be [B] = ({action_mask.shape[0]},); got "
                         f"{tuple(seq_advantages.shape)}")
    adv = seq_advantages.float().unsqueeze(1).expand(action_mask.shape)
    return torch.where(action_mask > 0, adv, torch.zeros_like(adv))


def discounted_returns(token_rewards: torch.Tensor, action_mask: torch.Tensor, gamma: float
                       ) -> torch.Tensor:
    """G_i = r_i + gamma * G_j over action tokens (j = the next action token of the row, G = 0
    past the last one); observation and padding tokens are skipped and get 0.

    This is skip-observation GAE with V = 0 and lambda = 1, so it is computed by that function.
    """
    zeros = torch.zeros_like(token_rewards)
    returns, _ = skip_observation_gae(token_rewards, zeros, action_mask, gamma, 1.0)
    return returns


def reinforce_pp_advantages(token_rewards: torch.Tensor, action_mask: torch.Tensor,
                            gamma: float = 1.0) -> torch.Tensor:
    """REINFORCE++: returns G (see `discounted_returns`), whitened over the whole batch's action
    tokens: A = (G - mu) / sqrt(var + 1e-8), mu and var (population) over all action tokens.

    Token rewards usually hold the outcome reward on the last action token and, with
    `algo.kl_in_reward`, minus kl_coef * KL_t on every action token (`kl_reward_penalty`).
    Pass the WHOLE optimizer batch: the whitening statistics are global, not per micro-batch.
    """
    return masked_whiten(discounted_returns(token_rewards, action_mask, gamma), action_mask)
