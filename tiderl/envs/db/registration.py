"""The SQL database environment as `env.name` finds it: its options, data sources and
`tiderl eval` shortcuts (`tiderl.envs.registration`). Imports nothing heavy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tiderl.envs.registration import BuiltinEnvironment, EvalFlag, check_drift
from tiderl.options import need, opt, section

# data.source values: AgentBench DB (the default), questions over your own database file, or the
# generated shop database (the embedded tiny model's; tiderl/envs/db/shop.py).
SOURCES = ("agentbench_db", "db_file", "shop")


@dataclass
class DBDriftOptions:
    """A database whose rows change during training (online learning; tiderl/envs/db/drift.py,
    docs/online.md): data.source=db_file on a SQLite or DuckDB file, on the local or the Ray backend."""

    every_steps: int = opt(0, "Optimizer steps between two changes of the rows (0 = no drift).")
    fraction: float = opt(0.2, "Share of each table's rows one change gives a new value (in one column outside "
                          "the primary key, taken from another row).")


@dataclass
class DBOptions:
    """The database environment's options (`env.options.*` with this environment)."""

    backend: str = opt("sqlite", "data.source=agentbench_db: where the task databases live: 'sqlite', "
                       "'duckdb' or an SQLAlchemy URL (a server; evaluated one task at a time).")
    timeout_s: float = opt(2.0, "Statement timeout in seconds.")
    db_path: str = opt("", "data.source=db_file: an existing SQLite or DuckDB database file, or a PostgreSQL/"
                       "MariaDB/MySQL URL (opened read-only; write tasks run on a scratch copy).")
    questions: str = opt("", "data.source=db_file: questions file, JSON lines of {question, sql or "
                         "answer} (docs/env_db.md); data.train_files / data.eval_files take files of the same "
                         "form for training / evaluation.")
    max_sessions: int = opt(32, "A server database (db_path is a URL): episodes open on it at once, one connection "
                            "each; more wait for a free one (keep rollout episodes in flight at or under it).")
    pool_size: int = opt(-1, "A server database: idle connections kept for later episodes, reset between them "
                         "(-1 = max_sessions, 0 = a new connection per episode).")
    drift: DBDriftOptions = section(DBDriftOptions, "The rows change every drift.every_steps steps (online "
                                    "learning).")

    def check(self, cfg: Any) -> None:
        need(self.timeout_s > 0, "timeout_s", "must be > 0", "use 2.0")
        need(self.max_sessions >= 1, "max_sessions", f"is {self.max_sessions}", "use 32 (at least 1)")
        need(-1 <= self.pool_size <= self.max_sessions, "pool_size",
             f"is {self.pool_size}, not between -1 and max_sessions ({self.max_sessions})",
             "use -1 (as many as max_sessions) or 0 (no reuse)")
        data = getattr(cfg, "data", None)
        if data is not None and (data.train_files or data.eval_files):
            need(data.source == "db_file", "data.train_files",
                 f"question files need a database, and data.source is {data.source or 'agentbench_db'}",
                 "add data.source=db_file env.options.db_path=<your .sqlite/.duckdb file or server URL>")
        check_drift(self.drift, cfg, "a drifting database")
        if self.drift.every_steps > 0:
            need(data is None or data.source in ("db_file", "shop"), "drift.every_steps",
                 f"a drifting database is a copy of your database file, and data.source is "
                 f"{getattr(data, 'source', '') or 'agentbench_db'}",
                 "use data.source=db_file env.options.db_path=<a .sqlite/.duckdb file> (or data.source=shop), or "
                 "drift.every_steps=0")
            need("://" not in self.db_path, "drift.every_steps",
                 "a server database (env.options.db_path is a URL) is opened read-only and cannot change",
                 "use a SQLite or DuckDB file, or env.options.drift.every_steps=0")
        if data is not None:
            need(not data.fields, "data.fields", "the DB environment's question files have fixed field names",
                 "name the fields question, sql (or answer), id, type (docs/env_db.md)")


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
    warm_start_path="tiderl.envs.db.shop:WARM_START",
    task_files=True,
    former_keys={"env.db_backend": "backend", "env.db_timeout_s": "timeout_s", "data.db_path": "db_path",
                 "data.questions": "questions"},
)
