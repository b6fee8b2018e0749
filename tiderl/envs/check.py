"""The environment contract, as checks anyone can run against their own environment.

    tiderl check-env mypkg.myenv:MyEnv            # prints each check, exits 1 on a failure
    assert_environment("mypkg.myenv:MyEnv")      # the same from a pytest test

What is checked (tiderl.envs.protocol has the contract in words):

1. `env.name` resolves and its setup returns a `Setup` with training and held-out tasks whose
   ids are unique and do not overlap (held-out means never trained on);
2. `make_env()` returns a fresh object per call with the five protocol methods;
3. `system_prompt()` is text and `tool_schemas()` is a JSON-serialisable list of OpenAI
   function specs (`{"type": "function", "function": {"name": ..., "parameters": ...}}`);
4. `reset(task)` returns the first user message: non-empty text, or an `Observation` with
   non-empty text and images that are PIL images (each step's observations likewise: text, or
   `Observation`s);
5. bad model output is an observation, not an exception: a turn with a parse error, a call to
   a tool that does not exist, a call with wrong arguments and a turn without any call each
   return a `StepResult` (the episode may go on or end, but nothing raises);
6. `finish(reason)` ends the episode with a finite reward and JSON-serialisable info holding
   `success`;
7. with an oracle (`Setup.oracle`), its scripted turns solve at least one of the first held-out
   tasks, and every final result's `reward_parts` sum to its reward;
8. for a built-in environment (a name in `tiderl.registry.ENVIRONMENTS`): `step` after the
   episode ended (after `finish`, and after an oracle's answer) raises RuntimeError whose
   message says to call `reset(task)` first. One rule for every built-in environment: a step
   after the end is a caller bug (the agent loop never makes one), not a second chance to
   score. Your own environment need not follow it, as nothing in tiderl steps an ended episode.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from tiderl.envs.protocol import Action, Observation, StepResult, ToolCall, message_text
from tiderl.envs.setup import Setup, load_setup
from tiderl.registry import ENVIRONMENTS

if TYPE_CHECKING:
    from tiderl.config import RunConfig

PROTOCOL_METHODS = ("system_prompt", "tool_schemas", "reset", "step", "finish")


@dataclass
class Report:
    """The outcome of every check, in order: (name, passed, detail)."""

    checks: list[tuple[str, bool, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(passed for _, passed, _ in self.checks)

    def add(self, name: str, passed: bool, detail: str = "") -> bool:
        self.checks.append((name, passed, detail))
        return passed

    def text(self) -> str:
        lines = [f"{'PASS' if passed else 'FAIL'}  {name}" + (f": {detail}" if detail else "")
                 for name, passed, detail in self.checks]
        failed = sum(not passed for _, passed, _ in self.checks)
        lines.append(f"{len(self.checks) - failed} passed, {failed} failed")
        return "\n".join(lines)


def _attempt(report: Report, name: str, fn: Callable[[], Any]) -> Any:
    """Run `fn`; a raised exception fails the check `name` (and returns None)."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - a failing environment is what this reports
        report.add(name, False, f"raised {type(exc).__name__}: {exc}")
        return None


def message_problem(message: Any) -> str:
    """Why `message` is not a valid environment message ("" when it is): text, or an `Observation`
    whose text is a string and whose images are a list of PIL images."""
    if isinstance(message, str):
        return ""
    if not isinstance(message, Observation):
        return f"a {type(message).__name__}, not text or an Observation"
    if not isinstance(message.text, str):
        return f"an Observation whose text is a {type(message.text).__name__}"
    if not isinstance(message.images, list):
        return f"an Observation whose images are a {type(message.images).__name__}, not a list"
    if not message.images:
        return ""
    from PIL import Image

    if not all(isinstance(i, Image.Image) for i in message.images):
        return "an Observation whose images are not a list of PIL images"
    return ""


def _is_result(x: Any) -> bool:
    return (isinstance(x, StepResult) and isinstance(x.observations, list) and math.isfinite(float(x.reward))
            and not any(message_problem(o) for o in x.observations))


def check_environment(cfg: "RunConfig", episodes: int = 4) -> Report:
    """Run the contract checks (module docstring) on the environment `cfg.env.name` names."""
    report = Report()
    setup = _attempt(report, "setup", lambda: load_setup(cfg))
    if setup is None:
        return report
    _check_tasks(report, setup)
    env = _attempt(report, "make_env", setup.make_env)
    if env is None:
        return report
    missing = [m for m in PROTOCOL_METHODS if not callable(getattr(env, m, None))]
    if not report.add("protocol methods", not missing, f"missing {missing}" if missing else ""):
        return report
    fresh = setup.make_env() is not env
    report.add("fresh environment per episode", fresh,
               "" if fresh else "make_env() must build a new environment each call (episodes run concurrently)")
    prompt = _attempt(report, "system_prompt", env.system_prompt)
    if prompt is not None:
        report.add("system_prompt", isinstance(prompt, str), "" if isinstance(prompt, str) else
                   f"returned {type(prompt).__name__}")
    schemas = _attempt(report, "tool_schemas", env.tool_schemas)
    if schemas is not None:
        report.add("tool_schemas", _schemas_problem(schemas) == "", _schemas_problem(schemas))
    tasks = (setup.eval_tasks or setup.train_tasks)[:max(1, episodes)]
    bad_turns = [
        ("a turn with a parse error", Action("<tool_call>{not json</tool_call>", [], ["invalid JSON in tool call"])),
        ("a call to an unknown tool", Action("", [ToolCall("no_such_tool_xyz", {})])),
        ("a call with wrong arguments", Action("", [ToolCall(_first_tool(schemas), {"no_such_argument": 1})])),
        ("a turn without any call", Action("I am not sure.")),
    ]
    for what, action in bad_turns:
        fresh = setup.make_env()
        first = _attempt(report, f"reset before {what}", lambda: fresh.reset(tasks[0]))
        if first is None:
            continue
        problem = message_problem(first) or ("" if message_text(first).strip() else "its text is empty")
        report.add("reset", not problem, f"returned {first!r:.60}: {problem}" if problem else "")
        result = _attempt(report, f"step on {what}", lambda: fresh.step(action))
        if result is not None:
            report.add(f"step on {what}", _is_result(result), "" if _is_result(result) else repr(result)[:120])
    fresh = setup.make_env()
    if _attempt(report, "reset before finish", lambda: fresh.reset(tasks[0])) is not None:
        final = _attempt(report, "finish", lambda: fresh.finish("max_turns"))
        if final is not None:
            report.add("finish", _final_problem(final) == "", _final_problem(final))
            if cfg.env.name in ENVIRONMENTS:
                _check_step_after_end(report, fresh, "finish")
    if setup.oracle is not None:
        _check_oracle(report, setup, tasks, built_in=cfg.env.name in ENVIRONMENTS)
    return report


def _check_step_after_end(report: Report, env: Any, ended_by: str) -> None:
    """Check 8 on an environment whose episode has just ended (by `ended_by`)."""
    name = f"step after the episode ended ({ended_by}) raises RuntimeError"
    try:
        result = env.step(Action("Final Answer: #0"))
    except RuntimeError as exc:
        says_reset = "reset" in str(exc)
        report.add(name, says_reset,
                   "" if says_reset else f"its message {str(exc)!r:.120} does not say to call reset(task)")
    except Exception as exc:  # noqa: BLE001 - the wrong exception is what this reports
        report.add(name, False, f"raised {type(exc).__name__}: {exc}"[:200])
    else:
        report.add(name, False, f"returned {result!r:.100} instead of raising RuntimeError")


def _check_tasks(report: Report, setup: Setup) -> None:
    train, held = setup.train_tasks, setup.eval_tasks
    report.add("tasks", bool(train) and bool(held), f"{len(train)} training and {len(held)} held-out tasks")
    ids = [t.task_id for t in train + held]
    report.add("unique task ids", len(ids) == len(set(ids)), f"{len(ids) - len(set(ids))} repeated ids")
    overlap = {t.task_id for t in train} & {t.task_id for t in held}
    report.add("held-out tasks never trained on", not overlap, f"{len(overlap)} ids in both" if overlap else "")


def _schemas_problem(schemas: Any) -> str:
    if not isinstance(schemas, list):
        return f"returned {type(schemas).__name__}, not a list"
    for s in schemas:
        fn = s.get("function") if isinstance(s, dict) else None
        if not isinstance(fn, dict) or s.get("type") != "function" or not fn.get("name"):
            return f"not an OpenAI function spec: {s!r:.100}"
    try:
        json.dumps(schemas)
    except (TypeError, ValueError) as exc:
        return f"not JSON-serialisable ({exc})"
    return ""


def _first_tool(schemas: Any) -> str:
    try:
        return schemas[0]["function"]["name"]
    except (TypeError, LookupError):
        return "no_such_tool_xyz"


def _final_problem(result: Any) -> str:
    if not _is_result(result):
        return f"returned {result!r:.100}"
    if "success" not in result.info:
        return "its info has no 'success'"
    try:
        json.dumps(result.info)
    except (TypeError, ValueError) as exc:
        return f"its info is not JSON-serialisable ({exc})"
    parts = result.info.get("reward_parts")
    if parts is not None and abs(sum(parts.values()) - result.reward) > 1e-6:
        return f"reward_parts {parts} do not sum to the reward {result.reward}"
    return ""


def _check_oracle(report: Report, setup: Setup, tasks: list[Any], built_in: bool = False) -> None:
    from tiderl.agent.tool_parser import parse_hermes_tool_calls

    solved, problems = 0, []
    checked_after_answer = not built_in
    for task in tasks:
        env = setup.make_env()
        env.reset(task)
        result = None
        for turn in setup.oracle(task):
            result = env.step(parse_hermes_tool_calls(turn))
            if result.done:
                break
        if result is not None and result.done and not checked_after_answer:
            _check_step_after_end(report, env, "an answer")
            checked_after_answer = True
        if result is None or not result.done:
            result = env.finish("max_turns")
        problem = _final_problem(result)
        if problem:
            problems.append(f"{task.task_id}: {problem}")
        solved += bool(result.info.get("success"))
    report.add("oracle episodes score", not problems, "; ".join(problems[:2]))
    report.add("oracle solves a task", solved > 0, f"{solved} of {len(tasks)} held-out tasks solved")


def assert_environment(env_name: str, *overrides: str, episodes: int = 4) -> Report:
    """`check_environment` for a pytest test: raises AssertionError with the report on a failure."""
    from tiderl.config import load_config

    report = check_environment(load_config(None, [f"env.name={env_name}", *overrides]), episodes)
    assert report.ok, report.text()
    return report
