"""Policy and value losses against numbers and gradients derived by hand."""

from __future__ import annotations

import math

import pytest
import torch

from tiderl.algos.aggregation import aggregate
from tiderl.algos.losses import dis_token_loss, ppo_token_loss, value_loss

EPS_LOW, EPS_HIGH = 0.3, 5.0  # SAO's band for math/tool reasoning: (0.7, 6.0)


# The token losses as SAO aggregates them: the sum over action tokens / normalizer (token mean
# over the whole batch, dropped tokens included in the denominator).
def dis_token_mean(logprobs, behavior, adv, mask, eps_low, eps_high, normalizer):
    token_loss, metrics = dis_token_loss(logprobs, behavior, adv, mask, eps_low, eps_high)
    return aggregate(token_loss, mask, "token-mean", normalizer), metrics


def ppo_token_mean(logprobs, old, adv, mask, eps_low, eps_high, normalizer):
    token_loss, metrics = ppo_token_loss(logprobs, old, adv, mask, eps_low, eps_high)
    return aggregate(token_loss, mask, "token-mean", normalizer), metrics


def _logprobs_for_ratios(ratios: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """Current log-probs whose ratio to a behaviour log-prob of 0 is each given ratio.

    The log-ratios are math.log(r) in float64 rounded once to float32, exactly how the loss
    rounds its band edges log(1 - eps_low) and log(1 + eps_high); with behavior = 0 the
    subtraction is exact, so a ratio built on a band edge lands bit-exactly on it. (exp() would
    not round-trip: float32 exp(log(0.7)) is not 0.7, and torch.log(tensor(0.7)) differs from
    float32(math.log(0.7)) by one ulp, which is why the loss compares in log space.)
    """
    logprobs = torch.tensor([[math.log(r) for r in ratios]], requires_grad=True)
    return logprobs, torch.zeros_like(logprobs)


def test_dis_paper_example_keeps_0110() -> None:
    # papers.md: ratios [0.7, 0.8, 2.0, 6.0] with eps (0.3, 5.0) keep [0, 1, 1, 0]. The band is
    # the open interval (0.7, 6.0): 0.7 and 6.0 sit exactly on its edges, dropped (strict).
    logprobs, behavior = _logprobs_for_ratios([1 - EPS_LOW, 0.8, 2.0, 1 + EPS_HIGH])
    adv = torch.ones(1, 4)
    mask = torch.ones(1, 4)
    loss, metrics = dis_token_mean(logprobs, behavior, adv, mask, EPS_LOW, EPS_HIGH, normalizer=4)
    loss.backward()
    # Kept tokens: gradient of -sg(r) * A * logp / N is -r * A / N:
    #   r=0.8: -0.8/4 = -0.2;  r=2.0: -2/4 = -0.5;  dropped tokens: exactly 0.
    assert logprobs.grad is not None
    assert torch.allclose(logprobs.grad, torch.tensor([[0.0, -0.2, -0.5, 0.0]]), atol=1e-6)
    assert logprobs.grad[0, 0].item() == 0.0 and logprobs.grad[0, 3].item() == 0.0
    # Loss: -(0.8 * log 0.8 + 2 * log 2) / 4 = -(0.8 * -0.223144 + 2 * 0.693147) / 4
    #     = -(-0.178515 + 1.386294) / 4 = -1.207779 / 4 = -0.301945.
    # The dropped tokens still count in the denominator (4, not 2).
    assert loss.item() == pytest.approx(-0.301945, abs=1e-5)
    assert metrics["dis_masked_frac"] == 0.5
    assert metrics["dis_low_frac"] == 0.25 and metrics["dis_high_frac"] == 0.25
    # ratio_mean = (0.7 + 0.8 + 2 + 6) / 4 = 2.375; min 0.7; max 6.
    assert metrics["ratio_mean"] == pytest.approx(2.375, abs=1e-5)
    assert metrics["ratio_min"] == pytest.approx(0.7, abs=1e-6)
    assert metrics["ratio_max"] == pytest.approx(6.0, abs=1e-5)
    # k3 per token, r - 1 - log r: 0.7 -> 0.056675, 0.8 -> 0.023144, 2 -> 0.306853,
    # 6 -> 3.208241; mean = 3.594913 / 4 = 0.898728.
    assert metrics["approx_kl"] == pytest.approx(0.898728, abs=1e-5)
    assert metrics["num_action_tokens"] == 4.0


def test_dis_keeps_ratios_just_inside_the_band() -> None:
    logprobs, behavior = _logprobs_for_ratios([0.7 * 1.001, 6.0 * 0.999])
    _, metrics = dis_token_mean(
        logprobs, behavior, torch.ones(1, 2), torch.ones(1, 2), EPS_LOW, EPS_HIGH, normalizer=2
    )
    assert metrics["dis_masked_frac"] == 0.0


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_dis_vs_ppo_gradients_clearly_outside_band(sign: float) -> None:
    # Ratios [0.5, 0.8, 2.0, 8.0]: one clearly below the band (0.7, 6.0), two inside, one
    # clearly above. A = sign everywhere, N = 4. Per-token gradient where it flows: -r * A / 4.
    ratios = [0.5, 0.8, 2.0, 8.0]
    mask = torch.ones(1, 4)
    adv = torch.full((1, 4), sign)

    lp_dis, beh = _logprobs_for_ratios(ratios)
    dis_token_mean(lp_dis, beh, adv, mask, EPS_LOW, EPS_HIGH, 4)[0].backward()
    lp_ppo, old = _logprobs_for_ratios(ratios)
    ppo_loss, ppo_metrics = ppo_token_mean(lp_ppo, old, adv, mask, EPS_LOW, EPS_HIGH, 4)
    ppo_loss.backward()
    assert lp_dis.grad is not None and lp_ppo.grad is not None

    # DIS: only the in-band tokens get gradient, for either sign: [0, -0.2, -0.5, 0] * sign.
    assert torch.allclose(lp_dis.grad, sign * torch.tensor([[0.0, -0.2, -0.5, 0.0]]), atol=1e-6)
    if sign > 0:
        # PPO, A > 0: -min(rA, clip(r)A). r=0.5 < 0.7: rA = 0.5 < 0.7 = clip(r)A, the unclipped
        # branch wins, gradient -0.5/4 = -0.125 flows. r=8 > 6: clip(r)A = 6 < 8, the constant
        # clipped branch wins, gradient 0.
        expected_ppo = [-0.125, -0.2, -0.5, 0.0]
        # Loss: -(0.5 + 0.8 + 2.0 + 6.0) / 4 = -9.3 / 4 = -2.325.
        assert ppo_loss.item() == pytest.approx(-2.325, abs=1e-5)
    else:
        # PPO, A < 0: r=0.5: rA = -0.5 > clip(r)A = -0.7, the clipped branch wins, gradient 0.
        # r=8: rA = -8 < clip(r)A = -6, the UNCLIPPED branch wins, so the token keeps the full
        # gradient -r*A/4 = 8/4 = 2.0 however far the ratio has drifted. DIS gives it 0.
        expected_ppo = [0.0, 0.2, 0.5, 2.0]
        # Loss: -(-0.7 - 0.8 - 2.0 - 8.0) / 4 = 11.5 / 4 = 2.875.
        assert ppo_loss.item() == pytest.approx(2.875, abs=1e-5)
    assert torch.allclose(lp_ppo.grad, torch.tensor([expected_ppo]), atol=1e-6)
    # In each case exactly one token of four has its gradient cut by the clip.
    assert ppo_metrics["clip_frac"] == 0.25


def test_dis_vs_ppo_gradients_on_paper_example() -> None:
    # Ratios [0.7, 0.8, 2.0, 6.0]: 0.7 and 6.0 lie exactly on PPO's clip bounds. Only the cases
    # that do not depend on how exp() rounds at a bound are asserted for PPO:
    #   A = +1, r = 0.7: rA <= clip(r)A on either side of the bound (and torch.clamp passes
    #     gradient at the bound itself), so PPO's gradient is -0.7/4 = -0.175.
    #   A = -1, r = 6.0: rA <= clip(r)A likewise, so PPO's gradient is +6/4 = 1.5.
    # DIS gives both tokens exactly 0 for either sign.
    ratios = [1 - EPS_LOW, 0.8, 2.0, 1 + EPS_HIGH]
    mask = torch.ones(1, 4)
    for sign, token, ppo_grad in [(1.0, 0, -0.175), (-1.0, 3, 1.5)]:
        adv = torch.full((1, 4), sign)
        lp_dis, beh = _logprobs_for_ratios(ratios)
        dis_token_mean(lp_dis, beh, adv, mask, EPS_LOW, EPS_HIGH, 4)[0].backward()
        lp_ppo, old = _logprobs_for_ratios(ratios)
        ppo_token_mean(lp_ppo, old, adv, mask, EPS_LOW, EPS_HIGH, 4)[0].backward()
        assert lp_dis.grad is not None and lp_ppo.grad is not None
        assert lp_dis.grad[0, 0].item() == 0.0 and lp_dis.grad[0, 3].item() == 0.0
        assert lp_ppo.grad[0, token].item() == pytest.approx(ppo_grad, abs=1e-5)
        # Inside the band both losses give the same gradient, -r*A/4: 0.8 -> -0.2, 2 -> -0.5.
        for grad in (lp_dis.grad, lp_ppo.grad):
            assert grad[0, 1:3].tolist() == pytest.approx([-0.2 * sign, -0.5 * sign], abs=1e-6)


def test_ppo_clip_frac_with_mixed_signs() -> None:
    # Ratios [0.5, 0.8, 2.0, 8.0], A = [-1, 1, -1, 1]: the clip cuts r=0.5 (A<0, below the band)
    # and r=8 (A>0, above it): 2 of 4.
    lp, old = _logprobs_for_ratios([0.5, 0.8, 2.0, 8.0])
    adv = torch.tensor([[-1.0, 1.0, -1.0, 1.0]])
    _, metrics = ppo_token_mean(lp, old, adv, torch.ones(1, 4), EPS_LOW, EPS_HIGH, 4)
    assert metrics["clip_frac"] == 0.5


def test_padding_with_inf_logprobs_gives_finite_loss_and_zero_grad() -> None:
    logprobs = torch.tensor([[-0.1, -0.2, -math.inf, -math.inf]], requires_grad=True)
    behavior = torch.tensor([[-0.1, -0.3, 0.0, -math.inf]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    adv = torch.tensor([[1.0, -1.0, 5.0, 5.0]])
    for fn in (dis_token_mean, ppo_token_mean):
        logprobs.grad = None
        loss, metrics = fn(logprobs, behavior, adv, mask, EPS_LOW, EPS_HIGH, 2)
        loss.backward()
        assert logprobs.grad is not None
        assert torch.isfinite(loss) and torch.isfinite(logprobs.grad).all()
        assert logprobs.grad[0, 2:].tolist() == [0.0, 0.0]
        assert metrics["num_action_tokens"] == 2.0


def _random_batch(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.rand(4, 7, generator=gen) > 0.3).float()
    behavior = -torch.rand(4, 7, generator=gen) * 3
    # Log-ratios with std 0.8 put a fair share of tokens outside (0.7, 6.0) and PPO's clip.
    current = (behavior + torch.randn(4, 7, generator=gen) * 0.8).requires_grad_(True)
    return {
        "mask": mask,
        "behavior": behavior,
        "current": current,
        "adv": torch.randn(4, 7, generator=gen),
        "values": torch.randn(4, 7, generator=gen).requires_grad_(True),
        "old_values": torch.randn(4, 7, generator=gen),
        "returns": torch.randn(4, 7, generator=gen),
    }


def _all_losses(d: dict[str, torch.Tensor], rows: slice, normalizer: float) -> torch.Tensor:
    m = d["mask"][rows]
    dis, metrics = dis_token_mean(
        d["current"][rows], d["behavior"][rows], d["adv"][rows], m, EPS_LOW, EPS_HIGH, normalizer
    )
    ppo, _ = ppo_token_mean(
        d["current"][rows], d["behavior"][rows], d["adv"][rows], m, 0.2, 0.28, normalizer
    )
    val, _ = value_loss(
        d["values"][rows], d["returns"][rows], m, normalizer, d["old_values"][rows], 0.2
    )
    # The batch must exercise the band, or this test would not cover masked tokens.
    assert 0.0 < metrics["dis_masked_frac"] < 1.0
    return dis + ppo + val


def test_micro_batches_with_global_normalizer_add_up_to_the_batch() -> None:
    full = _random_batch(0)
    n_tokens = full["mask"].sum().item()  # action tokens in the WHOLE batch
    full_loss = _all_losses(full, slice(0, 4), n_tokens)
    full_loss.backward()

    split = _random_batch(0)  # identical tensors, fresh gradients
    micro_total = torch.zeros(())
    for rows in (slice(0, 2), slice(2, 4)):
        micro = _all_losses(split, rows, n_tokens)
        micro.backward()  # gradients accumulate as in a trainer's micro-batch loop
        micro_total = micro_total + micro.detach()

    assert micro_total.item() == pytest.approx(full_loss.item(), abs=1e-6)
    for name in ("current", "values"):
        grad_full, grad_split = full[name].grad, split[name].grad
        assert grad_full is not None and grad_split is not None
        assert torch.allclose(grad_full, grad_split, atol=1e-6)


def test_value_loss_unclipped_by_hand() -> None:
    values = torch.tensor([[0.5, 2.0, 1.0, 9.0]], requires_grad=True)
    returns = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    loss, metrics = value_loss(values, returns, mask, normalizer=3)
    # 0.5 * ((0.5-1)^2 + (2-1)^2 + 0) / 3 = 0.5 * 1.25 / 3 = 0.208333; the padded 9.0 is ignored.
    assert loss.item() == pytest.approx(0.625 / 3, abs=1e-6)
    loss.backward()
    # d/dV = (V - R) / 3 = (-0.5/3, 1/3, 0, 0).
    assert values.grad is not None
    assert torch.allclose(values.grad, torch.tensor([[-0.5 / 3, 1 / 3, 0.0, 0.0]]), atol=1e-6)
    # value_mean = (0.5 + 2 + 1) / 3 = 1.166667; return_mean = 1.
    assert metrics["value_mean"] == pytest.approx(3.5 / 3, abs=1e-6)
    assert metrics["return_mean"] == pytest.approx(1.0)
    assert metrics["value_clip_frac"] == 0.0


def test_value_loss_clipped_by_hand() -> None:
    values = torch.tensor([[0.5, 2.0, 1.0, 9.0]], requires_grad=True)
    old_values = torch.tensor([[0.0, 1.5, 1.0, 0.0]])
    returns = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    loss, metrics = value_loss(values, returns, mask, 3, old_values=old_values, clip_eps=0.2)
    # Token 0: V - old = 0.5 -> clipped to 0.2, V_clip = 0.2; (0.5-1)^2 = 0.25 vs
    #   (0.2-1)^2 = 0.64: the clipped term wins, and it is constant in V -> gradient 0.
    # Token 1: V - old = 0.5 -> V_clip = 1.7; (2-1)^2 = 1.0 vs (1.7-1)^2 = 0.49: unclipped wins,
    #   gradient (V - R) / 3 = 1/3.
    # Token 2: V = old = R = 1: both terms 0.
    # Loss: 0.5 * (0.64 + 1.0 + 0) / 3 = 0.82 / 3 = 0.273333.
    assert loss.item() == pytest.approx(0.82 / 3, abs=1e-6)
    loss.backward()
    assert values.grad is not None
    assert torch.allclose(values.grad, torch.tensor([[0.0, 1 / 3, 0.0, 0.0]]), atol=1e-6)
    assert metrics["value_clip_frac"] == pytest.approx(1 / 3)


def test_bad_arguments_are_rejected() -> None:
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="both old_values and clip_eps"):
        value_loss(x, x, x, 1, old_values=x)
    with pytest.raises(ValueError, match="normalizer"):
        dis_token_mean(x, x, x, x, EPS_LOW, EPS_HIGH, normalizer=0)
    with pytest.raises(ValueError, match="eps_low"):
        ppo_token_mean(x, x, x, x, 0.0, EPS_HIGH, normalizer=1)
