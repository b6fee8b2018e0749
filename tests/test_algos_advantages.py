"""Advantage estimators against numbers derived by hand (SAO components 3 and 4)."""

from __future__ import annotations

import math

import pytest
import torch

from tiderl.algos.advantages import (
    decoupled_policy_lambda,
    explained_variance,
    masked_mean,
    masked_whiten,
    outcome_token_rewards,
    skip_observation_gae,
)

F64 = torch.float64


def test_outcome_reward_sits_on_last_action_token() -> None:
    mask = torch.tensor(
        [
            [0, 1, 1, 0, 1, 0],  # last action token at position 4
            [1, 1, 0, 0, 0, 0],  # last action token at position 1 (then padding)
            [0, 0, 0, 0, 0, 0],  # no action token: the reward has nowhere to go
        ],
        dtype=torch.float32,
    )
    rewards = torch.tensor([1.0, -0.5, 3.0])
    out = outcome_token_rewards(rewards, mask)
    expected = torch.zeros(3, 6)
    expected[0, 4] = 1.0
    expected[1, 1] = -0.5
    assert torch.equal(out, expected)


def test_decoupled_lambda_hand_values() -> None:
    lam = decoupled_policy_lambda(torch.tensor([0, 1, 4, 100]), alpha=1.5)
    # l=0 -> 0 by definition; l=1 -> 1 - 1/1.5 = 1/3; l=4 -> 1 - 1/6 = 5/6;
    # l=100 -> 1 - 1/150 = 149/150.
    assert torch.allclose(lam, torch.tensor([0.0, 1 / 3, 5 / 6, 149 / 150]), atol=1e-7)
    # alpha * l < 1 would give a negative lambda: alpha=0.5, l=1 -> 1 - 2 = -1, clipped to 0.
    assert decoupled_policy_lambda(torch.tensor([1]), alpha=0.5).item() == 0.0
    with pytest.raises(ValueError, match="alpha"):
        decoupled_policy_lambda(torch.tensor([1]), alpha=0.0)


# The two-turn trajectory used below: tokens [p, p, a, a, o, o, a, a].
TWO_TURN_MASK = [0, 0, 1, 1, 0, 0, 1, 1]
# Prompt/observation positions hold 100.0: if the recursion ever read them, the numbers would
# be wildly off, which is how the test proves the observation tokens are skipped.
TWO_TURN_VALUES = [100.0, 100.0, 0.5, 0.6, 100.0, 100.0, 0.4, 0.8]


def test_skip_observation_gae_two_turns_by_hand() -> None:
    mask = torch.tensor([TWO_TURN_MASK], dtype=F64)
    values = torch.tensor([TWO_TURN_VALUES], dtype=F64)
    rewards = outcome_token_rewards(torch.tensor([1.0], dtype=F64), mask)
    adv, ret = skip_observation_gae(rewards, values, mask, gamma=1.0, lam=0.5)
    # Backwards over action tokens 7, 6, 3, 2 (gamma = 1, lam = 0.5):
    #   t=7 (last, episode ends): delta = 1 + 0 - 0.8 = 0.2;            A7 = 0.2
    #   t=6 -> 7:                 delta = 0 + 0.8 - 0.4 = 0.4;          A6 = 0.4 + 0.5*0.2 = 0.5
    #   t=3 -> 6 (skips 4, 5):    delta = 0 + 0.4 - 0.6 = -0.2;         A3 = -0.2 + 0.5*0.5 = 0.05
    #   t=2 -> 3:                 delta = 0 + 0.6 - 0.5 = 0.1;          A2 = 0.1 + 0.5*0.05 = 0.125
    # Had t=3 linked to the observation at t=4, delta3 would be 100 - 0.6 = 99.4.
    # Returns = A + V: R2 = 0.625, R3 = 0.65, R6 = 0.9, R7 = 1.0; zero off the action tokens.
    expected_adv = torch.tensor([[0, 0, 0.125, 0.05, 0, 0, 0.5, 0.2]], dtype=F64)
    expected_ret = torch.tensor([[0, 0, 0.625, 0.65, 0, 0, 0.9, 1.0]], dtype=F64)
    assert torch.allclose(adv, expected_adv, atol=1e-12)
    assert torch.allclose(ret, expected_ret, atol=1e-12)


def test_lambda_one_gives_monte_carlo_reward_to_go() -> None:
    # Rewards on action tokens 2 (0.5) and 7 (1.0). With lam = 1 the value terms telescope:
    # A_i = sum_k gamma^k r_(k-th action token after i) - V_i, so returns = reward-to-go counted
    # in action-token steps, whatever the values are.
    mask = torch.tensor([TWO_TURN_MASK], dtype=F64)
    rewards = torch.tensor([[0, 0, 0.5, 0, 0, 0, 0, 1.0]], dtype=F64)
    values = torch.randn(1, 8, dtype=F64, generator=torch.Generator().manual_seed(0))
    _, ret = skip_observation_gae(rewards, values, mask, gamma=1.0, lam=1.0)
    # gamma = 1: R2 = 0.5 + 1 = 1.5, R3 = R6 = R7 = 1.
    assert torch.allclose(ret, torch.tensor([[0, 0, 1.5, 1, 0, 0, 1, 1]], dtype=F64), atol=1e-12)
    _, ret = skip_observation_gae(rewards, values, mask, gamma=0.9, lam=1.0)
    # gamma = 0.9, steps between action tokens (observations do not count as steps):
    # R7 = 1, R6 = 0.9, R3 = 0.81, R2 = 0.5 + 0.729 = 1.229.
    expected = torch.tensor([[0, 0, 1.229, 0.81, 0, 0, 0.9, 1.0]], dtype=F64)
    assert torch.allclose(ret, expected, atol=1e-12)


def test_batch_with_padding_matches_hand_values() -> None:
    mask = torch.tensor(
        [
            TWO_TURN_MASK,
            [0, 1, 1, 0, 1, 0, 0, 0],  # [p, a, a, o, a] + 3 padding tokens
            [0, 0, 0, 0, 0, 0, 0, 0],  # a row with no action token at all
        ],
        dtype=F64,
    )
    values = torch.tensor(
        [TWO_TURN_VALUES, [7.0, 0.2, 0.3, 7.0, 0.5, 7.0, 7.0, 7.0], [3.0] * 8], dtype=F64
    )
    rewards = outcome_token_rewards(torch.tensor([1.0, 2.0, 5.0], dtype=F64), mask)
    adv, ret = skip_observation_gae(rewards, values, mask, gamma=1.0, lam=0.5)
    # Row 1 (gamma = 1, lam = 0.5), action tokens 4, 2, 1; padding values 7.0 are never read:
    #   t=4: delta = 2 - 0.5 = 1.5;           A4 = 1.5
    #   t=2: delta = 0.5 - 0.3 = 0.2;         A2 = 0.2 + 0.5*1.5 = 0.95
    #   t=1: delta = 0.3 - 0.2 = 0.1;         A1 = 0.1 + 0.5*0.95 = 0.575
    #   returns: R4 = 2.0, R2 = 1.25, R1 = 0.775
    assert torch.allclose(adv[0], torch.tensor([0, 0, 0.125, 0.05, 0, 0, 0.5, 0.2], dtype=F64))
    assert torch.allclose(adv[1], torch.tensor([0, 0.575, 0.95, 0, 1.5, 0, 0, 0], dtype=F64))
    assert torch.allclose(ret[1], torch.tensor([0, 0.775, 1.25, 0, 2.0, 0, 0, 0], dtype=F64))
    # Row 2 has no action tokens: no reward placed, nothing estimated.
    assert torch.equal(adv[2], torch.zeros(8, dtype=F64))
    assert torch.equal(ret[2], torch.zeros(8, dtype=F64))


def test_per_trajectory_lambda_matches_row_by_row() -> None:
    gen = torch.Generator().manual_seed(1)
    mask = (torch.rand(3, 12, generator=gen) > 0.4).to(F64)
    values = torch.randn(3, 12, dtype=F64, generator=gen)
    rewards = torch.randn(3, 12, dtype=F64, generator=gen) * mask
    lam = decoupled_policy_lambda(mask.sum(dim=1)).to(F64)
    adv, ret = skip_observation_gae(rewards, values, mask, gamma=0.95, lam=lam)
    for b in range(3):
        row_adv, row_ret = skip_observation_gae(
            rewards[b : b + 1], values[b : b + 1], mask[b : b + 1], gamma=0.95, lam=lam[b].item()
        )
        assert torch.allclose(adv[b], row_adv[0], atol=1e-12)
        assert torch.allclose(ret[b], row_ret[0], atol=1e-12)
    # The rows really use different lambdas, so this is not a vacuous comparison.
    assert len(set(lam.tolist())) == 3


def test_gae_rejects_reward_on_observation_token() -> None:
    mask = torch.tensor([TWO_TURN_MASK], dtype=F64)
    rewards = torch.zeros(1, 8, dtype=F64)
    rewards[0, 4] = 1.0  # an observation token
    with pytest.raises(ValueError, match="non-action"):
        skip_observation_gae(rewards, torch.zeros_like(rewards), mask, gamma=1.0, lam=1.0)


def test_gae_outputs_are_detached() -> None:
    mask = torch.tensor([TWO_TURN_MASK], dtype=F64)
    values = torch.tensor([TWO_TURN_VALUES], dtype=F64, requires_grad=True)
    adv, ret = skip_observation_gae(torch.zeros(1, 8, dtype=F64), values, mask, 1.0, 0.5)
    assert not adv.requires_grad and not ret.requires_grad


def test_masked_mean_and_whiten() -> None:
    x = torch.tensor([1.0, 2.0, 3.0, math.inf])
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])
    # inf sits outside the mask and must not leak: mean = (1 + 2 + 3) / 3 = 2.
    assert masked_mean(x, mask).item() == 2.0
    assert masked_mean(x, torch.zeros(4)).item() == 0.0
    # var = ((1-2)^2 + 0 + (3-2)^2) / 3 = 2/3, std = sqrt(2/3) = 0.81650;
    # whitened = (-1, 0, 1) / 0.81650 = (-1.22474, 0, 1.22474), 0 on the masked slot.
    w = masked_whiten(x, mask, eps=0.0)
    assert torch.allclose(w, torch.tensor([-1.224745, 0.0, 1.224745, 0.0]), atol=1e-5)
    # shift_mean=False adds the mean 2 back: (0.77526, 2, 3.22474).
    w = masked_whiten(x, mask, shift_mean=False, eps=0.0)
    assert torch.allclose(w, torch.tensor([0.775255, 2.0, 3.224745, 0.0]), atol=1e-5)


def test_explained_variance_by_hand() -> None:
    mask = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0])
    returns = torch.tensor([1.0, 2.0, 3.0, 4.0, 50.0])
    values = torch.tensor([1.0, 2.0, 3.0, 2.0, -50.0])
    # Var[returns] over the mask: mean 2.5, squared deviations 2.25 + 0.25 + 0.25 + 2.25 = 5,
    # / 4 = 1.25. Residual returns - values = (0, 0, 0, 2): mean 0.5, squared deviations
    # 0.25 * 3 + 2.25 = 3, / 4 = 0.75. EV = 1 - 0.75 / 1.25 = 0.4.
    assert explained_variance(values, returns, mask) == pytest.approx(0.4, abs=1e-9)
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    # Predicting the mean return everywhere explains nothing: 1 - 1.25 / 1.25 = 0.
    assert explained_variance(torch.full((5,), 2.5), returns, mask) == pytest.approx(0.0)
    # Constant returns (e.g. every trajectory got reward 0): undefined, reported as 0.0.
    assert explained_variance(values, torch.full((5,), 0.3), mask) == 0.0
    assert explained_variance(values, returns, torch.zeros(5)) == 0.0
