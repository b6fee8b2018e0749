"""Episodes with images in the trainer and the torch engine (issue 31): the training forward with
images equals a plain Hugging Face forward with pixel values, gradients reach the vision tower and
the connector, image tokens carry no loss, and the engine's behaviour log-probs (prefill with image
features, KV-cache decoding, prefix reuse across turns) equal the trainer's recompute. The engine
check runs on the tiny Idefics3, Qwen2-VL and Qwen2.5-VL, the colour-learning check on the first two
(tests/test_qwen2vl.py has Qwen2-VL's own checks: M-RoPE, its processor, its assembly)."""

from __future__ import annotations

import copy
import functools
from dataclasses import replace

import pytest
import torch

from support import give_own_behaviour_logprobs, worst_behaviour_gap
from test_vlm import CORPUS, SquaresEnv, square
from tiderl.agent.loop import ScriptedEngine, play_episodes
from tiderl.config import AlgoConfig, preset_defaults
from tiderl.embedded.tiny_qwen2vl import build_tiny_qwen2vl
from tiderl.embedded.tiny_vlm import build_tiny_vlm
from tiderl.envs.protocol import Observation, StepResult, Task
from tiderl.models.vision import PromptImages, image_inputs
from tiderl.rollout.base import SamplingParams
from tiderl.rollout.torch_engine import TorchEngine
from tiderl.train.batching import collate
from tiderl.train.critic import ValueModel
from tiderl.train.forward import token_logprobs, token_values
from tiderl.train.learner import Learner
from tiderl.train.step import train_step

CALL = '<tool_call>\n{"name": "look", "arguments": {}}\n</tool_call>'
# Each tiny architecture's builder and the worst engine - trainer log-prob difference it is held to.
ARCHITECTURES = {"idefics3": (build_tiny_vlm, 1e-4), "qwen2_vl": (build_tiny_qwen2vl, 1e-5),
                 "qwen2_5_vl": (functools.partial(build_tiny_qwen2vl, architecture="qwen2_5_vl"), 1e-5)}


class ShowEveryTurnEnv(SquaresEnv):
    """Answers every turn with the next square (as a user turn when the turn called no tool); ends
    after `task.meta["turns"]` turns, reward 1 when the last turn's text names the last colour."""

    def step(self, action):
        assert self.task is not None
        if self.shown >= self.task.meta["turns"]:
            return StepResult([], reward=float(self.task.meta["colours"][-1] in action.text), done=True)
        return StepResult([Observation("Here is the next square.", [self.show()])])


@pytest.fixture(scope="module")
def vlm():
    return build_tiny_vlm(CORPUS, seed=0)


@pytest.fixture(scope="module")
def tiny(vlm):
    """`tiny(architecture)`: that architecture's tiny model and processor, built once a module."""
    built = {"idefics3": vlm}

    def get(architecture: str):
        if architecture not in built:
            built[architecture] = ARCHITECTURES[architecture][0](CORPUS, seed=0)
        return built[architecture]

    return get


def _hf_logprobs(model, ids: list[int], images, image_processor) -> torch.Tensor:
    """log pi(token t | tokens < t) from the model's own forward with pixel values."""
    pixels = image_inputs(image_processor, images) if images else {}
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), **pixels).logits[0, :-1].float()
    lp = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)
    return torch.cat([torch.zeros(1), lp])


def _scripted_episodes(processor):
    """One episode with two images (a look call), one text-only episode of the same environment."""
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


def test_training_logprobs_and_values_equal_the_plain_forward_with_pixel_values(vlm):
    model, processor = vlm
    trajectories = _scripted_episodes(processor)
    assert len(trajectories[0].images) == 2 and trajectories[1].images == []
    batch = collate(trajectories, 0, processor.image_processor)
    assert batch.pixels is not None and batch.pixels[1] is None
    with torch.no_grad():
        lp, _ = token_logprobs(model, batch.input_ids, batch.attention_mask, pixels=batch.pixels)
    for row, t in enumerate(trajectories):
        n = len(t.tokens)
        expected = _hf_logprobs(model, t.tokens, t.images, processor.image_processor)
        torch.testing.assert_close(lp[row, :n], expected, atol=1e-5, rtol=1e-5)
    # Image tokens are forced: no loss there.
    image_id = model.config.image_token_id
    assert bool((batch.action_mask[batch.input_ids == image_id] == 0).all())
    assert int((batch.input_ids == image_id).sum()) == 8
    # The critic sees the same inputs: its values are its head on the backbone's forward with pixels.
    critic = ValueModel.from_policy(model)
    torch.nn.init.normal_(critic.head.weight)
    with torch.no_grad():
        values = token_values(critic, batch.input_ids, batch.attention_mask, batch.pixels)
        t = trajectories[0]
        hidden = critic.backbone(input_ids=torch.tensor([t.tokens]),
                                 **image_inputs(processor.image_processor, t.images)).last_hidden_state
        expected_v = critic.head(hidden).squeeze(-1)[0, :-1]
    torch.testing.assert_close(values[0, 1:len(t.tokens)], expected_v, atol=1e-5, rtol=1e-5)
    # ... and its value loss reaches its own vision tower and connector.
    token_values(critic, batch.input_ids, batch.attention_mask, batch.pixels).sum().backward()
    for part in ("vision_model", "connector"):
        grads = [p.grad for n, p in critic.backbone.named_parameters() if n.startswith(part)]
        assert any(g is not None and float(g.abs().sum()) > 0 for g in grads), part


def test_a_batch_with_images_needs_the_image_processor(vlm):
    _, processor = vlm
    with pytest.raises(ValueError, match="image_processor"):
        collate(_scripted_episodes(processor), 0)


def test_a_train_step_on_episodes_with_images_trains_the_vision_tower_and_connector(vlm):
    model, processor = vlm
    policy = copy.deepcopy(model)
    trajectories = _scripted_episodes(processor)
    trajectories[1].reward = 0.0  # rewards differ (both answers were right): advantages survive whitening
    give_own_behaviour_logprobs(policy, trajectories, processor.image_processor)
    critic = ValueModel.from_policy(policy)
    cfg = AlgoConfig(**{**preset_defaults("sao"), "critic_updates": 1, "entropy_coef": 0.0})
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    metrics = train_step(trajectories, Learner(policy, lr=1e-2), Learner(critic, lr=1e-2), None, cfg, pad_id=0,
                         micro_batch_tokens=4096, train_actor=True, image_processor=processor.image_processor)
    assert metrics["policy/grad_norm"] > 0
    after = policy.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert any(k.startswith("model.vision_model.") for k in changed), "the vision tower got no update"
    assert any(k.startswith("model.connector.") for k in changed), "the connector got no update"


@pytest.mark.parametrize("prefix_cache_mb", [1024.0, 0.0])
@pytest.mark.parametrize("architecture", list(ARCHITECTURES))
def test_engine_behaviour_logprobs_equal_the_trainers_recompute_on_two_turns_with_images(tiny, architecture,
                                                                                         prefix_cache_mb):
    model, processor = tiny(architecture)
    engine = TorchEngine(model, processor, seed=3, prefix_cache_mb=prefix_cache_mb)
    tasks = [Task(f"t{i}", "q", None, {"colours": colours, "turns": 2})
             for i, colours in enumerate((["red", "blue"], ["green", "red"], ["blue", "blue"]))]
    trajectories = play_episodes(engine, processor, ShowEveryTurnEnv, tasks,
                                 SamplingParams(temperature=1.0, max_new_tokens=12, seed=7), max_turns=3,
                                 max_total_tokens=400)
    assert all(t.num_turns == 2 and len(t.images) == 2 for t in trajectories)
    # The engine's own recompute path: prefix reuse across the turns when it keeps caches.
    assert (engine.stats["reused_tokens"] > 0) == (prefix_cache_mb > 0)
    batch = collate(trajectories, 0, processor.image_processor)
    with torch.no_grad():
        lp, _ = token_logprobs(model, batch.input_ids, batch.attention_mask, pixels=batch.pixels)
    worst, sampled_after_an_image = worst_behaviour_gap(trajectories, lp)
    print(f"\n[{architecture} engine] prefix_cache_mb={prefix_cache_mb}: max |engine - trainer| log-prob = {worst:.2e}")
    assert worst < ARCHITECTURES[architecture][1], worst
    assert sampled_after_an_image > 30  # several decode steps per turn, each after images
    assert len({tok for t in trajectories for tok, m in zip(t.tokens, t.loss_mask) if m}) > 5  # it sampled
    if architecture != "idefics3":
        # Positions at token indices (no M-RoPE) would give other log-probs: the check has teeth.
        from test_qwen2vl import _logprobs_at_token_indices

        t = trajectories[0]
        assert float((_logprobs_at_token_indices(model, processor, t) - lp[0, :len(t.tokens)]).abs().max()) > 1e-3


def test_the_engine_refuses_images_without_a_processor_or_with_the_wrong_flags(vlm):
    model, processor = vlm
    shown = PromptImages([square("red")], [1, 1, 1])
    with pytest.raises(ValueError, match="processor"):
        TorchEngine(model, processor.tokenizer).generate([[1, 2, 3]], SamplingParams(max_new_tokens=2), images=[shown])
    with pytest.raises(ValueError, match="one per prompt token"):
        TorchEngine(model, processor).generate([[1, 2, 3, 4]], SamplingParams(max_new_tokens=2), images=[shown])


def test_a_placeholder_token_the_model_sampled_is_text_for_the_trainer_and_the_engine(vlm):
    model, processor = vlm
    tok = processor.tokenizer
    # The first turn "says" <image>: a sampled placeholder token among the forced ones.
    (t,) = play_episodes(ScriptedEngine(tok, {"What colour": [CALL + "<image>", "answer: red blue"]}), processor,
                         SquaresEnv, [Task("a", "q", None, {"colours": ["red", "blue"]})],
                         SamplingParams(max_new_tokens=40), max_turns=3, max_total_tokens=400)
    image_id = model.config.image_token_id
    sampled_at = [i for i, (tk, m) in enumerate(zip(t.tokens, t.loss_mask)) if tk == image_id and m]
    assert len(sampled_at) == 1 and len(t.images) == 2
    # Beside it in the batch, a text-only episode whose turn says <image> too: text there as well.
    class TextEnv(SquaresEnv):
        def reset(self, task):
            self.task = task
            return "What colour is the square?"

    (text_only,) = play_episodes(ScriptedEngine(tok, {"What colour": ["<image> answer: red"]}), processor, TextEnv,
                                 [Task("b", "q", None, {"colours": ["red"]})], SamplingParams(max_new_tokens=40),
                                 max_turns=1, max_total_tokens=400)
    assert image_id in text_only.tokens and not text_only.images
    batch = collate([t, text_only], 0, processor.image_processor)
    with torch.no_grad():
        lp, _ = token_logprobs(model, batch.input_ids, batch.attention_mask, pixels=batch.pixels)
    n = len(text_only.tokens)
    torch.testing.assert_close(lp[1, :n], _hf_logprobs(model, text_only.tokens, [], processor.image_processor),
                               atol=1e-5, rtol=1e-5)
    # Before that token, the model's own forward (which would refuse the whole sequence) agrees.
    k = sampled_at[0]
    prefix_images = t.images[:1]
    torch.testing.assert_close(lp[0, :k], _hf_logprobs(model, t.tokens[:k], prefix_images, processor.image_processor),
                               atol=1e-5, rtol=1e-5)
    # After it (the second image's features are where they belong), the engine agrees with the trainer.
    end = len(t.tokens) - 3
    engine = TorchEngine(model, processor, seed=0)
    forced = [1 - m for m in t.loss_mask[:end]]
    (c,) = engine.generate([t.tokens[:end]], SamplingParams(temperature=0.0, max_new_tokens=1),
                           images=[PromptImages(list(t.images), forced)])
    again = collate([replace(t, tokens=t.tokens[:end] + c.token_ids, loss_mask=t.loss_mask[:end] + [1],
                             behavior_logprobs=[0.0] * (end + 1), policy_version=[0] * (end + 1))],
                    0, processor.image_processor)
    with torch.no_grad():
        lp2, _ = token_logprobs(model, again.input_ids, again.attention_mask, pixels=again.pixels)
    assert abs(float(lp2[0, end]) - c.logprobs[0]) < 1e-4


@pytest.mark.slow  # trains a model (60 warm-start steps)
@pytest.mark.parametrize("architecture", ["idefics3", "qwen2_vl"])  # (Qwen2.5-VL: the same path as Qwen2-VL's)
def test_a_tiny_vlm_learns_to_name_the_colour_it_is_shown(tiny, architecture):
    """The images carry signal end to end (with Qwen2-VL, through M-RoPE too): after a short
    supervised warm start on demonstrations (the answer is the colour of the square, the question
    the same text every time), the torch engine's greedy answer names the colour of the square it is
    shown, for every colour."""
    from tiderl.models.warmstart import supervised_finetune

    model, processor = tiny(architecture)
    model = copy.deepcopy(model)
    tok = processor.tokenizer
    colours = ["red", "green", "blue"]
    demos = []
    for colour in colours:
        (t,) = play_episodes(ScriptedEngine(tok, {"What colour": [f"answer: {colour}"]}), processor, SquaresEnv,
                             [Task(colour, "q", None, {"colours": [colour]})], SamplingParams(max_new_tokens=20),
                             max_turns=1, max_total_tokens=200)
        assert t.reward == 1.0
        demos.append(t)
    losses = supervised_finetune(model, demos, 0, steps=60, batch_size=3, lr=3e-3, seed=0, log=lambda _: None,
                                 image_processor=processor.image_processor)
    assert losses[-1] < 0.1 * losses[0]
    engine = TorchEngine(model, processor, seed=0)
    tasks = [Task(c, "q", None, {"colours": [c]}) for c in colours]
    out = play_episodes(engine, processor, SquaresEnv, tasks, SamplingParams(temperature=0.0, max_new_tokens=12),
                        max_turns=1, max_total_tokens=200)
    assert [t.reward for t in out] == [1.0, 1.0, 1.0], [tok.decode([x for x, m in zip(t.tokens, t.loss_mask) if m])
                                                          for t in out]
