"""Qwen2-VL on data-parallel ranks (issue 31): 2 gloo ranks under DDP take the same SAO
`train_step` on episodes with images as one process on the same batch, vision tower included: the
M-RoPE positions (`models.vision.model_inputs`) reach the wrapped model on every rank."""

from __future__ import annotations

import copy

import pytest
import torch

from support import CLIP, LR, give_own_behaviour_logprobs, snapshot
from test_parallel_vlm import episodes
from test_vlm import CORPUS
from tiderl.config import AlgoConfig, preset_defaults
from tiderl.embedded.tiny_qwen2vl import build_tiny_qwen2vl
from tiderl.lab.ranks import spawn_ranks
from tiderl.train.critic import ValueModel
from tiderl.train.learner import Learner
from tiderl.train.step import train_step


def one_step(make_learner) -> dict:
    model, processor = build_tiny_qwen2vl(CORPUS, seed=0)
    trajectories = episodes(processor)
    give_own_behaviour_logprobs(model, trajectories, processor.image_processor)
    cfg = AlgoConfig(**{**preset_defaults("sao"), "critic_updates": 2, "entropy_coef": 0.0})
    value_model = ValueModel.from_policy(copy.deepcopy(model))
    actor, critic = make_learner(model, LR), make_learner(value_model, LR)
    metrics = train_step(trajectories, actor, critic, None, cfg, pad_id=0, micro_batch_tokens=300,
                         train_actor=True, image_processor=processor.image_processor)
    return {"metrics": metrics, "actor": snapshot(actor), "critic": snapshot(critic)}


def rank_main(rank: int, world_size: int, out_path: str) -> None:
    from tiderl.train.parallel import ParallelLearner

    got = one_step(lambda m, lr: ParallelLearner(m, "ddp", lr=lr, grad_clip=CLIP))
    if rank == 0:
        torch.save(got, out_path)


@pytest.mark.slow  # spawns 2 ranks (about 30 s on 2 shared cores)
def test_two_ddp_ranks_train_a_qwen2vl_as_one_process_does(tmp_path):
    path = tmp_path / "rank0.pt"
    spawn_ranks(rank_main, 2, str(path), timeout_s=300)
    got = torch.load(path, weights_only=False)
    single = one_step(lambda m, lr: Learner(m, lr=lr, grad_clip=CLIP))
    assert single["metrics"]["micro_batches"] >= 3  # a real split across the ranks
    for part in ("actor", "critic"):
        want_all = single[part]
        assert got[part].keys() == want_all.keys(), part
        vision = [k for k in want_all if k.startswith("grad/") and "visual." in k and want_all[k].abs().max() > 0]
        assert vision, f"{part}: the vision tower got no gradient, the test would show nothing"
        for name, want in want_all.items():
            torch.testing.assert_close(got[part][name], want, atol=1e-6, rtol=1e-5, msg=f"{part} {name}")
    for key, want in single["metrics"].items():
        assert got["metrics"][key] == pytest.approx(want, rel=1e-5, abs=1e-6), key
