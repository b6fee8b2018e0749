"""AgentBench DB tasks (dbbench) as `Task`s for `DBEnv`.

The data is AgentBench's `data/dbbench/{dev,standard}.jsonl`, one self-contained task per line
(see `../shared/data/agentbench_dbbench/README.md`): a description, the table (name, columns
with declared types, rows), a type (one of INSERT, UPDATE, counting, ranking, comparison,
aggregation-SUM/MIN/MAX/AVG, other), a label (the answer values of SELECT-type tasks, the gold
statement of INSERT/UPDATE tasks) and, for SELECT-type tasks, a hint query `sql.query`.

Each record becomes:
    Task.task_id  "dbbench-<split>-<line index, 4 digits>" (stable while the file is unchanged)
    Task.prompt   the description, then AgentBench's sentence naming the table and its headers
    Task.answer   {"values": label, "ordered": bool} or, for writes, {"gold_sql": label}
    Task.meta     {"tables": [TableSpec.to_dict()], "answer_type": type, "gold_sql": the SQL
                  that produces the answer (the hint query, or the gold statement), "source",
                  "split", "answer_md5" (write tasks; AgentBench's MySQL table hash, kept for
                  reference: it is not used for scoring)}
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Iterable, Sequence

from tiderl.envs.db.backend import TableSpec
from tiderl.envs.protocol import Task
from tiderl.envs.setup import data_root

DBBENCH_DIR = "agentbench_dbbench"
SPLITS = ("dev", "standard")

# Types whose answer order is scored. AgentBench compares answer lists without order for every
# type, and no dbbench type asks for an ordered list (ranking questions ask for the top
# item(s)), so none by default.
ORDERED_TYPES: frozenset[str] = frozenset()

_WRITE_TYPES = ("INSERT", "UPDATE", "DELETE")


def dbbench_dir(data_dir: str | Path | None = None) -> Path:
    """The folder holding dev.jsonl / standard.jsonl: `data_dir/agentbench_dbbench`, or
    `data_dir` itself when it holds the files directly; `tiderl.envs.setup.data_root()` when None."""
    root = Path(data_dir) if data_dir is not None else data_root()
    if (root / DBBENCH_DIR).is_dir():
        return root / DBBENCH_DIR
    return root


def record_table(record: dict[str, Any]) -> TableSpec:
    """The table of one dbbench record."""
    table = record["table"]
    info = table["table_info"]
    return TableSpec.from_dict({"name": table["table_name"], "columns": info["columns"], "rows": info["rows"]})


def record_type(record: dict[str, Any]) -> str:
    """The record's answer type (its `type` field is a one-element list)."""
    kind = record.get("type")
    if isinstance(kind, list):
        kind = kind[0] if kind else ""
    return str(kind or "")


def task_from_record(record: dict[str, Any], task_id: str, split: str,
                     ordered_types: Iterable[str] = ORDERED_TYPES) -> Task:
    """One dbbench record as a Task (see the module docstring for the fields)."""
    kind = record_type(record)
    label = list(record["label"])
    prompt = record["description"].strip()
    if record.get("add_description"):
        prompt += "\n" + record["add_description"].strip()
    meta: dict[str, Any] = {
        "tables": [record_table(record).to_dict()],
        "answer_type": kind,
        "source": record.get("source", ""),
        "split": split,
    }
    if kind.upper() in _WRITE_TYPES:
        gold_sql = ";\n".join(s.strip().rstrip(";") for s in label)
        answer: dict[str, Any] = {"gold_sql": gold_sql}
        meta["gold_sql"] = gold_sql
        meta["answer_md5"] = record.get("answer_md5", "")
    else:
        answer = {"values": label, "ordered": kind in set(ordered_types)}
        meta["gold_sql"] = (record.get("sql") or {}).get("query", "")
    return Task(task_id=task_id, prompt=prompt, answer=answer, meta=meta)


def load_dbbench_tasks(data_dir: str | Path | None = None, split: str = "dev",
                       types: Iterable[str] | None = None, limit: int | None = None,
                       ordered_types: Iterable[str] = ORDERED_TYPES) -> list[Task]:
    """The tasks of one dbbench split, in file order.

    data_dir: the data root holding `agentbench_dbbench/` (or that folder itself); None means
        `tiderl.envs.setup.data_root()`.
    types: keep only these answer types (e.g. {"INSERT", "UPDATE"}); None keeps all.
    limit: keep at most this many (after filtering).
    Raises FileNotFoundError naming the path and the fix when the split file is missing.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown dbbench split {split!r}; use one of {', '.join(SPLITS)}")
    path = dbbench_dir(data_dir) / f"{split}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: point data_dir (or $TIDERL_DATA_DIR) at the folder holding "
                                f"{DBBENCH_DIR}/ (AgentBench's data/dbbench files)")
    keep = None if types is None else set(types)
    tasks = []
    with path.open(encoding="utf-8") as lines:
        for index, line in enumerate(lines):
            if not line.strip():
                continue
            record = json.loads(line)
            if keep is not None and record_type(record) not in keep:
                continue
            tasks.append(task_from_record(record, f"dbbench-{split}-{index:04d}", split, ordered_types))
            if limit is not None and len(tasks) >= limit:
                break
    return tasks


def answer_md5(task: Task) -> str | None:
    """The 32-hex-digit table hash AgentBench stored for a write task (its `answer_md5` field,
    written as a Python repr of a MySQL result such as "[('09aa...',)]"), or None."""
    match = re.search(r"[0-9a-f]{32}", str(task.meta.get("answer_md5") or ""))
    return match.group(0) if match else None


def agentbench_table_md5(rows: Iterable[Sequence[Any]]) -> str:
    """AgentBench's MySQL table hash, recomputed in Python: for each row, the first five hex
    digits of the md5 of its non-NULL values joined by commas; those sorted and joined by
    commas; the md5 of that.

    Values are rendered with Python's str(). MySQL renders DECIMAL, FLOAT, DATE and TIME
    columns its own way, and compares strings case- and trailing-space-insensitively, so only
    tables of text and integer columns reproduce reliably. A diagnostic for the gold tables;
    scoring uses `rows_hash`.
    """
    prefixes = sorted(
        hashlib.md5(",".join(str(v) for v in row if v is not None).encode("utf-8")).hexdigest()[:5]
        for row in rows
    )
    return hashlib.md5(",".join(prefixes).encode("utf-8")).hexdigest()
