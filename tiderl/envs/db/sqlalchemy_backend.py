"""A backend for any database SQLAlchemy can reach by URL (needs the `sqlalchemy` package and
the database's driver).

tiderl only ever creates, writes or drops tables in a database it owns (a scratch database);
it refuses any other with a ValueError that names the fix. It owns:
- `sqlite://` (in memory): a private database of each session's process;
- `sqlite:///path` when `path` does not exist yet: the backend creates the file and marks it;
- any database that carries tiderl's marker table `tiderl_scratch_database`, which the
  backend writes only into a database that has no tables at all (an empty database a user
  dedicates to tiderl, e.g. a new PostgreSQL database).
A `sqlite:///` file or server database with tables of its own and no marker is refused: to
ask questions about an existing SQLite or DuckDB file, open it read-only with
`SQLiteFileBackend` / `DuckDBFileBackend` (`tiderl eval --env db --db FILE`).

Opening a session creates the task's tables in the scratch database (dropping same-named
tables of an earlier session first) with portable column types (`portable_column`), and
closing it drops them again. So one database serves one episode at a time (a backend refuses
to open a second session while one is open); give concurrent env instances their own backends.

Isolation is by transaction: every agent statement runs in its own transaction, rolled back
for read-only sessions (SELECT tasks) and committed for writable ones. The environment refuses
anything but SELECT (and, in write tasks, INSERT/UPDATE/DELETE) before a statement gets here;
beyond that the database's own permissions apply, so point the URL at a user that may touch
nothing else.

Limits: by default (`isolate=True`) sessions run in a worker process killed when a statement
overruns (`worker.py`), which bounds every statement's time as seen by tiderl; for SQLite URLs
a progress handler also stops statements inside the worker, and values are capped at
`MAX_VALUE_BYTES` (`SQLITE_LIMIT_LENGTH`). A killed worker's connection closes, but a server
may go on running the statement: for servers also set the statement timeout in the URL (e.g.
PostgreSQL `?options=-c%20statement_timeout%3D2000`). Results holding a value over
`MAX_VALUE_BYTES` are refused on every database. SQLite URLs are tested here; MariaDB and
PostgreSQL scratch databases were measured with dbbench (docs/env_db.md). To ask questions about
an existing server database, read-only, use `ServerBackend` (server_backend.py) instead.

Knowledge units come from `referenced_units` (a conservative reading of the SQL text).
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any, Sequence

from tiderl.envs.db.backend import (
    MAX_VALUE_BYTES,
    QueryResult,
    SQLError,
    TableSpec,
    fetch_limited,
    portable_table,
    rows_hash,
)
from tiderl.envs.db.sql_text import referenced_units
from tiderl.envs.db.worker import BackendSpec, IsolatedSession, timeout_message

# The table that marks a database as tiderl's scratch space.
MARKER_TABLE = "tiderl_scratch_database"


def _import_sqlalchemy() -> Any:
    try:
        import sqlalchemy
    except ImportError:
        raise ImportError("the SQLAlchemy backend needs the sqlalchemy package: pip install sqlalchemy") from None
    return sqlalchemy


class SQLAlchemyBackend:
    """Task tables created in the database at `url` (see the module docstring)."""

    name = "sqlalchemy"

    def __init__(self, url: str, isolate: bool = True, **engine_kwargs: Any) -> None:
        self._sa = _import_sqlalchemy()
        self.url = url
        self.isolate = isolate
        self._engine_kwargs = engine_kwargs
        parsed = self._sa.engine.make_url(url)
        self._sqlite = parsed.get_backend_name() == "sqlite"
        in_memory = self._sqlite and parsed.database in (None, "", ":memory:")
        created = False
        if self._sqlite and not in_memory and not Path(parsed.database).exists():
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
            sqlite3.connect(parsed.database).close()  # an empty file tiderl made
            created = True
        self.engine = self._sa.create_engine(url, **engine_kwargs)
        self._sa.event.listen(self.engine, "connect", _cap_sqlite_values)
        if not in_memory:
            self._claim(created)
        self._open: Any = None

    def _claim(self, created: bool) -> None:
        """Check that tiderl owns the database (marker table), marking it when it is new or
        empty; ValueError naming the fix otherwise. Nothing is written before the check."""
        sa = self._sa
        with self.engine.connect() as conn:
            names = set(sa.inspect(conn).get_table_names())
        if MARKER_TABLE in names:
            return
        if names:
            shown = ", ".join(sorted(names)[:5]) + (", ..." if len(names) > 5 else "")
            raise ValueError(
                f"SQLAlchemyBackend refuses {self.url!r}: that database already has tables ({shown}) and was "
                "not created by tiderl, which creates and drops task tables in the database it is given. "
                "Fix: point the URL at a new SQLite file (sqlite:///new.sqlite), sqlite:// (in memory) or "
                "an empty database you dedicate to tiderl; to ask questions about an existing database "
                "file or server, open it read-only with --db FILE or --db URL (SQLiteFileBackend / "
                "DuckDBFileBackend / ServerBackend).")
        with self.engine.begin() as conn:
            conn.exec_driver_sql(f"CREATE TABLE {MARKER_TABLE} (created_by VARCHAR(32))")
            conn.exec_driver_sql(f"INSERT INTO {MARKER_TABLE} VALUES ('tiderl')")

    def open(self, tables: Sequence[TableSpec], writable: bool) -> "SQLAlchemySession":
        """A session with the task's tables freshly created. Raises RuntimeError while another
        session of this backend is open: both would share (and silently corrupt) one set of
        tables."""
        if self._open is not None and not self._open.closed:
            raise RuntimeError(f"SQLAlchemyBackend({self.url!r}) serves one session at a time (the task tables "
                               "live in one database): close the open session first, or give each env its "
                               "own database URL")
        if any(t.name.casefold() == MARKER_TABLE for t in tables):
            raise ValueError(f"a task table may not be named {MARKER_TABLE!r} (tiderl's scratch marker)")
        if self.isolate:
            spec = BackendSpec(f"{__name__}:SQLAlchemyBackend",
                               (("url", self.url),) + tuple(sorted(self._engine_kwargs.items())))
            self._open = IsolatedSession(spec, tables, writable)
            return self._open  # type: ignore[return-value]
        sa = self._sa
        kinds = {"integer": sa.BigInteger, "real": sa.Float, "text": sa.Text}
        metadata = sa.MetaData()
        loaded = []
        for spec in tables:
            columns, rows = portable_table(spec)
            table = sa.Table(spec.name, metadata, *(sa.Column(c, kinds[k]()) for c, k in columns))
            loaded.append((table, [dict(zip(table.columns.keys(), r)) for r in rows]))
        conn = self.engine.connect()
        with conn.begin():
            metadata.drop_all(conn)
            metadata.create_all(conn)
            for table, rows in loaded:
                if rows:
                    conn.execute(table.insert(), rows)
        self._open = SQLAlchemySession(sa, conn, metadata, tables, writable)
        return self._open


def _cap_sqlite_values(dbapi_connection: Any, _record: Any) -> None:
    """Cap strings and blobs a SQLite connection may build (other drivers: nothing to do)."""
    if hasattr(dbapi_connection, "setlimit"):
        dbapi_connection.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, MAX_VALUE_BYTES)


class SQLAlchemySession:
    """One episode's connection; each agent statement in its own transaction."""

    def __init__(self, sa: Any, conn: Any, metadata: Any, tables: Sequence[TableSpec], writable: bool) -> None:
        self._sa = sa
        self._conn = conn
        self._metadata = metadata
        self._tables = list(tables)
        self._writable = writable
        self.closed = False

    def _begin(self) -> Any:
        """A new transaction (inspection may have auto-begun one: it is ended first)."""
        if self._conn.in_transaction():
            self._conn.rollback()
        return self._conn.begin()

    def execute(self, sql: str, *, max_rows: int, timeout_s: float) -> QueryResult:
        transaction = self._begin()
        self._set_deadline(time.monotonic() + timeout_s)
        try:
            # exec_driver_sql: the text goes to the driver as is (text() would read ":name" as
            # a bind parameter). Drivers with %s parameters (PyMySQL, psycopg) still format the
            # text with the (empty) parameters, so a literal % is doubled: `LIKE '%Ca%'` would
            # otherwise fail as "unsupported format character".
            if self._conn.dialect.paramstyle in ("format", "pyformat"):
                sql_text = sql.replace("%", "%%")
            else:
                sql_text = sql
            cursor = self._conn.exec_driver_sql(sql_text)
            if cursor.returns_rows:
                rows, more, capped = fetch_limited(cursor.fetchmany, max_rows)
                result = QueryResult(list(cursor.keys()), rows, more, capped)
            else:
                result = QueryResult([], [], rowcount=max(cursor.rowcount, 0))
            cursor.close()
        except self._sa.exc.DBAPIError as exc:
            transaction.rollback()
            raise SQLError(self._explain(exc, timeout_s)) from None
        except (self._sa.exc.SQLAlchemyError, ValueError) as exc:  # ValueError: text the driver cannot encode
            transaction.rollback()
            raise SQLError(str(exc).splitlines()[0]) from None
        finally:
            self._set_deadline(None)
        if self._writable:
            transaction.commit()
        else:
            transaction.rollback()
        result.units = frozenset(referenced_units(sql, {t.name: t.column_names for t in self._tables}))
        return result

    def _set_deadline(self, deadline: float | None) -> None:
        """Install (or remove) the time limit where the driver supports it (SQLite)."""
        driver = self._conn.connection.dbapi_connection
        if hasattr(driver, "set_progress_handler"):
            if deadline is None:
                driver.set_progress_handler(None, 0)
            else:
                driver.set_progress_handler(lambda: int(time.monotonic() > deadline), 1_000)

    @staticmethod
    def _explain(exc: Any, timeout_s: float) -> str:
        text = str(getattr(exc, "orig", exc)) or str(exc).splitlines()[0]
        if text == "interrupted":
            return timeout_message(timeout_s)
        if "one statement at a time" in text:
            return "only one SQL statement per call"
        return text

    def list_tables(self) -> list[str]:
        with self._begin():
            existing = set(self._sa.inspect(self._conn).get_table_names())
        return sorted(t.name for t in self._tables if t.name in existing)

    def describe_table(self, name: str) -> list[tuple[str, str]]:
        if name not in self.list_tables():
            raise SQLError(f"no table named {name!r}")
        with self._begin():
            columns = self._sa.inspect(self._conn).get_columns(name)
        return [(c["name"], str(c["type"])) for c in columns]

    def table_hash(self, name: str) -> str:
        if name not in self.list_tables():
            raise SQLError(f"no table named {name!r}")
        table = self._metadata.tables[name]
        with self._begin():
            return rows_hash(self._conn.execute(self._sa.select(table)).fetchall())

    def close(self) -> None:
        """Drop the task's tables and release the connection (once; later calls do nothing)."""
        if self.closed:
            return
        self.closed = True
        try:
            with self._begin():
                self._metadata.drop_all(self._conn)
        finally:
            self._conn.close()
