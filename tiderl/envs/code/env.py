"""The code environment: write a Python function, try it in the sandbox, submit it.

An episode: the agent reads a task (`tiderl.envs.code.data`), may call `run_tests` (its code
against the visible examples) and `execute` (run any code, see its output) as often as its
turns allow, and ends by calling `submit` with its final code.

Reward (`reward_parts = {"outcome": reward}`): 1 when the submitted code passes the hidden
tests in the sandbox (`harness.scoring_files`: exit 0, the pass marker last, plain-data
results), else 0. An episode that never submits (turn or token limit) scores 0.

Every tool runs in a fresh sandboxed process; `astep` awaits it (the agent loop awaits
`astep`, so concurrent episodes do not hold threads), and `step` runs the same coroutine to
completion for synchronous callers. Bad calls (unknown tool, missing or non-string `code`,
code over `MAX_CODE_CHARS`, more than `MAX_CALLS_PER_TURN` calls) and any exception inside a
tool become `Error: ...` observations; observations are valid UTF-8 text of at most
`max_observation_chars` characters.

The final info holds "success", "reward_parts", "tool_calls", "tool_errors" (malformed calls
count in both), "executions" (sandbox runs), "submitted" and, after a submission,
"hidden_status" (the sandbox status of the hidden-test run).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Awaitable, Callable
from typing import Any

from tiderl.envs.code import harness
from tiderl.envs.code.sandbox import ExecResult, Limits, Sandbox, run_sync
from tiderl.envs.protocol import Action, StepResult, Task

MAX_CODE_CHARS = 20_000
MAX_CALLS_PER_TURN = 4

DEFAULT_SYSTEM_PROMPT = (
    "You write Python code. Tools: run_tests(code) runs your code against the visible examples; "
    "execute(code) runs any code and shows its output; submit(code) hands in your final code and "
    "ends the task (hidden tests decide). Write complete functions with their imports."
)

_NO_CALL = ("No tool call. Call a tool as <tool_call>{\"name\": \"submit\", \"arguments\": {\"code\": \"...\"}}"
            "</tool_call>; run_tests and execute try your code first.")


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """One Hermes-format tool call, as the oracles write their turns."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


def function_spec(name: str, description: str, properties: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """An OpenAI function spec whose parameters are all required strings (or as given)."""
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties, "required": list(properties)}}}


_CODE = {"code": {"type": "string", "description": "Python source"}}
TOOL_SCHEMAS: list[dict[str, Any]] = [
    function_spec("run_tests", "Run your code against the task's visible examples; one line per test.", _CODE),
    function_spec("execute", "Run Python code (with the task's starter code above it) and show its output.", _CODE),
    function_spec("submit", "Submit your final code and end the task; hidden tests score it.", _CODE),
]


def clean_text(text: str, limit: int) -> str:
    """`text` as valid UTF-8 (lone surrogates become '?') cut to `limit` characters with a note."""
    text = text.encode("utf-8", "replace").decode("utf-8")
    if len(text) > limit:
        note = f"\n... ({len(text) - limit} more characters cut)"
        text = text[:max(0, limit - len(note))] + note
    return text


def format_run(result: ExecResult) -> str:
    """What the agent sees of one execution: its output, its errors, how it ended."""
    parts = []
    if result.stdout:
        parts.append(result.stdout.rstrip("\n"))
    if result.stderr:
        parts.append("stderr:\n" + result.stderr.rstrip("\n"))
    ending = {"ok": "exit code 0", "error": f"exit code {result.exit_code}",
              "timeout": "stopped: wall-clock time limit", "cpu_limit": "stopped: CPU time limit",
              "output_limit": "stopped: too much output", "signal": f"killed by a signal (exit status {result.exit_code})"}
    parts.append(f"[{ending.get(result.status, result.status)}]" + (" (output cut)" if result.truncated else ""))
    return "\n".join(parts)


_SANDBOXES: dict[Limits, Sandbox] = {}


def default_sandbox(limits: Limits = Limits()) -> Sandbox:
    """A process-wide sandbox per set of limits (the probe of the machine runs once)."""
    if limits not in _SANDBOXES:
        _SANDBOXES[limits] = Sandbox(limits)
    return _SANDBOXES[limits]


class CodeEnv:
    """One code episode at a time (the `Env` protocol, with `astep`).

    sandbox: where code runs (the process-wide default when None).
    max_observation_chars: longest observation. system_prompt: overrides the default.
    """

    def __init__(self, sandbox: Sandbox | None = None, max_observation_chars: int = 4000,
                 system_prompt: str | None = None) -> None:
        self.sandbox = sandbox if sandbox is not None else default_sandbox()
        self.max_observation_chars = max_observation_chars
        self._system_prompt = system_prompt or DEFAULT_SYSTEM_PROMPT
        self.task: Task | None = None
        self._open = False
        self._counts = {"tool_calls": 0, "tool_errors": 0, "executions": 0}

    def system_prompt(self) -> str:
        return self._system_prompt

    def tool_schemas(self) -> list[dict[str, Any]]:
        return copy.deepcopy(TOOL_SCHEMAS)

    def reset(self, task: Task) -> str:
        """Start an episode on `task`; raises ValueError on a task without hidden tests."""
        if not isinstance(task.answer, dict) or not isinstance(task.answer.get("tests"), str):
            raise ValueError(f"task {task.task_id}: a code task needs answer={{'tests': '<test code>'}}")
        self.task, self._open = task, True
        self._counts = {"tool_calls": 0, "tool_errors": 0, "executions": 0}
        return task.prompt

    def step(self, action: Action) -> StepResult:
        """`astep` for synchronous callers."""
        self._require_open()
        return run_sync(self.astep(action))

    async def astep(self, action: Action) -> StepResult:
        """Answer parse errors and tool calls in order, one observation each; `submit` ends the
        episode (calls after it in the same turn are not run: info["ignored_calls"])."""
        self._require_open()

        async def call_tool(call: Any) -> str | StepResult:
            code = self._code_argument(call.name, call.arguments)
            if call.name == "submit":
                return await self._submit(code)
            return await self._run_tool(call.name, code)

        return await play_turn(action, self._counts, call_tool, MAX_CALLS_PER_TURN, _NO_CALL,
                               self.max_observation_chars)

    def finish(self, reason: str) -> StepResult:
        """End without a submission (turn or token limit): reward 0."""
        self._require_open()
        return self._final(0.0, {"finish_reason": reason, "submitted": False})

    # -- tools ------------------------------------------------------------------------------

    def _code_argument(self, name: str, arguments: dict[str, Any]) -> str:
        if name not in ("run_tests", "execute", "submit"):
            raise ValueError(f"unknown tool {name!r}; the tools are run_tests, execute and submit")
        code = arguments.get("code") if isinstance(arguments, dict) else None
        if not isinstance(code, str):
            raise ValueError(f"{name} needs 'code', a string of Python source (got {type(code).__name__})")
        if len(code) > MAX_CODE_CHARS:
            raise ValueError(f"the code has {len(code)} characters; at most {MAX_CODE_CHARS} are run")
        return code

    async def _run_tool(self, name: str, code: str) -> str:
        assert self.task is not None
        prelude = self.task.meta.get("prelude", "")
        self._counts["executions"] += 1
        if name == "execute":
            result = await self.sandbox.run_python(harness.solution_source(prelude, code))
            return format_run(result)
        visible = list(self.task.meta.get("visible_tests", []))
        if not visible:
            return "This task shows no runnable examples; try your function with execute."
        result = await self.sandbox.run({**harness.visible_files(prelude, code, visible)},
                                        [self.sandbox.python, "-E", "-s", "-B", "main.py"])
        return format_run(result) if result.status not in ("ok", "error") else result.stdout.rstrip("\n") or format_run(result)

    async def _submit(self, code: str) -> StepResult:
        assert self.task is not None
        self._counts["executions"] += 1
        passed, status = await score(self.sandbox, self.task, code)
        return self._final(1.0 if passed else 0.0, {"submitted": True, "hidden_status": status})

    # -- helpers ----------------------------------------------------------------------------

    def _require_open(self) -> None:
        if not self._open:
            raise RuntimeError("CodeEnv: the episode already ended (or never started); call reset(task) first")

    def _final(self, reward: float, extra: dict[str, Any]) -> StepResult:
        self._open = False
        info = {**self._counts, "success": reward, "reward_parts": {"outcome": reward}, **extra}
        return StepResult([], reward=reward, done=True, info=info)


async def score(sandbox: Sandbox, task: Task, code: str) -> tuple[bool, str]:
    """(whether `code` passes the task's hidden tests, the sandbox status of the run)."""
    files = harness.scoring_files(task.meta.get("prelude", ""), code, task.answer["tests"],
                                  list(task.meta.get("entry_points", [])))
    result = await sandbox.run(files, [sandbox.python, "-E", "-s", "-B", "main.py"])
    return harness.passed(result.ok, result.stdout), result.status


async def play_turn(action: Action, counts: dict[str, int], call_tool: Callable[[Any], Awaitable[str | StepResult]],
                    max_calls: int, no_call: str, max_observation_chars: int) -> StepResult:
    """One turn of a sandboxed environment (code, repo): parse errors and tool calls answered in
    order, one observation each; a tool's exception is an `Error:` observation; at most
    `max_calls` calls run; a call whose tool returns a StepResult (submit) ends the episode, and
    the calls after it in the same turn are not run (info["ignored_calls"]). `counts` gains
    tool_calls and tool_errors."""
    observations = [f"Error: {e}" for e in action.parse_errors]
    counts["tool_calls"] += len(action.parse_errors)
    counts["tool_errors"] += len(action.parse_errors)
    for index, call in enumerate(action.tool_calls):
        counts["tool_calls"] += 1
        if index >= max_calls:
            observation = f"Error: at most {max_calls} tool calls per turn; this one was not run."
        else:
            try:
                outcome = await call_tool(call)
            except Exception as exc:  # noqa: BLE001 - a tool failure is an observation
                outcome = f"Error: {type(exc).__name__}: {exc}"
            if isinstance(outcome, StepResult):
                outcome.info["ignored_calls"] = len(action.tool_calls) - index - 1
                return outcome
            observation = outcome
        if observation.startswith("Error:"):
            counts["tool_errors"] += 1
        observations.append(observation)
    if not observations:
        observations.append(no_call)
    return StepResult([clean_text(o, max_observation_chars) for o in observations], info=dict(counts))
