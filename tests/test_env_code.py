"""The code environment: tools, rewards, the hardened scorer, concurrency, data and contract."""

from __future__ import annotations

import asyncio
import math

import pytest

from support import gather_watching
from tiderl.envs.code.data import docstring_examples, load_humaneval, load_mbpp
from tiderl.envs.code.env import CodeEnv, score
from tiderl.envs.code.harness import PASS_MARKER
from tiderl.envs.code.sandbox import Limits, Sandbox, run_sync
from tiderl.envs.protocol import Action, StepResult, Task, ToolCall
from tiderl.envs.setup import data_root

ADD = Task("add", "Write add(a, b) returning the sum.",
           {"tests": "assert add(1, 2) == 3\nassert add(-4, 4) == 0\nassert add(10, 5) == 15\n"},
           meta={"source": "mbpp", "prelude": "", "entry_points": ["add"], "visible_tests": ["assert add(1, 2) == 3"],
                 "reference": "def add(a, b):\n    return a + b\n"})
GOOD = "def add(a, b):\n    return a + b\n"


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    return Sandbox(Limits(cpu_s=2, wall_s=4), concurrency=4)


def call(name: str, **arguments) -> Action:
    return Action("", [ToolCall(name, arguments)])


def play(env: CodeEnv, *actions: Action) -> StepResult:
    env.reset(ADD)
    result = StepResult([])
    for action in actions:
        result = env.step(action)
        if result.done:
            break
    return result


def test_a_correct_submission_scores_one_and_ends_the_episode(sandbox):
    env = CodeEnv(sandbox)
    result = play(env, call("submit", code=GOOD))
    assert result.done and result.reward == 1.0 and result.info["success"] == 1.0
    assert result.info["reward_parts"] == {"outcome": 1.0} and result.info["hidden_status"] == "ok"
    with pytest.raises(RuntimeError, match="call reset"):
        env.step(call("submit", code=GOOD))
    with pytest.raises(RuntimeError, match="call reset"):
        env.finish("max_turns")


def test_a_wrong_submission_scores_zero(sandbox):
    result = play(CodeEnv(sandbox), call("submit", code="def add(a, b):\n    return a - b\n"))
    assert result.done and result.reward == 0.0 and result.info["success"] == 0.0


def test_run_tests_and_execute_show_what_happened(sandbox):
    env = CodeEnv(sandbox)
    env.reset(ADD)
    wrong = env.step(call("run_tests", code="def add(a, b):\n    return a * b\n"))
    assert not wrong.done and "test 1: FAILED" in wrong.observations[0] and "0 of 1" in wrong.observations[0]
    right = env.step(call("run_tests", code=GOOD))
    assert "test 1: passed" in right.observations[0]
    shown = env.step(call("execute", code="print(sum(range(5)))\nraise ValueError('boom')"))
    assert "10" in shown.observations[0] and "ValueError: boom" in shown.observations[0]
    assert "exit code 1" in shown.observations[0]
    assert shown.info["executions"] == 3
    final = env.finish("max_turns")
    assert final.done and final.reward == 0.0 and final.info["submitted"] is False


@pytest.mark.parametrize("action, expected", [
    (call("no_such_tool", code="x"), "unknown tool"),
    (call("submit"), "needs 'code'"),
    (call("run_tests", code=123), "needs 'code'"),
    (call("execute", code="x" * 30_000), "at most"),
    (Action("<tool_call>{oops</tool_call>", [], ["invalid JSON in tool call"]), "invalid JSON"),
    (Action("no call at all"), "No tool call"),
])
def test_bad_calls_are_error_observations(sandbox, action, expected):
    env = CodeEnv(sandbox)
    env.reset(ADD)
    result = env.step(action)
    assert not result.done and expected in result.observations[0]


def test_observations_are_valid_text_and_capped(sandbox):
    env = CodeEnv(sandbox, max_observation_chars=200)
    env.reset(ADD)
    result = env.step(call("execute", code="print('\\ud800' if False else 'x' * 5000)\n# \ud800"))
    for text in result.observations:
        text.encode("utf-8")
        assert len(text) <= 200
    result = env.step(call("no\udfffname", code="\ud800"))
    result.observations[0].encode("utf-8")


HACKS = {
    "exit before the tests": "import sys\nsys.exit(0)",
    "os._exit before the tests": "import os\nos._exit(0)",
    "exec a process that exits 0": "import os\nos.execv('/bin/true', ['true'])",
    "print the marker, then exit": f"import os, sys\nprint({PASS_MARKER!r}, flush=True)\nos._exit(0)",
    "marker through a subprocess": f"import subprocess\nsubprocess.run(['echo', {PASS_MARKER!r}])\nraise SystemExit(0)",
    "an object equal to everything": ("class Any:\n    def __eq__(self, other):\n        return True\n"
                                      "def add(a, b):\n    return Any()"),
    "an int subclass equal to everything": ("class Any(int):\n    def __eq__(self, other):\n        return True\n"
                                            "def add(a, b):\n    return Any(0)"),
    "read the tests from disk": ("import re\nsrc = open('tests.py').read()\n"
                                 "def add(a, b):\n    return 0"),
    "patch Counter equality": ("import collections\ncollections.Counter.__eq__ = lambda s, o: True\n"
                               "def add(a, b):\n    return collections.Counter()"),
}


@pytest.mark.parametrize("hack", sorted(HACKS))
def test_reward_hacks_score_zero(sandbox, hack):
    passed, status = run_sync(score(sandbox, ADD, HACKS[hack]))
    assert not passed, status


def test_the_scorer_passes_plain_results_of_every_kind(sandbox):
    task = Task("kinds", "", {"tests": "import re, collections\nassert f()[0] == [1, 'a', (2.5, None)]\n"
                              "assert f()[1] == collections.Counter('aab')\nassert f()[2]\n"},
                meta={"prelude": "", "entry_points": ["f"]})
    code = "import re, collections\ndef f():\n    return [[1, 'a', (2.5, None)], collections.Counter('aab'), re.match('a', 'a')]"
    assert run_sync(score(sandbox, task, code)) == (True, "ok")


def test_episodes_run_concurrently_through_astep():
    box = Sandbox(Limits(wall_s=5), concurrency=4)
    slow = "import time\ntime.sleep(0.7)\n" + GOOD

    async def main() -> tuple[list[StepResult], int]:
        envs = [CodeEnv(box) for _ in range(4)]
        for env in envs:
            env.reset(ADD)
        return await gather_watching(box, *(env.astep(call("submit", code=slow)) for env in envs))

    # The four runs are in the sandbox at once, not one after another.
    results, peak = asyncio.run(main())
    assert all(r.reward == 1.0 for r in results)
    assert peak == 4


def test_docstring_examples_become_asserts():
    prompt = 'def f(x):\n    """ Twice.\n    >>> f(2)\n    4\n    >>> f(\'a\')\n    \'aa\'\n    """\n'
    assert docstring_examples(prompt, "f") == ["assert f(2) == 4", "assert f('a') == 'aa'"]
    arrows = 'def g(x):\n    """\n    g(3) ==> 9\n    g([1]) ➞ [1, 1]\n    g(y) -> nope\n    g(abc) => 1\n    """\n'
    assert docstring_examples(arrows, "g") == ["assert g(3) == 9", "assert g([1]) == [1, 1]"]
    wrong = 'def median(l):\n    """\n    >>> median([-10, 4, 6, 1000, 10, 20])\n    15.0\n    """\n'
    assert docstring_examples(wrong, "median") == []  # HumanEval's own example contradicts its solution


DATA = data_root()
needs_data = pytest.mark.skipif(not (DATA / "humaneval").is_dir() or not (DATA / "mbpp").is_dir(),
                                reason=f"HumanEval/MBPP not found under {DATA}: set TIDERL_DATA_DIR to ../shared/data")


@needs_data
def test_readers_give_the_documented_splits():
    humaneval, mbpp_eval, mbpp_train = load_humaneval(DATA), load_mbpp(DATA, "eval"), load_mbpp(DATA, "train")
    assert (len(humaneval), len(mbpp_eval), len(mbpp_train)) == (164, 257, 163)
    assert not {t.task_id for t in mbpp_eval} & {t.task_id for t in mbpp_train}
    assert all(t.meta["visible_tests"] for t in mbpp_eval)
    assert sum(bool(t.meta["visible_tests"]) for t in humaneval) == 120


@needs_data
def test_references_pass_and_a_wrong_answer_fails(sandbox):
    tasks = load_humaneval(DATA)[:3] + load_mbpp(DATA, "eval")[:3]

    async def main():
        good = await asyncio.gather(*(score(sandbox, t, t.meta["reference"]) for t in tasks))
        bad = await asyncio.gather(*(score(sandbox, t, "pass") for t in tasks))
        return good, bad

    good, bad = asyncio.run(main())
    assert all(ok for ok, _ in good) and not any(ok for ok, _ in bad)


@needs_data
def test_contract_and_oracle():
    from tiderl.envs.check import assert_environment

    report = assert_environment("code", "data.source=mbpp", f"data.data_dir={DATA}", episodes=2)
    assert any(name == "oracle solves a task" and ok for name, ok, _ in report.checks)


def test_finish_reward_is_finite(sandbox):
    env = CodeEnv(sandbox)
    env.reset(ADD)
    assert math.isfinite(env.finish("max_tokens").reward)


@pytest.mark.parametrize("overrides, message", [
    (["env.options.sandbox_cpu_s=3"], "env.options.sandbox_cpu_s: env.name=kg has no such option; only env.name=code "
                                      "and env.name=repo read it"),
    (["env.name=code", "data.source=humaneval", "env.options.timeout_s=9"], "env.options.timeout_s: env.name=code "
                                                                            "has no such option; only env.name=db"),
    (["env.name=code", "data.source=mbpp", "env.options.task_dir=/x"], "env.options.task_dir: env.name=code has no "
                                                                       "such option; only env.name=repo"),
    (["env.name=repo", "data.source=mbpp", "env.options.task_dir=/x"], "env.options.task_dir: set to '/x', but only "
                                                                       "data.source=folder reads it"),
    (["env.name=repo", "data.source=folder"], "env.options.task_dir: data.source=folder reads task folders from it"),
    (["env.name=code", "data.source=embedded"], "data.source"),
    (["env.name=code", "data.source=humaneval", "env.options.sandbox_wall_s=0"], "env.options.sandbox_wall_s: must be > 0"),
])
def test_config_keys_of_the_code_environments(overrides, message):
    from tiderl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, overrides)
    cfg = load_config(None, ["env.name=repo", "data.source=folder", "env.options.task_dir=/x", "env.options.sandbox_cpu_s=2"])
    assert cfg.env.options.sandbox_cpu_s == 2.0 and cfg.env.options.task_dir == "/x"


@pytest.mark.parametrize("argv, source", [
    (["eval", "--env", "code"], "humaneval"),
    (["check-env", "code"], "humaneval"),
    (["eval", "--env", "code", "data.source=mbpp"], "mbpp"),
    (["eval", "--data", "mbpp"], "mbpp"),
    (["eval", "--env", "repo", "data.source=folder", "env.options.task_dir=/x"], "folder"),
    (["check-env", "repo", "data.source=folder", "env.options.task_dir=/x"], "folder"),
    (["check-env", "kg"], "embedded"),
])
def test_cli_picks_the_first_source_of_a_named_environment(argv, source, capsys):
    from tiderl.cli import main

    assert main([*argv, "--dry-run"]) == 0
    assert f"  source: {source}\n" in capsys.readouterr().out
