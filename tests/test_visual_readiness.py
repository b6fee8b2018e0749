"""The image stage of the readiness buffer (issue 31): a finished trajectory's images are processed
once, ahead of the step (`tiderl.train.annotate.ImagePixels`), and the critic and reference
preparations and the trainer's forward reuse those pixel inputs; the results are bit for bit those
of the path without the stage, for the tiny Idefics3 and the tiny Qwen2-VL."""

from __future__ import annotations

import asyncio
import copy
import gc
from types import SimpleNamespace

import pytest
import torch

from support import give_own_behaviour_logprobs
from test_vlm import CORPUS, square
from test_vlm_train import _scripted_episodes
from tiderl.config import AlgoConfig, preset_defaults
from tiderl.embedded.tiny_qwen2vl import build_tiny_qwen2vl
from tiderl.embedded.tiny_vlm import build_tiny_vlm
from tiderl.models import vision
from tiderl.models.vision import ChatProcessor, image_inputs, prepare_image_inputs
from tiderl.run import preparations_for
from tiderl.system.buffer import ReadyBuffer
from tiderl.train.annotate import CriticSnapshot, ImagePixels, RefLogprobs
from tiderl.train.critic import ValueModel
from tiderl.train.learner import Learner
from tiderl.train.step import train_step


class CountingProcessor:
    """An image processor that counts its calls (the work the stage saves)."""

    def __init__(self, image_processor):
        self.image_processor = image_processor
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.image_processor(*args, **kwargs)


@pytest.fixture(scope="module", params=["idefics3", "qwen2vl"])
def vlm(request):
    build = build_tiny_vlm if request.param == "idefics3" else build_tiny_qwen2vl
    return build(CORPUS, seed=0)


def _prepare_and_train(model, processor, trajectories, stage: bool):
    """The preparations (critic values, reference log-probs; the image stage first when `stage`)
    then one SAO step with a KL term; returns the processor's call count, the annotations, the
    metrics and the trained weights."""
    images = CountingProcessor(processor.image_processor)
    policy, critic = copy.deepcopy(model), ValueModel.from_policy(copy.deepcopy(model))
    preparations = [CriticSnapshot(critic, 0, 4096, "cpu", image_processor=images),
                    RefLogprobs(copy.deepcopy(model), 0, 4096, "cpu", image_processor=images)]
    for preparation in ([ImagePixels(images)] if stage else []) + preparations:
        preparation(trajectories)
    cfg = AlgoConfig(**{**preset_defaults("sao"), "critic_updates": 2, "entropy_coef": 0.0, "kl_coef": 0.1})
    torch.manual_seed(0)
    metrics = train_step(trajectories, Learner(policy, lr=1e-2), Learner(critic, lr=1e-2), None, cfg, pad_id=0,
                         micro_batch_tokens=64, train_actor=True, image_processor=images)
    assert metrics["value/precomputed"] == 1.0 and metrics["kl/ref_precomputed"] == 1.0
    return (images.calls, [t.annotations for t in trajectories],
            {k: v for k, v in metrics.items() if not k.startswith("time/")},
            {**policy.state_dict(), **{f"critic.{k}": v for k, v in critic.state_dict().items()}})


def test_the_image_stage_processes_each_episode_once_and_changes_no_bit(vlm):
    model, processor = vlm
    episodes = _scripted_episodes(processor)
    episodes[1].reward = 0.0  # rewards differ: advantages survive whitening
    give_own_behaviour_logprobs(model, episodes, processor.image_processor)
    assert len(episodes[0].images) == 2 and not episodes[1].images
    # Copies: new image objects, so the path without the stage finds nothing prepared.
    calls_with, notes_with, metrics_with, weights_with = _prepare_and_train(model, processor, episodes, stage=True)
    calls_without, notes_without, metrics_without, weights_without = _prepare_and_train(
        model, processor, copy.deepcopy(episodes), stage=False)
    assert calls_with == 1  # one episode shows images: processed once, by the stage
    # Without it: the critic's and the reference's preparations and the step each process them
    # (the step's 64-token micro-batches put the episode in one, so once there).
    assert calls_without == 3
    assert notes_with == notes_without  # critic values, reference log-probs: the same floats
    assert metrics_with == metrics_without
    assert weights_with.keys() == weights_without.keys()
    changed = [k for k in weights_with if not torch.equal(weights_with[k], weights_without[k])]
    assert not changed, f"weights differ with the image stage: {changed[:5]}"
    assert any(not torch.equal(weights_with[k], v) for k, v in model.state_dict().items()), "the step trained nothing"


def test_prepared_pixels_are_those_of_the_processor_and_go_with_their_images(vlm):
    _, processor = vlm
    images = [square("red", (40, 40)), square("blue", (50, 40))]
    expected = image_inputs(processor.image_processor, images)
    counting = CountingProcessor(processor.image_processor)
    prepare_image_inputs(counting, images)
    prepare_image_inputs(counting, images)  # already there: not processed again
    got = image_inputs(counting, images)
    assert counting.calls == 1 and got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    # Identity, not content: equal copies of the images, or another processor, are processed anew.
    image_inputs(counting, [i.copy() for i in images])
    image_inputs(CountingProcessor(processor.image_processor), images)
    assert counting.calls == 2
    prepare_image_inputs(counting, [])  # no images: nothing to prepare
    # Entries go with their images (no growth over a run).
    before = len(vision._PREPARED)
    green = [square("green", (40, 40))]
    prepare_image_inputs(counting, green)
    assert len(vision._PREPARED) == before + 1
    del green
    gc.collect()
    assert len(vision._PREPARED) == before


def test_the_buffer_runs_the_image_stage_before_a_trajectory_is_ready(vlm):
    _, processor = vlm
    counting = CountingProcessor(processor.image_processor)
    episodes = _scripted_episodes(processor)

    async def put_and_take():
        buffer = ReadyBuffer([ImagePixels(counting)])
        buffer.start()
        for t in episodes:
            buffer.put(t)
        try:
            return await buffer.take(2, timeout_s=60)
        finally:
            await buffer.close()

    ready = asyncio.run(put_and_take())
    assert counting.calls == 1
    image_inputs(counting, ready[0].images)  # what the trainer's collate asks for: already there
    assert counting.calls == 1


def test_a_vision_language_runs_preparations_start_with_the_image_stage(vlm):
    _, processor = vlm
    cfg = SimpleNamespace(train=SimpleNamespace(micro_batch_tokens=64), model=SimpleNamespace(device="cpu"),
                          rollout=SimpleNamespace(temperature=1.0))
    run = SimpleNamespace(cfg=cfg, tokenizer=ChatProcessor(processor) if not isinstance(processor, ChatProcessor)
                          else processor, critic=None, ref=None)
    (stage,) = preparations_for(run)
    assert isinstance(stage, ImagePixels) and stage.image_processor is processor.image_processor
    assert preparations_for(SimpleNamespace(**{**vars(run), "tokenizer": processor.tokenizer})) == []
