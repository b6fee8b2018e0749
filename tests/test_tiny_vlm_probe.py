"""The image-reliance probe (`tiderl.embedded.vlm_probe`) and the embedded tiny VLM's image
setting (issue 31): the probe's parts on hand-made grids, and a model whose image features are
zeroed scores the same with any picture."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tiderl.config import load_config
from tiderl.embedded.tiny_vlm import (EMBEDDED_SCALE_FACTOR, build_tiny_vlm, image_seq_len, init_tiny_vlm,
                                      make_processor, tiny_vlm_config, train_vlm_tokenizer)
from tiderl.embedded.vlm_probe import direction_logprobs, direction_tokens, first_prompts, probe, right_first_moves
from tiderl.envs.protocol import Task
from tiderl.envs.setup import load_setup
from tiderl.envs.visual.grid import DIRECTIONS, SYSTEM_PROMPT, render, tool_call_text
from tiderl.models.vision import ChatProcessor, image_features, image_inputs


def grid_task(start, goal, walls=()):
    meta = {"size": 4, "walls": [list(w) for w in walls], "start": list(start), "goal": list(goal), "shortest": 0}
    return Task("grid4-test", "Reach the green goal square. The image shows the grid.", 0, meta)


def test_right_first_moves_are_the_moves_that_start_a_shortest_path():
    assert right_first_moves(grid_task((0, 0), (1, 1))) == {"down", "right"}
    assert right_first_moves(grid_task((0, 0), (1, 1), walls=[(0, 1)])) == {"down"}
    assert right_first_moves(grid_task((2, 2), (2, 0), walls=[(2, 1)])) == {"up", "down"}
    assert right_first_moves(grid_task((3, 3), (0, 3))) == {"up"}


def test_direction_tokens_tell_the_four_moves_apart_at_one_token():
    tokenizer = train_vlm_tokenizer([SYSTEM_PROMPT] + [tool_call_text("move", {"direction": d}) for d in DIRECTIONS] * 5,
                                    400)
    common, choices = direction_tokens(tokenizer)
    assert len(set(choices)) == 4
    assert [tokenizer.decode(common + [c]).rsplit('"', 1)[-1] for c in choices] == list(DIRECTIONS)


def test_the_embedded_build_gives_one_token_per_picture_holding_every_patch_in_its_own_slot():
    """The pixel shuffle the build uses (`tiny_vlm.EMBEDDED_SCALE_FACTOR`): a 64 px picture of 16 px
    patches is one `<image>` token; before the connector's projection its features are the 16
    patches' vision features side by side, so moving the agent changes the slots of the two cells
    involved and leaves the other 14 as they were."""
    assert image_seq_len(64, 16, EMBEDDED_SCALE_FACTOR) == 1
    tokenizer = train_vlm_tokenizer([SYSTEM_PROMPT] * 3, 300)
    processor = make_processor(tokenizer, scale_factor=EMBEDDED_SCALE_FACTOR)
    model = init_tiny_vlm(tiny_vlm_config(tokenizer, scale_factor=EMBEDDED_SCALE_FACTOR), 0)
    slots = []
    for agent in ((0, 0), (0, 1)):
        pixels = image_inputs(processor.image_processor, [render(4, frozenset(), agent, (3, 3))])
        with torch.no_grad():
            assert image_features(model, pixels).shape == (1, model.config.text_config.hidden_size)
            hidden = model.model.vision_model(pixel_values=pixels["pixel_values"][0]).last_hidden_state
            shuffled = model.model.connector.pixel_shuffle(hidden, EMBEDDED_SCALE_FACTOR)
        assert shuffled.shape == (1, 1, 16 * model.config.vision_config.hidden_size)
        slots.append(shuffled.view(16, -1))
    changed = [(a - b).abs().max().item() > 1e-3 for a, b in zip(*slots)]
    assert sum(changed) >= 2 and sum(changed) < 16, changed


def small_cfg(**extra):
    overrides = {"data.eval_size": 24, "env.options.num_train_tasks": 300, "model.warmstart.num_traces": 300,
                 "env.system_prompt": "Move to the green square.", **extra}
    return load_config(Path(__file__).resolve().parents[1] / "configs" / "visual_sao_tiny.yaml",
                       [f"{k}={v}" for k, v in overrides.items()])


def test_a_model_that_ignores_its_picture_scores_the_same_with_any_picture():
    """The connector's projection zeroed: every picture gives zero image features, so the three
    variants score alike to rounding; the losses are those of a distribution over four moves."""
    cfg = small_cfg()
    setup = load_setup(cfg)
    model, processor = build_tiny_vlm([SYSTEM_PROMPT, tool_call_text("move", {"direction": "up"})] * 3, seed=0,
                                      vocab_size=300, hidden_size=32, scale_factor=EMBEDDED_SCALE_FACTOR)
    processor = ChatProcessor(processor)
    prompts = first_prompts(processor, setup, setup.eval_tasks[:4], cfg)
    swapped = [(tokens, prompts[(i + 1) % 4][1]) for i, (tokens, _) in enumerate(prompts)]
    assert {len(tokens) for tokens, _ in prompts} == {len(prompts[0][0])}  # one prompt text for every grid
    # an untrained model's choice moves (a little) with the picture: the pictures reach the scored position
    assert (direction_logprobs(model, processor, prompts) - direction_logprobs(model, processor, swapped)).abs().max() > 1e-7
    with torch.no_grad():
        model.model.connector.modality_projection.proj.weight.zero_()
    assert (direction_logprobs(model, processor, prompts) - direction_logprobs(model, processor, swapped)).abs().max() < 1e-6
    result = probe(model, processor, setup, setup.eval_tasks[:8], cfg)
    assert result["tasks"] == 8
    assert abs(result["gap_swapped"]) < 1e-4 and abs(result["gap_blank"]) < 1e-4, result
    for name in ("true", "swapped", "blank"):
        assert 0 < result[name]["loss"] < 2 * result["uniform_loss"] and 0 <= result[name]["accuracy"] <= 1
    with pytest.raises(ValueError, match="at least 2 tasks"):
        probe(model, processor, setup, setup.eval_tasks[:1], cfg)

