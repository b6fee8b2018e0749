"""The SQL database environment as `env.name` finds it: its options, data sources and
`tiderl eval` shortcuts (`tiderl.envs.registration`). Imports nothing heavy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tiderl.envs.registration import BuiltinEnvironment, EvalFlag
from tiderl.options import need, opt

# data.source values: AgentBench DB (the default), or questions over your own database file.
SOURCES = ("agentbench_db", "db_file")


@dataclass
class DBOptions:
    """The database environment's options (`env.options.*` with this environment)."""

    backend: str = opt("sqlite", "data.source=agentbench_db: where the task databases live: 'sqlite', "
                       "'duckdb' or an SQLAlchemy URL (a server; evaluated one task at a time).")
    timeout_s: float = opt(2.0, "Statement timeout in seconds.")
    db_path: str = opt("", "data.source=db_file: an existing SQLite or DuckDB database file, or a PostgreSQL/"
                       "MariaDB/MySQL URL (opened read-only; write tasks run on a scratch copy).")
    questions: str = opt("", "data.source=db_file: questions file, JSON lines of {question, sql or "
                         "answer} (docs/env_db.md).")

    def check(self, cfg: Any) -> None:
        need(self.timeout_s > 0, "timeout_s", "must be > 0", "use 2.0")


ENVIRONMENT = BuiltinEnvironment(
    setup_path="tiderl.envs.db.setup:setup",
    Options=DBOptions,
    sources=SOURCES,
    eval_flags=(
        EvalFlag("--db", ("data.source=db_file", "env.options.db_path={}"),
                 "shortcut for data.source=db_file env.options.db_path=... (an existing SQLite/DuckDB file or "
                 "a postgresql:// / mysql:// URL, read-only; with --env db)"),
        EvalFlag("--questions", ("env.options.questions={}",),
                 "shortcut for env.options.questions=... (JSONL questions on --db)"),
    ),
    former_keys={"env.db_backend": "backend", "env.db_timeout_s": "timeout_s", "data.db_path": "db_path",
                 "data.questions": "questions"},
)
