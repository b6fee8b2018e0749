"""The repository-editing environment (SWE-style, miniature).

An episode: the agent gets a small repository whose visible test fails (`tasks.py` says where
tasks come from) and fixes it with tools:

- `list_files()`: the repository's files;
- `read_file(path)`: a file's text (cut to the observation limit);
- `edit_file(path, old, new)`: replace the one occurrence of `old` in the file by `new` (an
  error when `old` occurs zero or several times; `old` empty is an error too);
- `run_tests()`: run the visible tests in the sandbox and see their report;
- `submit()`: end the episode; the hidden tests run on the edited repository.

Reward (`reward_parts = {"outcome": reward}`): 1 when every hidden test passes (the scorer of
`harness.repo_test_files`: exit 0 and the pass marker last, guards on), else 0; an episode
that never submits scores 0. Every exception inside a tool is an `Error: ...` observation;
`step` after the episode ended raises RuntimeError. The final info holds "success",
"reward_parts", "tool_calls", "tool_errors", "executions", "edits", "submitted" and, after a
submission, "hidden_status".
"""

from __future__ import annotations

import copy
from typing import Any

from tiderl.envs.code import harness
from tiderl.envs.code.env import default_sandbox, format_run, function_spec, play_turn
from tiderl.envs.code.sandbox import Sandbox, run_sync
from tiderl.envs.protocol import Action, StepResult, Task

MAX_CALLS_PER_TURN = 8
MAX_FILE_CHARS = 100_000

DEFAULT_SYSTEM_PROMPT = (
    "You fix bugs in a Python repository. Tools: list_files(), read_file(path), edit_file(path, old, "
    "new) replaces the one occurrence of old with new, run_tests() runs the visible tests, submit() "
    "ends the task (hidden tests decide)."
)

_NO_CALL = ("No tool call. Call a tool as <tool_call>{\"name\": \"read_file\", \"arguments\": {\"path\": \"...\"}}"
            "</tool_call>; finish with submit.")

_PATH = {"path": {"type": "string", "description": "a path from list_files"}}
TOOL_SCHEMAS: list[dict[str, Any]] = [
    function_spec("list_files", "List the repository's files.", {}),
    function_spec("read_file", "Show a file's text.", _PATH),
    function_spec("edit_file", "Replace the one occurrence of `old` in a file with `new`.",
                  {**_PATH, "old": {"type": "string", "description": "exact text to replace (must occur once)"},
                   "new": {"type": "string", "description": "the replacement text"}}),
    function_spec("run_tests", "Run the visible tests and show their report.", {}),
    function_spec("submit", "Submit the repository as it is now and end the task.", {}),
]


def apply_edit(files: dict[str, str], path: Any, old: Any, new: Any) -> str:
    """Replace the one occurrence of `old` in `files[path]` by `new` (in place); returns what
    changed. ValueError says what is wrong (unknown path, `old` missing, ambiguous or empty)."""
    for name, value in (("path", path), ("old", old), ("new", new)):
        if not isinstance(value, str):
            raise ValueError(f"edit_file needs '{name}' as a string (got {type(value).__name__})")
    if path not in files:
        raise ValueError(f"no file {path!r} in the repository; list_files shows the paths")
    if not old:
        raise ValueError("'old' is empty; give the exact text to replace")
    count = files[path].count(old)
    if count != 1:
        raise ValueError(f"'old' occurs {count} times in {path}; give text that occurs exactly once")
    updated = files[path].replace(old, new, 1)
    if len(updated) > MAX_FILE_CHARS:
        raise ValueError(f"the edit would make {path} longer than {MAX_FILE_CHARS} characters")
    files[path] = updated
    return f"Edited {path}: replaced {len(old)} characters with {len(new)}."


class RepoEnv:
    """One repository episode at a time (the `Env` protocol, with `astep`)."""

    def __init__(self, sandbox: Sandbox | None = None, max_observation_chars: int = 4000,
                 system_prompt: str | None = None) -> None:
        self.sandbox = sandbox if sandbox is not None else default_sandbox()
        self.max_observation_chars = max_observation_chars
        self._system_prompt = system_prompt or DEFAULT_SYSTEM_PROMPT
        self.task: Task | None = None
        self.files: dict[str, str] = {}
        self._open = False
        self._counts = {"tool_calls": 0, "tool_errors": 0, "executions": 0, "edits": 0}

    def system_prompt(self) -> str:
        return self._system_prompt

    def tool_schemas(self) -> list[dict[str, Any]]:
        return copy.deepcopy(TOOL_SCHEMAS)

    def reset(self, task: Task) -> str:
        """Start an episode on a fresh copy of the task's repository; ValueError on a task
        without files or hidden tests."""
        files, hidden = task.meta.get("files"), (task.answer or {}).get("hidden_tests") if isinstance(task.answer, dict) else None
        if not isinstance(files, dict) or not isinstance(hidden, dict) or not hidden:
            raise ValueError(f"task {task.task_id}: a repo task needs meta['files'] and answer['hidden_tests']")
        self.task, self.files, self._open = task, dict(files), True
        self._counts = dict.fromkeys(self._counts, 0)
        return task.prompt

    def step(self, action: Action) -> StepResult:
        """`astep` for synchronous callers."""
        self._require_open()
        return run_sync(self.astep(action))

    async def astep(self, action: Action) -> StepResult:
        """Answer parse errors and tool calls in order; `submit` ends the episode (calls after it
        in the same turn are not run: info["ignored_calls"])."""
        self._require_open()

        async def call_tool(call: Any) -> str | StepResult:
            if call.name == "submit":
                return await self._submit()
            return await self._tool(call.name, call.arguments if isinstance(call.arguments, dict) else {})

        return await play_turn(action, self._counts, call_tool, MAX_CALLS_PER_TURN, _NO_CALL,
                               self.max_observation_chars)

    def finish(self, reason: str) -> StepResult:
        """End without a submission (turn or token limit): reward 0."""
        self._require_open()
        return self._final(0.0, {"finish_reason": reason, "submitted": False})

    # -- tools ------------------------------------------------------------------------------

    async def _tool(self, name: str, args: dict[str, Any]) -> str:
        if name == "list_files":
            return "\n".join(sorted(self.files))
        if name == "read_file":
            path = args.get("path")
            if not isinstance(path, str) or path not in self.files:
                raise ValueError(f"no file {path!r} in the repository; list_files shows the paths")
            return self.files[path] or "(empty file)"
        if name == "edit_file":
            message = apply_edit(self.files, args.get("path"), args.get("old"), args.get("new"))
            self._counts["edits"] += 1
            return message
        if name == "run_tests":
            assert self.task is not None
            tests = [p for p in self.task.meta.get("visible_tests", []) if p in self.files]
            if not tests:
                return "The repository has no visible tests left to run."
            self._counts["executions"] += 1
            result = await self.sandbox.run(harness.repo_test_files(self.files, tests, hidden=False),
                                            [self.sandbox.python, "-E", "-s", "-B", harness.RUNNER])
            return format_run(result)
        raise ValueError(f"unknown tool {name!r}; the tools are list_files, read_file, edit_file, run_tests and submit")

    async def _submit(self) -> StepResult:
        assert self.task is not None
        self._counts["executions"] += 1
        passed, status = await score_repo(self.sandbox, self.task, self.files)
        return self._final(1.0 if passed else 0.0, {"submitted": True, "hidden_status": status})

    def _require_open(self) -> None:
        if not self._open:
            raise RuntimeError("RepoEnv: the episode already ended (or never started); call reset(task) first")

    def _final(self, reward: float, extra: dict[str, Any]) -> StepResult:
        self._open = False
        info = {**self._counts, "success": reward, "reward_parts": {"outcome": reward}, **extra}
        return StepResult([], reward=reward, done=True, info=info)


async def score_repo(sandbox: Sandbox, task: Task, files: dict[str, str]) -> tuple[bool, str]:
    """(whether the repository `files` passes the task's hidden tests, the sandbox status)."""
    hidden = dict(task.answer["hidden_tests"])
    result = await sandbox.run(harness.repo_test_files({**files, **hidden}, list(hidden), hidden=True),
                               [sandbox.python, "-E", "-s", "-B", harness.RUNNER])
    return harness.passed(result.ok, result.stdout), result.status
