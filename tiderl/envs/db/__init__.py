"""SQL database environment: AgentBench DB-style tools, pluggable backends (SQLite by default,
DuckDB, any SQLAlchemy URL), safe per-episode databases, scoring, tasks and an oracle."""

from tiderl.envs.db.backend import (
    Backend,
    DBSession,
    QueryResult,
    SQLError,
    TableSpec,
    database_hash,
    rows_hash,
    specs_from_meta,
)
from tiderl.envs.db.env import (
    DEFAULT_SYSTEM_PROMPT,
    TOOL_SCHEMAS,
    WRITE_TYPES,
    DBEnv,
    default_backend,
    gold_database_hash,
    is_write_task,
    make_backend,
    resolve_gold_write,
)
from tiderl.envs.db.oracle import gold_query_cells, oracle_ceiling, oracle_turns, replay_turns, tool_call_text
from tiderl.envs.db.scoring import answers_match, values_match
from tiderl.envs.db.sqlite_backend import SQLiteBackend
from tiderl.envs.db.tasks import ORDERED_TYPES, dbbench_dir, load_dbbench_tasks, task_from_record
from tiderl.envs.db.tools import TOOL_ARGUMENTS, DBToolbox, Limits

__all__ = [
    "Backend",
    "DBEnv",
    "DBSession",
    "DBToolbox",
    "DEFAULT_SYSTEM_PROMPT",
    "Limits",
    "ORDERED_TYPES",
    "QueryResult",
    "SQLError",
    "SQLiteBackend",
    "TOOL_ARGUMENTS",
    "TOOL_SCHEMAS",
    "TableSpec",
    "WRITE_TYPES",
    "answers_match",
    "database_hash",
    "dbbench_dir",
    "default_backend",
    "gold_database_hash",
    "gold_query_cells",
    "is_write_task",
    "load_dbbench_tasks",
    "make_backend",
    "oracle_ceiling",
    "oracle_turns",
    "replay_turns",
    "resolve_gold_write",
    "rows_hash",
    "specs_from_meta",
    "task_from_record",
    "tool_call_text",
    "values_match",
]
