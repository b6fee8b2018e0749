"""The SQL database environment (AgentBench DB-style tasks).

An episode: the agent reads a task (a question about a table, or an instruction to change
it), calls the SQL tools (see `tools.py`) and ends by calling `commit_final_answer`.

Task format (what `load_dbbench_tasks` builds; hand-made tasks use the same):
    task.meta["tables"]: the task's tables as `TableSpec.to_dict()` forms;
    task.meta["answer_type"]: "INSERT", "UPDATE" or "DELETE" for write tasks, anything else
        (AgentBench: counting, ranking, comparison, aggregation-SUM, other, ...) for
        SELECT-type tasks;
    task.answer: {"values": [...], "ordered": bool} for SELECT-type tasks, {"gold_sql": "..."}
        for write tasks.

Scoring (reward 1 on success, else 0; `reward_parts = {"outcome": reward}`):
- SELECT-type: the committed list against `answer["values"]` with `answers_match` (numbers
  within a relative tolerance, text normalised, order ignored unless `answer["ordered"]`).
- write: the hash of the task tables after the episode against their hash after running the
  gold statement on a fresh copy (`database_hash`: order-independent row hashes). The gold
  hash is computed at `reset` (and cached per backend, table specs and gold SQL; see
  `resolve_gold_write` for the one retry a MySQL-only statement gets). If the gold statement
  fails on the backend the task cannot be scored: reward 0 and info["gold_error"].

An episode counts only when the agent commits: `finish` (turn or token limit) scores 0.

The final info (from `step` when done, and from `finish`) holds "success", "reward_parts",
"answer_type", "knowledge_units" (sorted; units of the statements that succeeded),
"tool_calls" and "tool_errors" (malformed calls count in both).
"""

from __future__ import annotations

import copy
import threading
import weakref
from pathlib import Path
from typing import Any

from tiderl.envs.db.backend import Backend, SQLError, TableSpec, database_hash, spec_digest, specs_from_meta
from tiderl.envs.db.scoring import DEFAULT_REL_TOL, answers_match, result_sets_match
from tiderl.envs.db.sql_text import quote_bare_names, split_statements
from tiderl.envs.db.sqlite_backend import SQLiteBackend
from tiderl.envs.db.tools import DBToolbox, Limits, valid_text
from tiderl.envs.protocol import Action, StepResult, Task

WRITE_TYPES = frozenset({"INSERT", "UPDATE", "DELETE"})

DEFAULT_SYSTEM_PROMPT = (
    "You work with a SQL database through tools. Explore it with list_tables, describe_table "
    "and execute_sql (one SQL statement per call; quote names that contain spaces with "
    "backticks or double quotes). For a question, finish with commit_final_answer and the "
    "answer values as a list, e.g. [\"Giza\"] or [3]. For an insert, update or delete task, "
    "run the statement with execute_sql, then call commit_final_answer with an empty list."
)

_NO_ACTION = (
    "No tool call. Call a tool as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>; "
    "finish with commit_final_answer."
)


def _function(name: str, description: str, properties: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": list(properties)},
        },
    }


TOOL_SCHEMAS: list[dict[str, Any]] = [
    _function("execute_sql", "Run one SQL statement and see its result (at most 20 rows are shown).",
              {"query": {"type": "string", "description": "one SQL statement"}}),
    _function("commit_final_answer",
              "Submit the answer and end the task: the answer values (an empty list after a write).",
              {"answers": {"type": "array", "items": {}, "description": "the answer values, e.g. [\"Giza\"]"}}),
    _function("list_tables", "List the tables of the database.", {}),
    _function("describe_table", "List the columns of a table with their types.",
              {"name": {"type": "string", "description": "a table name from list_tables"}}),
]

_DEFAULT_BACKEND: SQLiteBackend | None = None
_DEFAULT_BACKEND_LOCK = threading.Lock()

# Gold hashes of write tasks, per backend, keyed by (table spec digest, gold SQL): envs are
# created per episode, so the cache lives with the backend they share.
_GOLD_CACHE: "weakref.WeakKeyDictionary[Any, dict[tuple[str, str], tuple[str | None, str]]]" = (
    weakref.WeakKeyDictionary()
)


def default_backend() -> SQLiteBackend:
    """The process-wide SQLite backend (one cache directory of task databases for all envs)."""
    global _DEFAULT_BACKEND
    with _DEFAULT_BACKEND_LOCK:
        if _DEFAULT_BACKEND is None:
            _DEFAULT_BACKEND = SQLiteBackend()
        return _DEFAULT_BACKEND


def open_database_file(path: str | Path) -> Backend:
    """A read-only backend on an existing database file: SQLite or DuckDB, told apart by the
    file's header. FileNotFoundError / ValueError naming the fix otherwise."""
    from tiderl.envs.db.duckdb_backend import is_duckdb_file
    from tiderl.envs.db.sqlite_backend import SQLiteFileBackend, is_sqlite_file

    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"database file {file} not found. Fix: pass the path of an existing SQLite "
                                "(.sqlite/.db) or DuckDB (.duckdb) file.")
    if is_sqlite_file(file):
        return SQLiteFileBackend(file)
    if is_duckdb_file(file):
        from tiderl.envs.db.duckdb_backend import DuckDBFileBackend

        return DuckDBFileBackend(file)
    raise ValueError(f"{file} is neither a SQLite nor a DuckDB database file. Fix: pass a .sqlite/.db or "
                     ".duckdb file.")


def open_database(source: str | Path, **server_options: Any) -> Backend:
    """A read-only backend on a database the user already has: a PostgreSQL or MariaDB/MySQL
    server URL (`ServerBackend(source, **server_options)`: every episode in a rolled-back
    read-only transaction) or a SQLite/DuckDB file (`open_database_file`; `server_options` are
    ignored)."""
    from tiderl.envs.db.server_backend import ServerBackend, server_dialect

    if isinstance(source, str) and server_dialect(source):
        return ServerBackend(source, **server_options)
    return open_database_file(source)


def make_backend(kind: str = "sqlite", cache_dir: str | None = None) -> Backend:
    """A backend by name: "sqlite" (default), "duckdb", a SQLAlchemy URL (contains "://"), or
    the path of an existing SQLite/DuckDB file (opened read-only: `open_database_file`)."""
    if "://" in kind:
        from tiderl.envs.db.sqlalchemy_backend import SQLAlchemyBackend

        return SQLAlchemyBackend(kind)
    if kind == "sqlite":
        return SQLiteBackend(cache_dir)
    if kind == "duckdb":
        from tiderl.envs.db.duckdb_backend import DuckDBBackend

        return DuckDBBackend(cache_dir)
    if Path(kind).expanduser().is_file():
        return open_database_file(kind)
    raise ValueError(f"unknown DB backend {kind!r}: use 'sqlite', 'duckdb', a SQLAlchemy URL such as "
                     "'postgresql://user@host/db', or the path of an existing .sqlite/.duckdb file")


def task_tables(task: Task, backend: Backend) -> list[TableSpec]:
    """The task's tables: `task.meta["tables"]` when it carries them, else the tables of the
    backend's database file. ValueError naming the fix when neither exists."""
    if "tables" in task.meta:
        return specs_from_meta(task.meta)
    own = getattr(backend, "tables", None)
    if own is None:
        raise ValueError(f"task {task.task_id} has no meta['tables'] and the backend is not a database file. "
                         "Fix: give the task its tables, or open the database file: DBEnv('path/to.sqlite').")
    return list(own)


def is_write_task(task: Task) -> bool:
    """Whether the task changes the database (INSERT/UPDATE/DELETE) rather than asking a question."""
    return str(task.meta.get("answer_type", "")).upper() in WRITE_TYPES


def gold_database_hash(backend: Backend, tables: list[TableSpec], gold_sql: str,
                       timeout_s: float = 10.0) -> str:
    """The hash of `tables` after running the gold statement(s) on a fresh writable copy.
    Raises SQLError when a gold statement fails on this backend."""
    session = backend.open(tables, writable=True)
    try:
        statements = split_statements(gold_sql)
        if not statements:
            raise SQLError("the gold SQL is empty")
        for statement in statements:
            session.execute(statement, max_rows=0, timeout_s=timeout_s)
        return database_hash(session, [t.name for t in tables])
    finally:
        session.close()


def resolve_gold_write(backend: Backend, tables: list[TableSpec], gold_sql: str) -> tuple[str, str]:
    """(the gold SQL that runs on this backend, the table hash after it).

    AgentBench's gold statements were written for MySQL, which accepts bare table names that
    start with a digit; when the statement fails as written it is retried once with the task's
    table names quoted (`quote_bare_names`). Raises SQLError (the first failure) when both fail.
    """
    try:
        return gold_sql, gold_database_hash(backend, tables, gold_sql)
    except SQLError as first:
        quoted = quote_bare_names(gold_sql, [t.name for t in tables])
        if quoted == gold_sql:
            raise
        try:
            return quoted, gold_database_hash(backend, tables, quoted)
        except SQLError:
            raise first from None


class DBEnv:
    """One SQL episode at a time (the `Env` protocol).

    backend: where task databases live (the process-wide SQLite backend when None), or the
        path of an existing SQLite/DuckDB file (str or Path), opened read-only: its tables
        are every task's (`open_database_file`).
    limits: per-call limits (rows shown, query length, statement time, observation length).
    rel_tol: relative tolerance for numeric answers.
    system_prompt: overrides `DEFAULT_SYSTEM_PROMPT`.
    The current episode's `toolbox` is public (its `units` are the knowledge units so far).
    """

    def __init__(self, backend: Backend | None = None, limits: Limits = Limits(),
                 rel_tol: float = DEFAULT_REL_TOL, system_prompt: str | None = None) -> None:
        if isinstance(backend, (str, Path)):
            backend = make_backend(str(backend))
        self.backend = backend if backend is not None else default_backend()
        self.limits = limits
        self.rel_tol = rel_tol
        if system_prompt is None:  # a server backend says which SQL dialect the agent writes
            note = getattr(self.backend, "prompt_note", "")
            system_prompt = DEFAULT_SYSTEM_PROMPT + (" " + note if note else "")
        self._system_prompt = system_prompt
        self.toolbox: DBToolbox | None = None
        self._task: Task | None = None
        self._tables: list[TableSpec] = []
        self._gold_hash: str | None = None
        self._gold_error = ""
        self._parse_errors = 0
        self._ended = False

    def system_prompt(self) -> str:
        """How to use the tools and how to finish."""
        return self._system_prompt

    def tool_schemas(self) -> list[dict[str, Any]]:
        """The four SQL tools in OpenAI function format (a copy: callers may edit it)."""
        schemas = copy.deepcopy(TOOL_SCHEMAS)
        schemas[0]["function"]["description"] = (
            f"Run one SQL statement and see its result (at most {self.limits.max_rows} rows are shown)."
        )
        return schemas

    def reset(self, task: Task) -> str:
        """Start an episode on a fresh session of the task's database; returns the task text.
        Raises ValueError on a task without tables or answer (a data error, not an agent one)."""
        self.close()
        tables = task_tables(task, self.backend)
        writable = is_write_task(task)
        if writable:
            self._gold_hash, self._gold_error = self._gold(tables, task)
        elif not isinstance(task.answer, dict) or not ("values" in task.answer or "rows" in task.answer):
            raise ValueError(f"task {task.task_id}: a SELECT-type task needs answer={{'values': [...]}} "
                             "(a list of values) or answer={'rows': [[...], ...]} (a result set)")
        self._task, self._tables = task, tables
        self.toolbox = DBToolbox(self.backend.open(tables, writable), writable, self.limits)
        self._parse_errors = 0
        self._ended = False
        return task.prompt

    def _gold(self, tables: list[TableSpec], task: Task) -> tuple[str | None, str]:
        """(gold hash, "") or (None, why the gold statement failed); cached per backend, table
        specs and gold SQL."""
        if not isinstance(task.answer, dict) or not task.answer.get("gold_sql"):
            raise ValueError(f"task {task.task_id}: a write task needs answer={{'gold_sql': '...'}}")
        cache = _GOLD_CACHE.setdefault(self.backend, {})
        key = (spec_digest(tables), task.answer["gold_sql"])
        if key not in cache:
            try:
                cache[key] = (resolve_gold_write(self.backend, tables, key[1])[1], "")
            except SQLError as exc:
                cache[key] = (None, str(exc))
        return cache[key]

    def step(self, action: Action) -> StepResult:
        """Answer parse errors and tool calls (one observation each, in order). A
        `commit_final_answer` call ends and scores the episode; calls after it in the same turn
        are not run (info["ignored_calls"])."""
        toolbox = self._require_episode()
        observations = [valid_text(f"Error: {e}") for e in action.parse_errors]
        self._parse_errors += len(action.parse_errors)
        for index, call in enumerate(action.tool_calls):
            observation = toolbox.call(call.name, call.arguments)
            if toolbox.committed is not None:
                try:
                    result = self._score()
                except Exception as exc:  # no committed answer may crash the episode
                    result = self._final(0.0, {"score_error": valid_text(f"{type(exc).__name__}: {exc}")[:500]})
                result.info["ignored_calls"] = len(action.tool_calls) - index - 1
                return result
            observations.append(observation)
        if not observations:
            observations.append(_NO_ACTION)
        return StepResult(observations=observations, info=self._counters())

    def finish(self, reason: str) -> StepResult:
        """End without a committed answer (turn/token limit): reward 0, the final info keys."""
        self._require_episode()
        return self._final(0.0, {"finish_reason": reason})

    def close(self) -> None:
        """Release the current episode's database session (safe to call at any time)."""
        if self.toolbox is not None:
            self.toolbox.session.close()
            self.toolbox = None

    # -- helpers -------------------------------------------------------------------------

    def _require_episode(self) -> DBToolbox:
        if self.toolbox is None:
            if self._ended:
                raise RuntimeError("DBEnv.step/finish called after the episode already ended (it was scored "
                                   "and its database closed): call reset(task) first to start a new one")
            raise RuntimeError("DBEnv.step/finish called without an episode in progress: call reset(task) first")
        return self.toolbox

    def _counters(self) -> dict[str, Any]:
        """Tool calls include malformed ones (parse errors), which also count as tool errors."""
        assert self.toolbox is not None
        return {
            "tool_calls": self.toolbox.num_calls + self._parse_errors,
            "tool_errors": self.toolbox.num_errors + self._parse_errors,
        }

    def _final(self, reward: float, extra: dict[str, Any]) -> StepResult:
        """The final StepResult (closes the session)."""
        assert self.toolbox is not None and self._task is not None
        info = self._counters() | {
            "success": reward,
            "reward_parts": {"outcome": reward},
            "answer_type": str(self._task.meta.get("answer_type", "")),
            "knowledge_units": sorted(self.toolbox.units),
            "answer_size": len(self.toolbox.committed or []),
        } | extra
        self.close()
        self._ended = True
        return StepResult(observations=[], reward=reward, done=True, info=info)

    def _score(self) -> StepResult:
        assert self.toolbox is not None and self._task is not None
        if self.toolbox.writable:
            if self._gold_hash is None:
                return self._final(0.0, {"gold_error": self._gold_error})
            try:
                current = database_hash(self.toolbox.session, [t.name for t in self._tables])
            except SQLError as exc:  # a task table is gone; the backend should not allow it
                return self._final(0.0, {"score_error": str(exc)})
            return self._final(1.0 if current == self._gold_hash else 0.0, {})
        answer = self._task.answer
        if "rows" in answer:
            ok = result_sets_match(self.toolbox.committed_raw or [], answer["rows"],
                                   ordered=bool(answer.get("ordered", False)), rel_tol=self.rel_tol)
            return self._final(1.0 if ok else 0.0, {})
        committed = self.toolbox.committed or []
        ok = answers_match(committed, list(answer["values"]), ordered=bool(answer.get("ordered", False)),
                           rel_tol=self.rel_tol)
        return self._final(1.0 if ok else 0.0, {})
