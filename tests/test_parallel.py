"""The data-parallel trainer: 2 gloo ranks (DDP and FSDP2) against 1 process on the same batch,
through the real `train_step` (actor and critic); the token-balanced micro-batch assignment."""

from __future__ import annotations

import pytest
import torch

from support import CLIP, build, nine_trajectories, parallel_cases, snapshot
from tiderl.config import AlgoConfig
from tiderl.lab.ranks import spawn_ranks
from tiderl.train.learner import Learner
from tiderl.train.parallel import assign_micro_batches
from tiderl.train.step import train_step

CASES = parallel_cases()


def one_step(cfg: AlgoConfig, micro_tokens: int, make_learner) -> dict[str, object]:
    actor, critic, ref = build(cfg, make_learner)
    metrics = train_step(nine_trajectories(), actor, critic, ref, cfg, pad_id=0, micro_batch_tokens=micro_tokens,
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


@pytest.mark.slow
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


@pytest.mark.slow
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
