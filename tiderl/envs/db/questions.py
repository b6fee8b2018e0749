"""Questions over a database the user already has (the BIRD / Spider / GeoQuery shape).

A questions file is JSON lines, one question per line:

    {"question": "How many singers are there?", "sql": "SELECT count(*) FROM singer"}
    {"id": "q7", "question": "Which country ...?", "answer": [["France"]]}
    {"question": "Remove the singers born before 1950.", "type": "DELETE",
     "sql": "DELETE FROM singer WHERE birth_year < 1950"}

Fields: `question` (required; `text` also works); the gold SQL as `sql` (also `gold_sql`,
`query`, `SQL`) and/or a gold `answer` (rows as nested arrays, or a flat list for a one-column
result); `id` (also `question_id`; default `q<line>`); `type` (`INSERT`, `UPDATE` or `DELETE`
make a write task scored by the tables' hash after the gold statement, run on a scratch copy;
anything else is a question); `ordered` (with an `answer` and no SQL: whether row order counts).

The gold answer of a question is the result of its gold SQL on the database (run read-only at
load time), and order counts only when that SQL has a top-level ORDER BY; a given `answer` is
used only when there is no SQL. Answers are compared as result sets (`result_sets_match`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tiderl.envs.db.backend import Backend, SQLError
from tiderl.envs.db.scoring import json_cell
from tiderl.envs.db.sql_text import has_top_level_order_by, split_statements
from tiderl.envs.protocol import Task

_SQL_KEYS = ("sql", "gold_sql", "query", "SQL")
_WRITE_TYPES = {"INSERT", "UPDATE", "DELETE"}
# Rows of a gold result kept (a question whose gold result is longer is refused).
MAX_GOLD_ROWS = 100_000


def _gold_sql(record: dict[str, Any]) -> str:
    for key in _SQL_KEYS:
        if isinstance(record.get(key), str) and record[key].strip():
            return record[key].strip()
    return ""


def gold_rows(backend: Backend, sql: str, timeout_s: float = 30.0) -> list[list[Any]]:
    """The result rows of `sql` (its last statement) on a read-only session, as JSON cells.
    Raises SQLError when it fails or returns more than MAX_GOLD_ROWS rows."""
    session = backend.open([], False)
    try:
        result = None
        for statement in split_statements(sql):
            result = session.execute(statement, max_rows=MAX_GOLD_ROWS, timeout_s=timeout_s)
        if result is None:
            raise SQLError("the gold SQL is empty")
        if result.more_rows:
            raise SQLError(f"the gold result has more than {MAX_GOLD_ROWS} rows")
        return [[json_cell(v) for v in row] for row in result.rows]
    finally:
        session.close()


def gold_answer(backend: Backend, sql: str) -> dict[str, Any]:
    """A question's gold answer on `backend`: the rows of its gold SQL (`gold_rows`), and whether
    their order counts (the last statement has a top-level ORDER BY). Raises SQLError as
    `gold_rows` does."""
    return {"rows": gold_rows(backend, sql), "ordered": has_top_level_order_by(split_statements(sql)[-1])}


def load_questions(path: str | Path, backend: Backend, database: str = "") -> list[Task]:
    """The questions of a JSONL file as Tasks on `backend` (a database file backend).

    Raises FileNotFoundError / ValueError naming the line and the fix on a missing file, a
    malformed line, a line without question or gold, or gold SQL that fails on the database.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"questions file {path} not found. Fix: pass a JSONL file with one "
                                '{"question": ..., "sql": ...} object per line.')
    tasks = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not a JSON object ({exc}). Fix: one JSON object per line.") from None
            if not isinstance(record, dict):
                raise ValueError(f"{where}: not a JSON object. Fix: one JSON object per line.")
            tasks.append(_task(record, where, number, backend, database))
    if not tasks:
        raise ValueError(f"{path} holds no questions. Fix: one JSON object per line.")
    ids = [t.task_id for t in tasks]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise ValueError(f"{path}: question id {dup!r} appears twice. Fix: give each question its own id.")
    return tasks


def _task(record: dict[str, Any], where: str, number: int, backend: Backend, database: str) -> Task:
    question = record.get("question", record.get("text"))
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"{where}: no 'question' text. Fix: add \"question\": \"...\".")
    task_id = str(record.get("id", record.get("question_id", f"q{number:05d}")))
    kind = str(record.get("type") or "question")
    sql = _gold_sql(record)
    meta: dict[str, Any] = {"answer_type": kind, "gold_sql": sql, "database": database}
    if kind.upper() in _WRITE_TYPES:
        if not sql:
            raise ValueError(f"{where}: a {kind} task needs its gold statement in 'sql'.")
        return Task(task_id=task_id, prompt=question.strip(), answer={"gold_sql": sql}, meta=meta)
    if sql:
        try:
            answer = gold_answer(backend, sql)
        except SQLError as exc:
            raise ValueError(f"{where}: the gold SQL fails on the database: {exc}. Fix: correct the SQL "
                             "(it must run on this database as written).") from None
    elif "answer" in record and isinstance(record["answer"], list):
        given = record["answer"]
        rows = [list(r) if isinstance(r, (list, tuple)) else [r] for r in given]
        answer = {"rows": rows, "ordered": bool(record.get("ordered", False))}
    else:
        raise ValueError(f"{where}: no gold SQL ('sql') and no gold 'answer' list. Fix: add one of them.")
    return Task(task_id=task_id, prompt=question.strip(), answer=answer, meta=meta)
