"""Fuzz the code and repo environments with random and malformed agent outputs.

Each output goes through the real tool-call parser, then reset/astep/finish. Nothing may
raise, every observation must be valid text, every episode must end with a finite reward.
1,000 outputs per environment run against a stub sandbox that answers instantly with random
statuses, outputs and sandbox failures, and 400 more per environment through the real sandbox
(about one in twelve reaches it; the rest fail before).
"""

from __future__ import annotations

import asyncio
import json
import math
import random

import pytest

from tiderl.agent.tool_parser import parse_hermes_tool_calls
from tiderl.envs.code.env import CodeEnv
from tiderl.envs.code.sandbox import ExecResult, Limits, Sandbox, SandboxError
from tiderl.envs.protocol import StepResult, Task
from tiderl.envs.repo.env import RepoEnv

CODE_TASK = Task("add", "Write add(a, b).", {"tests": "assert add(1, 2) == 3\n"},
                 meta={"source": "mbpp", "prelude": "", "entry_points": ["add"],
                       "visible_tests": ["assert add(1, 2) == 3"], "reference": "def add(a, b):\n    return a + b\n"})
REPO_TASK = Task("repo/t", "Fix lib.", {"hidden_tests": {"tests/test_h.py": "from lib import f\ndef test_h():\n    assert f() == 1\n"}},
                 meta={"files": {"lib/__init__.py": "def f():\n    return 2\n",
                                 "tests/test_v.py": "from lib import f\ndef test_v():\n    assert f() == 1\n"},
                       "visible_tests": ["tests/test_v.py"], "fix": []})

SNIPPETS = ["print(1)", "def add(a, b):\n    return a + b", "def add(a, b):\n    return a - b", "import sys\nsys.exit(3)",
            "raise ValueError('x')", "import time\ntime.sleep(5)", "print('\\udc80'.encode('utf-8', 'surrogateescape'))",
            "print('x' * 100000)", "def add(", "\x00", "return 2", "import os\nos._exit(0)", ""]
NAMES = ["run_tests", "execute", "submit", "list_files", "read_file", "edit_file", "nope", "", "SUBMIT", "\ud800"]
WEIRD = [None, 0, -1, 1.5, True, [], {}, [1, "a"], {"code": "x"}, "", "\ud800\udfff", "a" * 25_000, "lib/__init__.py",
         "../../etc/passwd", "tests/test_v.py"]


def random_text(rng: random.Random) -> str:
    alphabet = "ab{}[]\":,<>/_\\ \n\t\x00é漢\U0001F600\ud800"
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))


def random_value(rng: random.Random) -> object:
    return rng.choice(SNIPPETS) if rng.random() < 0.5 else rng.choice(WEIRD)


def random_call(rng: random.Random) -> str:
    kind = rng.random()
    name = rng.choice(NAMES)
    if kind < 0.6:
        keys = rng.sample(["code", "path", "old", "new", "x"], rng.randint(0, 4))
        args = {k: random_value(rng) for k in keys}
        if rng.random() < 0.3 and "old" in args:
            args.update(path="lib/__init__.py", old="return 2", new=rng.choice(["return 1", "return 2", "\ud800"]))
        body = json.dumps({"name": name, "arguments": args}, ensure_ascii=rng.random() < 0.5)
    elif kind < 0.7:
        body = json.dumps({"name": name, "arguments": json.dumps({"code": random_value(rng)})})
    elif kind < 0.8:
        body = json.dumps([name, 1]) if rng.random() < 0.5 else json.dumps({"arguments": {}})
    else:
        body = random_text(rng)
    opener, closer = "<tool_call>", rng.choice(["</tool_call>", "</tool_call>", "", "<tool_call>"])
    return f"{random_text(rng) if rng.random() < 0.3 else ''}{opener}{body}{closer}"


def random_output(rng: random.Random) -> str:
    if rng.random() < 0.15:
        return random_text(rng)
    return "".join(random_call(rng) + rng.choice(["", "\n", " text "]) for _ in range(rng.randint(1, 5)))


class StubSandbox:
    """Answers instantly with a random status (and sometimes a sandbox failure)."""

    python = "/usr/bin/python3"

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    async def run(self, files, argv, stdin="", limits=None) -> ExecResult:
        roll = self.rng.random()
        if roll < 0.05:
            raise SandboxError("setup failed: stub")
        status = self.rng.choice(["ok", "error", "timeout", "cpu_limit", "output_limit", "signal"])
        out = self.rng.choice(["", "ok\n", "__tiderl_hidden_tests_passed__\n", "x" * 10_000, "\ufffd"])
        code = {"ok": 0, "error": 1, "signal": -11}.get(status)
        return ExecResult(status, code, out, self.rng.choice(["", "Traceback"]), 0.0, truncated=roll > 0.9)

    async def run_python(self, code, files=None, stdin="", limits=None) -> ExecResult:
        return await self.run({"main.py": code}, [self.python, "main.py"])


def check_result(result: StepResult) -> None:
    assert isinstance(result, StepResult) and math.isfinite(float(result.reward))
    for text in result.observations:
        assert isinstance(text, str)
        text.encode("utf-8")  # no lone surrogates
    if result.done:
        assert result.info["success"] in (0.0, 1.0) and sum(result.info["reward_parts"].values()) == result.reward
        json.dumps(result.info)


async def fuzz(make_env, task: Task, outputs: int, seed: int, concurrency: int = 16) -> int:
    """Play `outputs` random agent outputs in episodes of 1-3 turns; returns how many ran."""
    rng = random.Random(seed)
    texts = [random_output(rng) for _ in range(outputs)]
    episodes, i = [], 0
    while i < len(texts):
        n = rng.randint(1, 3)
        episodes.append(texts[i:i + n])
        i += n
    gate = asyncio.Semaphore(concurrency)

    async def episode(turns: list[str]) -> int:
        async with gate:
            env = make_env()
            assert isinstance(env.reset(task), str)
            result = StepResult([])
            for text in turns:
                result = await env.astep(parse_hermes_tool_calls(text))
                check_result(result)
                if result.done:
                    with pytest.raises(RuntimeError):
                        await env.astep(parse_hermes_tool_calls(text))
                    break
            if not result.done:
                final = env.finish("max_turns")
                check_result(final)
                assert final.done
            return len(turns)

    return sum(await asyncio.gather(*(episode(t) for t in episodes)))


@pytest.mark.parametrize("env_class, task", [(CodeEnv, CODE_TASK), (RepoEnv, REPO_TASK)], ids=["code", "repo"])
@pytest.mark.timeout(120)  # a hang guard: the fuzz takes seconds
def test_one_thousand_outputs_against_a_stub_sandbox(env_class, task):
    stub = StubSandbox(1)
    assert asyncio.run(fuzz(lambda: env_class(stub, max_observation_chars=500), task, 1000, seed=7)) == 1000


@pytest.mark.slow
@pytest.mark.parametrize("env_class, task", [(CodeEnv, CODE_TASK), (RepoEnv, REPO_TASK)], ids=["code", "repo"])
@pytest.mark.timeout(300)  # a hang guard: every run is cut off at 1 s, 4 at a time
def test_four_hundred_outputs_through_the_real_sandbox(env_class, task):
    box = Sandbox(Limits(cpu_s=1, wall_s=1, memory_mb=512), concurrency=4)
    assert asyncio.run(fuzz(lambda: env_class(box, max_observation_chars=500), task, 400, seed=11)) == 400
