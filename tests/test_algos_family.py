"""The GRPO family, PPO variants, CISPO, GSPO, regularisers and DAPO helpers, against numbers
derived by hand in the comments."""

from __future__ import annotations

import math

import pytest
import torch

from tiderl.algos.aggregation import (
    aggregate,
    loss_normalizer,
    sequence_mean,
    sequence_token_counts,
    token_weights,
)
from tiderl.algos.advantages import (
    AdvantageInputs,
    broadcast_to_tokens,
    discounted_returns,
    dr_grpo_advantages,
    dr_grpo_token_advantages,
    gae_advantages,
    group_index_of,
    grpo_advantages,
    grpo_token_advantages,
    reinforce_pp_advantages,
    reinforce_pp_token_advantages,
    rloo_advantages,
    rloo_token_advantages,
    skip_observation_gae,
)
from tiderl.algos.losses import (
    PolicyLossInputs,
    cispo_loss,
    cispo_token_loss,
    decoupled_ppo_loss,
    decoupled_ppo_token_loss,
    dis_loss,
    dis_token_loss,
    gspo_loss,
    gspo_token_loss,
    ppo_loss,
    ppo_token_loss,
)
from tiderl.config import preset_defaults
from tiderl.config import AlgoConfig
from tiderl.algos.regularizers import entropy_from_logits, kl_estimate, kl_reward_penalty
from tiderl.algos.sampling import informative_groups, overlong_penalty

F64 = torch.float64


def _lp(ratios: list[float], old: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Current log-probs (leaf, with grad) whose ratio to constant old log-probs is each ratio."""
    lp = torch.tensor([[old + math.log(r) for r in ratios]], dtype=F64, requires_grad=True)
    return lp, torch.full_like(lp, old).detach()


# ------------------------------------------------------------------------------------------
# Group advantages

REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.5])
GROUPS = group_index_of(["q1", "q1", "q1", "q1", "q2", "q2", "q3"])


def test_group_index_in_order_of_first_appearance() -> None:
    assert group_index_of(["b", "a", "b", "c"]).tolist() == [0, 1, 0, 2]
    assert GROUPS.tolist() == [0, 0, 0, 0, 1, 1, 2]


def test_grpo_advantages_by_hand() -> None:
    # Group q1 = [1, 0, 0, 1]: mean 0.5, deviations +-0.5, sum of squares 1, Bessel variance
    # 1/3, std 0.577350; A = +-0.5 / (0.577350 + 1e-6) = +-0.866024.
    # Group q2 = [1, 1]: std 0, numerators 0 -> A = 0. Group q3 = [0.5]: a group of one -> 0.
    adv = grpo_advantages(REWARDS, GROUPS, eps=1e-6)
    h = 0.866024
    assert adv.tolist() == pytest.approx([h, -h, -h, h, 0.0, 0.0, 0.0], abs=1e-6)


def test_dr_grpo_advantages_by_hand() -> None:
    # r - group mean, no std: q1 -> [0.5, -0.5, -0.5, 0.5]; q2 -> 0; q3 -> 0.
    adv = dr_grpo_advantages(REWARDS, GROUPS)
    assert adv.tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0], abs=1e-7)


def test_rloo_advantages_by_hand() -> None:
    # q1: r = 1 against the mean of the other three [0, 0, 1] = 1/3 -> 2/3;
    #     r = 0 against [1, 0, 1] = 2/3 -> -2/3. (= 4/3 * (r - 0.5).)
    # q2: 1 - 1 = 0. q3: no other sample -> 0.
    adv = rloo_advantages(REWARDS, GROUPS)
    t = 2 / 3
    assert adv.tolist() == pytest.approx([t, -t, -t, t, 0.0, 0.0, 0.0], abs=1e-6)


def test_group_size_one_degenerates_to_zero_advantages() -> None:
    # Every trajectory alone in its group: r - mean_g = r - r = 0 for all three estimators,
    # whatever the rewards are (GRPO divides 0 by eps, RLOO has no other sample).
    rewards = torch.tensor([1.0, 0.0, 0.3, -2.0])
    singletons = group_index_of(["a", "b", "c", "d"])
    for fn in (grpo_advantages, dr_grpo_advantages, rloo_advantages):
        assert fn(rewards, singletons).tolist() == [0.0, 0.0, 0.0, 0.0]


def test_broadcast_to_tokens() -> None:
    mask = torch.tensor([[0, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.float32)
    out = broadcast_to_tokens(torch.tensor([2.0, -1.0]), mask)
    assert out.tolist() == [[0, 2, 2, 0], [-1, 0, 0, 0]]


def test_discounted_returns_and_reinforce_pp_by_hand() -> None:
    mask = torch.tensor([[0, 1, 1, 0, 1], [0, 1, 1, 0, 0]], dtype=F64)
    # Row 0: a KL penalty of -0.1 on token 1 and the outcome 1.0 on its last action token 4;
    # row 1: outcome 0.
    rewards = torch.tensor([[0, -0.1, 0, 0, 1.0], [0, 0, 0, 0, 0]], dtype=F64)
    # gamma = 0.5, over action tokens only (token 3 is an observation):
    #   G4 = 1, G2 = 0 + 0.5 * 1 = 0.5, G1 = -0.1 + 0.5 * 0.5 = 0.15; row 1 all 0.
    ret = discounted_returns(rewards, mask, gamma=0.5)
    assert ret[0].tolist() == pytest.approx([0, 0.15, 0.5, 0, 1.0], abs=1e-12)
    # REINFORCE++ with gamma = 1: G = [0.9, 1.0, 1.0] (row 0) and [0, 0] (row 1).
    # Whitened over the 5 action tokens: mean 2.9 / 5 = 0.58; deviations 0.32, 0.42, 0.42,
    # -0.58, -0.58; population variance (0.1024 + 2 * 0.1764 + 2 * 0.3364) / 5 = 0.2256,
    # std 0.474974: A = 0.673722, 0.884259, 0.884259, -1.221120, -1.221120.
    adv = reinforce_pp_advantages(rewards, mask, gamma=1.0)
    assert adv[0].tolist() == pytest.approx([0, 0.673722, 0.884259, 0, 0.884259], abs=1e-5)
    assert adv[1].tolist() == pytest.approx([0, -1.221120, -1.221120, 0, 0], abs=1e-5)


# ------------------------------------------------------------------------------------------
# Aggregation

# Row 0: 3 action tokens with losses 1, 2, 3 (the 9.0 is padding); row 1: 2 action tokens with
# losses 4, 6 (7.0 sits on a prompt token); row 2: no action token at all.
AGG_LOSS = torch.tensor([[1.0, 2.0, 3.0, 9.0], [7.0, 4.0, 6.0, 9.0], [5.0, 5.0, 5.0, 5.0]],
                        dtype=F64)
AGG_MASK = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 0], [0, 0, 0, 0]], dtype=F64)


@pytest.mark.parametrize("mode, normalizer, expected", [
    # N = 5 action tokens, S = 2 sequences with action tokens (row 2 has none); token sum 16.
    ("token-mean", 5.0, 16 / 5),                       # 3.2
    ("seq-mean-token-sum", 2.0, 16 / 2),               # 8.0
    ("seq-mean-token-mean", 2.0, (6 / 3 + 10 / 2) / 2),  # (2 + 5) / 2 = 3.5
    ("seq-mean-token-sum-norm", 8.0, 16 / (2 * 4)),    # L = 4: 2.0
])
def test_aggregation_modes_by_hand(mode: str, normalizer: float, expected: float) -> None:
    norm = loss_normalizer(AGG_MASK, mode, norm_length=4)
    assert norm == normalizer
    assert aggregate(AGG_LOSS, AGG_MASK, mode, norm).item() == pytest.approx(expected)
    # Micro-batches [row 0] and [rows 1, 2] with the SAME global normaliser add up exactly.
    parts = aggregate(AGG_LOSS[:1], AGG_MASK[:1], mode, norm) + aggregate(
        AGG_LOSS[1:], AGG_MASK[1:], mode, norm)
    assert parts.item() == pytest.approx(expected, abs=1e-12)


def test_token_weights_and_sequence_helpers() -> None:
    # seq-mean-token-mean weighs each token by 1 / n_s: 1/3 in row 0, 1/2 in row 1.
    w = token_weights(AGG_MASK, "seq-mean-token-mean")
    assert w[0].tolist() == pytest.approx([1 / 3, 1 / 3, 1 / 3, 0])
    assert w[1].tolist() == pytest.approx([0, 0.5, 0.5, 0])
    assert sequence_token_counts(AGG_MASK)[1].tolist() == [0, 2, 2, 0]
    # sequence_mean: row 0 mean (1 + 2 + 3) / 3 = 2, row 1 (4 + 6) / 2 = 5, on action tokens.
    m = sequence_mean(AGG_LOSS, AGG_MASK)
    assert m.tolist() == [[2, 2, 2, 0], [0, 5, 5, 0], [0, 0, 0, 0]]
    with pytest.raises(ValueError, match="norm_length"):
        loss_normalizer(AGG_MASK, "seq-mean-token-sum-norm")


# ------------------------------------------------------------------------------------------
# Policy losses

RATIOS = [0.5, 0.9, 1.25, 1.35, 4.0]  # clip-higher band (0.8, 1.28) with eps (0.2, 0.28)
ONES = torch.ones(1, 5, dtype=F64)


def test_ppo_clip_higher_positive_advantage() -> None:
    lp, old = _lp(RATIOS)
    tl, m = ppo_token_loss(lp, old, ONES, ONES, eps_low=0.2, eps_high=0.28)
    # A = 1: s = min(r, clip(r, 0.8, 1.28)) = [0.5, 0.9, 1.25, 1.28, 1.28]. r = 1.25 is inside
    # the raised upper bound (a symmetric eps 0.2 would have clipped it at 1.2).
    assert (-tl).tolist()[0] == pytest.approx([0.5, 0.9, 1.25, 1.28, 1.28], abs=1e-12)
    tl.sum().backward()
    # Gradient -r A where the unclipped branch wins, 0 where the clip does (r > 1.28):
    assert lp.grad.tolist()[0] == pytest.approx([-0.5, -0.9, -1.25, 0.0, 0.0], abs=1e-12)
    assert m["clip_frac"] == pytest.approx(2 / 5)
    assert m["dual_clip_frac"] == 0.0


def test_ppo_dual_clip_negative_advantage() -> None:
    neg = -ONES
    lp, old = _lp(RATIOS)
    tl, m = ppo_token_loss(lp, old, neg, ONES, 0.2, 0.28)
    # A = -1: s = min(-r, -clip(r)) = [-0.8, -0.9, -1.25, -1.35, -4.0]: the r = 0.5 token is
    # clipped (constant), r = 4 keeps its full gradient r = 4.
    tl.sum().backward()
    assert (-tl).tolist()[0] == pytest.approx([-0.8, -0.9, -1.25, -1.35, -4.0], abs=1e-12)
    assert lp.grad.tolist()[0] == pytest.approx([0.0, 0.9, 1.25, 1.35, 4.0], abs=1e-12)
    assert m["clip_frac"] == pytest.approx(1 / 5)
    # Dual clip c = 3: s = max(s, c A) = max(s, -3) caps the r = 4 token at -3, constant.
    lp, old = _lp(RATIOS)
    tl, m = ppo_token_loss(lp, old, neg, ONES, 0.2, 0.28, dual_clip_c=3.0)
    tl.sum().backward()
    assert tl.tolist()[0] == pytest.approx([0.8, 0.9, 1.25, 1.35, 3.0], abs=1e-12)
    assert lp.grad.tolist()[0] == pytest.approx([0.0, 0.9, 1.25, 1.35, 0.0], abs=1e-12)
    assert m["dual_clip_frac"] == pytest.approx(1 / 5)
    with pytest.raises(ValueError, match="dual_clip_c"):
        ppo_token_loss(lp, old, neg, ONES, 0.2, 0.28, dual_clip_c=0.5)


def _random(seed: int, shape: tuple[int, int] = (4, 7)) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(shape, generator=g) > 0.3).to(F64)
    behavior = -torch.rand(shape, generator=g, dtype=F64) * 3
    return {"mask": mask, "behavior": behavior,
            "prox": behavior + torch.randn(shape, generator=g, dtype=F64) * 0.5,
            "current": behavior + torch.randn(shape, generator=g, dtype=F64) * 0.8,
            "adv": torch.randn(shape, generator=g, dtype=F64)}


def test_loss_adapters_pass_the_config_to_the_token_losses() -> None:
    # Each registry adapter is its token loss with the config's hyperparameters and the right
    # log-probs (dis: behaviour; the others: old), metrics named as logged.
    d = _random(0)
    cfg = AlgoConfig(**{**preset_defaults("decoupled_ppo"), "eps_low": 0.2, "eps_high": 0.28,
                        "dual_clip_c": 3.0, "behavior_weight_cap": 2.0})
    inp = PolicyLossInputs(d["current"], d["prox"], d["behavior"], d["adv"], d["mask"])
    args = (d["current"], d["prox"], d["adv"], d["mask"], 0.2, 0.28)
    cases = [
        (dis_loss, dis_token_loss(d["current"], d["behavior"], d["adv"], d["mask"], 0.2, 0.28)),
        (ppo_loss, ppo_token_loss(*args, 3.0)),
        (decoupled_ppo_loss, decoupled_ppo_token_loss(
            d["current"], d["prox"], d["behavior"], d["adv"], d["mask"], 0.2, 0.28, 2.0, 3.0)),
        (cispo_loss, cispo_token_loss(*args)),
        (gspo_loss, gspo_token_loss(*args)),
    ]
    for adapter, (expected, raw) in cases:
        loss, metrics = adapter(inp, cfg)
        assert torch.equal(loss, expected), adapter.__name__
        prefix = "dis" if adapter is dis_loss else "policy"
        assert metrics[f"{prefix}/ratio_mean"] == raw["ratio_mean"]
        assert "num_action_tokens" not in metrics and f"{prefix}/num_action_tokens" not in metrics
    _, metrics = dis_loss(inp, cfg)
    assert {"dis/masked_frac", "dis/low_frac", "dis/high_frac", "dis/approx_kl"} <= set(metrics)


def test_estimators_read_their_inputs_and_config() -> None:
    # Two groups over three trajectories, KL-adjusted sequence rewards, one critic.
    mask = torch.tensor([[0, 1, 1, 0], [0, 1, 0, 0], [0, 1, 1, 1.0]])
    rewards = torch.tensor([1.0, 0.0, 0.5])
    token_rewards = torch.tensor([[0, 0, 1.0, 0], [0, 0, 0, 0], [0, 0.1, 0, 0.5]])
    values = torch.tensor([[0, 0.2, 0.4, 0], [0, 0.1, 0, 0], [0, 0.3, 0.3, 0.3]])
    groups = torch.tensor([0, 0, 1])
    inp = AdvantageInputs(rewards, token_rewards, mask, mask.sum(1), groups, values)
    cfg = AlgoConfig(**{**preset_defaults("ppo"), "gamma": 0.9, "adv_eps": 0.5})
    assert torch.equal(grpo_token_advantages(inp, cfg),
                       broadcast_to_tokens(grpo_advantages(rewards, groups, 0.5), mask))
    assert torch.equal(dr_grpo_token_advantages(inp, cfg),
                       broadcast_to_tokens(dr_grpo_advantages(rewards, groups), mask))
    assert torch.equal(rloo_token_advantages(inp, cfg),
                       broadcast_to_tokens(rloo_advantages(rewards, groups), mask))
    assert torch.equal(reinforce_pp_token_advantages(inp, cfg),
                       reinforce_pp_advantages(token_rewards, mask, 0.9))
    # gae: the fixed policy lambda (0.95 in the ppo preset), or SAO's decoupled one,
    # 1 - 1 / (1.5 n): n = 2, 1, 3 -> 2/3, 1/3, 7/9.
    fixed = skip_observation_gae(token_rewards, values, mask, 0.9, 0.95)[0]
    assert torch.equal(gae_advantages(inp, cfg), fixed)
    sao_lam = AlgoConfig(**{**preset_defaults("sao"), "gamma": 0.9})
    lam = torch.tensor([2 / 3, 1 / 3, 7 / 9])
    decoupled = skip_observation_gae(token_rewards, values, mask, 0.9, lam)[0]
    assert torch.allclose(gae_advantages(inp, sao_lam), decoupled, atol=1e-7)
    with pytest.raises(ValueError, match="group_index"):
        grpo_token_advantages(AdvantageInputs(rewards, token_rewards, mask, mask.sum(1)), cfg)


def test_decoupled_ppo_by_hand() -> None:
    # Behaviour weights pi_prox / pi_behav = [1, 2, 8]; ratios to the proximal policy
    # r = [1.1, 0.5, 1.0]; A = [1, 1, -2]; eps (0.2, 0.2).
    behavior = torch.tensor([[-1.0, -2.0, -3.0]], dtype=F64)
    prox = behavior + torch.tensor([[0.0, math.log(2), math.log(8)]], dtype=F64)
    current = (prox + torch.tensor([[math.log(1.1), math.log(0.5), 0.0]], dtype=F64)
               ).requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0, -2.0]], dtype=F64)
    mask = torch.ones(1, 3, dtype=F64)
    tl, m = decoupled_ppo_token_loss(current, prox, behavior, adv, mask, 0.2, 0.2,
                                     weight_cap=5.0)
    # Cap 5: w = [1, 2, 5]. PPO surrogates: min(1.1, 1.1) = 1.1; min(0.5, 0.8) = 0.5;
    # min(-2, -2) = -2. Token losses -w * s = [-1.1, -1.0, 10.0].
    assert tl.tolist()[0] == pytest.approx([-1.1, -1.0, 10.0], abs=1e-12)
    # Gradients -w r A: [-1.1, -2 * 0.5 = -1.0, -5 * 1.0 * -2 = 10.0].
    tl.sum().backward()
    assert current.grad.tolist()[0] == pytest.approx([-1.1, -1.0, 10.0], abs=1e-12)
    # Token mean over 3 tokens: (-1.1 - 1.0 + 10) / 3 = 2.633333.
    assert aggregate(tl, mask, "token-mean", 3).item() == pytest.approx(7.9 / 3)
    assert m["behavior_weight_mean"] == pytest.approx(8 / 3)
    assert m["behavior_weight_max"] == pytest.approx(5.0)
    assert m["behavior_weight_capped_frac"] == pytest.approx(1 / 3)
    # No cap: the third token keeps w = 8: loss 8 * 2 = 16.
    tl, _ = decoupled_ppo_token_loss(current, prox, behavior, adv, mask, 0.2, 0.2)
    assert tl[0, 2].item() == pytest.approx(16.0)
    # Proximal = behaviour (no mismatch): w = 1 everywhere and it is plain PPO.
    d = _random(1)
    tl, _ = decoupled_ppo_token_loss(d["current"], d["behavior"], d["behavior"], d["adv"],
                                     d["mask"], 0.2, 0.28)
    ref, _ = ppo_token_loss(d["current"], d["behavior"], d["adv"], d["mask"], 0.2, 0.28)
    assert torch.allclose(tl, ref, atol=1e-12)


def test_cispo_keeps_every_token_with_a_clipped_weight() -> None:
    # Ratios [0.5, 1, 2, 4] against old log-probs -2; A = [1, -1, 1, 1]; eps_low = 1 (no lower
    # bound), eps_high = 2: weights clip(r, 0, 3) = [0.5, 1, 2, 3].
    lp, old = _lp([0.5, 1.0, 2.0, 4.0], old=-2.0)
    adv = torch.tensor([[1.0, -1.0, 1.0, 1.0]], dtype=F64)
    mask = torch.ones(1, 4, dtype=F64)
    tl, m = cispo_token_loss(lp, old, adv, mask, eps_low=1.0, eps_high=2.0)
    # log-probs = -2 + log r = [-2.693147, -2, -1.306853, -0.613706];
    # token loss -w A logp = [1.346574, -2.0, 2.613706, 1.841117]; mean 0.950349.
    assert tl.tolist()[0] == pytest.approx([1.346574, -2.0, 2.613706, 1.841117], abs=1e-6)
    assert aggregate(tl, mask, "token-mean", 4).item() == pytest.approx(0.950349, abs=1e-6)
    tl.sum().backward()
    # Gradient -w A: the r = 4 token still learns with weight 3 (PPO/DIS would give it 0).
    assert lp.grad.tolist()[0] == pytest.approx([-0.5, 1.0, -2.0, -3.0], abs=1e-12)
    assert m["clip_frac"] == pytest.approx(1 / 4)


def _gspo_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # Sequence 0: tokens 1-2 with log-ratios [0.1, 0.3] (mean 0.2); sequence 1: tokens 1-3 with
    # log-ratios [-0.2, 0.0, -0.1] (mean -0.1). Old log-probs -1; A0 = +1, A1 = -1.
    mask = torch.tensor([[0, 1, 1, 0], [0, 1, 1, 1]], dtype=F64)
    old = torch.full((2, 4), -1.0, dtype=F64)
    lr = torch.tensor([[0, 0.1, 0.3, 0], [0, -0.2, 0.0, -0.1]], dtype=F64)
    adv = torch.tensor([[0, 1, 1, 0], [0, -1, -1, -1]], dtype=F64)
    return old + lr, old, adv, mask


def sequence_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, action_mask: torch.Tensor
                   ) -> torch.Tensor:
    """GSPO's length-normalised sequence ratio, at every action token of the sequence (0 elsewhere):

        s_i = exp( (1 / n_i) sum_{action t in i} (logprobs_t - old_t) )
            = (pi_theta(y_i) / pi_old(y_i)) ^ (1 / n_i)

    Differentiable in `logprobs` (d s_i / d logprobs_t = s_i / n_i). The reference the
    per-token form of `gspo_token_loss` is checked against.
    """
    is_action = action_mask > 0
    zeros = torch.zeros_like(logprobs)
    log_ratio = torch.where(is_action, logprobs, zeros) - torch.where(is_action, old_logprobs, zeros)
    s = sequence_mean(log_ratio, action_mask).exp()
    return torch.where(is_action, s, zeros)


def test_gspo_sequence_ratio_and_clip_by_hand() -> None:
    base, old, adv, mask = _gspo_inputs()
    # s0 = exp(mean(0.1, 0.3)) = exp(0.2) = 1.221403; s1 = exp(mean(-0.2, 0, -0.1)) = exp(-0.1)
    # = 0.904837, on every action token of the sequence.
    lp = base.clone().requires_grad_(True)
    s = sequence_ratio(lp, old, mask)
    assert s[0].tolist() == pytest.approx([0, 1.221403, 1.221403, 0], abs=1e-6)
    assert s[1].tolist() == pytest.approx([0, 0.904837, 0.904837, 0.904837], abs=1e-6)
    # d s1 / d logp_t = s1 / 3 = 0.301612 for each token of sequence 1.
    s[1, 1].backward()
    assert lp.grad[1].tolist() == pytest.approx([0, 0.301612, 0.301612, 0.301612], abs=1e-6)
    lp = base.clone().requires_grad_(True)
    tl, m = gspo_token_loss(lp, old, adv, mask, 0.2, 0.2)
    # s0 = exp(0.2) = 1.221403 > 1.2 with A > 0: clipped, objective 1.2 on each token (loss
    # -1.2, constant). s1 = exp(-0.1) = 0.904837 inside the band: loss -(s1 * -1) = 0.904837.
    assert tl[0].tolist() == pytest.approx([0, -1.2, -1.2, 0], abs=1e-9)
    assert tl[1].tolist() == pytest.approx([0, 0.904837, 0.904837, 0.904837], abs=1e-6)
    # seq-mean-token-mean, S = 2: (-1.2 + 0.904837) / 2 = -0.147581.
    loss = aggregate(tl, mask, "seq-mean-token-mean", 2)
    assert loss.item() == pytest.approx(-0.147581, abs=1e-6)
    loss.backward()
    # Sequence-level gradient: (1/2) * d s1 / d logp_t = (1/2) * s1 / 3 = 0.150806 on each
    # token of sequence 1; the clipped sequence 0 gets none.
    assert lp.grad[0].tolist() == pytest.approx([0, 0, 0, 0], abs=1e-12)
    assert lp.grad[1].tolist() == pytest.approx([0, 0.150806, 0.150806, 0.150806], abs=1e-6)
    assert m["clip_frac"] == pytest.approx(2 / 5)  # the 2 tokens of sequence 0
    assert m["seq_ratio_max"] == pytest.approx(1.221403, abs=1e-6)


def test_gspo_token_form_equals_the_sequence_level_formula() -> None:
    # The per-token form under seq-mean-token-mean must give the value and gradient of
    # (1/S) sum_i -min(s_i A_i, clip(s_i) A_i) with s_i computed differentiably; checked on a
    # random batch with sequence-level advantages, where some sequences clip.
    d = _random(2)
    mask = d["mask"]
    seq_adv = torch.tensor([0.7, -1.3, 0.4, -0.2], dtype=F64)
    adv = seq_adv.unsqueeze(1) * mask
    a = d["current"].clone().requires_grad_(True)
    b = d["current"].clone().requires_grad_(True)
    tl, m = gspo_token_loss(a, d["behavior"], adv, mask, 0.1, 0.1)
    mine = aggregate(tl, mask, "seq-mean-token-mean", loss_normalizer(mask, "seq-mean-token-mean"))
    n = mask.sum(1)
    s = torch.exp(((b - d["behavior"]) * mask).sum(1) / n)
    direct = -torch.minimum(s * seq_adv, s.clamp(0.9, 1.1) * seq_adv).mean()
    mine.backward()
    direct.backward()
    assert 0 < m["clip_frac"] < 1
    assert mine.item() == pytest.approx(direct.item(), abs=1e-12)
    assert torch.allclose(a.grad * mask, b.grad * mask, atol=1e-12)


def test_losses_are_finite_with_inf_padding() -> None:
    lp = torch.tensor([[-0.1, -0.2, -math.inf]], requires_grad=True)
    old = torch.tensor([[-0.1, -0.3, -math.inf]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    adv = torch.tensor([[1.0, -1.0, 5.0]])
    calls = [
        lambda: ppo_token_loss(lp, old, adv, mask, 0.2, 0.28, 3.0),
        lambda: decoupled_ppo_token_loss(lp, old, old, adv, mask, 0.2, 0.2, 5.0),
        lambda: cispo_token_loss(lp, old, adv, mask, 1.0, 2.0),
        lambda: gspo_token_loss(lp, old, adv, mask, 0.2, 0.2),
        lambda: dis_token_loss(lp, old, adv, mask, 0.3, 5.0),
    ]
    for call in calls:
        lp.grad = None
        tl, _ = call()
        loss = aggregate(tl, mask, "seq-mean-token-mean", 1)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()
        assert lp.grad[0, 2].item() == 0.0


# ------------------------------------------------------------------------------------------
# Regularisers


def test_kl_estimators_by_hand() -> None:
    # x = logp - ref = [0.5, -0.5, 0] on action tokens; the 4th token is padding (-inf).
    ref = torch.tensor([[-1.0, -1.0, -1.0, -math.inf]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0]], dtype=F64)
    expected = {
        "k1": ([0.5, -0.5, 0.0], [1.0, 1.0, 1.0]),  # x; d/dx = 1
        "k2": ([0.125, -0.0 + 0.125, 0.0], [0.5, -0.5, 0.0]),  # x^2/2; d/dx = x
        # exp(-x) - 1 + x: 0.606531 - 0.5 = 0.106531; 1.648721 - 1.5 = 0.148721; 0.
        # d/dx = 1 - exp(-x): 0.393469, -0.648721, 0.
        "k3": ([0.106531, 0.148721, 0.0], [0.393469, -0.648721, 0.0]),
    }
    for name, (values, grads) in expected.items():
        lp = torch.tensor([[-0.5, -1.5, -1.0, -math.inf]], dtype=F64, requires_grad=True)
        k = kl_estimate(lp, ref, mask, name)
        assert k.tolist()[0] == pytest.approx(values + [0.0], abs=1e-6)
        k.sum().backward()
        assert lp.grad.tolist()[0] == pytest.approx(grads + [0.0], abs=1e-6)


def test_kl_reward_penalty_by_hand() -> None:
    # k1 = [0.5, -0.5, 0]; coef 0.1: rewards [0, 0, 1] become [-0.05, 0.05, 1.0]; the padding
    # token keeps its reward (0) untouched.
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0]], dtype=F64)
    old = torch.tensor([[-0.5, -1.5, -1.0, 0.0]], dtype=F64)
    ref = torch.full((1, 4), -1.0, dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0]], dtype=F64)
    shaped, kl = kl_reward_penalty(rewards, old, ref, mask, 0.1, "k1")
    assert shaped.tolist()[0] == pytest.approx([-0.05, 0.05, 1.0, 0.0], abs=1e-12)
    assert kl.tolist()[0] == pytest.approx([0.5, -0.5, 0.0, 0.0])


def test_entropy_from_logits_by_hand() -> None:
    # Uniform over 2: ln 2 = 0.693147. Logits [0, ln 3]: p = [1/4, 3/4],
    # H = 0.25 ln 4 + 0.75 ln(4/3) = 0.346574 + 0.215762 = 0.562335.
    logits = torch.tensor([[0.0, 0.0], [0.0, math.log(3)]], dtype=F64, requires_grad=True)
    h = entropy_from_logits(logits)
    assert h.tolist() == pytest.approx([math.log(2), 0.562335], abs=1e-6)
    h.sum().backward()
    # dH/dz_j = -p_j (log p_j + H): uniform -> 0; [1/4, 3/4]: -0.25 (-1.386294 + 0.562335)
    # = 0.205990 and -0.75 (-0.287682 + 0.562335) = -0.205990.
    assert logits.grad.tolist()[0] == pytest.approx([0.0, 0.0], abs=1e-12)
    assert logits.grad.tolist()[1] == pytest.approx([0.205990, -0.205990], abs=1e-6)


# ------------------------------------------------------------------------------------------
# DAPO sampling helpers


def test_dynamic_sampling_keeps_groups_with_reward_variance() -> None:
    # Groups: [1, 1] all right -> drop; [0, 1] -> keep; [0, 0] all wrong -> drop;
    # [0.5] alone -> drop (nothing to compare with).
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5])
    groups = group_index_of(["a", "a", "b", "b", "c", "c", "d"])
    assert informative_groups(rewards, groups).tolist() == [False, False, True, True, False,
                                                            False, False]


def test_overlong_penalty_by_hand() -> None:
    # L_max = 100, buffer 20: the zone starts at 80. (80 - l) / 20: l = 90 -> -0.5,
    # l = 100 -> -1; beyond 100 -> -1; up to 80 -> 0. Factor 0.5 halves it.
    lengths = torch.tensor([50, 80, 90, 100, 101, 150])
    out = overlong_penalty(lengths, max_length=100, buffer=20, factor=0.5)
    assert out.tolist() == pytest.approx([0.0, 0.0, -0.25, -0.5, -0.5, -0.5])
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(lengths, max_length=10, buffer=20)


def test_has_signal_is_the_per_group_form_of_informative_groups():
    from tiderl.algos.sampling import has_signal, informative_groups

    assert has_signal([0.0, 1.0]) and not has_signal([1.0, 1.0]) and not has_signal([0.0])
    rewards = torch.tensor([0.0, 1.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 1, 1])
    assert informative_groups(rewards, groups).tolist() == [True, True, False, False]
