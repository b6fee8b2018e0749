"""A scripted oracle for DB tasks, and the environment's ceiling it measures.

The oracle replays the SQL the task record carries (`task.meta["gold_sql"]`: AgentBench's hint
query for SELECT-type tasks, the gold statement for write tasks) through `execute_sql`, then
commits: the cells of the query's result for a SELECT-type task (computed beforehand on a
fresh copy of the database), an empty list for a write task. Its turns are Hermes
`<tool_call>` texts, so they can be played through the agent loop (`ScriptedEngine`) or
parsed and stepped directly (`replay_turns`).

The oracle succeeds exactly where the record's SQL reproduces the gold answer on the backend:
that fraction is the environment's ceiling (AgentBench's hint queries are often MySQL-flavoured
or wrong; see docs/env_db.md for the measured figures).
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any, Callable

from tiderl.envs.db.backend import Backend, SQLError, specs_from_meta
from tiderl.envs.db.env import DBEnv, default_backend, is_write_task, resolve_gold_write, task_tables
from tiderl.envs.db.scoring import json_cell
from tiderl.envs.db.sql_text import quote_identifier, split_statements
from tiderl.envs.db.tasks import agentbench_table_md5, answer_md5
from tiderl.envs.protocol import Action, StepResult, Task

# Rows the oracle reads when it computes a gold query's answer (far above any dbbench table).
_ORACLE_MAX_ROWS = 100_000


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """One Hermes-format tool call: `<tool_call>\\n{json}\\n</tool_call>`, name first; non-ASCII
    text written as it is (not \\u-escaped), so it reads like the task's own text."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


def gold_query_cells(task: Task, backend: Backend | None = None, timeout_s: float = 10.0) -> list[Any]:
    """The cells (row by row) of the last statement of `task.meta["gold_sql"]`, run on a fresh
    read-only session. Raises SQLError when the SQL is missing or fails on the backend."""
    statements = split_statements(str(task.meta.get("gold_sql") or ""))
    if not statements:
        raise SQLError(f"task {task.task_id} has no gold SQL")
    backend = backend or default_backend()
    session = backend.open(task_tables(task, backend), writable=False)
    try:
        result = None
        for statement in statements:
            result = session.execute(statement, max_rows=_ORACLE_MAX_ROWS, timeout_s=timeout_s)
        assert result is not None
        if isinstance(task.answer, dict) and "rows" in task.answer:  # a result-set task: rows as rows
            return [[json_cell(v) for v in row] for row in result.rows]
        return [json_cell(v) for row in result.rows for v in row]
    finally:
        session.close()


def oracle_turns(task: Task, backend: Backend | None = None) -> list[str]:
    """Assistant turns that replay the record's SQL and commit the answer, one tool call a turn:
    one `execute_sql` per statement of `task.meta["gold_sql"]` (for write tasks in the form
    `resolve_gold_write` found to run), then `commit_final_answer` with the last statement's
    result cells (SELECT-type; an empty list when the SQL fails or is missing) or an empty
    list (write tasks)."""
    gold_sql = str(task.meta.get("gold_sql") or "")
    if is_write_task(task) and gold_sql:
        try:  # the form of the gold statement that runs on this backend
            backend = backend or default_backend()
            gold_sql = resolve_gold_write(backend, task_tables(task, backend), gold_sql)[0]
        except SQLError:
            pass
    statements = split_statements(gold_sql)
    turns = [tool_call_text("execute_sql", {"query": s}) for s in statements]
    answers: list[Any] = []
    if not is_write_task(task) and statements:
        try:
            answers = gold_query_cells(task, backend)
        except SQLError:
            answers = []
    if not statements and isinstance(task.answer, dict) and "rows" in task.answer:
        answers = [list(row) for row in task.answer["rows"]]  # a question given with its answer only
    turns.append(tool_call_text("commit_final_answer", {"answers": answers}))
    return turns


def replay_turns(env: DBEnv, task: Task, turns: list[str],
                 parse: Callable[[str], Action] | None = None) -> StepResult:
    """Play assistant turns through `env` (reset, then one `step` per turn, parsed with the
    Hermes parser unless `parse` is given) and return the final StepResult; when the turns run
    out before the episode ends, `env.finish("max_turns")`."""
    if parse is None:
        from tiderl.agent.tool_parser import parse_hermes_tool_calls as parse
    env.reset(task)
    for turn in turns:
        result = env.step(parse(turn))
        if result.done:
            return result
    return env.finish("max_turns")


def oracle_ceiling(tasks: list[Task], make_env: Callable[[], DBEnv] = DBEnv,
                   backend: Backend | None = None) -> dict[str, Any]:
    """Replay the oracle on every task; returns {"n", "success" (fraction), "by_type":
    {type: [successes, n]}, "failed": [task ids]}."""
    by_type: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    failed = []
    for task in tasks:
        env = make_env()
        result = replay_turns(env, task, oracle_turns(task, backend or env.backend))
        kind = str(task.meta.get("answer_type", ""))
        by_type[kind][0] += int(result.info["success"])
        by_type[kind][1] += 1
        if not result.info["success"]:
            failed.append(task.task_id)
    n = len(tasks)
    return {
        "n": n,
        "success": (n - len(failed)) / n if n else 0.0,
        "by_type": dict(sorted(by_type.items())),
        "failed": failed,
    }


def gold_matches_answer_md5(task: Task, backend: Backend | None = None) -> bool | None:
    """Whether the task table after the gold statement (run as `resolve_gold_write` runs it)
    hashes to AgentBench's `answer_md5` (`agentbench_table_md5`); None for tasks without one.
    Checks that the environment's gold table is the one AgentBench scored against."""
    expected = answer_md5(task)
    if expected is None or not is_write_task(task):
        return None
    backend = backend or default_backend()
    tables = specs_from_meta(task.meta)
    try:
        gold_sql = resolve_gold_write(backend, tables, str(task.meta.get("gold_sql") or ""))[0]
    except SQLError:
        return False
    session = backend.open(tables, writable=True)
    try:
        for statement in split_statements(gold_sql):
            session.execute(statement, max_rows=0, timeout_s=10.0)
        rows = session.execute(f"SELECT * FROM {_quoted_for(backend, tables[0].name)}",
                               max_rows=_ORACLE_MAX_ROWS, timeout_s=10.0).rows
    finally:
        session.close()
    return agentbench_table_md5(rows) == expected


def _quoted_for(backend: Backend, name: str) -> str:
    """A table name quoted for the backend's SQL: backticks on MySQL/MariaDB (a SQLAlchemy URL
    or a server backend), double quotes elsewhere."""
    engine = getattr(backend, "engine", None)
    dialect = getattr(getattr(engine, "dialect", None), "name", None) or getattr(backend, "dialect", "")
    if dialect in ("mysql", "mariadb"):
        return "`" + name.replace("`", "``") + "`"
    return quote_identifier(name)
