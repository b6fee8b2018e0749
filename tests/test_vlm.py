"""The tiny vision-language model (issue 31): built offline, saved and loaded; chat assembly with
images equal to the processor's rendering in one go; the agent loop carrying images to the
trajectory and to the engine. The environment is a small one of this file: the first message shows
a coloured square, a `look` tool shows another, and the answer is the colours."""

from __future__ import annotations

import json
import socket
from typing import Any

import pytest
import torch
from PIL import Image

from tiderl.agent.chat import chat_format
from tiderl.agent.loop import ScriptedEngine, play_episodes
from tiderl.embedded.tiny import train_tokenizer
from tiderl.embedded.tiny_vlm import build_tiny_vlm, image_seq_len
from tiderl.envs.protocol import Action, Observation, StepResult, Task
from tiderl.models.loading import load_processor
from tiderl.rollout.base import SamplingParams

COLOURS = {"red": (255, 0, 0), "green": (0, 160, 0), "blue": (0, 0, 255)}
SYSTEM = "Say the colour of each square. look() shows the next one."
TOOLS = [{"type": "function", "function": {"name": "look", "description": "Show the next square.",
                                           "parameters": {"type": "object", "properties": {}}}}]
CORPUS = [SYSTEM, "What colour is the square?", "Here is the next square.", "answer: red green blue",
          '<tool_call>\n{"name": "look", "arguments": {}}\n</tool_call>'] * 20
TOKENS_PER_IMAGE = 4  # 64 px images, 16 px patches, pixel shuffle by 2: (64 / 16) ** 2 / 2 ** 2


def square(colour: str, size: tuple[int, int] = (40, 40)) -> Image.Image:
    return Image.new("RGB", size, COLOURS[colour])


class SquaresEnv:
    """Shows `task.meta["colours"][0]` with the question; each `look` call shows the next colour;
    a turn that says "answer: <colours>" ends the episode (reward 1 when they are the task's)."""

    def __init__(self) -> None:
        self.shown = 0
        self.task: Task | None = None
        self.images: list[Image.Image] = []

    def system_prompt(self) -> str:
        return SYSTEM

    def tool_schemas(self) -> list[dict[str, Any]]:
        return TOOLS

    def show(self) -> Image.Image:
        assert self.task is not None
        image = square(self.task.meta["colours"][self.shown], size=(40 + 10 * self.shown, 40))
        self.shown += 1
        self.images.append(image)
        return image

    def reset(self, task: Task) -> Observation:
        self.task = task
        return Observation("What colour is the square?", [self.show()])

    def step(self, action: Action) -> StepResult:
        assert self.task is not None
        if "answer:" in action.text:
            said = action.text.split("answer:", 1)[1].split()
            return StepResult([], reward=float(said == self.task.meta["colours"]), done=True)
        return StepResult([Observation("Here is the next square.", [self.show()]) for _ in action.tool_calls])

    def finish(self, reason: str) -> StepResult:
        return StepResult([], done=True)


@pytest.fixture(scope="module")
def vlm():
    return build_tiny_vlm(CORPUS, seed=0)


def test_the_tiny_vlm_round_trips_through_a_folder_without_the_network(vlm, tmp_path, monkeypatch):
    from transformers import Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers.models.idefics3 import Idefics3ImageProcessorPil

    def no_network(*args, **kwargs):
        raise AssertionError("the tiny VLM touched the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    model, processor = build_tiny_vlm(CORPUS, seed=0)  # built here too, under the no-network guard
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    loaded = Idefics3ForConditionalGeneration.from_pretrained(tmp_path).eval()
    again = load_processor(tmp_path)
    assert type(again) is Idefics3Processor
    assert type(again.image_processor) is Idefics3ImageProcessorPil  # the PIL one: no torchvision needed
    assert again.image_seq_len == processor.image_seq_len == TOKENS_PER_IMAGE
    assert again.tokenizer.chat_template == processor.tokenizer.chat_template
    assert again.tokenizer.get_vocab() == processor.tokenizer.get_vocab()
    inputs = again(text=["<image>What colour is the square?"], images=[[square("red")]], return_tensors="pt")
    with torch.no_grad():
        a, b = model(**inputs).logits, loaded(**inputs).logits
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    # The same config and seed give the same weights.
    assert torch.equal(model.get_input_embeddings().weight, vlm[0].get_input_embeddings().weight)


def test_a_folder_with_only_a_tokenizer_is_refused_with_the_fix(vlm, tmp_path):
    vlm[1].tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"processor\.save_pretrained"):
        load_processor(tmp_path)


@pytest.mark.parametrize("size", [(40, 40), (90, 30), (16, 120)])
def test_an_image_becomes_the_expected_number_of_image_tokens(vlm, size):
    model, processor = vlm
    assert image_seq_len(64, 16, 2) == TOKENS_PER_IMAGE
    out = processor(text=["a <image> b"], images=[[square("blue", size)]], return_tensors="pt")
    ids = out["input_ids"][0].tolist()
    assert ids.count(model.config.image_token_id) == TOKENS_PER_IMAGE
    assert tuple(out["pixel_values"].shape) == (1, 1, 3, 64, 64)
    with torch.no_grad():
        logits = model(**out).logits
    assert logits.shape == (1, len(ids), len(processor.tokenizer)) and torch.isfinite(logits).all()


def test_the_image_changes_the_model_output(vlm):
    model, processor = vlm
    text = ["<image>What colour is the square?"]
    with torch.no_grad():
        red = model(**processor(text=text, images=[[square("red")]], return_tensors="pt")).logits
        blue = model(**processor(text=text, images=[[square("blue")]], return_tensors="pt")).logits
    assert (red[0, -1] - blue[0, -1]).abs().max() > 1e-4


def test_turn_by_turn_assembly_equals_the_processor_rendering_the_whole_conversation(vlm):
    _, processor = vlm
    tok = processor.tokenizer
    fmt = chat_format(processor, TOOLS)
    red, green, blue = square("red"), square("green", (60, 20)), square("blue", (20, 60))
    ids, images = fmt.prompt_with_images(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": Observation("What colour?", [red])}])
    call = '<tool_call>\n{"name": "look", "arguments": {}}\n</tool_call>'
    for turn, shown in ((call, [Observation("Here is the next square.", [green, blue])]), ("I see.", ["no image"])):
        ids += tok.encode(turn, add_special_tokens=False) + [fmt.end_of_turn_id]  # sampled tokens, as sampled
        more, new = fmt.answer_with_images(shown, as_tool_responses=turn == call)
        ids, images = ids + more, images + new
    whole = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]},
        {"role": "assistant", "content": call},
        {"role": "tool", "content": [{"type": "image"}, {"type": "image"},
                                     {"type": "text", "text": "Here is the next square."}]},
        {"role": "assistant", "content": "I see."},
        {"role": "user", "content": "no image"},
    ]
    text = processor.apply_chat_template(whole, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    expected = processor(text=[text], images=[[red, green, blue]], add_special_tokens=False)["input_ids"][0]
    assert images == [red, green, blue]
    assert ids == list(expected)
    assert ids.count(tok.convert_tokens_to_ids("<image>")) == 3 * TOKENS_PER_IMAGE  # expanded once each


def test_text_only_assembly_is_unchanged_by_the_processor(vlm):
    _, processor = vlm
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What colour?"}]
    assert chat_format(processor, None).prompt_ids(messages) == processor.tokenizer.encode(
        processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
        add_special_tokens=False)


def test_bad_image_messages_are_refused_with_the_reason(vlm):
    _, processor = vlm
    fmt = chat_format(processor, None)
    with pytest.raises(ValueError, match="placeholders for 1 images"):  # a literal placeholder in the text
        fmt.answer_with_images([Observation("look: <image>", [square("red")])])
    with pytest.raises(ValueError, match="placeholders for 0 images"):  # also in a message without images
        fmt.answer_with_images(["the page says <image>"])
    with pytest.raises(ValueError, match="answer_with_images"):  # the ids-only method would drop the image
        fmt.answer_ids([Observation("look", [square("red")])])
    text_only = chat_format(train_tokenizer(CORPUS, 300), None)
    with pytest.raises(ValueError, match="no processor"):
        text_only.answer_with_images([Observation("look", [square("red")])])
    with pytest.raises(TypeError, match="Observation"):
        fmt.answer_with_images([b"bytes"])


class ImageScriptedEngine(ScriptedEngine):
    """A ScriptedEngine that takes images and records the ones each call got."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.seen: list[list[list[Image.Image]] | None] = []

    def generate(self, prompts, params, images=None):
        self.seen.append(None if images is None else [i.images for i in images])
        for prompt, shown in zip(prompts, images or []):
            assert len(shown.forced) == len(prompt)
        return super().generate(prompts, params)


def test_the_agent_loop_carries_images_to_the_trajectory_and_the_engine(vlm):
    model, processor = vlm
    tok = processor.tokenizer
    call = '<tool_call>\n{"name": "look", "arguments": {}}\n</tool_call>'
    engine = ImageScriptedEngine(tok, {"What colour": [call, "answer: red blue"]})
    envs: list[SquaresEnv] = []

    def make_env() -> SquaresEnv:
        envs.append(SquaresEnv())
        return envs[-1]

    task = Task("t0", "What colour is the square?", None, {"colours": ["red", "blue"]})
    (t,) = play_episodes(engine, processor, make_env, [task], SamplingParams(max_new_tokens=40), max_turns=4,
                         max_total_tokens=400)
    assert t.stop_reason == "answer" and t.reward == 1.0
    shown = envs[0].images
    assert t.images == shown and len(shown) == 2  # in token order
    image_id = model.config.image_token_id
    at_images = [i for i, token in enumerate(t.tokens) if token == image_id]
    assert len(at_images) == 2 * TOKENS_PER_IMAGE
    assert all(t.loss_mask[i] == 0 for i in at_images)  # forced, no loss
    # The engine got, with each turn's prompt, the images of that prompt.
    assert engine.seen == [[shown[:1]], [shown]]
    # The whole episode is the processor's rendering of the conversation in one go.
    whole = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is the square?"}]},
        {"role": "assistant", "content": call},
        {"role": "tool", "content": [{"type": "image"}, {"type": "text", "text": "Here is the next square."}]},
        {"role": "assistant", "content": "answer: red blue"},
    ]
    # (the episode ends on the last turn's end-of-turn token; the template adds a newline after it)
    text = processor.apply_chat_template(whole, tools=TOOLS, tokenize=False).removesuffix("\n")
    assert t.tokens == list(processor(text=[text], images=[shown], add_special_tokens=False)["input_ids"][0])


def test_an_engine_without_images_is_refused_for_an_episode_with_images(vlm):
    _, processor = vlm
    class TextEngine(ScriptedEngine):
        def generate(self, prompts, params):
            return super().generate(prompts, params)

    engine = TextEngine(processor.tokenizer, {"What colour": ["answer: red"]})
    task = Task("t0", "What colour is the square?", None, {"colours": ["red"]})
    with pytest.raises(ValueError, match="takes no images"):
        play_episodes(engine, processor, SquaresEnv, [task], SamplingParams(max_new_tokens=20), max_turns=2,
                      max_total_tokens=300)


def test_a_text_only_episode_passes_no_images_to_the_engine(vlm):
    _, processor = vlm

    class TextEnv(SquaresEnv):
        def reset(self, task: Task) -> str:
            self.task = task
            return "What colour is the square?"

    engine = ImageScriptedEngine(processor.tokenizer, {"What colour": ["answer: red"]})
    task = Task("t0", "What colour is the square?", None, {"colours": ["red"]})
    (t,) = play_episodes(engine, processor, TextEnv, [task], SamplingParams(max_new_tokens=20), max_turns=2,
                         max_total_tokens=300)
    assert t.images == [] and engine.seen == [None] and t.reward == 1.0
    assert json.dumps(t.tokens)  # plain ids


def test_image_parts_that_hold_their_image_render_as_an_observation_does(vlm):
    # (the form a chat request carries images in: a part per image, the image in it)
    _, processor = vlm
    fmt = chat_format(processor, None)
    red = square("red")
    as_parts = fmt.prompt_with_images([{"role": "user", "content": [{"type": "image", "image": red},
                                                                    {"type": "text", "text": "What colour?"}]}])
    as_observation = fmt.prompt_with_images([{"role": "user", "content": Observation("What colour?", [red])}])
    assert as_parts == as_observation and as_parts[1] == [red]
    assert fmt.prompt_with_images([{"role": "user", "content": Observation("What colour?")}]) == (
        fmt.prompt_ids([{"role": "user", "content": "What colour?"}]), [])


def test_a_chat_processor_answers_as_its_tokenizer_and_pickles(vlm):
    import pickle

    from tiderl.models.vision import ChatProcessor, split_processor

    _, processor = vlm
    wrapped = ChatProcessor(processor)
    assert wrapped.pad_token_id == processor.tokenizer.pad_token_id and len(wrapped) == len(processor.tokenizer)
    assert split_processor(wrapped) == (processor.tokenizer, wrapped)
    assert split_processor(processor.tokenizer) == (processor.tokenizer, None)
    again = pickle.loads(pickle.dumps(wrapped))  # (a Ray worker gets it pickled)
    assert again.eos_token == processor.tokenizer.eos_token and again.image_processor is not None
    wrapped.tiderl_test_flag = 1  # set on it: set on the tokenizer, where readers look
    assert processor.tokenizer.tiderl_test_flag == 1
    del processor.tokenizer.tiderl_test_flag
