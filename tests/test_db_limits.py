"""The SQL limits hold for any statement, values are capped on every backend, and no backend
writes into a database it did not create."""

from __future__ import annotations

import hashlib
import sqlite3

import pytest

from tiderl.envs.db.backend import MAX_VALUE_BYTES, SQLError, TableSpec, value_size
from tiderl.envs.db.env import make_backend

TABLES = [TableSpec("t", (("a", "INT"), ("b", "TEXT")), ((1, "x"), (2, "y")))]
SLOW_PRINTF = "SELECT length(printf('%.*c', 2000000000, 'x'))"


def _backends(tmp_path):
    out = [("sqlite", make_backend("sqlite", str(tmp_path / "s"))), ("sqlalchemy", make_backend("sqlite://"))]
    try:
        out.append(("duckdb", make_backend("duckdb", str(tmp_path / "d"))))
    except ImportError:
        pass
    return out


def _run(session, sql, timeout_s=0.5):
    try:
        return session.execute(sql, max_rows=5, timeout_s=timeout_s)
    except SQLError as exc:
        return exc


@pytest.mark.parametrize("writable", [False, True])
def test_one_long_opcode_is_stopped_at_the_limit_on_sqlite(tmp_path, writable):
    """SQLite's progress handler never fires inside printf's loop (3-6 s in process, and then it
    would answer); the worker is killed, the agent reads the time-limit error, and a write task's
    earlier writes survive the kill."""
    session = make_backend("sqlite", str(tmp_path)).open(TABLES, writable)
    try:
        if writable:
            session.execute("INSERT INTO t VALUES (3, 'z')", max_rows=0, timeout_s=1.0)
        outcome = _run(session, SLOW_PRINTF)
        assert isinstance(outcome, SQLError) and "0.5 s limit" in str(outcome)
        assert session.kills == 1  # cut off by the kill, not answered after its 3-6 s
        rows = session.execute("SELECT count(*) FROM t", max_rows=5, timeout_s=1.0).rows
        assert rows == [(3 if writable else 2,)]
    finally:
        session.close()


@pytest.mark.slow
def test_every_backend_stops_slow_statements_and_caps_values(tmp_path):
    slow = ["WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c",
            SLOW_PRINTF]
    huge = ["SELECT length(repeat('x', 1000000000))", "SELECT zeroblob(1000000000)",
            "SELECT printf('%.*c', 2000000, 'x')", "SELECT repeat('x', 2000000)"]
    for name, backend in _backends(tmp_path):
        session = backend.open(TABLES, False)
        try:
            for sql in slow:  # neither answers within seconds: refused, or stopped at the limit
                outcome = _run(session, sql)
                assert isinstance(outcome, SQLError), (name, sql, outcome)
            for sql in huge:
                outcome = _run(session, sql, timeout_s=3.0)
                # refused (no such function, too big, out of memory) or NULL (SQLite's printf
                # past the length limit): never a value over the cap
                assert isinstance(outcome, SQLError) or all(
                    value_size(v) <= MAX_VALUE_BYTES for row in outcome.rows for v in row), (name, sql, outcome)
            assert session.execute("SELECT count(*) FROM t", max_rows=5, timeout_s=1.0).rows == [(2,)]
        finally:
            session.close()


def _digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_sqlalchemy_refuses_a_users_sqlite_file_and_leaves_it_alone(tmp_path):
    user = tmp_path / "users.sqlite"
    conn = sqlite3.connect(user)
    conn.execute("CREATE TABLE t (precious TEXT)")
    conn.execute("INSERT INTO t VALUES ('keep me')")
    conn.commit()
    conn.close()
    before = _digest(user)
    with pytest.raises(ValueError, match="refuses .*--db FILE"):
        make_backend(f"sqlite:///{user}")
    assert _digest(user) == before
    assert sqlite3.connect(user).execute("SELECT * FROM t").fetchall() == [("keep me",)]


def test_sqlalchemy_uses_a_new_file_it_creates_and_reuses_it(tmp_path):
    path = tmp_path / "scratch" / "new.sqlite"
    backend = make_backend(f"sqlite:///{path}")
    session = backend.open(TABLES, True)
    session.execute("DELETE FROM t WHERE a = 1", max_rows=0, timeout_s=1.0)
    assert session.execute("SELECT count(*) FROM t", max_rows=5, timeout_s=1.0).rows == [(1,)]
    session.close()
    again = make_backend(f"sqlite:///{path}")  # marked as tiderl's: accepted
    session = again.open(TABLES, False)
    assert session.execute("SELECT count(*) FROM t", max_rows=5, timeout_s=1.0).rows == [(2,)]
    session.close()
    names = {r[0] for r in sqlite3.connect(path).execute("SELECT name FROM sqlite_master")}
    assert names == {"tiderl_scratch_database"}


@pytest.mark.parametrize("isolate", [True, False])
@pytest.mark.parametrize("writable", [False, True])
def test_duckdb_refuses_to_build_a_value_over_the_cap_like_sqlite(tmp_path, isolate, writable):
    """DuckDB has no per-value length limit: `length(repeat('x', 50000000))` built 50 MB and
    answered 50000000. Like SQLite's SQLITE_LIMIT_LENGTH, it is now refused before it is built,
    with SQLite's words, whether the value is shown, measured, filtered on or written."""
    duckdb_backend = pytest.importorskip("tiderl.envs.db.duckdb_backend")
    pytest.importorskip("duckdb")
    session = duckdb_backend.DuckDBBackend(tmp_path, isolate=isolate).open(TABLES, writable)
    try:
        huge = ["SELECT repeat('x', 50000000)", "SELECT length(repeat('x', 50000000))",
                "SELECT length(repeat('abcde', 300000))", "SELECT a FROM t WHERE length(repeat(b, 50000000)) > 0",
                "SELECT length(lpad('x', 50000000, 'y'))", "SELECT length(rpad('x', 50000000, 'y'))",
                "SELECT length('x'.repeat(50000000))"]
        if writable:
            huge.append("UPDATE t SET b = repeat('x', 50000000)")
        for sql in huge:
            outcome = _run(session, sql, timeout_s=5.0)
            assert isinstance(outcome, SQLError), (sql, outcome)
            assert str(outcome).startswith("string or blob too big") and "the limit is 1,000,000" in str(outcome), sql
        outcome = _run(session, "SELECT length(system.main.repeat('x', 50000000))", timeout_s=5.0)
        assert isinstance(outcome, SQLError) and "system." in str(outcome)
        # values under the cap are built as before
        assert _run(session, "SELECT length(repeat('x', 1000000)), repeat('ab', 2), lpad('7', 3, '0'), "
                             "rpad('7', 3, '0'), length(repeat([1, 2], 3))").rows == [(1000000, "abab", "007", "700", 6)]
        assert _run(session, "SELECT count(*) FROM t WHERE length(b) = 1").rows == [(2,)]
    finally:
        session.close()
