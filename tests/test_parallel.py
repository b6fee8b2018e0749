"""The data-parallel trainer: 2 gloo ranks (DDP and FSDP2) against 1 process on the same batch,
through the real `train_step` (actor and critic); the token-balanced micro-batch assignment."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tiderl.algos.registry import needs_critic, needs_ref
from tiderl.config import AlgoConfig, preset_defaults
from tiderl.lab.ranks import spawn_ranks
from tiderl.models.tiny import init_tiny_model, tiny_qwen2_config
from tiderl.train.critic import ValueModel, freeze_matching
from tiderl.train.forward import token_logprobs
from tiderl.train.learner import Learner
from tiderl.train.parallel import assign_micro_batches
from tiderl.train.step import train_step
from tiderl.types import NO_VERSION, Trajectory

MODEL_CFG = tiny_qwen2_config(50, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                              max_position_embeddings=64)
LR, CLIP = 1e-3, 0.5  # a real step: a learning rate and a clip that bites


def trajectories() -> list[Trajectory]:
    """9 trajectories of different lengths (prompt, turn, observation, turn), rewards in 3 groups."""
    g = torch.Generator().manual_seed(0)
    model = init_tiny_model(MODEL_CFG, seed=0)
    out = []
    for i in range(9):
        turn1, obs, turn2 = (int(torch.randint(2, 9, (1,), generator=g)) for _ in range(3))
        mask = [0, 0, 0] + [1] * turn1 + [0] * obs + [1] * turn2
        tokens = torch.randint(3, 50, (len(mask),), generator=g).tolist()
        with torch.no_grad():
            ids = torch.tensor([tokens])
            lp, _ = token_logprobs(model, ids, torch.ones_like(ids))
        noise = torch.randn(len(mask), generator=g) * 0.3
        behavior = [float(lp[0, t] + noise[t]) if m else 0.0 for t, m in enumerate(mask)]
        out.append(Trajectory(tokens=tokens, loss_mask=mask, behavior_logprobs=behavior,
                              policy_version=[0 if m else NO_VERSION for m in mask],
                              reward=float(i % 3 == 0) + 0.1 * i, group_id=f"q{i // 3}"))
    return out


def algo(name: str, **overrides) -> AlgoConfig:
    d = preset_defaults(name)
    d.update(group_size=min(d["group_size"], 3), **overrides)
    return AlgoConfig(**d)


# SAO (critic with frozen attention, GAE, DIS, two critic updates) and a PPO with recomputed old
# log-probs and a KL term in the loss against a reference (every no-grad pass of the step).
CASES = {
    "sao": (algo("sao", critic_updates=2), 40),
    "ppo_kl": (algo("ppo", old_logprobs="recompute", kl_coef=0.1, entropy_coef=0.01), 64),
}


def build(cfg: AlgoConfig, make_learner):
    actor = make_learner(init_tiny_model(MODEL_CFG, seed=0), LR)
    critic = None
    if needs_critic(cfg):
        value_model = ValueModel.from_policy(init_tiny_model(MODEL_CFG, seed=0))
        with torch.no_grad():
            value_model.head.weight.copy_(torch.randn(value_model.head.weight.shape,
                                                      generator=torch.Generator().manual_seed(7)) * 0.1)
        freeze_matching(value_model, cfg.critic_freeze_pattern)
        critic = make_learner(value_model, LR)
    ref = init_tiny_model(MODEL_CFG, seed=1) if needs_ref(cfg) else None
    return actor, critic, ref


def snapshot(learner) -> dict[str, torch.Tensor]:
    """Gradients and parameters after the step, whole (FSDP2 shards gathered), by name."""
    model = getattr(learner.model, "module", learner.model)
    out = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad
            out[f"grad/{name}"] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
        out[f"param/{name}"] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
    return out


def one_step(cfg: AlgoConfig, micro_tokens: int, make_learner) -> dict[str, object]:
    actor, critic, ref = build(cfg, make_learner)
    metrics = train_step(trajectories(), actor, critic, ref, cfg, pad_id=0, micro_batch_tokens=micro_tokens,
                         train_actor=True)
    return {"metrics": metrics, "actor": snapshot(actor), "critic": snapshot(critic) if critic else None}


def rank_main(rank: int, world_size: int, out_path: str) -> None:
    """One rank: the step of every case under DDP and FSDP2; rank 0 saves what it saw."""
    from tiderl.train.parallel import ParallelLearner

    results = {}
    for mode in ("ddp", "fsdp2"):
        for case, (cfg, micro_tokens) in CASES.items():
            results[(mode, case)] = one_step(cfg, micro_tokens, lambda m, lr: ParallelLearner(
                m, mode, lr=lr, grad_clip=CLIP))
    if rank == 0:
        torch.save(results, out_path)


@pytest.fixture(scope="module")
def parallel_results(tmp_path_factory):
    path = tmp_path_factory.mktemp("parallel") / "rank0.pt"
    spawn_ranks(rank_main, 2, str(path), timeout_s=240)
    return torch.load(path, weights_only=False)


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_equal_one_process(parallel_results, mode, case):
    cfg, micro_tokens = CASES[case]
    single = one_step(cfg, micro_tokens, lambda m, lr: Learner(m, lr=lr, grad_clip=CLIP))
    got = parallel_results[(mode, case)]
    assert single["metrics"]["micro_batches"] >= 3  # the split is real, with a ghost on one rank
    for part in ("actor", "critic"):
        if single[part] is None:
            continue
        assert got[part].keys() == single[part].keys()
        assert any(k.startswith("grad/") for k in single[part])
        for name, want in single[part].items():
            assert name.startswith("param/") or want.abs().max() > 0 or "head" in name
            torch.testing.assert_close(got[part][name], want, atol=1e-6, rtol=1e-5, msg=f"{mode} {case} {part} {name}")
    for key, want in single["metrics"].items():
        assert got["metrics"][key] == pytest.approx(want, rel=1e-5, abs=1e-6), key


def test_micro_batches_are_balanced_by_tokens_and_padded_with_ghosts():
    tokens = [100, 10, 60, 50, 40]
    shares = assign_micro_batches(tokens, 2)
    # Largest first, each to the lighter rank with a free place; one ghost evens the counts.
    assert shares == [[0, 4, None], [2, 3, 1]]
    assert [sum(tokens[i] for i in s if i is not None) for s in shares] == [140, 120]
    assert assign_micro_batches([5], 3) == [[0], [None], [None]]
    with pytest.raises(ValueError):
        assign_micro_batches([1], 0)


def test_bf16_autocast_keeps_fp32_master_weights():
    from tiderl.train.precision import trainer_autocast

    cfg, micro_tokens = CASES["sao"]
    plain = one_step(cfg, micro_tokens, lambda m, lr: Learner(m, lr=lr, grad_clip=CLIP))
    with trainer_autocast("bfloat16", "cpu"):
        mixed = one_step(cfg, micro_tokens, lambda m, lr: Learner(m, lr=lr, grad_clip=CLIP))
    grads = [k for k in plain["actor"] if k.startswith("grad/")]
    assert all(mixed["actor"][k].dtype == torch.float32 for k in plain["actor"])
    # bf16 matmuls: the same step to bf16 precision, not bit for bit.
    assert any(not torch.equal(mixed["actor"][k], plain["actor"][k]) for k in grads)
    for k in grads:
        scale = plain["actor"][k].abs().max().clamp_min(1e-6)
        assert (mixed["actor"][k] - plain["actor"][k]).abs().max() / scale < 0.1, k
    with pytest.raises(ValueError, match="train.autocast"):
        trainer_autocast("float8", "cpu")
