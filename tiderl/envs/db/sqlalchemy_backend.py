"""A backend for any database SQLAlchemy can reach by URL (needs the `sqlalchemy` package and
the database's driver).

The URL must name a database that tiderl may use as scratch space: opening a session creates
the task's tables there (dropping tables of the same names first) with portable column types
(`portable_column`), and closing it drops them again. So one database serves one episode at a
time (a backend refuses to open a second session while one is open); give concurrent env
instances their own backends and databases (with `sqlite://`, the in-memory URL, each backend
instance has its own database).

Isolation is by transaction: every agent statement runs in its own transaction, rolled back
for read-only sessions (SELECT tasks) and committed for writable ones. The environment refuses
anything but SELECT (and, in write tasks, INSERT/UPDATE/DELETE) before a statement gets here;
beyond that the database's own permissions apply, so point the URL at a user that may touch
nothing else.

Time limits: enforced for SQLite URLs (a progress handler on the driver connection); for
other databases set the server's statement timeout in the URL or connect arguments (e.g.
PostgreSQL `?options=-c%20statement_timeout%3D2000`). Only SQLite URLs are tested here.

Knowledge units come from `referenced_units` (a conservative reading of the SQL text).
"""

from __future__ import annotations

import time
from typing import Any, Sequence

from tiderl.envs.db.backend import (
    QueryResult,
    SQLError,
    TableSpec,
    fetch_limited,
    portable_table,
    rows_hash,
)
from tiderl.envs.db.sql_text import referenced_units


def _import_sqlalchemy() -> Any:
    try:
        import sqlalchemy
    except ImportError:
        raise ImportError("the SQLAlchemy backend needs the sqlalchemy package: pip install sqlalchemy") from None
    return sqlalchemy


class SQLAlchemyBackend:
    """Task tables created in the database at `url` (see the module docstring)."""

    name = "sqlalchemy"

    def __init__(self, url: str, **engine_kwargs: Any) -> None:
        self._sa = _import_sqlalchemy()
        self.url = url
        self.engine = self._sa.create_engine(url, **engine_kwargs)
        self._open: SQLAlchemySession | None = None

    def open(self, tables: Sequence[TableSpec], writable: bool) -> "SQLAlchemySession":
        """A session with the task's tables freshly created. Raises RuntimeError while another
        session of this backend is open: both would share (and silently corrupt) one set of
        tables."""
        if self._open is not None and not self._open.closed:
            raise RuntimeError(f"SQLAlchemyBackend({self.url!r}) serves one session at a time (the task tables "
                               "live in one database): close the open session first, or give each env its "
                               "own database URL")
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
            # a bind parameter).
            cursor = self._conn.exec_driver_sql(sql)
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
            return f"the statement ran longer than the {timeout_s:g} s limit and was stopped"
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
