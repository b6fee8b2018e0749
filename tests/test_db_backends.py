"""The DB backends (SQLite, DuckDB, SQLAlchemy) behind one interface, and the SQLite safety
layer on its own (statements sent straight to the session, past the env's own checks)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from support import SCHOOLS, STORED_ROWS, T
from tiderl.envs.db.backend import SQLError, database_hash, rows_hash
from tiderl.envs.db.sqlite_backend import SQLiteBackend

# An endless recursive query: only the time limit stops it.
ENDLESS = "WITH RECURSIVE r(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM r) SELECT count(*) FROM r"


def make(kind: str, tmp_path: Path):
    if kind == "sqlite":
        return SQLiteBackend(tmp_path / "cache")
    if kind == "duckdb":
        pytest.importorskip("duckdb")
        from tiderl.envs.db.duckdb_backend import DuckDBBackend

        return DuckDBBackend(tmp_path / "cache")
    pytest.importorskip("sqlalchemy")
    from tiderl.envs.db.sqlalchemy_backend import SQLAlchemyBackend

    return SQLAlchemyBackend(kind if "://" in kind else f"sqlite:///{tmp_path / 'scratch.db'}")


BACKENDS = ["sqlite", "duckdb", "sqlalchemy-file", "sqlite://"]


@pytest.fixture(params=BACKENDS)
def backend(request, tmp_path):
    return make(request.param, tmp_path)


def test_select_rows_and_units(backend):
    session = backend.open([SCHOOLS], writable=False)
    try:
        result = session.execute(f"SELECT School FROM {T} WHERE Location = 'San Diego' ORDER BY School",
                                 max_rows=10, timeout_s=5)
        assert result.columns == ["School"]
        assert result.rows == [("Lincoln High School",), ("Madison High School",)]
        assert result.more_rows == 0 and result.rowcount is None
        assert result.units == {"table:School Location Table", "column:School Location Table.School",
                                "column:School Location Table.Location"}
    finally:
        session.close()


def test_row_limit_counts_rows_left_out(backend):
    session = backend.open([SCHOOLS], writable=False)
    try:
        result = session.execute(f"SELECT School FROM {T} ORDER BY School", max_rows=2, timeout_s=5)
        assert result.rows == [("Burroughs High School",), ("Central High School",)]
        assert (result.more_rows, result.more_rows_capped) == (3, False)
    finally:
        session.close()


def test_list_describe_and_hash(backend):
    session = backend.open([SCHOOLS], writable=False)
    try:
        assert session.list_tables() == ["School Location Table"]
        assert [c for c, _ in session.describe_table("School Location Table")] == SCHOOLS.column_names
        assert session.table_hash("School Location Table") == rows_hash(STORED_ROWS)
        with pytest.raises(SQLError):
            session.describe_table("nope")
    finally:
        session.close()


def test_write_in_a_scratch_copy_is_scored_by_table_hash(backend):
    session = backend.open([SCHOOLS], writable=True)
    try:
        result = session.execute(f"UPDATE {T} SET Students = 1000 WHERE Location = 'San Diego'",
                                 max_rows=10, timeout_s=5)
        assert result.rowcount == 2
        expected = [r if r[1] != "San Diego" else (*r[:3], 1000) for r in STORED_ROWS]
        assert session.table_hash("School Location Table") == rows_hash(expected)
    finally:
        session.close()
    # The next episode starts from the original table.
    again = backend.open([SCHOOLS], writable=False)
    try:
        assert again.table_hash("School Location Table") == rows_hash(STORED_ROWS)
    finally:
        again.close()


@pytest.mark.parametrize("kind", ["sqlite", "duckdb"])
def test_concurrent_writable_sessions_are_independent(tmp_path, kind):
    backend = make(kind, tmp_path)
    first, second = backend.open([SCHOOLS], writable=True), backend.open([SCHOOLS], writable=True)
    try:
        first.execute(f"DELETE FROM {T} WHERE Location = 'Fresno'", max_rows=0, timeout_s=5)
        assert first.table_hash("School Location Table") == rows_hash(STORED_ROWS[:4])
        assert second.table_hash("School Location Table") == rows_hash(STORED_ROWS)
    finally:
        first.close()
        second.close()


def test_sqlalchemy_backend_refuses_a_second_open_session(tmp_path):
    backend = make("sqlite://", tmp_path)
    session = backend.open([SCHOOLS], writable=True)
    with pytest.raises(RuntimeError, match="one session at a time"):
        backend.open([SCHOOLS], writable=True)
    session.close()
    backend.open([SCHOOLS], writable=False).close()


def test_the_same_write_hashes_alike_on_every_backend(tmp_path):
    hashes = {}
    for index, kind in enumerate(BACKENDS):
        folder = tmp_path / str(index)
        folder.mkdir()
        backend = make(kind, folder)
        session = backend.open([SCHOOLS], writable=True)
        try:
            session.execute(f"INSERT INTO {T} VALUES ('New School', 'Ridgecrest', 2001, 50)", max_rows=0, timeout_s=5)
            hashes[kind] = database_hash(session, ["School Location Table"])
        finally:
            session.close()
    assert len(set(hashes.values())) == 1, hashes


def test_read_only_session_never_changes_the_table(backend):
    session = backend.open([SCHOOLS], writable=False)
    try:
        try:
            session.execute(f"DELETE FROM {T}", max_rows=0, timeout_s=5)
        except SQLError:
            pass  # SQLite and DuckDB refuse; SQLAlchemy rolls the statement back
        assert session.table_hash("School Location Table") == rows_hash(STORED_ROWS)
    finally:
        session.close()


def test_statement_time_limit(backend):
    session = backend.open([SCHOOLS], writable=False)
    try:
        # ENDLESS never finishes by itself: only the limit ends it (without it, the test would
        # hang until its timeout).
        with pytest.raises(SQLError, match="longer than the 0.3 s limit"):
            session.execute(ENDLESS, max_rows=10, timeout_s=0.3)
        # The session still works after an interrupted statement.
        assert session.execute(f"SELECT COUNT(*) FROM {T}", max_rows=1, timeout_s=5).rows == [(5,)]
    finally:
        session.close()


@pytest.mark.parametrize("sql", [
    "SELECT nosuchcolumn FROM nosuchtable",
    "SELECT '\ud800'",  # a lone surrogate, as JSON can deliver it: no driver can encode it
    "SELECT " + "(" * 1500 + "1" + ")" * 1500,
])
def test_bad_statements_raise_only_sql_errors(backend, sql):
    session = backend.open([SCHOOLS], writable=False)
    try:
        with pytest.raises(SQLError):
            session.execute(sql, max_rows=1, timeout_s=5)
    finally:
        session.close()


# -- SQLite: the authorizer and the read-only source file --------------------------------------


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("writable", [False, True])
def test_sqlite_authorizer_refuses_what_the_env_would_refuse(tmp_path, writable):
    backend = SQLiteBackend(tmp_path / "cache")
    source = backend.source_path([SCHOOLS])
    before = file_digest(source)
    session = backend.open([SCHOOLS], writable=writable)
    vacuum_target = tmp_path / "stolen.db"
    refused = [
        f"DROP TABLE {T}",
        "CREATE TABLE x (a)",
        f"ATTACH DATABASE '{source}' AS src",
        "PRAGMA writable_schema = ON",
        "SELECT load_extension('/nonexistent/ext')",
        f"VACUUM INTO '{vacuum_target}'",
        "UPDATE sqlite_master SET sql = ''",
        "BEGIN",
        f"SELECT 1; DELETE FROM {T}",
        "SELECT zeroblob(100000000)",
    ]
    try:
        for sql in refused:
            with pytest.raises(SQLError):
                session.execute(sql, max_rows=10, timeout_s=2)
        assert session.table_hash("School Location Table") == rows_hash(STORED_ROWS)
    finally:
        session.close()
    assert not vacuum_target.exists()
    assert file_digest(source) == before


def test_sqlite_write_refusal_names_the_reason(tmp_path):
    session = SQLiteBackend(tmp_path).open([SCHOOLS], writable=False)
    try:
        with pytest.raises(SQLError, match="read-only"):
            session.execute(f"UPDATE {T} SET Students = 0", max_rows=0, timeout_s=2)
    finally:
        session.close()


@pytest.mark.parametrize(
    "sql, units",
    [
        # COUNT(*) reads the table but no column.
        (f"SELECT COUNT(*) FROM {T}", {"table:School Location Table"}),
        (f"SELECT * FROM {T} LIMIT 1", {"table:School Location Table"}
         | {f"column:School Location Table.{c}" for c in SCHOOLS.column_names}),
        # The schema table and tables that do not belong to the task are not units.
        ("SELECT name FROM sqlite_master", set()),
        (f"UPDATE {T} SET Students = 1 WHERE School = 'x'",
         {"table:School Location Table", "column:School Location Table.Students",
          "column:School Location Table.School"}),
        (f"INSERT INTO {T} (School) VALUES ('x')", {"table:School Location Table"}),
    ],
)
def test_sqlite_units_come_from_the_authorizer(tmp_path, sql, units):
    session = SQLiteBackend(tmp_path).open([SCHOOLS], writable=True)
    try:
        assert session.execute(sql, max_rows=1, timeout_s=2).units == units
    finally:
        session.close()


def test_sqlite_source_is_built_once_and_read_only_on_disk(tmp_path):
    backend = SQLiteBackend(tmp_path)
    path = backend.source_path([SCHOOLS])
    mtime = path.stat().st_mtime_ns
    assert backend.source_path([SCHOOLS]) == path and path.stat().st_mtime_ns == mtime
    assert path.stat().st_mode & 0o222 == 0
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left behind


def test_duckdb_configuration_is_locked(tmp_path):
    pytest.importorskip("duckdb")
    from tiderl.envs.db.duckdb_backend import DuckDBBackend

    (tmp_path / "data.csv").write_text("a\n1\n")
    for writable in (False, True):
        session = DuckDBBackend(tmp_path / "cache").open([SCHOOLS], writable=writable)
        try:
            for sql in ["SET enable_external_access = true", f"SELECT * FROM read_csv('{tmp_path / 'data.csv'}')",
                        f"ATTACH '{tmp_path / 'x.duckdb'}' AS x", f"COPY {T} TO '{tmp_path / 'out.csv'}'"]:
                with pytest.raises(SQLError):
                    session.execute(sql, max_rows=1, timeout_s=5)
        finally:
            session.close()
    assert not (tmp_path / "out.csv").exists() and not (tmp_path / "x.duckdb").exists()
