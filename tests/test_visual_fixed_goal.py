"""`env.options.fixed_goal` of visual_grid (issue 31, the visual demo): every task's goal is the
same cell, shown only in the picture, the start and the walls vary; the splits stay disjoint and the
option is keyed (it changes the tasks)."""

from __future__ import annotations

import pytest

from tiderl.config import load_config
from tiderl.envs.setup import load_setup
from tiderl.envs.visual.grid import fixed_goal_cell, generate_tasks, layout_of, render
from tiderl.options import ConfigError

SHAPE = dict(size=4, min_path=2, max_path=3, wall_fraction=0.1875)


def test_every_fixed_goal_task_has_its_goal_at_the_fixed_cell_and_the_starts_vary():
    train = generate_tasks(0, count=300, held_out=False, fixed_goal=True, **SHAPE)
    held = generate_tasks(0, count=60, held_out=True, fixed_goal=True, **SHAPE)
    assert fixed_goal_cell(4) == (1, 2)
    for task in train + held:
        size, walls, start, goal = layout_of(task)
        assert goal == (1, 2) and goal not in walls and start != goal and len(walls) == 3
        assert 2 <= task.meta["shortest"] <= 3
    assert len({tuple(t.meta["start"]) for t in train}) >= 6
    assert not {t.task_id for t in train} & {t.task_id for t in held}
    assert [t.task_id for t in generate_tasks(0, count=300, held_out=False, fixed_goal=True, **SHAPE)] == \
        [t.task_id for t in train]
    # without the option the goal moves
    assert len({tuple(t.meta["goal"]) for t in generate_tasks(0, count=100, held_out=False, **SHAPE)}) > 4


def test_the_picture_shows_the_fixed_goal_and_too_few_layouts_name_the_fix():
    task = generate_tasks(0, count=1, held_out=False, fixed_goal=True, **SHAPE)[0]
    size, walls, start, goal = layout_of(task)
    image = render(size, walls, start, goal, 16)
    assert image.getpixel((goal[1] * 16 + 8, goal[0] * 16 + 8)) == (40, 170, 60)  # the goal's green
    with pytest.raises(ConfigError, match="fixed goal.*wall_fraction"):
        generate_tasks(0, count=700, held_out=False, fixed_goal=True, size=4, min_path=2, max_path=3,
                       wall_fraction=0.125)


def test_the_demo_config_uses_the_fixed_goal():
    cfg = load_config(None, ["env.name=visual_grid", "env.options.size=4", "env.options.fixed_goal=true",
                             "env.options.wall_fraction=0.1875", "env.options.max_path=3", "env.max_turns=4",
                             "data.eval_size=20", "env.options.num_train_tasks=100"])
    setup = load_setup(cfg)
    assert {tuple(t.meta["goal"]) for t in setup.train_tasks + setup.eval_tasks} == {(1, 2)}
