"""The SQLite backend (stdlib `sqlite3`), the default.

Each task's database is built once into a file under the backend's cache directory (named by
the digest of its table specs, written to a temporary name and renamed into place, then made
read-only on disk). Sessions never open that file for writing:

- read-only sessions (SELECT tasks) open it with the `file:...?mode=ro` URI;
- writable sessions (INSERT/UPDATE/DELETE tasks) open it read-only, copy it into a private
  in-memory database with SQLite's backup API, and close it: the episode writes to the copy.

On top of that, an authorizer callback allows only what a task needs: reading (SELECT, READ,
recursive CTEs, ordinary functions) and, in writable sessions only, INSERT/UPDATE/DELETE on
the task's own tables in the main schema. DDL, ATTACH/DETACH (which also stops VACUUM INTO),
PRAGMA, transactions and savepoints, and `load_extension` are refused. Extension loading is
also off at the connection level (the stdlib default), blobs and strings are capped by
`SQLITE_LIMIT_LENGTH`, and a progress handler interrupts statements that run past their time
limit.

The progress handler runs only between virtual-machine instructions, so one instruction that
loops inside a function (`printf('%.*c', 2000000000, 'x')` runs 3-6 s whatever the limit)
escapes it: by default (`isolate=True`) sessions therefore run in a worker process that is
killed when a statement overruns (`worker.py`), which makes the limit hold for any statement.

`SQLiteFileBackend` opens a database file the user already has: read-only and immutable
(`file:...?mode=ro&immutable=1`: SQLite neither writes nor locks the file), and for write
tasks a private in-memory copy made with the backup API. The file itself is never written.

The authorizer also reports which tables and columns a statement reads or writes (SQLITE_READ
carries table and column; an empty column means the table was used without reading a column,
e.g. `COUNT(*)`); those become the statement's knowledge units. Prepared statements are not
cached (`cached_statements=0`) so the authorizer sees every statement.
"""

from __future__ import annotations

import os
import sqlite3
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Sequence

from tiderl.envs.db.backend import (
    MAX_VALUE_BYTES,
    QueryResult,
    SQLError,
    TableSpec,
    fetch_limited,
    rows_hash,
    spec_digest,
    sqlite_column_type,
    units_for,
)
from tiderl.envs.db.sql_text import quote_identifier
from tiderl.envs.db.worker import BackendSpec, IsolatedSession, timeout_message

# Functions an agent may never call, whatever the build of SQLite offers.
DENIED_FUNCTIONS = frozenset({"load_extension", "fts3_tokenizer", "readfile", "writefile", "edit"})

# How often (in SQLite virtual-machine instructions) the progress handler checks the clock.
_PROGRESS_STEPS = 1_000

_OK, _DENY = sqlite3.SQLITE_OK, sqlite3.SQLITE_DENY
_ALWAYS_ALLOWED = {sqlite3.SQLITE_SELECT, getattr(sqlite3, "SQLITE_RECURSIVE", 33)}
_WRITES = {sqlite3.SQLITE_INSERT, sqlite3.SQLITE_UPDATE, sqlite3.SQLITE_DELETE}


def build_sqlite_file(tables: Sequence[TableSpec], path: Path) -> None:
    """Write a new SQLite database holding `tables` to `path` (atomically: a temporary file in
    the same directory is renamed into place, so readers never see a half-built file), and make
    the file read-only on disk."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    conn = sqlite3.connect(tmp)
    try:
        for spec in tables:
            columns = ", ".join(f"{quote_identifier(c)} {sqlite_column_type(t)}" for c, t in spec.columns)
            conn.execute(f"CREATE TABLE {quote_identifier(spec.name)} ({columns})")
            marks = ", ".join("?" for _ in spec.columns)
            conn.executemany(f"INSERT INTO {quote_identifier(spec.name)} VALUES ({marks})", spec.rows)
        conn.commit()
    finally:
        conn.close()
    os.chmod(tmp, 0o444)
    os.replace(tmp, path)


class SQLiteBackend:
    """SQLite task databases as files under `cache_dir` (a private temporary directory, removed
    with the backend, when None). One backend may serve many env instances and threads.
    isolate: run each session in a worker process killed on overrun (see the module docstring);
        False runs it in this process, where the time limit holds only between instructions."""

    name = "sqlite"

    def __init__(self, cache_dir: str | Path | None = None, isolate: bool = True) -> None:
        self.isolate = isolate
        self._tmp = None
        if cache_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="tiderl-db-")
            cache_dir = self._tmp.name
        self.cache_dir = Path(cache_dir)
        self.cache_dir.mkdir(parents=True, exist_ok=True)

    def source_path(self, tables: Sequence[TableSpec]) -> Path:
        """The read-only database file of `tables`, built on first use."""
        path = self.cache_dir / f"{spec_digest(tables)[:32]}.sqlite"
        if not path.exists():
            build_sqlite_file(tables, path)
        return path

    def open(self, tables: Sequence[TableSpec], writable: bool) -> "SQLiteSession":
        """A session on the task database: the read-only file itself, or a private in-memory
        copy of it when `writable`."""
        if self.isolate:
            self.source_path(tables)  # built here, once, so workers only open it
            spec = BackendSpec(f"{__name__}:SQLiteBackend", (("cache_dir", str(self.cache_dir)),))
            return IsolatedSession(spec, tables, writable)  # type: ignore[return-value]
        source = sqlite3.connect(self.source_path(tables).as_uri() + "?mode=ro", uri=True,
                                 isolation_level=None, cached_statements=0, check_same_thread=False)
        if not writable:
            return SQLiteSession(source, tables, writable=False)
        copy = sqlite3.connect(":memory:", isolation_level=None, cached_statements=0, check_same_thread=False)
        try:
            source.backup(copy)
        finally:
            source.close()
        return SQLiteSession(copy, tables, writable=True)


class SQLiteSession:
    """One episode's SQLite connection, guarded by the authorizer (see the module docstring)."""

    def __init__(self, conn: sqlite3.Connection, tables: Sequence[TableSpec], writable: bool) -> None:
        self._conn = conn
        self._tables = list(tables)
        self._writable = writable
        self._guarded = False  # the authorizer checks only the agent's statements
        self._touched: list[tuple[str, str | None]] = []
        self._refusal = ""
        conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, MAX_VALUE_BYTES)
        conn.set_authorizer(self._authorize)

    # -- the agent's statements ----------------------------------------------------------

    def execute(self, sql: str, *, max_rows: int, timeout_s: float) -> QueryResult:
        """Run one statement under the authorizer and the time limit."""
        self._touched, self._refusal = [], ""
        deadline = time.monotonic() + timeout_s
        self._conn.set_progress_handler(lambda: int(time.monotonic() > deadline), _PROGRESS_STEPS)
        self._guarded = True
        try:
            cursor = self._conn.execute(sql)
            if cursor.description is None:
                result = QueryResult([], [], rowcount=max(cursor.rowcount, 0))
            else:
                rows, more, capped = fetch_limited(cursor.fetchmany, max_rows)
                result = QueryResult([d[0] for d in cursor.description], rows, more, capped)
        except (sqlite3.Error, ValueError) as exc:  # ValueError: text the driver cannot encode
            raise SQLError(self._explain(exc, timeout_s)) from None
        finally:
            self._guarded = False
            self._conn.set_progress_handler(None, 0)
        result.units = units_for(self._tables, self._touched)
        return result

    def _authorize(self, action: int, arg1: Any, arg2: Any, db: Any, trigger: Any) -> int:
        if not self._guarded or action in _ALWAYS_ALLOWED:
            return _OK
        if action == sqlite3.SQLITE_READ:
            self._touched.append((arg1, arg2))
            return _OK
        if action == sqlite3.SQLITE_FUNCTION:
            if str(arg2).lower() in DENIED_FUNCTIONS:
                self._refusal = f"function {arg2}() is not allowed"
                return _DENY
            return _OK
        if action in _WRITES:
            if not self._writable:
                self._refusal = "this task is read-only: only SELECT statements are allowed"
                return _DENY
            if db == "main" and not str(arg1).lower().startswith("sqlite_") and self._is_task_table(arg1):
                self._touched.append((arg1, arg2 if action == sqlite3.SQLITE_UPDATE else None))
                return _OK
        self._refusal = ("only SELECT, and in write tasks INSERT/UPDATE/DELETE on the task's tables, "
                         "are allowed")
        return _DENY

    def _is_task_table(self, name: Any) -> bool:
        return any(t.name.casefold() == str(name).casefold() for t in self._tables)

    def _explain(self, exc: Exception, timeout_s: float) -> str:
        """The agent-facing message of a failed statement."""
        text = str(exc)
        if text == "interrupted":
            return timeout_message(timeout_s)
        if "not authorized" in text and self._refusal:
            return f"not authorized: {self._refusal}"
        if "one statement at a time" in text:
            return "only one SQL statement per call"
        return text

    # -- inspection (not subject to the authorizer) --------------------------------------

    def list_tables(self) -> list[str]:
        rows = self._conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite\\_%' ESCAPE '\\' "
            "ORDER BY name"
        ).fetchall()
        return [r[0] for r in rows]

    def describe_table(self, name: str) -> list[tuple[str, str]]:
        if name not in self.list_tables():
            raise SQLError(f"no table named {name!r}")
        rows = self._conn.execute("SELECT name, type FROM pragma_table_info(?)", (name,)).fetchall()
        return [(r[0], r[1] or "") for r in rows]

    def table_hash(self, name: str) -> str:
        if name not in self.list_tables():
            raise SQLError(f"no table named {name!r}")
        return rows_hash(self._conn.execute(f"SELECT * FROM {quote_identifier(name)}"))

    def close(self) -> None:
        self._conn.close()


SQLITE_MAGIC = b"SQLite format 3\x00"


def is_sqlite_file(path: str | Path) -> bool:
    """Whether the file starts with SQLite's 16-byte header string."""
    try:
        with open(path, "rb") as handle:
            return handle.read(16) == SQLITE_MAGIC
    except OSError:
        return False


def read_only_uri(path: Path) -> str:
    """The URI that opens `path` without ever writing or locking it."""
    return path.as_uri() + "?mode=ro&immutable=1"


def read_schema(conn: sqlite3.Connection) -> list[TableSpec]:
    """The tables of a database as row-less TableSpecs (names and declared column types)."""
    names = [r[0] for r in conn.execute(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite\\_%' ESCAPE '\\' "
        "ORDER BY name")]
    tables = []
    for name in names:
        columns = tuple((str(c), str(t or "")) for c, t in
                        conn.execute("SELECT name, type FROM pragma_table_info(?)", (name,)))
        tables.append(TableSpec(name, columns, ()))
    return tables


class SQLiteFileBackend:
    """An existing SQLite database file, opened read-only (see the module docstring).

    path: the database file; FileNotFoundError or ValueError (naming the fix) when it is
        missing or not a SQLite database.
    `open(tables, writable)` ignores `tables`: the file's own tables (`self.tables`, read once)
    are the task's. Write sessions get a private in-memory copy; the file is never written.
    """

    name = "sqlite-file"

    def __init__(self, path: str | Path, isolate: bool = True) -> None:
        self.path = Path(path).expanduser().resolve()
        self.isolate = isolate
        if not self.path.is_file():
            raise FileNotFoundError(f"database file {self.path} not found. Fix: pass the path of an existing "
                                    "SQLite (.sqlite/.db) or DuckDB (.duckdb) file.")
        if not is_sqlite_file(self.path):
            raise ValueError(f"{self.path} is not a SQLite database (no 'SQLite format 3' header). Fix: pass a "
                             "SQLite file, or a DuckDB file (opened by DuckDBFileBackend).")
        conn = self._connect()
        try:
            self.tables = read_schema(conn)
        except sqlite3.Error as exc:
            raise ValueError(f"cannot read the schema of {self.path}: {exc}") from None
        finally:
            conn.close()

    def _connect(self) -> sqlite3.Connection:
        return sqlite3.connect(read_only_uri(self.path), uri=True, isolation_level=None, cached_statements=0,
                               check_same_thread=False)

    def open(self, tables: Sequence[TableSpec] = (), writable: bool = False) -> "SQLiteSession":
        """A session on the file (read-only), or on a private in-memory copy when `writable`."""
        if self.isolate:
            spec = BackendSpec(f"{__name__}:SQLiteFileBackend", (("path", str(self.path)),))
            return IsolatedSession(spec, self.tables, writable)  # type: ignore[return-value]
        source = self._connect()
        if not writable:
            return SQLiteSession(source, self.tables, writable=False)
        copy = sqlite3.connect(":memory:", isolation_level=None, cached_statements=0, check_same_thread=False)
        try:
            source.backup(copy)
        finally:
            source.close()
        return SQLiteSession(copy, self.tables, writable=True)
