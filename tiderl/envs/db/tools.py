"""The SQL tools and their per-episode state.

Four tools, one `DBToolbox` per episode:

- `execute_sql(query)`: one SQL statement. SELECT (WITH, VALUES) always; INSERT, UPDATE,
  DELETE, REPLACE only in write tasks; everything else (DDL, PRAGMA, ATTACH, transactions, ...)
  is refused before it reaches the database. The result shows at most `max_rows` rows, as
  JSON arrays the agent can copy into its answer, and says how many rows were left out.
- `commit_final_answer(answers)`: a JSON array of values; ends the episode (the env scores it).
  Rows may be committed as nested arrays; they are flattened into cells.
- `list_tables()` and `describe_table(name)`: the task's tables and one table's columns.

The toolbox never raises on bad input from the agent: unknown tools, missing/extra/mistyped
arguments, empty or over-long queries, several statements in one call, refused statement kinds
and database errors all come back as an observation starting with `Error:`; `num_errors`
counts them.

`units` collects the knowledge units ("table:<t>", "column:<t>.<c>") of the statements that
succeeded: what the backend reports the statement read or wrote (see the backends).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable

from tiderl.envs.db.backend import DBSession, QueryResult, SQLError
from tiderl.envs.db.scoring import flatten_answers, json_cell
from tiderl.envs.db.sql_text import EMPTY, OTHER, WRITE, split_statements, statement_kind

# name -> (argument name, JSON type name, Python type) in the order the tools take them.
TOOL_ARGUMENTS: dict[str, tuple[tuple[str, str, type], ...]] = {
    "execute_sql": (("query", "string", str),),
    "commit_final_answer": (("answers", "array", list),),
    "list_tables": (),
    "describe_table": (("name", "string", str),),
}


@dataclass(frozen=True)
class Limits:
    """What one tool call may cost.

    max_rows: result rows shown per query (the rest are counted, not shown).
    max_query_chars: longest query accepted.
    timeout_s: wall-clock limit per statement.
    max_observation_chars: longest observation; rows that do not fit are left out like rows
        over `max_rows`.
    """

    max_rows: int = 20
    max_query_chars: int = 2_000
    timeout_s: float = 2.0
    max_observation_chars: int = 4_000

    def __post_init__(self) -> None:
        for name in ("max_rows", "max_query_chars", "max_observation_chars"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")


_SURROGATE = re.compile("[\ud800-\udfff]")


def valid_text(text: str) -> str:
    """`text` with lone UTF-16 surrogates (which no tokenizer or UTF-8 encoder takes) replaced
    by U+FFFD."""
    return _SURROGATE.sub("\ufffd", text)


class ToolError(Exception):
    """An agent mistake; its message becomes the `Error:` observation (never leaves the toolbox)."""


def _signature(name: str) -> str:
    return f"{name}({', '.join(a for a, _, _ in TOOL_ARGUMENTS[name])})"


def check_arguments(name: str, arguments: Any) -> dict[str, Any]:
    """The arguments of tool `name`, or ToolError naming what is missing, extra or mistyped."""
    if not isinstance(arguments, dict):
        raise ToolError(f"arguments of {name} must be a JSON object. Call it as {_signature(name)}.")
    expected = TOOL_ARGUMENTS[name]
    names = [a for a, _, _ in expected]
    missing = [a for a in names if a not in arguments]
    if missing:
        raise ToolError(f"{name} is missing argument '{missing[0]}'. Call it as {_signature(name)}.")
    extra = sorted(a for a in arguments if a not in names)
    if extra:
        raise ToolError(f"{name} got unexpected argument '{extra[0]}'. Call it as {_signature(name)}.")
    for arg, json_type, py_type in expected:
        if not isinstance(arguments[arg], py_type):
            raise ToolError(f"argument '{arg}' of {name} must be a JSON {json_type}, "
                            f"got {type(arguments[arg]).__name__}.")
    return dict(arguments)


def _json_cell(value: Any) -> Any:
    """A result cell JSON can show (`scoring.json_cell`: bytes as x'hex', times as HH:MM:SS,
    other non-JSON values such as dates and decimals as their text)."""
    return json_cell(value)


def format_result(result: QueryResult, limits: Limits) -> str:
    """The observation of a successful statement: the affected row count of a write, or the
    row count, column names and rows (JSON arrays, one a line) of a read, with a note on rows
    left out by the row or character limit."""
    if result.rowcount is not None:
        noun = "row" if result.rowcount == 1 else "rows"
        return f"OK: {result.rowcount} {noun} affected."
    total = len(result.rows) + result.more_rows
    count = f"more than {total}" if result.more_rows_capped else str(total)
    lines = [f"{count} {'row' if total == 1 else 'rows'}; columns: {json.dumps(result.columns, ensure_ascii=False)}"]
    budget = limits.max_observation_chars - len(lines[0]) - 200  # room for the note
    shown = 0
    for row in result.rows:
        line = json.dumps(list(row), ensure_ascii=False, default=_json_cell)
        if shown == 0 and len(line) > budget:
            lines.append(line[: max(budget, 0)] + " ...(row cut)")
            shown = 1
            break
        if len(line) + 1 > budget:
            break
        lines.append(line)
        budget -= len(line) + 1
        shown += 1
    left_out = total - shown
    if left_out > 0:
        more = f"more than {left_out}" if result.more_rows_capped else str(left_out)
        lines.append(f"({more} more {'row' if left_out == 1 else 'rows'} not shown: at most "
                     f"{limits.max_rows} rows and {limits.max_observation_chars} characters are shown. "
                     "Narrow the query with WHERE, LIMIT or an aggregate.)")
    return "\n".join(lines)


class DBToolbox:
    """One episode's tools over one database session.

    writable: whether write statements are allowed (the task is INSERT/UPDATE/DELETE).
    num_calls / num_errors: tool calls made / those that returned an `Error:` observation.
    units: knowledge units touched by successful statements.
    committed: the flattened committed answer list, or None before commit_final_answer.
    """

    def __init__(self, session: DBSession, writable: bool, limits: Limits = Limits()) -> None:
        self.session = session
        self.writable = writable
        self.limits = limits
        self.num_calls = 0
        self.num_errors = 0
        self.units: set[str] = set()
        self.committed: list[Any] | None = None
        self.committed_raw: list[Any] | None = None  # as given (rows kept), for result-set tasks
        self._tools: dict[str, Callable[[dict[str, Any]], str]] = {
            "execute_sql": self._execute_sql,
            "commit_final_answer": self._commit_final_answer,
            "list_tables": self._list_tables,
            "describe_table": self._describe_table,
        }

    def call(self, name: str, arguments: Any) -> str:
        """Run tool `name`; returns its observation, or an `Error: ...` observation. Never raises
        on agent input."""
        self.num_calls += 1
        try:
            if not isinstance(name, str) or name not in self._tools:
                raise ToolError(f"unknown tool '{name}'. Available tools: {', '.join(TOOL_ARGUMENTS)}.")
            return valid_text(self._tools[name](check_arguments(name, arguments)))
        except (ToolError, SQLError) as e:
            self.num_errors += 1
            return valid_text(f"Error: {e}")
        except Exception as e:  # a tool must never crash the episode: the agent reads what broke
            self.num_errors += 1
            return valid_text(f"Error: the tool {str(name)[:80]!r} failed: {type(e).__name__}: {str(e)[:500]}")

    # -- tools ---------------------------------------------------------------------------

    def _execute_sql(self, args: dict[str, Any]) -> str:
        statement = self._single_statement(args["query"])
        result = self.session.execute(statement, max_rows=self.limits.max_rows, timeout_s=self.limits.timeout_s)
        self.units.update(result.units)
        return format_result(result, self.limits)

    def _single_statement(self, query: str) -> str:
        """The one statement of `query`, checked against the limits and the allowed kinds."""
        try:
            query.encode("utf-8")
        except UnicodeEncodeError:
            # JSON lets "\ud800" through as a lone surrogate, which no database driver takes.
            raise ToolError("the query is not valid text: it holds a lone UTF-16 surrogate (a \\uD800-style "
                            "escape). Write the characters themselves.") from None
        if len(query) > self.limits.max_query_chars:
            raise ToolError(f"the query is {len(query)} characters long; the limit is "
                            f"{self.limits.max_query_chars}.")
        statements = split_statements(query)
        if len(statements) > 1:
            raise ToolError(f"one SQL statement per call, got {len(statements)}. "
                            "Send each statement in its own execute_sql call.")
        kind, keyword = statement_kind(statements[0]) if statements else (EMPTY, "")
        if kind == EMPTY:
            raise ToolError("the query is empty. Send one SQL statement, e.g. SELECT * FROM t LIMIT 5.")
        allowed = "SELECT, INSERT, UPDATE and DELETE" if self.writable else "SELECT"
        if kind == OTHER:
            raise ToolError(f"{keyword} statements are not allowed; only {allowed} statements are.")
        if kind == WRITE and not self.writable:
            raise ToolError(f"this task is read-only: {keyword} is not allowed, only SELECT statements are.")
        return statements[0]

    def _commit_final_answer(self, args: dict[str, Any]) -> str:
        answers = args["answers"]
        for value in flatten_answers(answers):
            if isinstance(value, (dict, list, tuple)):
                raise ToolError("answers must be a JSON array of values (or of rows of values), "
                                'e.g. {"answers": ["Giza"]} or {"answers": [3]}.')
        self.committed = flatten_answers(answers)
        self.committed_raw = list(answers)
        return "Answer committed."

    def _list_tables(self, args: dict[str, Any]) -> str:
        return "Tables: " + json.dumps(self.session.list_tables(), ensure_ascii=False)

    def _describe_table(self, args: dict[str, Any]) -> str:
        name = self._table_name(args["name"])
        columns = self.session.describe_table(name)
        lines = [f"Table {json.dumps(name, ensure_ascii=False)} has {len(columns)} columns (name, type):"]
        lines += [f"{json.dumps(c, ensure_ascii=False)} {t}" for c, t in columns]
        return "\n".join(lines)

    def _table_name(self, name: str) -> str:
        """The table `name` refers to: exact, else the one table equal to it ignoring case and
        surrounding quotes; ToolError listing the tables otherwise."""
        tables = self.session.list_tables()
        if name in tables:
            return name
        bare = name.strip().strip('"`[]').strip()
        matches = [t for t in tables if t.casefold() == bare.casefold()]
        if len(matches) == 1:
            return matches[0]
        raise ToolError(f"no table named {json.dumps(name, ensure_ascii=False)}. "
                        f"Tables: {json.dumps(tables, ensure_ascii=False)}.")
