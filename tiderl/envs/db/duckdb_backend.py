"""The DuckDB backend (needs the `duckdb` package).

Column types: DuckDB is strictly typed, so each column gets a portable type (`portable_column`:
integer, real or text, by the declared type and whether every cell converts).

Isolation: read-only sessions open the task's database file (built once under `cache_dir`,
atomically) with `read_only=True`; writable sessions build a fresh in-memory database from the
specs, which is the per-episode scratch copy. Every connection runs with external access off
(no files, no ATTACH, no COPY, no extension install/load) and its configuration locked, so a
statement cannot turn those back on. A timer interrupts statements past their time limit.

Sizes: DuckDB has no per-value length limit (its `memory_limit` does not bound a string built
by `repeat`), so by default (`isolate=True`) sessions run in a worker process (`worker.py`)
whose address space is capped (1 GiB: `repeat('x', 1000000000)` fails with an out-of-memory
error instead of building a gigabyte) and which is killed when a statement overruns its time
limit (DuckDB checks interrupts only between vector batches). Results holding a value over
`MAX_VALUE_BYTES` are refused (`fetch_limited`). Every session shadows the functions that build
a long value from a count (`repeat`, `lpad`, `rpad`) with temporary macros that refuse a value
over `MAX_VALUE_BYTES` before it is built, with SQLite's "string or blob too big" (the agent
cannot drop them: only SELECT/INSERT/UPDATE/DELETE reach the database; `system.`-qualified
names, which would reach the built-ins, are refused). Not capped, bounded only by the worker's
address space: values grown other ways (`string_agg`, `printf`/`format` with a wide field,
concatenating capped values; `length(printf('%5000000d', 1))` is still answered).

`DuckDBFileBackend` opens a DuckDB file the user already has: `read_only=True` for questions,
and for write tasks a private copy of the file in a temporary directory, deleted on close.

Knowledge units come from `referenced_units` (a conservative reading of the SQL text): DuckDB
has no authorizer hook.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import uuid
from pathlib import Path
from typing import Any, Sequence

from tiderl.envs.db.backend import (
    QueryResult,
    SQLError,
    MAX_VALUE_BYTES,
    TableSpec,
    fetch_limited,
    portable_table,
    rows_hash,
    spec_digest,
)
from tiderl.envs.db.sql_text import WRITE, quote_identifier, referenced_units, statement_kind, tokenize
from tiderl.envs.db.worker import BackendSpec, IsolatedSession, timeout_message

_DUCK_TYPES = {"integer": "BIGINT", "real": "DOUBLE", "text": "VARCHAR"}

# Applied to every connection; `lock_configuration` comes last so nothing can undo the others.
_LOCKED_CONFIG = {
    "enable_external_access": False,
    "autoinstall_known_extensions": False,
    "autoload_known_extensions": False,
    "threads": 1,
    "memory_limit": "512MB",
    "lock_configuration": True,
}


_TOO_BIG = "string or blob too big"


def _capped(size: str, call: str) -> str:
    """A macro body: `call` (a system function), or an error when `size` exceeds the cap."""
    return (f"CASE WHEN ({size}) > {MAX_VALUE_BYTES} THEN error('{_TOO_BIG}: a value would have ' || "
            f"CAST(({size}) AS VARCHAR) || ' characters or bytes; the limit is {MAX_VALUE_BYTES:,}') "
            f"ELSE system.main.{call} END")


# Temporary macros shadowing the built-ins that make a long value from a count (DuckDB has no
# per-value length limit): the size is counted on the value's text, so a blob or list counts
# its escaped text, an over-estimate.
_CAP_MACROS = (
    f"CREATE TEMP MACRO repeat(s, n) AS {_capped('length(CAST(s AS VARCHAR)) * n', 'repeat(s, n)')}",
    f"CREATE TEMP MACRO lpad(s, n, p) AS {_capped('n', 'lpad(s, n, p)')}",
    f"CREATE TEMP MACRO rpad(s, n, p) AS {_capped('n', 'rpad(s, n, p)')}",
)


def _refuse_system_names(sql: str, tables: Sequence[TableSpec]) -> None:
    """SQLError for `system.<name>`, which would reach the built-ins the cap macros shadow."""
    tokens = tokenize(sql)
    names = {t.name.lower() for t in tables}
    for word, dot in zip(tokens, tokens[1:]):
        if word.kind == "word" and word.text.lower() == "system" and dot.text == "." and "system" not in names:
            raise SQLError("names qualified with system. are not allowed; call functions by their plain name")


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

    def __init__(self, cache_dir: str | Path | None = None, isolate: bool = True) -> None:
        self._duckdb = _import_duckdb()
        self.isolate = isolate
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
        if self.isolate:
            if not writable:
                self.source_path(tables)  # built here, once, so workers only open it
            spec = BackendSpec(f"{__name__}:DuckDBBackend", (("cache_dir", str(self.cache_dir)),))
            return IsolatedSession(spec, tables, writable)  # type: ignore[return-value]
        if writable:
            conn = self._duckdb.connect(":memory:", config={"threads": 1})
            _create_tables(conn, tables)
            _lock_down(conn)
        else:
            conn = self._duckdb.connect(str(self.source_path(tables)), read_only=True, config=dict(_LOCKED_CONFIG))
        return DuckDBSession(conn, tables, self._duckdb.Error)


def _lock_down(conn: Any) -> None:
    """Lock a connection opened for building: external access off, configuration frozen."""
    for key, value in _LOCKED_CONFIG.items():
        text = str(value).lower() if isinstance(value, bool) else f"'{value}'" if isinstance(value, str) else value
        conn.execute(f"SET {key} = {text}")


class DuckDBSession:
    """One episode's DuckDB connection (`cleanup`: a scratch folder removed on close)."""

    def __init__(self, conn: Any, tables: Sequence[TableSpec], error_type: type, cleanup: str | None = None) -> None:
        self._conn = conn
        self._tables = list(tables)
        self._error = error_type
        self._cleanup = cleanup
        for macro in _CAP_MACROS:
            conn.execute(macro)

    def execute(self, sql: str, *, max_rows: int, timeout_s: float) -> QueryResult:
        """Run one statement; a timer interrupts it after `timeout_s`."""
        _refuse_system_names(sql, self._tables)
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
            message = timeout_message(timeout_s) if interrupted else str(exc)
            if _TOO_BIG in message:  # "Invalid Input Error: string or blob too big: ..."
                message = message[message.index(_TOO_BIG):]
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
        if self._cleanup:
            shutil.rmtree(self._cleanup, ignore_errors=True)


DUCKDB_MAGIC = b"DUCK"


def is_duckdb_file(path: str | Path) -> bool:
    """Whether the file carries DuckDB's magic bytes ("DUCK" at offset 8)."""
    try:
        with open(path, "rb") as handle:
            return handle.read(12)[8:12] == DUCKDB_MAGIC
    except OSError:
        return False


class DuckDBFileBackend:
    """An existing DuckDB database file, opened read-only (see the module docstring).

    `open(tables, writable)` ignores `tables`: the file's own tables of the main schema
    (`self.tables`, read once) are the task's. Write sessions get a private copy of the file.
    """

    name = "duckdb-file"

    def __init__(self, path: str | Path, isolate: bool = True) -> None:
        self._duckdb = _import_duckdb()
        self.path = Path(path).expanduser().resolve()
        self.isolate = isolate
        if not self.path.is_file():
            raise FileNotFoundError(f"database file {self.path} not found. Fix: pass the path of an existing "
                                    "DuckDB (.duckdb) or SQLite (.sqlite/.db) file.")
        if not is_duckdb_file(self.path):
            raise ValueError(f"{self.path} is not a DuckDB database. Fix: pass a DuckDB file, or a SQLite file "
                             "(opened by SQLiteFileBackend).")
        conn = self._connect(self.path)
        try:
            names = [r[0] for r in conn.execute(
                "SELECT table_name FROM information_schema.tables WHERE table_schema = 'main' "
                "ORDER BY table_name").fetchall()]
            self.tables = [TableSpec(name, tuple((str(c), str(t)) for c, t in conn.execute(
                "SELECT column_name, data_type FROM information_schema.columns WHERE table_schema = 'main' "
                "AND table_name = ? ORDER BY ordinal_position", [name]).fetchall()), ()) for name in names]
        finally:
            conn.close()

    def _connect(self, path: Path, read_only: bool = True) -> Any:
        return self._duckdb.connect(str(path), read_only=read_only, config=dict(_LOCKED_CONFIG))

    def open(self, tables: Sequence[TableSpec] = (), writable: bool = False) -> DuckDBSession:
        if self.isolate:
            spec = BackendSpec(f"{__name__}:DuckDBFileBackend", (("path", str(self.path)),))
            return IsolatedSession(spec, self.tables, writable)  # type: ignore[return-value]
        if not writable:
            return DuckDBSession(self._connect(self.path), self.tables, self._duckdb.Error)
        folder = tempfile.mkdtemp(prefix="tiderl-duckdb-copy-")
        copy = Path(folder) / self.path.name
        shutil.copyfile(self.path, copy)
        wal = self.path.with_name(self.path.name + ".wal")
        if wal.exists():
            shutil.copyfile(wal, copy.with_name(copy.name + ".wal"))
        return DuckDBSession(self._connect(copy, read_only=False), self.tables, self._duckdb.Error, cleanup=folder)
