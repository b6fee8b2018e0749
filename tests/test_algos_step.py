"""The generic algorithm step with a tiny model: invariances, SAO routing, errors, filters."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tiderl.algos.presets import preset_defaults
from tiderl.algos.sao import sao_step
from tiderl.algos.step import algo_step, group_size, needs_critic, needs_ref
from tiderl.config import AlgoConfig
from tiderl.models.tiny import init_tiny_model, tiny_qwen2_config
from tiderl.train.critic import ValueModel
from tiderl.train.forward import token_logprobs
from tiderl.train.learner import Learner
from tiderl.types import NO_VERSION, Trajectory

MODEL_CFG = tiny_qwen2_config(50, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                              max_position_embeddings=64)


@pytest.fixture(scope="module")
def trajectories() -> list[Trajectory]:
    """8 trajectories in 2 groups of 4 with prompt, two turns and an observation between them.

    Behaviour log-probs are the seed-0 model's own plus noise (std 0.3), so ratios differ from 1
    and every clip/band is exercised the way a stale or mismatched engine would exercise it.
    """
    g = torch.Generator().manual_seed(0)
    model = init_tiny_model(MODEL_CFG, seed=0)
    out = []
    for i in range(8):
        turn1, obs, turn2 = (int(torch.randint(2, 6, (1,), generator=g)) for _ in range(3))
        mask = [0, 0, 0] + [1] * turn1 + [0] * obs + [1] * turn2
        tokens = torch.randint(3, 50, (len(mask),), generator=g).tolist()
        with torch.no_grad():
            ids = torch.tensor([tokens])
            lp, _ = token_logprobs(model, ids, torch.ones_like(ids))
        noise = torch.randn(len(mask), generator=g) * 0.3
        behavior = [float(lp[0, t] + noise[t]) if m else 0.0 for t, m in enumerate(mask)]
        out.append(Trajectory(tokens=tokens, loss_mask=mask, behavior_logprobs=behavior,
                              policy_version=[0 if m else NO_VERSION for m in mask],
                              reward=float(i in (0, 3, 5, 6)) + 0.1 * i, group_id=f"q{i // 4}"))
    return out


def _critic(actor: Learner) -> Learner:
    """A critic from the actor with a seeded, non-zero head (so values and their targets vary)."""
    value_model = ValueModel.from_policy(actor.model)
    with torch.no_grad():
        value_model.head.weight.copy_(
            torch.randn(value_model.head.weight.shape, generator=torch.Generator().manual_seed(7))
            * 0.1)
    return Learner(value_model, lr=0.0, grad_clip=0.0)


def _algo(name: str, **overrides) -> AlgoConfig:
    d = preset_defaults(name)
    d["group_size"] = min(d["group_size"], 4)
    d.update(overrides)
    return AlgoConfig(**d)


def _grads(cfg: AlgoConfig, trajs: list[Trajectory], micro_batch_tokens: int,
           packed: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, float]]:
    """Run one step with lr = 0 and no clipping; return the accumulated actor/critic gradients."""
    actor = Learner(init_tiny_model(MODEL_CFG, seed=0), lr=0.0, grad_clip=0.0)
    critic = _critic(actor) if needs_critic(cfg) else None
    ref = init_tiny_model(MODEL_CFG, seed=1) if needs_ref(cfg) else None
    metrics = algo_step(trajs, actor, critic, ref, cfg, pad_id=0,
                        micro_batch_tokens=micro_batch_tokens, train_actor=True, packed=packed)

    return _flat(actor), (_flat(critic) if critic is not None else None), metrics


def _flat(learner: Learner) -> torch.Tensor:
    """All accumulated gradients of a learner as one vector."""
    return torch.cat([p.grad.flatten() for p in learner.params if p.grad is not None])


# Each preset, plus the options that no preset turns on by default.
CASES = {
    "ppo": _algo("ppo"),
    "grpo": _algo("grpo"),
    "dr_grpo": _algo("dr_grpo"),
    "dapo": _algo("dapo"),
    "gspo": _algo("gspo", eps_low=0.05, eps_high=0.05),
    "rloo": _algo("rloo"),
    "reinforce_pp": _algo("reinforce_pp"),
    "decoupled_ppo": _algo("decoupled_ppo", dual_clip_c=3.0),
    "cispo": _algo("cispo"),
    "grpo_k2_entropy_norm": _algo("grpo", kl_estimator="k2", entropy_coef=0.01,
                                  loss_agg="seq-mean-token-sum-norm", loss_agg_length=16,
                                  old_logprobs="recompute"),
    "ppo_after_clip_k1reward": _algo("ppo", advantage_values="after", value_clip=0.2,
                                     kl_coef=0.05, kl_in_reward=True, kl_estimator="k1",
                                     actor_updates=2),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_micro_batching_and_packing_do_not_change_the_gradient(case, trajectories) -> None:
    # One micro-batch holding everything, padded micro-batches of at most 40 padded tokens, and
    # packed rows of at most 40 tokens: the losses are normalised over the whole step, so the
    # accumulated gradients must agree within 1e-6.
    cfg = CASES[case]
    actor_one, critic_one, m_one = _grads(cfg, trajectories, 10_000)
    actor_mb, critic_mb, m_mb = _grads(cfg, trajectories, 40)
    actor_pk, critic_pk, m_pk = _grads(cfg, trajectories, 40, packed=True)
    assert m_one["micro_batches"] == 1 and m_mb["micro_batches"] > 2 and m_pk["micro_batches"] > 1
    assert actor_one.abs().max() > 0
    assert torch.allclose(actor_one, actor_mb, atol=1e-6)
    assert torch.allclose(actor_one, actor_pk, atol=1e-6)
    if critic_one is not None:
        assert critic_mb is not None and critic_pk is not None
        assert torch.allclose(critic_one, critic_mb, atol=1e-6)
        assert torch.allclose(critic_one, critic_pk, atol=1e-6)
    assert m_mb["policy/loss"] == pytest.approx(m_one["policy/loss"], abs=1e-6)
    assert m_pk["policy/loss"] == pytest.approx(m_one["policy/loss"], abs=1e-6)


def _sao_grads(trajs, fn) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    actor = Learner(init_tiny_model(MODEL_CFG, seed=0), lr=0.0, grad_clip=0.0)
    critic = _critic(actor)
    metrics = fn(actor, critic)
    return _flat(actor), _flat(critic), metrics


def test_sao_routes_to_sao_step_unchanged(trajectories) -> None:
    sao = AlgoConfig()
    direct = _sao_grads(trajectories, lambda a, c: sao_step(trajectories, a, c, sao, 0, 40, True))
    routed = _sao_grads(trajectories, lambda a, c: algo_step(trajectories, a, c, None, sao, 0,
                                                             40, True))
    assert torch.equal(direct[0], routed[0]) and torch.equal(direct[1], routed[1])
    assert direct[2] == routed[2]  # the same metric keys and values: it is the same code


def test_generic_step_with_sao_options_matches_sao_step(trajectories) -> None:
    # The generic path composes the same pure functions: with SAO's options (critic GAE with
    # the decoupled lambda, DIS against behaviour log-probs, token mean, K = 2) under another
    # name, it must produce SAO's gradients.
    sao = AlgoConfig()
    generic = dataclasses.replace(sao, name="ppo")
    direct = _sao_grads(trajectories, lambda a, c: sao_step(trajectories, a, c, sao, 0, 40, True))
    mine = _sao_grads(trajectories, lambda a, c: algo_step(trajectories, a, c, None, generic, 0,
                                                           40, True))
    assert torch.allclose(direct[0], mine[0], atol=1e-6)
    assert torch.allclose(direct[1], mine[1], atol=1e-6)
    for key in ("value/explained_variance", "value/loss", "policy/advantage_mean",
                "dis/masked_frac"):
        assert mine[2][key] == pytest.approx(direct[2][key], abs=1e-6)


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
        assert (needs_critic(cfg), needs_ref(cfg), group_size(cfg)) == (critic, ref, size), name


def test_missing_parts_and_group_ids_are_explained(trajectories) -> None:
    actor = Learner(init_tiny_model(MODEL_CFG, seed=0), lr=0.0)
    with pytest.raises(ValueError, match="needs a critic"):
        algo_step(trajectories, actor, None, None, _algo("ppo"), 0, 100, True)
    with pytest.raises(ValueError, match="needs a reference model"):
        algo_step(trajectories, actor, None, None, _algo("grpo"), 0, 100, True)
    ungrouped = [dataclasses.replace(t, group_id="") for t in trajectories]
    with pytest.raises(ValueError, match="group_id"):
        algo_step(ungrouped, actor, None, None, _algo("dr_grpo"), 0, 100, True)


def test_dynamic_sampling_and_overlong_penalty_in_the_step(trajectories) -> None:
    # Group q0 rewards: 1.0, 0.1, 0.2, 1.3; group q1: 0.4, 1.5, 1.6, 0.7 (reward = [i in
    # (0, 3, 5, 6)] + 0.1 i). Make q1 uninformative (all 1.0): dynamic sampling keeps 4 of 8.
    trajs = [dataclasses.replace(t, reward=1.0) if t.group_id == "q1" else t
             for t in trajectories]
    cfg = _algo("dapo")
    _, _, m = _grads(cfg, trajs, 10_000)
    assert m["sampling/kept_frac"] == 0.5
    # All groups uninformative: nothing to train on, the step says so and leaves the model alone.
    flat = [dataclasses.replace(t, reward=1.0) for t in trajectories]
    actor = Learner(init_tiny_model(MODEL_CFG, seed=0), lr=1.0)
    before = [p.clone() for p in actor.params]
    m = algo_step(flat, actor, None, None, cfg, 0, 100, True)
    assert m["skipped_no_signal"] == 1.0 and m["sampling/kept_frac"] == 0.0
    assert all(torch.equal(a, b) for a, b in zip(before, actor.params))
    # Overlong: L_max 8, buffer 4 -> zone from 4 action tokens. A trajectory with l action
    # tokens loses (4 - l) / 4 for 4 < l <= 8 and 1 beyond.
    cfg = _algo("dr_grpo", overlong_buffer=4, overlong_max_tokens=8)
    _, _, m = _grads(cfg, trajectories, 10_000)
    lengths = [t.num_action_tokens for t in trajectories]
    pen = [0.0 if n <= 4 else (4 - n) / 4 if n <= 8 else -1.0 for n in lengths]
    assert m["reward/overlong_penalty_mean"] == pytest.approx(sum(pen) / 8, abs=1e-6)
    base = sum(t.reward for t in trajectories) / 8
    assert m["reward/shaped_mean"] == pytest.approx(base + sum(pen) / 8, abs=1e-6)


def test_warmup_trains_only_the_critic(trajectories) -> None:
    cfg = _algo("ppo")
    actor = Learner(init_tiny_model(MODEL_CFG, seed=0), lr=0.0, grad_clip=0.0)
    critic = Learner(ValueModel.from_policy(actor.model), lr=0.0, grad_clip=0.0)
    m = algo_step(trajectories, actor, critic, None, cfg, 0, 100, train_actor=False)
    assert "value/loss" in m and "policy/loss" not in m
    assert all(p.grad is None for p in actor.params)
