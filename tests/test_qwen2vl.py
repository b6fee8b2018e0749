"""Qwen2-VL in tiderl (issue 31): a tiny one built offline with a processor that needs no
torchvision; its 3-D rotary positions (M-RoPE) computed by tiderl equal the model's own; exact
multi-turn assembly with its images; the trainer's log-probs and values equal the model's own
forward with pixel values; continuous batching of rows with other M-RoPE lags; and `tiderl train`
with SAO on a folder holding it. The checks both tiny architectures share run parametrized over
Idefics3 and Qwen2-VL beside the Idefics3 ones: the engine's behaviour log-probs equal to the
trainer's and learning the colour shown (tests/test_vlm_train.py), exact resume at staleness 0 and
LoRA / bf16 autocast / activation checkpointing (tests/test_vlm_run.py), DDP ranks
(tests/test_parallel_vlm.py). The environments are those of tests/test_vlm.py and tests/test_vlm_run.py."""

from __future__ import annotations

import copy
import json
import math
import pickle
import socket

import pytest
import torch

from test_vlm import CORPUS, SYSTEM, TOOLS, SquaresEnv, square
from test_vlm_train import CALL, ShowEveryTurnEnv
from tiderl.agent.chat import chat_format
from tiderl.agent.loop import ScriptedEngine, play_episodes
from tiderl.embedded.tiny_qwen2vl import IMAGE_PAD, build_tiny_qwen2vl
from tiderl.envs.protocol import Observation, Task
from tiderl.models.loading import ImageQwen2VLProcessor, load_model, load_processor, load_tokenizer
from tiderl.models.vision import ChatProcessor, PromptImages, embed_inputs, image_inputs, mrope_positions, rope_positions, uses_mrope
from tiderl.rollout.base import SamplingParams
from tiderl.rollout.torch_engine import TorchEngine
from tiderl.train.batching import collate
from tiderl.train.critic import ValueModel
from tiderl.train.forward import packed_token_logprobs, token_logprobs, token_values


@pytest.fixture(scope="module")
def qwen():
    return build_tiny_qwen2vl(CORPUS, seed=0)


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def any_qwen(request, qwen):
    """The tiny Qwen2-VL, then the tiny Qwen2.5-VL (window attention in its vision tower, the same
    image positions): the checks of positions, loading and training log-probs run on both."""
    return qwen if request.param == "qwen2_vl" else build_tiny_qwen2vl(CORPUS, seed=0, architecture=request.param)


def _tokens_per_image(size: tuple[int, int], patch: int = 8, merge: int = 2) -> int:
    """The formula: each side rounded to a multiple of patch * merge (16 px here; the areas stay
    within 16x16 .. 64x64), one token per merge x merge patches."""
    unit = patch * merge
    w, h = (max(unit, round(s / unit) * unit) for s in size)
    return (h // patch) * (w // patch) // merge**2


@pytest.mark.parametrize("size", [(40, 40), (50, 40), (64, 64), (20, 60)])
def test_an_image_becomes_the_patches_and_tokens_of_the_formula(qwen, size):
    model, processor = qwen
    assert type(processor.image_processor).__name__ == "Qwen2VLImageProcessorPil"  # no torchvision
    out = processor(text=[f"a <|vision_start|>{IMAGE_PAD}<|vision_end|> b"], images=[[square("red", size)]],
                    return_tensors="pt")
    n = _tokens_per_image(size)
    assert out["input_ids"][0].tolist().count(model.config.image_token_id) == n
    t, h, w = out["image_grid_thw"][0].tolist()
    assert t == 1 and h * w == n * 4
    # Flattened patches: one row per patch, channels x temporal patch (2) x 8 x 8 values.
    assert tuple(out["pixel_values"].shape) == (h * w, 3 * 2 * 8 * 8)
    assert image_inputs(processor.image_processor, [square("red", size)]).keys() == {"pixel_values", "image_grid_thw"}


def test_the_tiny_qwen2vl_round_trips_through_a_folder_without_the_network(any_qwen, tmp_path, monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("the tiny Qwen2-VL touched the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    architecture = any_qwen[0].config.model_type
    model, processor = build_tiny_qwen2vl(CORPUS, seed=0, architecture=architecture)
    assert torch.equal(model.get_input_embeddings().weight, any_qwen[0].get_input_embeddings().weight)
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    # It saves under the name of transformers' Qwen2VLProcessor (which needs torchvision to load it).
    assert json.loads((tmp_path / "processor_config.json").read_text())["processor_class"] == "Qwen2VLProcessor"
    again = load_processor(tmp_path)
    assert type(again) is ImageQwen2VLProcessor
    assert again.image_processor.to_dict() == processor.image_processor.to_dict()
    assert again.tokenizer.get_vocab() == processor.tokenizer.get_vocab()
    assert again.tokenizer.chat_template == processor.tokenizer.chat_template
    wrapped = load_tokenizer(tmp_path)
    assert isinstance(wrapped, ChatProcessor) and wrapped.image_token == IMAGE_PAD
    assert type(pickle.loads(pickle.dumps(wrapped)).processor) is ImageQwen2VLProcessor  # (Ray workers get it so)
    loaded = load_model(tmp_path)
    assert type(loaded) is type(model) and loaded.config.model_type == architecture
    inputs = again(text=[f"<|vision_start|>{IMAGE_PAD}<|vision_end|>What colour?"], images=[[square("red")]],
                   return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).logits, loaded(**inputs).logits, rtol=0, atol=0)


def test_a_qwen2vl_folder_in_the_older_layout_loads(qwen, tmp_path):
    """Checkpoints made before transformers 5: the image processor in preprocessor_config.json,
    the chat template in chat_template.json."""
    model, processor = qwen
    model.config.save_pretrained(tmp_path)
    processor.image_processor.save_pretrained(tmp_path)
    tokenizer = copy.deepcopy(processor.tokenizer)
    tokenizer.chat_template = None
    tokenizer.save_pretrained(tmp_path)
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": processor.tokenizer.chat_template}))
    assert (tmp_path / "preprocessor_config.json").is_file() and not (tmp_path / "processor_config.json").is_file()
    again = load_processor(tmp_path)
    assert again.image_processor.to_dict() == processor.image_processor.to_dict()
    assert again.tokenizer.chat_template == processor.tokenizer.chat_template
    messages = [{"role": "user", "content": Observation("What colour?", [square("red", (50, 40))])}]
    assert chat_format(ChatProcessor(again), None).prompt_with_images(messages)[0] == chat_format(
        processor, None).prompt_with_images(messages)[0]


def test_a_qwen2vl_folder_with_only_a_tokenizer_is_refused_with_the_fix(qwen, tmp_path):
    model, processor = qwen
    model.config.save_pretrained(tmp_path)
    processor.tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"processor\.save_pretrained"):
        load_processor(tmp_path)


def _two_image_sequence(processor):
    text = (f"hi <|vision_start|>{IMAGE_PAD}<|vision_end|> and <|vision_start|>{IMAGE_PAD}<|vision_end|> "
            "What colour?")
    images = [square("red", (50, 40)), square("blue", (20, 60))]
    return processor(text=[text], images=[images], add_special_tokens=False, return_tensors="pt"), images


def test_tiderls_mrope_positions_equal_the_models_rope_index(any_qwen):
    model, processor = any_qwen
    out, images = _two_image_sequence(processor)
    expected, delta = model.model.get_rope_index(out["input_ids"], out["mm_token_type_ids"], out["image_grid_thw"])
    ours = rope_positions(model, out["input_ids"], [image_inputs(processor.image_processor, images)])
    assert torch.equal(ours, expected)
    mask = (out["input_ids"][0] == model.config.image_token_id).tolist()
    positions, following = mrope_positions(mask, out["image_grid_thw"].tolist(), 2)
    assert following == int(expected.max()) + 1 == len(mask) + int(delta)
    assert following < len(mask)  # the text after an image lags behind its token index
    with pytest.raises(ValueError, match="disagree"):  # a token short of the images' grids
        mrope_positions(mask[:-8] + [False] * 8, out["image_grid_thw"].tolist(), 2)
    with pytest.raises(ValueError, match="disagree"):  # an image with no tokens
        mrope_positions(mask, out["image_grid_thw"].tolist() + [[1, 4, 4]], 2)


def test_other_mrope_models_are_refused_and_text_models_have_plain_positions(qwen):
    model, _ = qwen
    assert uses_mrope(model)
    other = copy.deepcopy(model.config)
    other.model_type = "qwen9_vl"

    class Fake:
        config = other

    with pytest.raises(ValueError, match="M-RoPE"):
        uses_mrope(Fake())
    from tiderl.embedded.tiny import init_tiny_model, tiny_qwen2_config

    text_model = init_tiny_model(tiny_qwen2_config(300, hidden_size=32), seed=0)
    assert rope_positions(text_model, torch.zeros(1, 4, dtype=torch.long), None) is None


def test_turn_by_turn_assembly_equals_the_processor_rendering_the_whole_conversation(qwen):
    _, processor = qwen
    tok = processor.tokenizer
    fmt = chat_format(processor, TOOLS)
    red, green, blue = square("red"), square("green", (60, 20)), square("blue", (20, 60))
    ids, images = fmt.prompt_with_images(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": Observation("What colour?", [red])}])
    for turn, shown in ((CALL, [Observation("Here is the next square.", [green, blue])]), ("I see.", ["no image"])):
        ids += tok.encode(turn, add_special_tokens=False) + [fmt.end_of_turn_id]  # sampled tokens, as sampled
        more, new = fmt.answer_with_images(shown, as_tool_responses=turn == CALL)
        ids, images = ids + more, images + new
    whole = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]},
        {"role": "assistant", "content": CALL},
        {"role": "tool", "content": [{"type": "image"}, {"type": "image"},
                                     {"type": "text", "text": "Here is the next square."}]},
        {"role": "assistant", "content": "I see."},
        {"role": "user", "content": "no image"},
    ]
    text = processor.apply_chat_template(whole, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    expected = processor(text=[text], images=[[red, green, blue]], add_special_tokens=False)["input_ids"][0]
    assert images == [red, green, blue]
    assert ids == list(expected)
    counts = [_tokens_per_image(i.size) for i in (red, green, blue)]
    assert ids.count(tok.convert_tokens_to_ids(IMAGE_PAD)) == sum(counts) == 4 + 4 + 4  # expanded once each
    assert ids.count(tok.convert_tokens_to_ids("<|vision_start|>")) == 3


def _hf_logprobs(model, processor, ids: list[int], images) -> torch.Tensor:
    """log pi(token t | tokens < t) from the model's own forward with pixel values, which computes
    its M-RoPE positions itself (`get_rope_index`)."""
    inputs = {"input_ids": torch.tensor([ids])}
    if images:
        inputs.update(image_inputs(processor.image_processor, images))
        inputs["mm_token_type_ids"] = (inputs["input_ids"] == model.config.image_token_id).int()
    with torch.no_grad():
        logits = model(**inputs).logits[0, :-1].float()
    lp = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)
    return torch.cat([torch.zeros(1), lp])


def _logprobs_at_token_indices(model, processor, t) -> torch.Tensor:
    """The log-probs of trajectory `t` with its image features but positions 0..T-1 (wrong)."""
    ids = torch.tensor([t.tokens])
    pixels = {**image_inputs(processor.image_processor, t.images), "forced": torch.tensor([m == 0 for m in t.loss_mask])}
    with torch.no_grad():
        logits = model(inputs_embeds=embed_inputs(model, ids, [pixels]), position_ids=torch.arange(ids.shape[1])[None],
                       use_cache=False).logits[0, :-1].float()
    lp = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros(1), lp])


def _scripted_episodes(processor):
    """One episode with two images of different shapes (a look call), one text-only episode."""
    class TextEnv(SquaresEnv):
        def reset(self, task):
            self.task = task
            return "What colour is the square?"

    tok = processor.tokenizer
    with_images = play_episodes(ScriptedEngine(tok, {"What colour": [CALL, "answer: red blue"]}), processor,
                                SquaresEnv, [Task("a", "q", None, {"colours": ["red", "blue"]})],
                                SamplingParams(max_new_tokens=40), max_turns=3, max_total_tokens=400)
    text_only = play_episodes(ScriptedEngine(tok, {"What colour": ["answer: red"]}), processor, TextEnv,
                              [Task("b", "q", None, {"colours": ["red"]})], SamplingParams(max_new_tokens=40),
                              max_turns=3, max_total_tokens=400)
    return with_images + text_only


def test_training_logprobs_and_values_equal_the_models_own_forward_with_pixel_values(any_qwen):
    model, processor = any_qwen
    model = copy.deepcopy(model)  # (the model's own forward keeps rope deltas on it)
    trajectories = _scripted_episodes(processor)
    assert len(trajectories[0].images) == 2 and trajectories[1].images == []
    batch = collate(trajectories, 0, processor.image_processor)
    with torch.no_grad():
        lp, _ = token_logprobs(model, batch.input_ids, batch.attention_mask, pixels=batch.pixels)
    for row, t in enumerate(trajectories):
        n = len(t.tokens)
        torch.testing.assert_close(lp[row, :n], _hf_logprobs(model, processor, t.tokens, t.images),
                                   atol=1e-5, rtol=1e-5)
    image_id = model.config.image_token_id
    assert bool((batch.action_mask[batch.input_ids == image_id] == 0).all())  # image tokens carry no loss
    # Positions matter: the same inputs at positions 0..T-1 give other log-probs after the first image.
    t = trajectories[0]
    assert float((_logprobs_at_token_indices(model, processor, t) - lp[0, :len(t.tokens)]).abs().max()) > 1e-3
    # The critic sees the same inputs and positions: its head on the backbone's own forward.
    critic = ValueModel.from_policy(model)
    torch.nn.init.normal_(critic.head.weight)
    t = trajectories[0]
    with torch.no_grad():
        values = token_values(critic, batch.input_ids, batch.attention_mask, batch.pixels)
        inputs = {"input_ids": torch.tensor([t.tokens]), **image_inputs(processor.image_processor, t.images)}
        inputs["mm_token_type_ids"] = (inputs["input_ids"] == image_id).int()
        expected = critic.head(critic.backbone(**inputs).last_hidden_state).squeeze(-1)[0, :-1]
    torch.testing.assert_close(values[0, 1:len(t.tokens)], expected, atol=1e-5, rtol=1e-5)
    token_values(critic, batch.input_ids, batch.attention_mask, batch.pixels).sum().backward()
    grads = [p.grad for n, p in critic.backbone.named_parameters() if n.startswith("visual.")]
    assert any(g is not None and float(g.abs().sum()) > 0 for g in grads), "no gradient reached the vision tower"


def test_text_only_rows_train_packed_as_unpacked(qwen):
    model, processor = qwen
    text_only = _scripted_episodes(processor)[1:] * 2
    batch = collate(text_only, 0)
    with torch.no_grad():
        padded, _ = token_logprobs(model, batch.input_ids, batch.attention_mask)
        packed, _ = packed_token_logprobs(model, batch.input_ids, batch.attention_mask, batch.action_mask)
    mask = batch.action_mask.bool()
    torch.testing.assert_close(packed[mask], padded[mask], atol=1e-5, rtol=1e-5)


@pytest.mark.slow  # trains and evaluates through the CLI (a few seconds)
@pytest.mark.parametrize("architecture", ["qwen2_vl", "qwen2_5_vl"])
def test_tiderl_train_with_sao_on_a_qwen2vl_directory(tmp_path, architecture):
    from test_vlm_run import ColourEnv, corpus
    from tiderl.cli import main

    model, processor = build_tiny_qwen2vl(corpus(), seed=0, architecture=architecture)
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    processor.save_pretrained(model_dir)
    shown = ColourEnv.shown
    run_dir = tmp_path / "run"
    code = main(["train", "env.name=test_vlm_run:ColourEnv", "data.source=colours", f"model.path={model_dir}",
                 f"run_dir={run_dir}", "algo.name=sao", "algo.critic_warmup_steps=0", "rollout.batch_size=6", "train.steps=2",
                 "env.max_turns=1", "env.max_total_tokens=300", "rollout.max_new_tokens=24",
                 "train.micro_batch_tokens=2048", "log.progress=false", "log.tensorboard=false"])
    assert code == 0
    assert ColourEnv.shown >= shown + 12  # the episodes showed their images
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    assert all(math.isfinite(s["policy/grad_norm"]) and s["policy/grad_norm"] > 0 for s in steps)
    ledger = json.loads((run_dir / "system.json").read_text())["ledger"]
    assert ledger["failed"] == 0, ledger
    actor = run_dir / "checkpoints" / "final" / "actor"
    assert type(load_processor(actor)) is ImageQwen2VLProcessor
    trained = load_model(actor)
    changed = [k for k, v in trained.state_dict().items()
               if k.startswith("model.visual.") and not torch.equal(v, model.state_dict()[k])]
    assert changed, "the vision tower did not train"
    results = tmp_path / "eval.json"  # `tiderl eval` evaluates the checkpoint
    assert main(["eval", "--model", str(actor), "--json", str(results), "env.name=test_vlm_run:ColourEnv",
                 "data.source=colours", "env.max_turns=1", "env.max_total_tokens=300", "rollout.max_new_tokens=24",
                 "log.progress=false"]) == 0
    greedy = json.loads(results.read_text())["greedy"]
    assert greedy["n"] == 6 and greedy["by_stop_reason"].get("error") is None


@pytest.mark.parametrize("prefill_tokens", [4096, 24])
def test_rows_with_other_lags_decode_together_and_one_joins_a_running_batch(qwen, prefill_tokens):
    """Continuous batching with M-RoPE: a text-only row (no lag), rows whose images give other lags,
    and a row that joins while another decodes; each row's log-probs are the trainer's. With a
    small prefill budget the joining rows are prefilled in groups, each in passes along its length."""
    model, processor = qwen
    engine = TorchEngine(model, processor, seed=5, prefill_tokens=prefill_tokens)
    fmt = chat_format(processor, None)

    def prompt(*images):
        content = Observation("What colour?", list(images)) if images else "What colour?"
        return fmt.prompt_with_images([{"role": "user", "content": content}])

    def submit(ids_images, n, on_done=None):
        ids, images = ids_images
        return engine.submit(ids, SamplingParams(temperature=1.0, max_new_tokens=n, stop_token_ids=[]),
                             on_done=on_done, images=PromptImages(images, [1] * len(ids)) if images else None)

    joined: list = []

    def join_another(_):
        joined.append(engine.pending())  # the long row still decodes
        joined.append(submit(prompt(square("green", (20, 60))), 6))

    requests = [submit(prompt(square("red", (50, 40))), 2, join_another),
                submit(prompt(square("blue", (64, 64)), square("red")), 16), submit(prompt(), 10)]
    engine.serve()
    assert joined[0] >= 1
    assert (engine.stats["prefill_passes"] > 2) == (prefill_tokens < 4096)  # the first three rows, then the fourth
    requests.append(joined[1])
    for request in requests:
        done = request.result
        assert done is not None and len(done.token_ids) == request.params.max_new_tokens
        ids = torch.tensor([request.prompt + done.token_ids])
        shown = request.images.images if request.images is not None else []
        pixels = [{**image_inputs(processor.image_processor, shown),
                   "forced": torch.tensor([True] * len(request.prompt))}] if shown else None
        with torch.no_grad():
            lp, _ = token_logprobs(model, ids, torch.ones_like(ids), pixels=pixels)
        torch.testing.assert_close(lp[0, len(request.prompt):], torch.tensor(done.logprobs), atol=1e-5, rtol=0)


def test_a_placeholder_token_the_model_sampled_is_text_for_positions_too(qwen):
    """A sampled `<|image_pad|>` takes no image features and a text position (one more than the
    last), for the trainer and for the engine alike: after it and the next image, the engine's
    log-prob of its next token is the trainer's."""
    model, processor = qwen
    tok = processor.tokenizer
    (t,) = play_episodes(ScriptedEngine(tok, {"What colour": [CALL + IMAGE_PAD, "answer: red blue"]}), processor,
                         SquaresEnv, [Task("a", "q", None, {"colours": ["red", "blue"]})],
                         SamplingParams(max_new_tokens=40), max_turns=3, max_total_tokens=400)
    image_id = model.config.image_token_id
    sampled_at = [i for i, (x, m) in enumerate(zip(t.tokens, t.loss_mask)) if x == image_id and m]
    assert len(sampled_at) == 1 and len(t.images) == 2
    pixels = {**image_inputs(processor.image_processor, t.images), "forced": torch.tensor([m == 0 for m in t.loss_mask])}
    positions = rope_positions(model, torch.tensor([t.tokens]), [pixels])[:, 0]
    k = sampled_at[0]
    assert positions[:, k].tolist() == [int(positions[:, :k].max()) + 1] * 3
    end = len(t.tokens) - 3
    engine = TorchEngine(model, processor, seed=0)
    (c,) = engine.generate([t.tokens[:end]], SamplingParams(temperature=0.0, max_new_tokens=1),
                           images=[PromptImages(list(t.images), [1 - m for m in t.loss_mask[:end]])])
    ids = torch.tensor([t.tokens[:end] + c.token_ids])
    forced = {**pixels, "forced": torch.tensor([m == 0 for m in t.loss_mask[:end]] + [False])}
    with torch.no_grad():
        lp, _ = token_logprobs(model, ids, torch.ones_like(ids), pixels=[forced])
    assert abs(float(lp[0, end]) - c.logprobs[0]) < 1e-5
