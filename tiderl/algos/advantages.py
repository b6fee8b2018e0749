"""Advantage estimation for SAO (and any critic-based algorithm) as pure tensor functions.

Every batch tensor is right-padded `[B, T]` and aligned with `Trajectory.tokens`: position `t`
holds token `t`. `action_mask[b, t]` is 1.0 where the policy sampled token `t` (the trajectory's
`loss_mask`) and 0.0 on prompt, tool/environment observation and padding tokens.
`values[b, t]` is the critic's estimate V_t of the state in which action token `t` was sampled
(the trainer aligns it; these functions only read it at action positions).

Source: SAO, "Single-rollout Asynchronous Optimization" (arXiv 2607.07508), components 3 and 4
as summarised in `shared/papers.md`: skip-observation token-level GAE, outcome reward on the
last model-generated token, decoupled lambda for the policy, gamma = 1.
"""

from __future__ import annotations

import torch

__all__ = [
    "outcome_token_rewards",
    "decoupled_policy_lambda",
    "skip_observation_gae",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "explained_variance",
]


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
