"""The repository-editing environment: task folders, generated tasks, tools, rewards, contract."""

from __future__ import annotations

from pathlib import Path

import pytest

from tiderl.envs.code.sandbox import Limits, Sandbox, run_sync
from tiderl.envs.protocol import Action, Task, ToolCall
from tiderl.envs.repo.env import RepoEnv, apply_edit
from tiderl.envs.repo.setup import oracle_turns
from tiderl.envs.repo.tasks import load_task_folder, load_task_folders, make_repo_task, mutations

BUGGY = "def mean(xs):\n    return sum(xs) / (len(xs) + 1)\n"
FIXED = "def mean(xs):\n    return sum(xs) / len(xs)\n"


def write_task(root: Path, name: str = "mean-bug") -> Path:
    folder = root / name
    files = {
        "task.md": "mean() is wrong; fix it.",
        "repo/stats/__init__.py": "from stats.core import mean\n",
        "repo/stats/core.py": BUGGY,
        "repo/tests/test_mean.py": "from stats import mean\n\ndef test_mean():\n    assert mean([2, 4]) == 3\n",
        "hidden_tests/test_more.py": "from stats import mean\n\ndef test_more():\n    assert mean([1, 2, 3]) == 2\n    assert mean([5]) == 5\n",
        "solution/stats/core.py": FIXED,
    }
    for path, text in files.items():
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_text(text)
    return folder


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    return Sandbox(Limits(cpu_s=2, wall_s=4), concurrency=4)


def call(name: str, **arguments) -> Action:
    return Action("", [ToolCall(name, arguments)])


def test_a_task_folder_is_read_as_documented(tmp_path):
    task = load_task_folder(write_task(tmp_path))
    assert task.task_id == "repo/mean-bug" and task.prompt == "mean() is wrong; fix it."
    assert set(task.meta["files"]) == {"stats/__init__.py", "stats/core.py", "tests/test_mean.py"}
    assert task.meta["visible_tests"] == ["tests/test_mean.py"]
    assert list(task.answer["hidden_tests"]) == ["tests/hidden_test_more.py"]
    assert task.meta["fix"] == [{"path": "stats/core.py", "old": BUGGY, "new": FIXED}]
    with pytest.raises(ValueError, match="needs repo/ and hidden_tests/"):
        load_task_folder(tmp_path)


def test_an_episode_with_every_tool(tmp_path, sandbox):
    env = RepoEnv(sandbox)
    env.reset(load_task_folder(write_task(tmp_path)))
    listed = env.step(call("list_files")).observations[0]
    assert listed.splitlines() == ["stats/__init__.py", "stats/core.py", "tests/test_mean.py"]
    assert env.step(call("read_file", path="stats/core.py")).observations[0] == BUGGY
    failing = env.step(call("run_tests")).observations[0]
    assert "test_mean FAILED" in failing and "0 of 1 tests passed" in failing
    errors = env.step(Action("", [ToolCall("edit_file", {"path": "stats/core.py", "old": "xs", "new": "ys"}),
                                  ToolCall("edit_file", {"path": "nope.py", "old": "a", "new": "b"}),
                                  ToolCall("read_file", {"path": 7})]))
    assert [o.split(":")[0] for o in errors.observations] == ["Error"] * 3
    assert "occurs 3 times" in errors.observations[0] and "no file 'nope.py'" in errors.observations[1]
    edited = env.step(call("edit_file", path="stats/core.py", old="(len(xs) + 1)", new="len(xs)"))
    assert edited.observations[0].startswith("Edited stats/core.py")
    assert "1 of 1 tests passed" in env.step(call("run_tests")).observations[0]
    final = env.step(call("submit"))
    assert final.done and final.reward == 1.0 and final.info["edits"] == 1
    with pytest.raises(RuntimeError, match="call reset"):
        env.step(call("list_files"))


def test_submitting_the_bug_scores_zero_and_a_new_episode_starts_clean(tmp_path, sandbox):
    task = load_task_folder(write_task(tmp_path))
    env = RepoEnv(sandbox)
    env.reset(task)
    env.step(call("edit_file", path="stats/core.py", old="(len(xs) + 1)", new="len(xs)"))
    env.reset(task)
    assert env.files["stats/core.py"] == BUGGY and task.meta["files"]["stats/core.py"] == BUGGY
    result = env.step(call("submit"))
    assert result.done and result.reward == 0.0


def test_edits_that_cheat_score_zero(tmp_path, sandbox):
    task = load_task_folder(write_task(tmp_path))
    for cheat in ["import os\nos._exit(0)\n", "import sys\nprint('__tiderl_hidden_tests_passed__')\nsys.exit(0)\n",
                  "import os\nos.remove('tests/hidden_test_more.py')\n"]:
        env = RepoEnv(sandbox)
        env.reset(task)
        env.step(call("edit_file", path="stats/core.py", old="def mean", new=cheat + "def mean"))
        assert env.step(call("submit")).reward == 0.0, cheat


def test_apply_edit_rules():
    files = {"a.py": "x = 1\ny = 1\n"}
    with pytest.raises(ValueError, match="occurs 2 times"):
        apply_edit(files, "a.py", "1", "2")
    with pytest.raises(ValueError, match="empty"):
        apply_edit(files, "a.py", "", "2")
    with pytest.raises(ValueError, match="occurs 0 times"):
        apply_edit(files, "a.py", "z", "2")
    apply_edit(files, "a.py", "y = 1", "y = 2")
    assert files["a.py"] == "x = 1\ny = 2\n"


def test_oracle_turns_are_the_fix_then_submit(tmp_path, sandbox):
    from tiderl.agent.tool_parser import parse_hermes_tool_calls

    task = load_task_folder(write_task(tmp_path))
    env = RepoEnv(sandbox)
    env.reset(task)
    results = [env.step(parse_hermes_tool_calls(turn)) for turn in oracle_turns(task)]
    assert results[-1].done and results[-1].reward == 1.0


def test_mutations_flip_one_token_outside_strings():
    source = "def f(x):\n    '''x < 1'''\n    return x < 1 and True\n"
    found = mutations(source, "seed")
    changed = sorted(bad for _, bad, _ in found)
    assert changed == sorted(["    return x <= 1 and True", "    return x < 2 and True", "    return x < 1 or True",
                              "    return x < 1 and False"])
    assert mutations(source, "seed") == found  # a fixed order per seed


def test_a_generated_task_fails_before_and_passes_after_its_fix(sandbox):
    code_task = Task("mbpp/x", "Write a function to return the largest of a list.\nYour code should pass this test:\n...",
                     {"tests": "assert largest([1, 5, 2]) == 5\nassert largest([-3, -1]) == -1\nassert largest([7]) == 7\n"},
                     meta={"source": "mbpp", "prelude": "", "entry_points": ["largest"],
                           "visible_tests": ["assert largest([1, 5, 2]) == 5"],
                           "reference": "def largest(xs):\n    best = xs[0]\n    for x in xs[1:]:\n        if x > best:\n"
                                        "            best = x\n    return best\n"})
    task = run_sync(make_repo_task(sandbox, code_task))
    assert task is not None and set(task.meta["files"]) == {"README.md", "lib/__init__.py", "lib/core.py",
                                                             "tests/test_visible.py"}
    fix = task.meta["fix"][0]
    assert fix["old"] != fix["new"] and fix["old"] in task.meta["files"]["lib/core.py"]
    env = RepoEnv(sandbox)
    env.reset(task)
    assert "FAILED" in env.step(call("run_tests")).observations[0]
    env.step(call("edit_file", **fix))
    assert "1 of 1 tests passed" in env.step(call("run_tests")).observations[0]
    assert env.step(call("submit")).reward == 1.0


def test_contract_on_task_folders(tmp_path):
    from tiderl.envs.check import assert_environment

    for name in ("a", "b", "c"):
        write_task(tmp_path, name)
    report = assert_environment("repo", "data.source=folder", f"env.options.task_dir={tmp_path}", episodes=2)
    assert any(name == "oracle solves a task" and ok for name, ok, _ in report.checks)
    assert len(load_task_folders(tmp_path)) == 3
