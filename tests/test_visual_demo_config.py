"""configs/visual_sao_tiny.yaml, the visual demo (docs/multimodal.md, "The visual demo"): it loads,
`tiderl train --dry-run` accepts it, its tasks generate, every held-out task fits the turn limit
(the oracle solves it) and the first message shows the grid as an image. The learning figure
itself (held-out success before and after SAO) is printed by
`tiderl demo --config configs/visual_sao_tiny.yaml`, not asserted here (minutes of CPU)."""

from __future__ import annotations

from pathlib import Path

from tiderl.agent.tool_parser import parse_hermes_tool_calls
from tiderl.cli import main
from tiderl.config import load_config
from tiderl.envs.protocol import Observation
from tiderl.envs.setup import load_setup

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "visual_sao_tiny.yaml"


def test_the_visual_demo_config_loads_and_train_dry_run_accepts_it(capsys):
    cfg = load_config(CONFIG)
    assert (cfg.env.name, cfg.model.path, cfg.algo.name) == ("visual_grid", "tiny", "sao")
    assert cfg.env.options.images and not cfg.env.options.text_state  # the model has to read the image
    # what lets the tiny VLM read the grid (docs/multimodal.md, "The visual demo"): one image token a
    # picture, every cell in its own slot, and a rule of one place (the goal fixed)
    assert cfg.model.tiny.image_scale_factor == 4 and cfg.env.options.fixed_goal
    # the headline is sampled success (greedy is at 0.975 before RL: no room), the same mode before and
    # after, on enough held-out grids, each sampled 4 times, for a 4-standard-error rise to show (docs/multimodal.md)
    assert (cfg.eval.greedy, cfg.eval.sampled, cfg.eval.pass_k) == (False, True, 4) and cfg.data.eval_size >= 400
    assert main(["train", "--config", str(CONFIG), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "name: visual_grid" in out and "path: tiny" in out


def test_the_visual_demo_tasks_fit_the_turn_limit_and_show_the_grid_as_an_image():
    cfg = load_config(CONFIG)
    setup = load_setup(cfg)
    assert len(setup.eval_tasks) == cfg.data.eval_size
    assert not {t.task_id for t in setup.train_tasks} & {t.task_id for t in setup.eval_tasks}
    env = setup.make_env()
    for task in setup.eval_tasks:  # the oracle, one move a turn, reaches every goal within env.max_turns
        turns = setup.oracle(task)
        assert 1 <= len(turns) <= cfg.env.max_turns
        env.reset(task)
        for turn in turns:
            result = env.step(parse_hermes_tool_calls(turn))
        assert result.done and result.reward == 1.0
    first = env.reset(setup.eval_tasks[0])
    assert isinstance(first, Observation) and len(first.images) == 1
    side = cfg.env.options.size * cfg.env.options.cell_px
    assert first.images[0].size == (side, side)
