"""A vision-language model on data-parallel ranks: 2 gloo ranks under DDP or FSDP2 take the same
`train_step` (SAO, critic included) on episodes with images as one process on the same batch: the
vision tower, the connector and the language model get the same averaged gradients and the same
update, for the tiny Idefics3 and the tiny Qwen2-VL (whose M-RoPE positions,
`models.vision.model_inputs`, must reach the wrapped model on every rank). Under FSDP2 the policy
embeds its images inside its own forward (`models.vision.embed_in_forward`), where its root-level
shards are gathered."""

from __future__ import annotations

import copy

import pytest
import torch

from support import CLIP, LR, give_own_behaviour_logprobs, seed_adapters, snapshot
from test_vlm import CORPUS, SquaresEnv
from tiderl.agent.loop import ScriptedEngine, play_episodes
from tiderl.config import AlgoConfig, preset_defaults
from tiderl.embedded.tiny_qwen2vl import build_tiny_qwen2vl
from tiderl.embedded.tiny_vlm import build_tiny_vlm
from tiderl.envs.protocol import Task
from tiderl.lab.ranks import spawn_ranks
from tiderl.rollout.base import SamplingParams
from tiderl.train.critic import ValueModel
from tiderl.train.learner import Learner
from tiderl.train.step import train_step

# Each architecture's builder and the parameter-name part of its vision tower.
ARCHITECTURES = {"idefics3": (build_tiny_vlm, "vision_model."), "qwen2_vl": (build_tiny_qwen2vl, "visual.")}
CALL = '<tool_call>\n{"name": "look", "arguments": {}}\n</tool_call>'


def episodes(processor) -> list:
    """6 scripted episodes with one or two images each, rewards in 3 groups of 2 (the same in every
    process: the script and the images are fixed)."""
    scripts = [[CALL, "answer: red blue"], ["answer: red"], [CALL, "answer: green blue"], ["answer: blue"],
               [CALL, CALL, "answer: red green blue"], ["answer: green red"]]
    colours = [["red", "blue"], ["red"], ["green", "blue"], ["green"], ["red", "green", "blue"], ["green", "red"]]
    out = []
    for i, (script, cs) in enumerate(zip(scripts, colours)):
        engine = ScriptedEngine(processor.tokenizer, {"What colour": list(script)})
        out += play_episodes(engine, processor, SquaresEnv, [Task(f"t{i}", "q", None, {"colours": cs})],
                             SamplingParams(max_new_tokens=40), max_turns=4, max_total_tokens=400)
    for i, t in enumerate(out):
        t.group_id = f"g{i // 2}"
    assert all(t.images for t in out)
    return out


def one_step(make_learner, architecture: str, lora: bool = False) -> dict:
    model, processor = ARCHITECTURES[architecture][0](CORPUS, seed=0)
    trajectories = episodes(processor)
    give_own_behaviour_logprobs(model, trajectories, processor.image_processor)
    cfg = AlgoConfig(**{**preset_defaults("sao"), "critic_updates": 2, "entropy_coef": 0.0})
    value_model = ValueModel.from_policy(copy.deepcopy(model))
    if lora:  # adapters on the language model's and the vision tower's attention, policy and critic
        from tiderl.train.lora import apply_critic_lora, apply_lora

        model = apply_lora(model, 4, 8.0, ["q_proj", "v_proj"])
        apply_critic_lora(value_model, 4, 8.0, ["q_proj", "v_proj"])
        seed_adapters(model, 1)
        seed_adapters(value_model, 2)
    actor, critic = make_learner(model, LR), make_learner(value_model, LR)
    metrics = train_step(trajectories, actor, critic, None, cfg, pad_id=0, micro_batch_tokens=300,
                         train_actor=True, image_processor=processor.image_processor)
    return {"metrics": metrics, "actor": snapshot(actor), "critic": snapshot(critic)}


def rank_main(rank: int, world_size: int, out_path: str, architecture: str, mode: str) -> None:
    from tiderl.train.parallel import ParallelLearner

    parallel, _, lora = mode.partition("+")
    got = one_step(lambda m, lr: ParallelLearner(m, parallel, lr=lr, grad_clip=CLIP), architecture, bool(lora))
    if rank == 0:
        torch.save(got, out_path)


@pytest.mark.slow  # spawns 2 ranks (about 30 s on 2 shared cores)
@pytest.mark.parametrize("architecture, mode", [(a, m) for a in sorted(ARCHITECTURES) for m in ("ddp", "fsdp2")]
                         + [("idefics3", "fsdp2+lora")])
def test_two_ranks_train_a_vlm_as_one_process_does(tmp_path, architecture, mode):
    path = tmp_path / "rank0.pt"
    spawn_ranks(rank_main, 2, str(path), architecture, mode, timeout_s=300)
    got = torch.load(path, weights_only=False)
    single = one_step(lambda m, lr: Learner(m, lr=lr, grad_clip=CLIP), architecture, mode.endswith("+lora"))
    tower = ARCHITECTURES[architecture][1]
    assert single["metrics"]["micro_batches"] >= 3  # a real split across the ranks
    for part in ("actor", "critic"):
        want_all = single[part]
        assert got[part].keys() == want_all.keys(), part
        vision = [k for k in want_all if k.startswith("grad/") and tower in k and want_all[k].abs().max() > 0]
        assert vision, f"{part}: the vision tower got no gradient, the test would show nothing"
        for name, want in want_all.items():
            torch.testing.assert_close(got[part][name], want, atol=1e-6, rtol=1e-5, msg=f"{part} {name}")
    for key, want in single["metrics"].items():
        assert got["metrics"][key] == pytest.approx(want, rel=1e-5, abs=1e-6), key
