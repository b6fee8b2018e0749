"""Fuzzing the built-in environments with random and malformed agent outputs (tiderl.envs.fuzz):
no exception, no hang, no contract violation, and every answer renders through the chat template.

To fuzz another environment, add its `env.name` to FUZZED_ENVIRONMENTS. The counts print with
`pytest -s` and are recorded as the test's `fuzz` property (junit XML); the same run from the
command line: `python -m tiderl.envs.fuzz kg --outputs 1000 --seed 0`.
"""

from __future__ import annotations

import json
import time

import pytest

from tiderl.config import load_config
from tiderl.envs.fuzz import agent_outputs, fuzz_config, fuzz_environment
from tiderl.envs.kg.env import TOOL_SCHEMAS
from tiderl.envs.protocol import StepResult, Task
from tiderl.envs.setup import Setup

# code and repo are fuzzed in tests/test_code_fuzz.py (the real sandbox is too slow for 1,000 outputs per test).
# Each entry: env.name plus the overrides that make its episodes multi-turn (math is single-turn
# unless its calculator tool is on, and then every output would be the answer).
FUZZED_ENVIRONMENTS = [("kg",), ("db",), ("math", "env.options.calculator=true")]
OUTPUTS = 1000


@pytest.mark.slow
@pytest.mark.parametrize("env", FUZZED_ENVIRONMENTS, ids=lambda e: e[0])
def test_no_fuzzed_output_crashes_the_environment(env, record_property):
    env_name, *overrides = env
    try:
        report = fuzz_environment(fuzz_config(env_name, *overrides), outputs=OUTPUTS, seed=0)
    except FileNotFoundError as exc:  # the environment's setup reads data this machine lacks
        pytest.skip(f"env.name={env_name}: its data is absent ({exc})")
    print(report.text())
    record_property("fuzz", json.dumps(report.counts()))
    assert report.outputs == OUTPUTS
    assert (report.exceptions, report.hangs, report.violations) == (0, 0, 0), report.text()
    # The outputs reached the environment's logic: steps were taken, and episodes ended both ways.
    assert report.steps >= OUTPUTS // 2 and report.answers > 0 and report.finished > 0, report.text()


def test_outputs_are_seeded_and_cover_the_malformed_families():
    outputs = agent_outputs(400, 3, TOOL_SCHEMAS, words=["film_000", "directed_by"], seeds=["Final Answer: #0"])
    assert outputs == agent_outputs(400, 3, TOOL_SCHEMAS, words=["film_000", "directed_by"], seeds=["Final Answer: #0"])
    assert outputs != agent_outputs(400, 4, TOOL_SCHEMAS, words=["film_000", "directed_by"], seeds=["Final Answer: #0"])
    joined = "\n".join(outputs)
    for needle in ["\\ud83d", "get_neighbors", "no_such_tool", "```", "9" * 5000, "Final Answer", "film_000"]:
        assert needle in joined, needle
    assert "" in outputs and max(map(len, outputs)) >= 100_000


class FaultyEnv:
    """Raises on one output, hangs on another, answers with a non-text observation on a third."""

    @classmethod
    def setup(cls, cfg) -> Setup:
        tasks = [Task(f"t{i}", f"question {i}", None) for i in range(4)]
        return Setup(train_tasks=tasks[:2], eval_tasks=tasks[2:], make_env=cls)

    def system_prompt(self) -> str:
        return "Answer."

    def tool_schemas(self) -> list:
        return []

    def reset(self, task: Task) -> str:
        return task.prompt

    def step(self, action) -> StepResult:
        if action.text == "":
            raise ValueError("empty turn")
        if action.text == "\n":
            time.sleep(3)
        if action.text == " ":
            return StepResult([None])  # type: ignore[list-item]
        return StepResult(["ok"])

    def finish(self, reason: str) -> StepResult:
        return StepResult([], done=True, info={"success": 0.0})


@pytest.mark.slow
def test_the_fuzz_finds_exceptions_hangs_and_violations():
    report = fuzz_environment(load_config(None, ["env.name=test_fuzz:FaultyEnv"]), outputs=300, seed=0,
                              step_timeout_s=0.5, turns_per_episode=1)
    assert report.exceptions > 0 and report.hangs > 0 and report.violations > 0, report.text()
    assert report.by_phase["step"] >= 1 and report.by_phase["contract"] >= 1
    # The non-text observation is a violation, and rendering it raises (TypeError, as the loop would).
    assert report.by_phase["render"] >= 1
    assert not report.ok and any("hang" in e for e in report.examples) and len(report.examples) == 5
