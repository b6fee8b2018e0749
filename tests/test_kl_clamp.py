"""The k3 KL estimate is clamped (algo.kl_k3_clamp): bounded value and gradient, k3 itself where
it is below the clamp."""

from __future__ import annotations

import math

import pytest
import torch

from support import step_algo, step_grads
from tiderl.algos.regularizers import K3_CLAMP, k3_clamped, kl_estimate, kl_reward_penalty
from tiderl.config import ConfigError, load_config

F64 = torch.float64


def k3_and_grad(x: list[float], clamp: float = K3_CLAMP) -> tuple[list[float], list[float]]:
    """k3 on one action token per x (logprobs = x, ref = 0) and d k3 / d logprobs."""
    lp = torch.tensor([x], dtype=F64, requires_grad=True)
    k = kl_estimate(lp, torch.zeros_like(lp), torch.ones_like(lp), "k3", clamp)
    k.sum().backward()
    return k.detach()[0].tolist(), lp.grad[0].tolist()


def test_the_reported_case_is_bounded():
    # Unclamped, x = logp - ref = -15 gives exp(15) - 16 = 3.3e6 and a gradient of 1 - exp(15) = -3.3e6.
    value, grad = k3_and_grad([-15.0])
    assert value == [K3_CLAMP] and grad == [0.0]


@pytest.mark.parametrize("clamp", [0.5, 1.0, 10.0, 100.0])
def test_value_and_gradient_are_bounded_everywhere(clamp):
    xs = [-1e4, -700.0, -50.0] + [i / 10 for i in range(-300, 301)] + [50.0, 700.0, 1e4]
    values, grads = k3_and_grad(xs, clamp)
    assert all(math.isfinite(v) and 0.0 <= v <= clamp for v in values)
    bound = clamp + math.log(2 * clamp + 2)
    assert all(math.isfinite(g) and abs(g) <= bound for g in grads)
    # Not a loose bound: just inside the clamp the gradient's size is k3(x) - x, more than 0.9 c.
    assert max(abs(g) for g in grads) > 0.9 * clamp


def test_below_the_clamp_it_is_k3_itself():
    xs = [i / 20 for i in range(-50, 201)]  # k3(-2.5) = 9.68 < 10; k3(10) = 9.00005 < 10
    values, grads = k3_and_grad(xs)
    for x, v, g in zip(xs, values, grads):
        assert v == pytest.approx(math.exp(-x) - 1 + x, rel=1e-12, abs=1e-15)
        assert g == pytest.approx(1 - math.exp(-x), rel=1e-12, abs=1e-15)


def test_k3_clamped_by_hand_and_off_action_tokens():
    # k3(-3) = e^3 - 4 = 16.09 > 10 -> 10; k3(1) = e^-1 = 0.3679; k3(12) = 11.000006 > 10 -> 10.
    assert k3_clamped(torch.tensor([-3.0, 1.0, 12.0], dtype=F64)).tolist() == pytest.approx([10.0, math.exp(-1), 10.0])
    lp = torch.tensor([[-15.0, -math.inf]], dtype=F64, requires_grad=True)
    k = kl_estimate(lp, torch.zeros_like(lp), torch.tensor([[1.0, 0.0]]), "k3")
    k.sum().backward()
    assert k.tolist() == [[10.0, 0.0]] and lp.grad.tolist() == [[0.0, 0.0]]
    with pytest.raises(ValueError, match="positive finite"):
        k3_clamped(torch.zeros(1), 0.0)


def test_the_reward_penalty_uses_the_clamp():
    rewards = torch.zeros(1, 2, dtype=F64)
    old = torch.tensor([[-15.0, 0.0]], dtype=F64)
    shaped, kl = kl_reward_penalty(rewards, old, torch.zeros_like(old), torch.ones_like(old), 0.1, "k3", 2.0)
    assert kl.tolist() == [[2.0, 0.0]] and shaped.tolist() == [[-0.2, 0.0]]


def test_the_config_field_is_validated_and_only_read_with_k3():
    assert load_config(None, []).algo.kl_k3_clamp == K3_CLAMP
    assert load_config(None, ["algo.kl_coef=0.1", "algo.kl_k3_clamp=5"]).algo.kl_k3_clamp == 5.0
    for bad in ("0", "-1", ".nan"):
        with pytest.raises(ConfigError, match="algo.kl_k3_clamp"):
            load_config(None, ["algo.kl_coef=0.1", f"algo.kl_k3_clamp={bad}"])
    with pytest.raises(ConfigError, match="only the k3 KL estimator reads it"):
        load_config(None, ["algo.kl_coef=0.1", "algo.kl_estimator=k1", "algo.kl_k3_clamp=5"])


def test_train_step_reads_the_clamp(trajectories):
    # The same step with the default clamp and with a tiny one: the KL term the loss sees is
    # capped at the configured value, through AlgoConfig into train_step.
    free = step_grads(step_algo("grpo"), trajectories, 10_000)[2]["kl/ref_kl_mean"]
    capped = step_grads(step_algo("grpo", kl_k3_clamp=1e-3), trajectories, 10_000)[2]["kl/ref_kl_mean"]
    assert free > 1e-3 >= capped > 0
