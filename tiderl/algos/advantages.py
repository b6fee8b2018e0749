"""Advantage estimators as pure tensor functions: skip-observation GAE (SAO), group baselines
(GRPO, Dr.GRPO, RLOO) and REINFORCE++.

Every batch tensor is right-padded `[B, T]` and aligned with `Trajectory.tokens`: position `t`
holds token `t`. `action_mask[b, t]` is 1.0 where the policy sampled token `t` (the trajectory's
`loss_mask`) and 0.0 on prompt, tool/environment observation and padding tokens.
`values[b, t]` is the critic's estimate V_t of the state in which action token `t` was sampled
(the trainer aligns it; these functions only read it at action positions).

The estimators the config names (`algo.advantage`, `tiderl.algos.registry`) all have one
signature, `fn(AdvantageInputs, AlgoConfig) -> advantages [B, T]`; they are thin wrappers at the
end of this module over the functions with explicit arguments above them.

Each estimator's formula and paper: docs/algorithms.md. Group statistics use the population mean
and the Bessel-corrected std (`group_stats`; std 0 for a group of one): a group of one, or one
whose rewards are all equal, has no relative signal and gets advantage 0 from every group estimator.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tiderl.config import AlgoConfig

__all__ = ["AdvantageInputs", "broadcast_to_tokens", "decoupled_policy_lambda", "discounted_returns",
           "dr_grpo_advantages", "dr_grpo_token_advantages", "explained_variance", "gae_advantages",
           "group_index_of", "group_stats", "grpo_advantages", "grpo_token_advantages", "masked_mean",
           "masked_var", "masked_whiten", "outcome_token_rewards", "reinforce_pp_advantages",
           "reinforce_pp_token_advantages", "rloo_advantages", "rloo_token_advantages",
           "skip_observation_gae"]


def _float_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """At least float32: GAE sums up to thousands of terms, which bf16/fp16 cannot carry."""
    dtype = torch.float32
    for t in tensors:
        if t.is_floating_point():
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def outcome_token_rewards(rewards: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """Place each trajectory's scalar reward on its last action token.

    token_rewards[b, t] = rewards[b] if t = max{t' : action_mask[b, t'] = 1} else 0.
    A row without any action token gets no reward at all (there is no token to credit).

    Args:
        rewards: [B] scalar outcome reward per trajectory.
        action_mask: [B, T], 1 on sampled tokens.
    Returns:
        [B, T] float tensor (float32 or wider).
    """
    if rewards.dim() != 1 or action_mask.dim() != 2 or rewards.shape[0] != action_mask.shape[0]:
        raise ValueError(
            f"rewards must be [B] and action_mask [B, T] with the same B; got "
            f"{tuple(rewards.shape)} and {tuple(action_mask.shape)}"
        )
    batch, length = action_mask.shape
    is_action = action_mask > 0
    positions = torch.arange(length, device=action_mask.device).expand(batch, length)
    # -1 marks "no action token"; max over the row then gives the last action position.
    last = torch.where(is_action, positions, torch.full_like(positions, -1)).max(dim=1).values
    has_action = last >= 0
    out = torch.zeros(batch, length, dtype=_float_dtype(rewards), device=action_mask.device)
    rows = torch.arange(batch, device=action_mask.device)[has_action]
    out[rows, last[has_action]] = rewards[has_action].to(out.dtype)
    return out


def decoupled_policy_lambda(num_action_tokens: torch.Tensor, alpha: float = 1.5) -> torch.Tensor:
    """SAO's length-adaptive GAE lambda for the policy (component 4).

    lambda_b = clip(1 - 1 / (alpha * l_b), 0, 1), with l_b the number of action tokens of
    trajectory b; l_b = 0 gives 0. Long trajectories get lambda close to 1 (low bias over a long
    horizon), short ones lean on the critic. The critic itself uses lambda = 1.

    Args:
        num_action_tokens: [B] counts (int or float).
        alpha: the paper's alpha (1.5); must be > 0.
    Returns:
        [B] float tensor in [0, 1].
    """
    if alpha <= 0:
        raise ValueError(f"alpha must be > 0 (the paper uses 1.5); got {alpha}")
    length = num_action_tokens.to(_float_dtype(num_action_tokens))
    # torch.where evaluates both branches; clamping the denominator keeps l = 0 free of inf.
    lam = 1.0 - 1.0 / (alpha * length.clamp(min=1.0))
    lam = torch.where(length > 0, lam, torch.zeros_like(lam))
    return lam.clamp(0.0, 1.0)


@torch.no_grad()
def skip_observation_gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    action_mask: torch.Tensor,
    gamma: float,
    lam: float | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level GAE whose recursion skips non-action tokens (SAO component 3).

    Let i -> j denote an action token i and the next action token j of the same row (observation
    and padding tokens in between are skipped, so the last token of turn k links straight to the
    first token of turn k+1). Then

        delta_i = r_i + gamma * V_j - V_i
        A_i     = delta_i + gamma * lam_b * A_j
        returns_i = A_i + V_i

    and for the last action token of a row V_j = 0 and A_j = 0 (the episode ended).
    Advantages and returns are 0 on non-action tokens. Outputs are detached (they are targets).

    Rewards on non-action tokens are rejected with ValueError rather than silently dropped:
    put them on an action token (see `outcome_token_rewards`).

    Args:
        token_rewards: [B, T] per-token rewards r_t.
        values: [B, T] critic values V_t.
        action_mask: [B, T], 1 on sampled tokens.
        gamma: discount (SAO: 1.0).
        lam: a float, or a [B] tensor of per-trajectory lambdas (see `decoupled_policy_lambda`).
    Returns:
        (advantages [B, T], returns [B, T]), float32 or wider.
    """
    if not (token_rewards.shape == values.shape == action_mask.shape) or values.dim() != 2:
        raise ValueError(
            "token_rewards, values and action_mask must all be [B, T]; got "
            f"{tuple(token_rewards.shape)}, {tuple(values.shape)}, {tuple(action_mask.shape)}"
        )
    batch, length = values.shape
    dtype = _float_dtype(token_rewards, values)
    is_action = action_mask > 0
    if bool((token_rewards.ne(0) & ~is_action).any()):
        raise ValueError(
            "token_rewards is non-zero on a non-action token; skip-observation GAE only reads "
            "rewards on action tokens, so move it to an action token (e.g. the last one)"
        )
    rewards = token_rewards.to(dtype)
    vals = values.detach().to(dtype)
    if isinstance(lam, torch.Tensor):
        if lam.shape != (batch,):
            raise ValueError(f"lam as a tensor must have shape [B] = ({batch},); got {tuple(lam.shape)}")
        lam_b = lam.to(dtype=dtype, device=values.device)
    else:
        lam_b = torch.full((batch,), float(lam), dtype=dtype, device=values.device)

    advantages = torch.zeros(batch, length, dtype=dtype, device=values.device)
    # Carried state per row: V and A of the next action token to the right (0 past the end).
    next_value = torch.zeros(batch, dtype=dtype, device=values.device)
    next_adv = torch.zeros(batch, dtype=dtype, device=values.device)
    for t in range(length - 1, -1, -1):
        act = is_action[:, t]
        delta = rewards[:, t] + gamma * next_value - vals[:, t]
        adv_t = delta + gamma * lam_b * next_adv
        # Non-action tokens keep the carried state unchanged: that is the "skip".
        advantages[:, t] = torch.where(act, adv_t, torch.zeros_like(adv_t))
        next_value = torch.where(act, vals[:, t], next_value)
        next_adv = torch.where(act, adv_t, next_adv)
    returns = torch.where(is_action, advantages + vals, torch.zeros_like(advantages))
    return advantages, returns


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum_{mask} x / |mask| over all elements, as a 0-dim tensor; 0 when the mask is empty.

    Masked-out entries are excluded with torch.where, so inf/nan there (e.g. -inf log-probs on
    padding) cannot leak into the result.
    """
    keep = mask > 0
    total = torch.where(keep, x, torch.zeros_like(x)).sum()
    return total / keep.sum().clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Population variance over masked entries: mean_{mask} (x - mean_{mask} x)^2; 0 if empty."""
    centered = x - masked_mean(x, mask)
    return masked_mean(centered * centered, mask)


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """Normalise x over the masked entries: (x - mu) / sqrt(var + eps); 0 outside the mask.

    With shift_mean=False the mean is added back, (x - mu) / sqrt(var + eps) + mu, i.e. only the
    scale changes (keeps the sign of a batch of all-positive advantages).
    Whiten the whole optimizer batch at once, before splitting it into micro-batches, so every
    micro-batch shares one mean and scale.
    """
    mu = masked_mean(x, mask)
    whitened = (x - mu) * torch.rsqrt(masked_var(x, mask) + eps)
    if not shift_mean:
        whitened = whitened + mu
    return torch.where(mask > 0, whitened, torch.zeros_like(whitened))


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var[returns - values] / Var[returns] over masked entries (population variances).

    1 is a perfect critic, 0 is no better than predicting the batch mean return, negative is
    worse. When Var[returns] is (numerically) zero, e.g. every trajectory of the batch got the
    same reward under gamma = lambda = 1, or the mask is empty, the ratio is undefined and this
    returns 0.0 ("no evidence either way") instead of nan or a huge negative number.
    Computed in float64 so a constant batch really has variance ~0.
    """
    v = values.detach().double()
    r = returns.detach().double()
    var_returns = masked_var(r, mask).item()
    if var_returns <= 1e-12:
        return 0.0
    return 1.0 - masked_var(r - v, mask).item() / var_returns


# --------------------------------------------------------------------------------------------
# Group baselines and REINFORCE++: one scalar reward per trajectory, rollouts of one prompt
# grouped by `group_index[B]` (long, 0..G-1; `group_index_of` turns Trajectory.group_id into it).


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
    """Per trajectory: (mean_g, std_g, n_g) of its group g: mean_g = sum_{j in g} r_j / n_g,
    std_g = sqrt(sum_{j in g} (r_j - mean_g)^2 / (n_g - 1)), 0 when n_g = 1.

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


# --------------------------------------------------------------------------------------------
# The estimators `algo.advantage` names (tiderl.algos.registry), with one signature.


@dataclass
class AdvantageInputs:
    """What an advantage estimator may read, for the WHOLE optimizer batch (N trajectories).

    rewards: [N] sequence rewards (shaped), minus kl_coef times the trajectory's summed KL
        penalty when `algo.kl_in_reward` is on.
    token_rewards: [N, T] the shaped reward on each trajectory's last action token, minus
        kl_coef * KL_t on every action token when `algo.kl_in_reward` is on.
    action_mask: [N, T], 1 on sampled tokens.
    num_action_tokens: [N] action tokens per trajectory (action_mask.sum(1)).
    group_index: [N] long group of each trajectory (`group_index_of`), or None when the
        algorithm does not group rollouts (`registry.uses_groups`).
    values: [N, T] critic values before (or after, `algo.advantage_values`) this step's critic
        update, or None without a critic (`registry.needs_critic`).
    """

    rewards: torch.Tensor
    token_rewards: torch.Tensor
    action_mask: torch.Tensor
    num_action_tokens: torch.Tensor
    group_index: torch.Tensor | None = None
    values: torch.Tensor | None = None


def _groups(inp: AdvantageInputs) -> torch.Tensor:
    if inp.group_index is None:
        raise ValueError("this advantage estimator compares rollouts of one prompt and needs "
                         "AdvantageInputs.group_index (set needs_groups on it in the registry)")
    return inp.group_index


def gae_advantages(inp: AdvantageInputs, cfg: AlgoConfig) -> torch.Tensor:
    """Skip-observation GAE with the critic's values; lambda = SAO's per-trajectory
    `decoupled_policy_lambda` if `cfg.decoupled_lambda`, else `cfg.policy_lambda`."""
    if inp.values is None:
        raise ValueError("gae needs critic values (AdvantageInputs.values)")
    lam: float | torch.Tensor = (
        decoupled_policy_lambda(inp.num_action_tokens, cfg.lambda_alpha)
        if cfg.decoupled_lambda else cfg.policy_lambda)
    return skip_observation_gae(inp.token_rewards, inp.values, inp.action_mask, cfg.gamma, lam)[0]


def grpo_token_advantages(inp: AdvantageInputs, cfg: AlgoConfig) -> torch.Tensor:
    """`grpo_advantages` (std epsilon `cfg.adv_eps`) on every action token."""
    return broadcast_to_tokens(grpo_advantages(inp.rewards, _groups(inp), cfg.adv_eps),
                               inp.action_mask)


def dr_grpo_token_advantages(inp: AdvantageInputs, cfg: AlgoConfig) -> torch.Tensor:
    """`dr_grpo_advantages` on every action token."""
    return broadcast_to_tokens(dr_grpo_advantages(inp.rewards, _groups(inp)), inp.action_mask)


def rloo_token_advantages(inp: AdvantageInputs, cfg: AlgoConfig) -> torch.Tensor:
    """`rloo_advantages` on every action token."""
    return broadcast_to_tokens(rloo_advantages(inp.rewards, _groups(inp)), inp.action_mask)


def reinforce_pp_token_advantages(inp: AdvantageInputs, cfg: AlgoConfig) -> torch.Tensor:
    """`reinforce_pp_advantages` of the token rewards with discount `cfg.gamma`."""
    return reinforce_pp_advantages(inp.token_rewards, inp.action_mask, cfg.gamma)
