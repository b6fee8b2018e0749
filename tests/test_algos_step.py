"""`train_step` with a tiny model: invariances, SAO as a preset, user-defined estimators and
losses, errors, filters. The fixture `trajectories` is conftest.py's (support.step_trajectories)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from support import STEP_MODEL_CFG, flat_grads, step_algo, step_critic, step_grads
from tiderl.algos.advantages import (
    decoupled_policy_lambda,
    masked_whiten,
    outcome_token_rewards,
    skip_observation_gae,
)
from tiderl.algos.losses import PolicyLossInputs, dis_token_loss, value_loss
from tiderl.algos.registry import needs_critic, needs_ref
from tiderl.config import preset_defaults
from tiderl.config import AlgoConfig
from tiderl.embedded.tiny import init_tiny_model
from tiderl.train.batching import collate
from tiderl.train.critic import ValueModel
from tiderl.train.forward import token_logprobs, token_values
from tiderl.train.learner import Learner
from tiderl.train.step import train_step
from tiderl.types import Trajectory

# Each preset, plus the options that no preset turns on by default.
CASES = {
    "sao": step_algo("sao"),
    "sao_whitened": step_algo("sao", normalize_advantages=True),
    "ppo": step_algo("ppo"),
    "grpo": step_algo("grpo"),
    "dr_grpo": step_algo("dr_grpo"),
    "dapo": step_algo("dapo"),
    "gspo": step_algo("gspo", eps_low=0.05, eps_high=0.05),
    "rloo": step_algo("rloo"),
    "reinforce_pp": step_algo("reinforce_pp"),
    "decoupled_ppo": step_algo("decoupled_ppo", dual_clip_c=3.0),
    "cispo": step_algo("cispo"),
    "grpo_k2_entropy_norm": step_algo("grpo", kl_estimator="k2", entropy_coef=0.01,
                                      loss_agg="seq-mean-token-sum-norm", loss_agg_length=16,
                                      old_logprobs="recompute"),
    "ppo_after_clip_k1reward": step_algo("ppo", advantage_values="after", value_clip=0.2,
                                         kl_coef=0.05, kl_in_reward=True, kl_estimator="k1",
                                         actor_updates=2),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_micro_batching_does_not_change_the_gradient(case, trajectories) -> None:
    # One micro-batch holding everything, and micro-batches of at most 40 padded tokens: the
    # losses are normalised over the whole step, so the accumulated gradients must agree
    # within 1e-6.
    cfg = CASES[case]
    actor_one, critic_one, m_one = step_grads(cfg, trajectories, 10_000)
    actor_mb, critic_mb, m_mb = step_grads(cfg, trajectories, 40)
    assert m_one["micro_batches"] == 1 and m_mb["micro_batches"] > 2
    assert actor_one.abs().max() > 0
    assert torch.allclose(actor_one, actor_mb, atol=1e-6)
    if critic_one is not None:
        assert critic_mb is not None
        assert torch.allclose(critic_one, critic_mb, atol=1e-6)
    assert m_mb["policy/loss"] == pytest.approx(m_one["policy/loss"], abs=1e-6)


def _sao_grads(trajs, fn) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    actor = Learner(init_tiny_model(STEP_MODEL_CFG, seed=0), lr=0.0, grad_clip=0.0)
    critic = step_critic(actor)
    metrics = fn(actor, critic)
    return flat_grads(actor), flat_grads(critic), metrics


def test_the_name_is_only_a_preset(trajectories) -> None:
    # train_step never reads algo.name: SAO's options under another name give the very same
    # gradients and metrics.
    sao = AlgoConfig(**preset_defaults("sao"))
    renamed = dataclasses.replace(sao, name="ppo")
    a = _sao_grads(trajectories, lambda x, c: train_step(trajectories, x, c, None, sao, 0, 40, True))
    b = _sao_grads(trajectories,
                   lambda x, c: train_step(trajectories, x, c, None, renamed, 0, 40, True))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert a[2] == b[2]


def _sao_by_hand(trajs: list[Trajectory], actor: Learner, critic: Learner, cfg: AlgoConfig
                 ) -> None:
    """SAO's step written out from the pure functions on one batch without micro-batches: critic
    values, Monte-Carlo targets, K value-loss steps (lr 0, so all see the same critic), GAE with
    the decoupled lambda (whitened with masked_whiten if configured), DIS token mean."""
    b = collate(trajs, 0)
    mask, n = b.action_mask, float(b.action_mask.sum())
    with torch.no_grad():
        values = token_values(critic.model, b.input_ids, b.attention_mask)
    rewards = outcome_token_rewards(b.rewards, mask)
    _, returns = skip_observation_gae(rewards, values, mask, cfg.gamma, cfg.critic_lambda)
    for _ in range(cfg.critic_updates):
        critic.step([b], lambda m: value_loss(
            token_values(critic.model, m.input_ids, m.attention_mask), returns, mask, n))
    lam = decoupled_policy_lambda(b.num_action_tokens, cfg.lambda_alpha)
    adv, _ = skip_observation_gae(rewards, values, mask, cfg.gamma, lam)
    if cfg.normalize_advantages:
        adv = masked_whiten(adv, mask)

    def actor_loss(m):
        lp, _ = token_logprobs(actor.model, m.input_ids, m.attention_mask)
        token_loss, metrics = dis_token_loss(lp, m.behavior_logprobs, adv, mask, cfg.eps_low,
                                             cfg.eps_high)
        return token_loss.sum() / n, metrics

    actor.step([b], actor_loss)


@pytest.mark.parametrize("whiten", [False, True])
def test_sao_preset_is_sao_by_hand(trajectories, whiten) -> None:
    # The sao preset through the generic step, in micro-batches of at most 40 tokens, gives the
    # gradients of SAO written out by hand; whitening is masked_whiten (population variance).
    sao = AlgoConfig(**{**preset_defaults("sao"), "normalize_advantages": whiten})
    mine = _sao_grads(trajectories, lambda a, c: train_step(trajectories, a, c, None, sao, 0, 40,
                                                            True))
    hand = _sao_grads(trajectories, lambda a, c: _sao_by_hand(trajectories, a, c, sao))
    assert torch.allclose(mine[0], hand[0], atol=1e-6)
    assert torch.allclose(mine[1], hand[1], atol=1e-6)
    for key in ("dis/masked_frac", "dis/low_frac", "dis/high_frac", "dis/ratio_mean",
                "dis/ratio_max", "dis/approx_kl", "policy/entropy", "policy/loss",
                "policy/grad_norm", "value/loss", "value/loss_first", "value/grad_norm",
                "value/explained_variance", "value/mean", "value/return_mean",
                "policy/advantage_mean", "policy/advantage_abs_mean", "micro_batches",
                "value/precomputed"):
        assert key in mine[2], key
    assert mine[2]["value/precomputed"] == 0.0
    if whiten:
        assert mine[2]["policy/advantage_mean"] == pytest.approx(0.0, abs=1e-6)


def test_sao_step_trains_both_and_precomputed_values_change_nothing(trajectories) -> None:
    sao = AlgoConfig(**preset_defaults("sao"))
    actor = Learner(init_tiny_model(STEP_MODEL_CFG, seed=0), lr=1e-3)
    critic = step_critic(actor)
    critic.optimizer.param_groups[0]["lr"] = 1e-3
    before = [[p.detach().clone() for p in x.params] for x in (actor, critic)]
    train_step(trajectories, actor, critic, None, sao, 0, 40, True)
    for learner, old in zip((actor, critic), before):  # one SAO step moves actor and critic
        assert any(not torch.equal(p, q) for p, q in zip(learner.params, old))
    # Values computed ahead (the buffer's), equal to the live critic's, one float per token:
    # the same step (compared on the gradients, at lr 0).
    critic = step_critic(Learner(init_tiny_model(STEP_MODEL_CFG, seed=0), lr=0.0))
    annotated = []
    for t in trajectories:
        ids = torch.tensor([t.tokens])
        with torch.no_grad():
            v = token_values(critic.model, ids, torch.ones_like(ids))[0].tolist()
        annotated.append(dataclasses.replace(t, annotations={"values": v}))
    plain = _sao_grads(trajectories, lambda a, c: train_step(trajectories, a, c, None, sao, 0, 40,
                                                             True))
    pre = _sao_grads(annotated, lambda a, c: train_step(annotated, a, c, None, sao, 0, 40, True))
    assert plain[2]["value/precomputed"] == 0.0 and pre[2]["value/precomputed"] == 1.0
    assert torch.allclose(plain[0], pre[0], atol=1e-6)
    assert torch.allclose(plain[1], pre[1], atol=1e-6)
    for key in ("value/loss_first", "value/explained_variance", "policy/loss",
                "policy/advantage_mean", "dis/masked_frac"):
        assert pre[2][key] == pytest.approx(plain[2][key], abs=1e-6), key
    bad = [dataclasses.replace(t, annotations={"values": [0.0]}) for t in trajectories]
    with pytest.raises(ValueError, match="precomputed 'values'"):
        _sao_grads(bad, lambda a, c: train_step(bad, a, c, None, sao, 0, 40, True))


# A user's own estimator and loss, named by import path ("module:function").
def zero_advantages(inp, cfg) -> torch.Tensor:
    return torch.zeros_like(inp.action_mask)


def logprob_sum_loss(inp: PolicyLossInputs, cfg) -> tuple[torch.Tensor, dict[str, float]]:
    """-log pi on every action token: the gradient is the same whatever the advantages."""
    return -(inp.logprobs * inp.action_mask), {"my_metric": 1.0, "mine/other": 2.0}


def test_user_estimator_and_loss_by_import_path(trajectories) -> None:
    # An estimator that returns zeros: a ppo loss then has value and gradient 0, only the
    # entropy bonus moves the actor.
    cfg = step_algo("reinforce_pp", kl_coef=0.0, advantage=f"{__name__}:zero_advantages")
    actor, _, m = step_grads(cfg, trajectories, 40)
    assert m["policy/advantage_abs_mean"] == 0.0 and m["policy/loss"] == 0.0
    assert actor.abs().max() == 0
    ent_cfg = dataclasses.replace(cfg, entropy_coef=0.1)
    actor_ent, _, _ = step_grads(ent_cfg, trajectories, 40)
    assert actor_ent.abs().max() > 0
    # A loss of one's own: it is the one that runs (its metrics are logged, bare names under
    # policy/), and its gradient is that of -sum log pi / N.
    cfg = step_algo("reinforce_pp", kl_coef=0.0, policy_loss=f"{__name__}:logprob_sum_loss")
    actor_mine, _, m = step_grads(cfg, trajectories, 40)
    assert m["policy/my_metric"] == 1.0 and m["mine/other"] == 2.0
    model = init_tiny_model(STEP_MODEL_CFG, seed=0)
    b = collate(trajectories, 0)
    lp, _ = token_logprobs(model, b.input_ids, b.attention_mask)
    (-(lp * b.action_mask).sum() / b.action_mask.sum()).backward()
    expected = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    assert torch.allclose(actor_mine, expected, atol=1e-6)


def test_needs_and_group_size_per_preset() -> None:
    # (critic?, ref?, group size) of each preset, from its definition in presets.py.
    expected = {
        "sao": (True, False, 1), "ppo": (True, False, 1), "grpo": (False, True, 8),
        "dr_grpo": (False, False, 8), "dapo": (False, False, 16), "gspo": (False, False, 8),
        "rloo": (False, False, 4), "reinforce_pp": (False, True, 1),
        "decoupled_ppo": (False, False, 8), "cispo": (False, False, 8),
    }
    for name, (critic, ref, size) in expected.items():
        cfg = AlgoConfig(**preset_defaults(name))
        assert (needs_critic(cfg), needs_ref(cfg), cfg.group_size) == (critic, ref, size), name


def test_missing_parts_and_group_ids_are_explained(trajectories) -> None:
    actor = Learner(init_tiny_model(STEP_MODEL_CFG, seed=0), lr=0.0)
    with pytest.raises(ValueError, match="needs a critic"):
        train_step(trajectories, actor, None, None, step_algo("ppo"), 0, 100, True)
    with pytest.raises(ValueError, match="needs a reference model"):
        train_step(trajectories, actor, None, None, step_algo("grpo"), 0, 100, True)
    ungrouped = [dataclasses.replace(t, group_id="") for t in trajectories]
    with pytest.raises(ValueError, match="group_id"):
        train_step(ungrouped, actor, None, None, step_algo("dr_grpo"), 0, 100, True)


def test_dynamic_sampling_and_overlong_penalty_in_the_step(trajectories) -> None:
    # Group q0 rewards: 1.0, 0.1, 0.2, 1.3; group q1: 0.4, 1.5, 1.6, 0.7 (reward = [i in
    # (0, 3, 5, 6)] + 0.1 i). Make q1 uninformative (all 1.0): dynamic sampling keeps 4 of 8.
    trajs = [dataclasses.replace(t, reward=1.0) if t.group_id == "q1" else t
             for t in trajectories]
    cfg = step_algo("dapo")
    _, _, m = step_grads(cfg, trajs, 10_000)
    assert m["sampling/kept_frac"] == 0.5
    # All groups uninformative: nothing to train on, the step says so and leaves the model alone.
    flat = [dataclasses.replace(t, reward=1.0) for t in trajectories]
    actor = Learner(init_tiny_model(STEP_MODEL_CFG, seed=0), lr=1.0)
    before = [p.clone() for p in actor.params]
    m = train_step(flat, actor, None, None, cfg, 0, 100, True)
    assert m["skipped_no_signal"] == 1.0 and m["sampling/kept_frac"] == 0.0
    assert all(torch.equal(a, b) for a, b in zip(before, actor.params))
    # Overlong: L_max 8, buffer 4 -> zone from 4 action tokens. A trajectory with l action
    # tokens loses (4 - l) / 4 for 4 < l <= 8 and 1 beyond.
    cfg = step_algo("dr_grpo", overlong_buffer=4, overlong_max_tokens=8)
    _, _, m = step_grads(cfg, trajectories, 10_000)
    lengths = [t.num_action_tokens for t in trajectories]
    pen = [0.0 if n <= 4 else (4 - n) / 4 if n <= 8 else -1.0 for n in lengths]
    assert m["reward/overlong_penalty_mean"] == pytest.approx(sum(pen) / 8, abs=1e-6)
    base = sum(t.reward for t in trajectories) / 8
    assert m["reward/shaped_mean"] == pytest.approx(base + sum(pen) / 8, abs=1e-6)


def test_warmup_trains_only_the_critic(trajectories) -> None:
    cfg = step_algo("ppo")
    actor = Learner(init_tiny_model(STEP_MODEL_CFG, seed=0), lr=0.0, grad_clip=0.0)
    critic = Learner(ValueModel.from_policy(actor.model), lr=0.0, grad_clip=0.0)
    m = train_step(trajectories, actor, critic, None, cfg, 0, 100, train_actor=False)
    assert "value/loss" in m and "policy/loss" not in m
    assert all(p.grad is None for p in actor.params)
