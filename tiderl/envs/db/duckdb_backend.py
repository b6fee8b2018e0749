"""The DuckDB backend (needs the `duckdb` package).

Column types: DuckDB is strictly typed, so each column gets a portable type (`portable_column`:
integer, real or text, by the declared type and whether every cell converts).

Isolation: read-only sessions open the task's database file (built once under `cache_dir`,
atomically) with `read_only=True`; writable sessions build a fresh in-memory database from the
specs, which is the per-episode scratch copy. Every connection runs with external access off
(no files, no ATTACH, no COPY, no extension install/load) and its configuration locked, so a
statement cannot turn those back on. A timer interrupts statements past their time limit.

Knowledge units come from `referenced_units` (a conservative reading of the SQL text): DuckDB
has no authorizer hook.
"""

from __future__ import annotations

import os
import tempfile
import threading
import uuid
from pathlib import Path
from typing import Any, Sequence

from tiderl.envs.db.backend import (
    QueryResult,
    SQLError,
    TableSpec,
    fetch_limited,
    portable_table,
    rows_hash,
    spec_digest,
)
from tiderl.envs.db.sql_text import WRITE, quote_identifier, referenced_units, statement_kind

_DUCK_TYPES = {"integer": "BIGINT", "real": "DOUBLE", "text": "VARCHAR"}

# Applied to every connection; `lock_configuration` comes last so nothing can undo the others.
_LOCKED_CONFIG = {
    "enable_external_access": False,
    "autoinstall_known_extensions": False,
    "autoload_known_extensions": False,
    "threads": 1,
    "lock_configuration": True,
}


def _import_duckdb() -> Any:
    try:
        import duckdb
    except ImportError:
        raise ImportError("the duckdb backend needs the duckdb package: pip install duckdb") from None
    return duckdb


def _create_tables(conn: Any, tables: Sequence[TableSpec]) -> None:
    for spec in tables:
        columns, rows = portable_table(spec)
        ddl = ", ".join(f"{quote_identifier(c)} {_DUCK_TYPES[k]}" for c, k in columns)
        conn.execute(f"CREATE TABLE {quote_identifier(spec.name)} ({ddl})")
        if rows:
            marks = ", ".join("?" for _ in columns)
            conn.executemany(f"INSERT INTO {quote_identifier(spec.name)} VALUES ({marks})", rows)


class DuckDBBackend:
    """DuckDB task databases: files under `cache_dir` (a private temporary directory when None)
    for read-only sessions, in-memory copies for writable ones."""

    name = "duckdb"

    def __init__(self, cache_dir: str | Path | None = None) -> None:
        self._duckdb = _import_duckdb()
        self._tmp = None
        if cache_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="tiderl-duckdb-")
            cache_dir = self._tmp.name
        self.cache_dir = Path(cache_dir)
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        self._build_lock = threading.Lock()

    def source_path(self, tables: Sequence[TableSpec]) -> Path:
        """The task's database file, built on first use (to a temporary name, then renamed)."""
        path = self.cache_dir / f"{spec_digest(tables)[:32]}.duckdb"
        with self._build_lock:
            if not path.exists():
                tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
                conn = self._duckdb.connect(str(tmp), config={"threads": 1})
                try:
                    _create_tables(conn, tables)
                    conn.execute("CHECKPOINT")
                finally:
                    conn.close()
                os.replace(tmp, path)
        return path

    def open(self, tables: Sequence[TableSpec], writable: bool) -> "DuckDBSession":
        if writable:
            conn = self._duckdb.connect(":memory:", config={"threads": 1})
            _create_tables(conn, tables)
            # Lock down only after building: external access off, configuration frozen.
            for key, value in _LOCKED_CONFIG.items():
                conn.execute(f"SET {key} = {str(value).lower() if isinstance(value, bool) else value}")
        else:
            conn = self._duckdb.connect(str(self.source_path(tables)), read_only=True, config=dict(_LOCKED_CONFIG))
        return DuckDBSession(conn, tables, self._duckdb.Error)


class DuckDBSession:
    """One episode's DuckDB connection."""

    def __init__(self, conn: Any, tables: Sequence[TableSpec], error_type: type) -> None:
        self._conn = conn
        self._tables = list(tables)
        self._error = error_type

    def execute(self, sql: str, *, max_rows: int, timeout_s: float) -> QueryResult:
        """Run one statement; a timer interrupts it after `timeout_s`."""
        timer = threading.Timer(timeout_s, self._conn.interrupt)
        timer.start()
        try:
            if len(self._conn.extract_statements(sql)) != 1:
                raise SQLError("only one SQL statement per call")
            self._conn.execute(sql)
            description = self._conn.description
            if statement_kind(sql)[0] == WRITE:
                counts = self._conn.fetchall()
                result = QueryResult([], [], rowcount=int(counts[0][0]) if counts else 0)
            else:
                rows, more, capped = fetch_limited(self._conn.fetchmany, max_rows)
                result = QueryResult([d[0] for d in description or []], rows, more, capped)
        except (self._error, TypeError, ValueError) as exc:  # TypeError: text the binding cannot pass
            interrupted = "interrupt" in type(exc).__name__.lower() or "Interrupted" in str(exc)
            message = (f"the statement ran longer than the {timeout_s:g} s limit and was stopped"
                       if interrupted else str(exc))
            raise SQLError(message) from None
        finally:
            timer.cancel()
        result.units = frozenset(referenced_units(sql, {t.name: t.column_names for t in self._tables}))
        return result

    def list_tables(self) -> list[str]:
        rows = self._conn.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = 'main' ORDER BY table_name"
        ).fetchall()
        return [r[0] for r in rows]

    def describe_table(self, name: str) -> list[tuple[str, str]]:
        if name not in self.list_tables():
            raise SQLError(f"no table named {name!r}")
        rows = self._conn.execute(
            "SELECT column_name, data_type FROM information_schema.columns "
            "WHERE table_schema = 'main' AND table_name = ? ORDER BY ordinal_position", [name]
        ).fetchall()
        return [(r[0], r[1]) for r in rows]

    def table_hash(self, name: str) -> str:
        if name not in self.list_tables():
            raise SQLError(f"no table named {name!r}")
        return rows_hash(self._conn.execute(f"SELECT * FROM {quote_identifier(name)}").fetchall())

    def close(self) -> None:
        self._conn.close()
