"""The visual environments (tiderl/envs/visual, docs/env_visual.md): the image is deterministic and
shows the state, the text does not give it away (unless text_state), the oracle solves every
held-out task, splits are disjoint, malformed calls are error observations, and both pass
`tiderl check-env` and 1,000 fuzzed outputs."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("PIL", reason="the visual environments render with Pillow: pip install 'tiderl[vision]'")

from tiderl.agent.tool_parser import parse_hermes_tool_calls  # noqa: E402
from tiderl.config import load_config  # noqa: E402
from tiderl.envs.check import assert_environment  # noqa: E402
from tiderl.envs.fuzz import fuzz_config, fuzz_environment  # noqa: E402
from tiderl.envs.protocol import Action, Observation, Task, ToolCall  # noqa: E402
from tiderl.envs.setup import load_setup  # noqa: E402
from tiderl.envs.visual import grid, table  # noqa: E402
from tiderl.envs.visual.setup import grid_demonstrations, table_demonstrations  # noqa: E402

WALLS = frozenset({(0, 1), (1, 1), (2, 3)})


def _setup(name, *overrides):
    return load_setup(load_config(None, [f"env.name={name}", "env.options.num_train_tasks=200", "data.eval_size=60",
                                         *overrides]))


def _play(setup, task, turns):
    env = setup.make_env()
    env.reset(task)
    result = None
    for turn in turns:
        result = env.step(parse_hermes_tool_calls(turn))
        if result.done:
            return result
    return env.finish("max_turns")


def _pixel(image, cell, cell_px=16):
    return image.getpixel((cell[1] * cell_px + cell_px // 2, cell[0] * cell_px + cell_px // 2))


# ----------------------------------------------------------------------------- visual_grid

def test_grid_rendering_is_deterministic_and_shows_the_state():
    first = grid.render(5, WALLS, (4, 0), (0, 4))
    assert first.size == (80, 80) and first.mode == "RGB"
    assert first.tobytes() == grid.render(5, WALLS, (4, 0), (0, 4)).tobytes()
    # Agent, goal, walls and floor where the state says, in their colours.
    assert _pixel(first, (4, 0)) == grid.AGENT and _pixel(first, (0, 4)) == grid.GOAL
    assert all(_pixel(first, w) == grid.WALL for w in WALLS) and _pixel(first, (3, 3)) == grid.FLOOR
    # Another agent position, another goal, other walls: other pixels.
    moved = grid.render(5, WALLS, (3, 0), (0, 4))
    assert moved.tobytes() != first.tobytes() and _pixel(moved, (4, 0)) == grid.FLOOR
    assert grid.render(5, WALLS, (4, 0), (0, 3)).tobytes() != first.tobytes()
    assert grid.render(5, WALLS | {(4, 4)}, (4, 0), (0, 4)).tobytes() != first.tobytes()
    assert grid.render(7, WALLS, (4, 0), (0, 4), cell_px=12).size == (84, 84)


def test_grid_episode_moves_blocks_and_reaches_the_goal():
    task = Task("t", grid.TASK_PROMPT, 3, {"size": 5, "walls": [list(w) for w in sorted(WALLS)],
                                           "start": [2, 0], "goal": [2, 2], "shortest": 2})
    env = grid.GridEnv()
    first = env.reset(task)
    assert isinstance(first, Observation) and len(first.images) == 1
    assert _pixel(first.images[0], (2, 0)) == grid.AGENT
    # The text says nothing of where anything is.
    assert not any(ch.isdigit() for ch in first.text) and "row" not in first.text

    def move(direction):
        return env.step(Action("", [ToolCall("move", {"direction": direction})]))

    blocked = move("left")  # the edge of the grid
    assert not blocked.done and blocked.observations[0].text.startswith("Blocked")
    assert _pixel(blocked.observations[0].images[0], (2, 0)) == grid.AGENT
    moved = move("right")
    assert moved.observations[0].text == "Moved." and _pixel(moved.observations[0].images[0], (2, 1)) == grid.AGENT
    done = move("right")
    assert done.done and done.reward == 1.0 and done.info["success"] == 1.0 and done.info["moves"] == 3
    assert done.info["reward_parts"] == {"outcome": 1.0}
    with pytest.raises(RuntimeError, match="reset"):
        move("up")


def test_grid_malformed_calls_are_error_observations():
    setup = _setup("visual_grid")
    env = setup.make_env()
    env.reset(setup.eval_tasks[0])
    turns = [Action("<tool_call>{oops", [], ["invalid JSON in tool call"]),
             Action("", [ToolCall("jump", {})]), Action("", [ToolCall("move", {"direction": "north"})]),
             Action("", [ToolCall("move", {"direction": "up", "speed": 2})]), Action("", [ToolCall("move", [1])]),
             Action("I think I should go up.")]
    for action in turns:
        result = env.step(action)
        assert not result.done and len(result.observations) == 1
        assert isinstance(result.observations[0], str), result.observations
        assert result.observations[0].startswith(("Error:", "No tool call")), result.observations[0]
    assert result.info["tool_errors"] == 5
    # More calls than a turn may make (4): the first are run, the rest refused in one error.
    env.reset(Task("far", grid.TASK_PROMPT, 8, {"size": 5, "walls": [], "start": [4, 4], "goal": [0, 0]}))
    many = env.step(Action("", [ToolCall("move", {"direction": "down"})] * 6))
    assert [type(o) for o in many.observations] == [Observation] * 4 + [str]
    assert "2 more tool calls were not run" in many.observations[-1] and many.info["tool_errors"] == 2
    flood = env.step(Action("", [ToolCall("move", {"direction": "down"})], ["bad block"] * 1000))
    assert len(flood.observations) == 5 and "997 more tool calls were not run" in flood.observations[-1]


def test_grid_text_state_describes_the_state():
    setup = _setup("visual_grid", "env.options.text_state=true")
    task = setup.eval_tasks[0]
    first = setup.make_env().reset(task)
    start, goal = task.meta["start"], task.meta["goal"]
    assert f"You are at row {start[0]}, column {start[1]}" in first.text
    assert f"the goal is at row {goal[0]}, column {goal[1]}" in first.text and "A" in first.text
    assert len(first.images) == 1


def test_text_only_runs_get_plain_text_messages():
    setup = _setup("visual_grid", "env.options.text_state=true", "env.options.images=false")
    task = setup.eval_tasks[0]
    env = setup.make_env()
    first = env.reset(task)
    assert isinstance(first, str) and "You are at row" in first
    moved = env.step(parse_hermes_tool_calls(setup.oracle(task)[0]))
    assert moved.done or (isinstance(moved.observations[0], str) and "You are at row" in moved.observations[0])
    table_setup = _setup("visual_table", "env.options.text_state=true", "env.options.images=false")
    question = table_setup.make_env().reset(table_setup.eval_tasks[0])
    assert isinstance(question, str) and "The highlighted bar is" in question
    from tiderl.options import ConfigError

    for name in ("visual_grid", "visual_table"):  # neither image nor text: nothing to see
        with pytest.raises(ConfigError, match="images.*text_state=true"):
            load_config(None, [f"env.name={name}", "env.options.images=false"])


def test_grid_oracle_solves_every_held_out_task_and_splits_are_disjoint():
    for max_turns in (4, 8):
        setup = _setup("visual_grid", f"env.max_turns={max_turns}", "env.options.size=6")
        assert len(setup.eval_tasks) == 60 and len(setup.train_tasks) == 200
        solved = [_play(setup, t, setup.oracle(t)).reward for t in setup.eval_tasks]
        assert solved == [1.0] * 60
        assert all(len(setup.oracle(t)) <= max_turns for t in setup.eval_tasks)
        train_ids, eval_ids = {t.task_id for t in setup.train_tasks}, {t.task_id for t in setup.eval_tasks}
        assert not train_ids & eval_ids and len(train_ids) == 200
        assert all(grid.is_held_out(grid.layout_key(*grid.layout_of(t))) for t in setup.eval_tasks)
        assert not any(grid.is_held_out(grid.layout_key(*grid.layout_of(t))) for t in setup.train_tasks)
    # Stable ids: the same seed draws the same tasks; another seed others, still in the same split.
    again = _setup("visual_grid", "env.max_turns=8", "env.options.size=6")
    assert [t.task_id for t in again.eval_tasks] == [t.task_id for t in setup.eval_tasks]
    other = _setup("visual_grid", "env.max_turns=8", "env.options.size=6", "data.seed=1")
    assert {t.task_id for t in other.eval_tasks} != eval_ids
    assert not {t.task_id for t in other.eval_tasks} & {t.task_id for t in setup.train_tasks}


def test_grid_options_are_checked():
    from tiderl.options import ConfigError

    for bad, field in [("env.options.size=12", "size"), ("env.options.min_path=9", "min_path"),
                       ("env.options.wall_fraction=0.9", "wall_fraction")]:
        with pytest.raises(ConfigError, match=field):
            load_config(None, ["env.name=visual_grid", bad])


def test_grid_demonstrations_err_at_the_noise_rate():
    setup = _setup("visual_grid", "env.max_turns=6")
    cfg = load_config(None, ["env.name=visual_grid", "env.max_turns=6", "model.warmstart.num_traces=120",
                             "model.warmstart.relation_noise=0.5"])
    tasks, scripts, report = grid_demonstrations(setup, cfg, random.Random(0))
    assert len(tasks) == len(scripts) == 120 and report == {"wrong_move_rate": 0.5}
    rewards = [_play(setup, t, s).reward for t, s in zip(tasks, scripts)]
    assert all(len(s) <= 6 for s in scripts) and 0.3 < sum(rewards) / 120 < 1.0
    optimal = sum(s == setup.oracle(t) for t, s in zip(tasks, scripts)) / 120
    assert 0.3 < optimal < 0.7


# ----------------------------------------------------------------------------- visual_table

def test_chart_is_deterministic_and_highlights_the_asked_city():
    setup = _setup("visual_table")
    seen_kinds = set()
    for task in setup.eval_tasks[:20]:
        image = table.render_chart(task)
        assert image.size == (table.CHART_WIDTH, table.CHART_HEIGHT)
        assert image.tobytes() == table.render_chart(task).tobytes()
        chart = task.meta["chart"]
        cities = sorted({r[0] for r in task.meta["tables"][0]["rows"]})
        for city in cities:
            left, top, right, bottom = table.bar_box(task, city)
            inside = image.getpixel(((left + right) // 2, (top + bottom) // 2))
            assert inside == (table.HIGHLIGHT if city == chart["highlight"] else table.BAR), (task.task_id, city)
        seen_kinds.add(task.meta["answer_type"])
        # The chart depends on which city is highlighted.
        other = next(c for c in cities if c != chart["highlight"])
        moved = Task(task.task_id, task.prompt, task.answer, {**task.meta, "chart": {**chart, "highlight": other}})
        assert table.render_chart(moved).tobytes() != image.tobytes()
    assert seen_kinds == set(table.QUESTIONS)


def test_table_question_hides_the_city_unless_text_state():
    setup = _setup("visual_table")
    task = setup.eval_tasks[0]
    city = task.meta["chart"]["highlight"]
    first = setup.make_env().reset(task)
    assert isinstance(first, Observation) and len(first.images) == 1 and city not in first.text
    shown = _setup("visual_table", "env.options.text_state=true").make_env().reset(task)
    assert f"The highlighted bar is {city}." in shown.text


def test_table_oracle_solves_held_out_tasks_through_sql():
    setup = _setup("visual_table")
    for task in setup.eval_tasks[:25]:
        env = setup.make_env()
        env.reset(task)
        sql_turn, commit_turn = setup.oracle(task)
        queried = env.step(parse_hermes_tool_calls(sql_turn))
        # The gold SQL, run by the DB environment's tools, returns the generator's answer.
        assert f"[{task.answer['values'][0]}]" in queried.observations[0], (task.meta["gold_sql"], queried)
        final = env.step(parse_hermes_tool_calls(commit_turn))
        assert final.done and final.reward == 1.0
    assert not {t.task_id for t in setup.train_tasks} & {t.task_id for t in setup.eval_tasks}


def test_table_tools_are_read_only_and_errors_are_observations():
    setup = _setup("visual_table")
    env = setup.make_env()
    env.reset(setup.eval_tasks[0])
    for call in [ToolCall("execute_sql", {"query": "DELETE FROM stats"}), ToolCall("execute_sql", {"query": 3}),
                 ToolCall("draw_chart", {}), ToolCall("execute_sql", {"query": "SELECT * FROM nowhere"})]:
        result = env.step(Action("", [call]))
        assert not result.done and result.observations[0].startswith("Error:"), result.observations
    wrong = env.step(Action("", [ToolCall("commit_final_answer", {"answers": [-1]})]))
    assert wrong.done and wrong.reward == 0.0


def test_table_demonstrations_misread_at_the_noise_rate():
    setup = _setup("visual_table")
    cfg = load_config(None, ["env.name=visual_table", "model.warmstart.num_traces=80",
                             "model.warmstart.relation_noise=0.5"])
    tasks, scripts, _ = table_demonstrations(setup, cfg, random.Random(0))
    misread = [s != setup.oracle(t) for t, s in zip(tasks, scripts)]
    assert 0.3 < sum(misread) / 80 < 0.7
    # A misread demonstration asks about a neighbouring bar and commits that city's answer.
    task, script = next((t, s) for t, s, m in zip(tasks, scripts, misread) if m)
    assert task.meta["chart"]["highlight"] not in script[0]
    committed = parse_hermes_tool_calls(script[1]).tool_calls[0].arguments["answers"]
    assert _play(setup, task, script).reward == float(committed == task.answer["values"])


# ----------------------------------------------------------------------------- both

@pytest.mark.parametrize("name", ["visual_grid", "visual_table"])
def test_check_env_passes(name):
    report = assert_environment(name, "env.options.num_train_tasks=50", "data.eval_size=20")
    assert any(n == "oracle solves a task" and ok for n, ok, _ in report.checks)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["visual_grid", "visual_table"])
def test_no_fuzzed_output_crashes_the_environment(name):
    report = fuzz_environment(fuzz_config(name, "env.options.num_train_tasks=100", "data.eval_size=50"),
                              outputs=1000, seed=0)
    print(report.text())
    assert report.outputs == 1000 and (report.exceptions, report.hangs, report.violations) == (0, 0, 0), report.text()
    assert report.steps >= 500 and report.finished > 0
    if name == "visual_table":  # commit_final_answer calls end episodes; a grid ends only at its goal
        assert report.answers > 0


def test_grid_options_no_task_satisfies_are_a_clean_config_error(capsys):
    from tiderl.cli import main

    code = main(["eval", "--env", "visual_grid", "--oracle", "env.options.size=4", "env.options.wall_fraction=0",
                 "env.options.num_train_tasks=300"])
    err = capsys.readouterr().err
    assert code == 2 and "config error: env.options: only" in err and "Fix: lower env.options.wall_fraction" in err
    assert "Traceback" not in err
