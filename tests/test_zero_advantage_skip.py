"""`train_step` leaves trajectories whose advantages are all 0 out of the actor's passes only
when that cannot change the update (`train.skip_zero_advantage`,
`registry.zero_advantage_rows_skippable`)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tiderl.algos.losses import PolicyLossInputs
from tiderl.algos.registry import zero_advantage_rows_skippable
from tiderl.config import AlgoConfig, preset_defaults
from tiderl.embedded.tiny import init_tiny_model, tiny_qwen2_config
from tiderl.train.learner import Learner
from tiderl.train.step import train_step
from tiderl.types import NO_VERSION, Trajectory

MODEL_CFG = tiny_qwen2_config(50, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                              max_position_embeddings=64)


def batch(rewards: list[list[float]], seed: int = 0) -> list[Trajectory]:
    """One group per inner list (one prompt each), completions of different lengths, behaviour
    log-probs near the (nearly uniform) model's own, so that ratios differ from 1 but stay in
    every band."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for q, group in enumerate(rewards):
        prompt = torch.randint(3, 50, (4,), generator=g).tolist()
        for r in group:
            n = int(torch.randint(2, 9, (1,), generator=g))
            tokens = prompt + torch.randint(3, 50, (n,), generator=g).tolist()
            mask = [0] * len(prompt) + [1] * n
            behavior = [float(-3.9 + 0.2 * torch.rand(1, generator=g)) if m else 0.0 for m in mask]
            out.append(Trajectory(tokens=tokens, loss_mask=mask, behavior_logprobs=behavior,
                                  policy_version=[0 if m else NO_VERSION for m in mask], reward=r,
                                  group_id=f"q{q}", task_id=f"q{q}"))
    return out


def algo(**overrides) -> AlgoConfig:
    d = preset_defaults("grpo")
    d.update(group_size=4, kl_coef=0.0)
    d.update(overrides)
    return AlgoConfig(**d)


def run(cfg: AlgoConfig, batches: list[list[Trajectory]], skip: bool, micro_batch_tokens: int = 30,
        lr: float = 1e-2) -> tuple[dict[str, torch.Tensor], torch.Tensor, list[dict[str, float]]]:
    """The weights after one optimizer step per batch (AdamW), the last step's gradient (one
    vector), and each step's metrics plus "tokens_in": the input tokens the model's forward
    passes saw."""
    learner = Learner(init_tiny_model(MODEL_CFG, seed=0), lr=lr, weight_decay=0.01, grad_clip=0.0)
    seen = [0]

    def count(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        seen[0] += int(ids.numel())

    learner.model.register_forward_pre_hook(count, with_kwargs=True)
    metrics = []
    for b in batches:
        seen[0] = 0
        metrics.append(train_step(b, learner, None, None, cfg, pad_id=0, micro_batch_tokens=micro_batch_tokens,
                                  train_actor=True, skip_zero_advantage=skip))
        metrics[-1]["tokens_in"] = seen[0]
    grads = torch.cat([p.grad.flatten() for p in learner.params])
    return {n: p.detach().clone() for n, p in learner.model.named_parameters()}, grads, metrics


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    for name, w in a.items():
        torch.testing.assert_close(b[name], w, atol=1e-6, rtol=1e-5, msg=f"weights {name}")


@pytest.mark.parametrize("loss", ["ppo", "dis", "cispo", "gspo", "decoupled_ppo"])
def test_skipping_equal_reward_groups_gives_the_same_update(loss) -> None:
    cfg = algo(policy_loss=loss)
    # Group q0 has equal rewards (advantages exactly 0), q1 and q2 do not.
    # (Gradients are compared, not AdamW's update: its division by sqrt(v) blows float rounding of
    # near-zero gradients up to full-size steps.)
    steps = [batch([[1.0] * 4, [0.0, 1.0, 0.0, 0.0], [1.0, 1.0, 0.0, 1.0]])]
    _, g_full, m_full = run(cfg, steps, skip=False, lr=0.0)
    _, g_skip, m_skip = run(cfg, steps, skip=True, lr=0.0)
    assert g_full.abs().max() > 1e-3
    torch.testing.assert_close(g_skip, g_full, atol=1e-7, rtol=1e-5)
    assert m_skip[0]["policy/zero_adv_skipped_frac"] == pytest.approx(4 / 12)
    assert "policy/zero_adv_skipped_frac" not in m_full[0]
    assert m_skip[0]["policy/loss"] == pytest.approx(m_full[0]["policy/loss"], abs=1e-6)
    assert m_skip[0]["policy/grad_norm"] == pytest.approx(m_full[0]["policy/grad_norm"], rel=1e-5)
    # The skipped rows really were left out of the forward passes.
    assert 0 < m_skip[0]["tokens_in"] < m_full[0]["tokens_in"]


def test_a_batch_without_signal_still_takes_the_optimizer_step() -> None:
    # After a step with signal AdamW's moments are non-zero, so a zero gradient still moves the
    # weights; leaving every row out must not skip that step.
    cfg = algo()
    steps = [batch([[0.0, 1.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0]], seed=0),
             batch([[1.0] * 4, [0.0] * 4], seed=1)]
    w_full, _, _ = run(cfg, steps, skip=False)
    w_skip, _, m_skip = run(cfg, steps, skip=True)
    assert m_skip[1]["policy/zero_adv_skipped_frac"] == pytest.approx(7 / 8)  # one row kept
    assert_same_weights(w_full, w_skip)
    w_first, _, _ = run(cfg, steps[:1], skip=True)
    assert any(not torch.equal(w_first[n], w) for n, w in w_skip.items())


def test_not_skipped_when_a_term_does_not_vanish_at_zero_advantage() -> None:
    steps = [batch([[1.0] * 4, [0.0, 1.0, 0.0, 0.0]])]
    for cfg in (algo(entropy_coef=0.01), algo(policy_loss=f"{__name__}:logprob_loss")):
        assert not zero_advantage_rows_skippable(cfg)
        _, _, metrics = run(cfg, steps, skip=True)
        assert "policy/zero_adv_skipped_frac" not in metrics[0]
    assert not zero_advantage_rows_skippable(algo(kl_coef=0.1))  # a KL term in the loss
    # KL folded into the reward leaves the loss itself vanishing at A = 0.
    assert zero_advantage_rows_skippable(algo(kl_coef=0.1, kl_in_reward=True))
    assert zero_advantage_rows_skippable(algo(policy_loss=f"{__name__}:opted_in_loss"))
    # SAO's GAE advantages are not 0, so nothing is left out.
    sao = AlgoConfig(**preset_defaults("sao"))
    assert zero_advantage_rows_skippable(sao)


def logprob_loss(inp: PolicyLossInputs, cfg) -> tuple[torch.Tensor, dict[str, float]]:
    """A user's loss that moves the policy whatever the advantages."""
    return -(inp.logprobs * inp.action_mask), {}


def opted_in_loss(inp: PolicyLossInputs, cfg) -> tuple[torch.Tensor, dict[str, float]]:
    return -(inp.logprobs * inp.advantages * inp.action_mask), {}


opted_in_loss.zero_at_zero_advantage = True  # type: ignore[attr-defined]


@pytest.mark.slow
def test_skipping_with_one_micro_batch_per_row_and_two_actor_updates() -> None:
    cfg = dataclasses.replace(algo(), actor_updates=2)
    steps = [batch([[1.0] * 4, [0.0, 1.0, 0.0, 0.0], [0.0] * 4], seed=3)]
    _, g_full, _ = run(cfg, steps, skip=False, micro_batch_tokens=1, lr=0.0)
    _, g_skip, m = run(cfg, steps, skip=True, micro_batch_tokens=1, lr=0.0)
    assert m[0]["policy/zero_adv_skipped_frac"] == pytest.approx(8 / 12)
    assert m[0]["micro_batches"] == 12  # the batch's count; the actor ran 4 of them
    torch.testing.assert_close(g_skip, g_full, atol=1e-7, rtol=1e-5)
