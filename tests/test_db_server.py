"""A user's PostgreSQL and MariaDB databases as read-only question sources (`ServerBackend`),
on throwaway servers these tests start (skipped with the reason when the server binaries or
the drivers are missing: `make db-servers` installs both).

Each server gets a small music database (a serial key, decimals, dates, NULLs, duplicates, a
quote in a name) and a read-only role; a SQLite file holds the same rows. The tests check: the
adversarial statements leave every table's checksum unchanged, through the env and straight
at a session, as the superuser and as the reader; an episode's writes are seen by its own later
statements and by no other episode; the oracle through `tiderl eval --db URL --oracle` reaches
the ceiling of the SQLite copy; gold results and write-task table hashes agree across SQLite,
PostgreSQL and MariaDB; time and size limits hold on the server.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from types import SimpleNamespace

import pytest

from tiderl.envs.db.backend import ROW_COUNT_CAP, SQLError, database_hash, rows_hash
from tiderl.envs.db.env import DBEnv, open_database
from tiderl.envs.db.oracle import oracle_turns, replay_turns
from tiderl.envs.db.questions import load_questions
from tiderl.envs.db.scoring import result_sets_match
from tiderl.envs.db.server_backend import ServerBackend, ServerSession, redact_url, server_dialect
from tiderl.envs.db.servers import SkipServer, ThrowawayMariaDB, ThrowawayPostgres
from tiderl.envs.db.tools import Limits
from tiderl.envs.protocol import Action, ToolCall

READER = "tiderl_reader"

SINGERS = [
    (1, "Ana", "France", 1948, "10.50", "1970-05-01"),
    (2, "Bo", "Sweden", 1975, "3.25", "1995-09-12"),
    (3, "Cy", "France", 1990, None, None),
    (4, "Di", "Chile", 1962, "7.00", "1981-01-30"),
    (5, "Ed O'Neil", None, 1948, "0.33", "1966-11-11"),
    (6, "Fé", "Chile", 2001, "1200.75", "2019-03-03"),
]
CONCERTS = [
    (1, 1, 2019, "Olympia", 55.5), (2, 1, 2021, "Bercy", 80.0), (3, 2, 2021, "Globen", None),
    (4, 4, 2022, "Olympia", 42.25), (5, 4, 2022, "Olympia", 42.25), (6, 6, 2023, "Movistar Arena", 99.125),
]
# Column types per dialect: a generated key (serial / AUTO_INCREMENT / SQLite's rowid alias).
DDL = {
    "postgresql": ["CREATE TABLE singer (id SERIAL PRIMARY KEY, name VARCHAR(40) NOT NULL, country VARCHAR(40), "
                   "birth_year INTEGER, net_worth NUMERIC(10,2), debut DATE)",
                   "CREATE TABLE concert (id INTEGER PRIMARY KEY, singer_id INTEGER REFERENCES singer (id), "
                   "year INTEGER, venue VARCHAR(40), ticket_price DOUBLE PRECISION)"],
    "mysql": ["CREATE TABLE singer (id INT AUTO_INCREMENT PRIMARY KEY, name VARCHAR(40) NOT NULL, country VARCHAR(40), "
              "birth_year INT, net_worth DECIMAL(10,2), debut DATE) ENGINE=InnoDB",
              "CREATE TABLE concert (id INT PRIMARY KEY, singer_id INT, year INT, venue VARCHAR(40), "
              "ticket_price DOUBLE) ENGINE=InnoDB"],
    "sqlite": ["CREATE TABLE singer (id INTEGER PRIMARY KEY, name VARCHAR(40) NOT NULL, country VARCHAR(40), "
               "birth_year INTEGER, net_worth DECIMAL(10,2), debut DATE)",
               "CREATE TABLE concert (id INTEGER PRIMARY KEY, singer_id INTEGER, year INTEGER, venue VARCHAR(40), "
               "ticket_price DOUBLE)"],
}
TABLES = ("concert", "singer")

# (id, question, gold SQL that runs unchanged on SQLite, PostgreSQL and MariaDB)
QUESTIONS = [
    ("count", "How many singers are there?", "SELECT count(*) FROM singer"),
    ("french", "French singers, alphabetically.", "SELECT name FROM singer WHERE country = 'France' ORDER BY name"),
    ("old", "Singers born before 1970 and their years.", "SELECT name, birth_year FROM singer WHERE birth_year < 1970"),
    ("avg", "Average net worth.", "SELECT avg(net_worth) FROM singer"),
    ("stateless", "Singers without a country.", "SELECT name FROM singer WHERE country IS NULL"),
    ("venues", "Venues of all concerts, with repeats.", "SELECT venue FROM concert"),
    ("per_singer", "Concerts per singer, most first.",
     "SELECT singer_id, count(*) AS n FROM concert GROUP BY singer_id ORDER BY n DESC, singer_id"),
    ("null_worth", "Net worth of Cy.", "SELECT net_worth FROM singer WHERE name = 'Cy'"),
    ("no_concert", "Singers who never gave a concert.",
     "SELECT name FROM singer WHERE id NOT IN (SELECT singer_id FROM concert)"),
    ("latest", "Latest concert year per venue.", "SELECT venue, max(year) FROM concert GROUP BY venue"),
    ("empty", "Singers born in 2050.", "SELECT name FROM singer WHERE birth_year = 2050"),
    ("takings", "Sum of the ticket prices.", "SELECT sum(ticket_price) FROM concert"),
    ("debuts", "Debuts after 1980, in order.",
     "SELECT name, debut FROM singer WHERE debut > '1980-01-01' ORDER BY debut"),
    ("case", "Chilean singers (identifiers in another case).",
     "SELECT Name, Birth_Year FROM singer WHERE COUNTRY = 'Chile'"),
    ("quote", "The singer with an apostrophe.", "SELECT name FROM singer WHERE name LIKE '%O''Neil%'"),
    ("join", "Who played where in 2022.",
     "SELECT s.name, c.venue FROM singer s JOIN concert c ON c.singer_id = s.id WHERE c.year = 2022"),
    ("decimal", "Net worth of the richest singer.", "SELECT max(net_worth) FROM singer"),
]
WRITES = [
    ("delete", "DELETE", "Delete the concerts of 2022.", "DELETE FROM concert WHERE year = 2022"),
    ("insert", "INSERT", "Add Gil from Peru, born 1999 (the key is generated).",
     "INSERT INTO singer (name, country, birth_year) VALUES ('Gil', 'Peru', 1999)"),
    ("update", "UPDATE", "Double the ticket prices at the Olympia.",
     "UPDATE concert SET ticket_price = ticket_price * 2 WHERE venue = 'Olympia'"),
]


def _load(server, kind):
    server.create_database("music")
    for ddl in DDL[kind]:
        server.execute(ddl, database="music")
    mark = "%s"
    columns = "(id, name, country, birth_year, net_worth, debut)"
    server.execute(f"INSERT INTO singer {columns} VALUES ({', '.join([mark] * 6)})", database="music", many=SINGERS)
    server.execute(f"INSERT INTO concert VALUES ({', '.join([mark] * 5)})", database="music", many=CONCERTS)
    if kind == "postgresql":
        server.execute("SELECT setval('singer_id_seq', 6)", database="music")
        server.execute(f"CREATE ROLE {READER} LOGIN")
        server.execute(f"GRANT SELECT ON ALL TABLES IN SCHEMA public TO {READER}", database="music")
    else:
        server.execute(f"CREATE USER '{READER}'@'localhost'")
        server.execute(f"GRANT SELECT, CREATE TEMPORARY TABLES ON music.* TO '{READER}'@'localhost'")


def _sqlite_copy(path):
    conn = sqlite3.connect(path)
    for ddl in DDL["sqlite"]:
        conn.execute(ddl)
    conn.executemany("INSERT INTO singer VALUES (?, ?, ?, ?, ?, ?)",
                     [r[:4] + (None if r[4] is None else float(r[4]), r[5]) for r in SINGERS])
    conn.executemany("INSERT INTO concert VALUES (?, ?, ?, ?, ?)", CONCERTS)
    conn.commit()
    conn.close()


@pytest.fixture(scope="module", params=["postgresql", "mariadb"])
def server(request, tmp_path_factory):
    """A throwaway server with the music database, its URLs (superuser and reader), a SQLite
    copy of the same rows and the questions file."""
    kind = "postgresql" if request.param == "postgresql" else "mysql"
    try:
        running = ThrowawayPostgres() if kind == "postgresql" else ThrowawayMariaDB()
    except SkipServer as exc:
        pytest.skip(f"{request.param}: {exc}")
    try:
        started = time.perf_counter()
        _load(running, kind)
        folder = tmp_path_factory.mktemp(f"db_server_{request.param}")
        _sqlite_copy(folder / "music.sqlite")
        questions = folder / "questions.jsonl"
        lines = [{"id": i, "question": q, "sql": sql} for i, q, sql in QUESTIONS]
        lines += [{"id": i, "type": t, "question": q, "sql": sql} for i, t, q, sql in WRITES]
        lines.append({"id": "given", "question": "Countries of Ana and Bo.", "answer": ["France", "Sweden"]})
        questions.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
        yield SimpleNamespace(
            name=request.param, kind=kind, server=running, folder=folder, questions=questions,
            sqlite=folder / "music.sqlite", admin_url=running.url(database="music"),
            reader_url=running.url(user=READER, database="music"), load_s=time.perf_counter() - started)
    finally:
        running.stop()


def checksums(server):
    """Every table of the music database (the catalog's list, so a new or dropped table shows)
    with its column names and the order-independent hash of its rows, read as the superuser."""
    if server.kind == "postgresql":
        names = [r[0] for r in server.server.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname NOT IN ('pg_catalog', 'information_schema') "
            "ORDER BY tablename", database="music")]
    else:
        names = [r[0] for r in server.server.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = 'music' ORDER BY table_name",
            database="music")]
    out = {}
    for name in names:
        rows = server.server.execute(f"SELECT * FROM {name}", database="music")
        out[name] = (len(rows), rows_hash(rows))
    return out


def _sql(env, query):
    return env.step(Action(text="", tool_calls=[ToolCall("execute_sql", {"query": query})])).observations[0]


def _commit(env, answers):
    return env.step(Action(text="", tool_calls=[ToolCall("commit_final_answer", {"answers": answers})]))


def _tasks(server, backend):
    return {t.task_id: t for t in load_questions(server.questions, backend)}


# -- the adversarial list ---------------------------------------------------------------------------------

# Statements an agent might send: the file backends' list (DDL, DML, DROP, ATTACH, PRAGMA, VACUUM,
# several statements, a 50,000-character query), then what a server adds: transaction and
# session control, sleeps, huge results and values, locks, server files, other sessions, and
# quoting tricks where a client's reading of the text and the server's differ.
ADVERSARIAL = [
    "DROP TABLE singer", "DELETE FROM singer", "INSERT INTO singer (id, name) VALUES (99, 'x')",
    "UPDATE singer SET name = 'x'", "TRUNCATE singer", "TRUNCATE TABLE concert", "ALTER TABLE singer ADD COLUMN x INT",
    "ALTER TABLE singer RENAME TO gone", "CREATE TABLE evil (a INT)", "CREATE TEMPORARY TABLE evil (a INT)",
    "CREATE TABLE stolen AS SELECT * FROM singer", "CREATE INDEX evil ON singer (name)", "DROP DATABASE music",
    "ATTACH DATABASE 'other.db' AS o", "PRAGMA writable_schema = 1", "VACUUM", "VACUUM FULL singer", "ANALYZE singer",
    "WITH c AS (SELECT 1) DELETE FROM singer", "WITH d AS (DELETE FROM singer RETURNING *) SELECT * FROM d",
    "REPLACE INTO singer (id, name) VALUES (1, 'x')", "SELECT 1; DROP TABLE singer", "DELETE FROM singer; COMMIT",
    "SELECT E'\\'' ; DELETE FROM singer; --'", "SELECT 'a\\'; DELETE FROM singer; -- '",
    "SELECT 1 /*! ; DELETE FROM singer */", "SELECT * FROM singer WHERE name = '" + "x" * 50_000 + "'",
    "BEGIN", "COMMIT", "ROLLBACK", "END", "START TRANSACTION", "SAVEPOINT s", "RELEASE SAVEPOINT tiderl_statement",
    "ROLLBACK TO SAVEPOINT tiderl_statement", "SET TRANSACTION READ WRITE",
    "SET SESSION CHARACTERISTICS AS TRANSACTION READ WRITE", "SET default_transaction_read_only = off",
    "SET SESSION TRANSACTION READ WRITE", "SET autocommit = 1", "SET statement_timeout = 0", "RESET ALL",
    "SET ROLE tiderl_admin", "SET SESSION AUTHORIZATION tiderl_admin", "DISCARD ALL",
    "SELECT set_config('default_transaction_read_only', 'off', false)",
    "SELECT set_config('statement_timeout', '0', false)", "SELECT pg_sleep(30)", "SELECT SLEEP(30)",
    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity", "SELECT pg_advisory_lock(1)", "SELECT GET_LOCK('x', 1)",
    "SELECT pg_read_file('/etc/hostname')", "SELECT LOAD_FILE('/etc/hostname')", "SELECT lo_import('/etc/hostname')",
    "SELECT * FROM singer INTO OUTFILE '/tmp/tiderl_evil.csv'", "COPY singer TO '/tmp/tiderl_evil.csv'",
    "COPY singer FROM '/etc/hostname'", "LOAD DATA INFILE '/etc/hostname' INTO TABLE singer",
    "LOCK TABLE singer IN ACCESS EXCLUSIVE MODE", "LOCK TABLES singer WRITE", "SELECT * FROM singer FOR UPDATE",
    "SELECT nextval('singer_id_seq')", "SELECT setval('singer_id_seq', 1000)", "SELECT * INTO TEMP stolen FROM singer",
    "DO $$ BEGIN DELETE FROM singer; END $$", "PREPARE p AS DELETE FROM singer", "EXECUTE p", "CALL evil()",
    "GRANT ALL ON singer TO PUBLIC", "REVOKE SELECT ON singer FROM tiderl_reader", "LISTEN x", "NOTIFY x",
    "KILL 1", "HANDLER singer OPEN", "SHOW TABLES", "FLUSH TABLES", "DELETE FROM public.singer",
    "UPDATE public.singer SET name = 'x'", "INSERT INTO public.concert (id) VALUES (99)", "DELETE FROM music.singer",
    "UPDATE music.concert SET year = 0", "SELECT repeat('x', 50000000)", "SELECT * FROM generate_series(1, 100000000)",
    "SELECT seq FROM seq_1_to_100000000",
    "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c",
    "SELECT U&\"\\0070g_terminate_backend\"(1)",
]
# The statements that succeed in a write task: writes that land in the episode's own copy (on
# MySQL the copy also hides the table under its qualified name; REPLACE is MySQL's, WITH ... DELETE
# PostgreSQL's).
COPY_WRITES = {"DELETE FROM singer", "INSERT INTO singer (id, name) VALUES (99, 'x')", "UPDATE singer SET name = 'x'"}
COPY_WRITES_OF = {"postgresql": COPY_WRITES | {"WITH c AS (SELECT 1) DELETE FROM singer"},
                  "mysql": COPY_WRITES | {"REPLACE INTO singer (id, name) VALUES (1, 'x')", "DELETE FROM music.singer",
                                    "UPDATE music.concert SET year = 0"}}
LIMITS = Limits(timeout_s=0.5)


@pytest.mark.slow
@pytest.mark.parametrize("role", ["admin", "reader"])
def test_adversarial_statements_leave_every_table_unchanged(server, role):
    before = checksums(server)
    backend = ServerBackend(server.admin_url if role == "admin" else server.reader_url)
    env = DBEnv(backend, limits=LIMITS)
    tasks = _tasks(server, backend)
    started = time.perf_counter()
    for task_id in ("count", "delete"):
        env.reset(tasks[task_id])
        for statement in ADVERSARIAL:
            observation = _sql(env, statement)
            allowed = task_id == "delete" and statement in COPY_WRITES_OF[server.kind]
            assert observation.startswith("OK: ") == allowed, (task_id, statement, observation[:300])
            if not observation.startswith(("OK: ", "Error: ")):  # a result: only plain reads get one
                assert statement.startswith(("SELECT", "WITH")) and "INTO" not in statement, \
                    (statement, observation[:300])
        env.finish("max_turns")
    elapsed = time.perf_counter() - started
    assert checksums(server) == before
    # A fresh episode sees the original rows, and the backend holds no session any more.
    env.reset(tasks["count"])
    assert _commit(env, [len(SINGERS)]).reward == 1.0
    assert backend._slots._value == backend.max_sessions
    print(f"\n{server.name} as {role}: {2 * len(ADVERSARIAL)} adversarial statements in {elapsed:.1f} s, "
          f"checksums unchanged: {sorted((k, v[0], v[1][:12]) for k, v in before.items())}")


@pytest.mark.slow
@pytest.mark.parametrize("writable", [False, True])
def test_the_server_alone_holds_without_the_session_check(server, writable, monkeypatch):
    """The same statements straight at a session with its own statement check switched off, as the
    superuser on PostgreSQL (the read-only transaction is what refuses) and as the reader on MariaDB
    (where a statement that ends the transaction could otherwise change the session's access mode,
    so the role is what refuses)."""
    monkeypatch.setattr(ServerSession, "_check", lambda self, sql: "read" if sql.lstrip().upper().startswith(
        ("SELECT", "WITH", "VALUES")) else "write")
    before = checksums(server)
    url = server.admin_url if server.kind == "postgresql" else server.reader_url
    backend = ServerBackend(url, isolate=False)
    # A superuser may read and write server files and end other sessions: not this test's subject.
    risky = ("OUTFILE", "COPY singer TO", "pg_read_file", "LOAD_FILE", "lo_import", "pg_terminate_backend")
    session = backend.open([], writable)
    ended = 0
    for statement in ADVERSARIAL:
        if server.kind == "postgresql" and any(r in statement for r in risky):
            continue
        if session.closed:
            ended += 1
            session.close()
            session = backend.open([], writable)
        try:
            session.execute(statement, max_rows=5, timeout_s=0.5)
        except SQLError:
            pass
    session.close()
    assert checksums(server) == before
    print(f"\n{server.name}: without the session check, sessions ended by the server-side guard: {ended}")


def test_writes_are_seen_by_the_episode_and_by_nobody_else(server):
    backend = ServerBackend(server.reader_url)
    tasks = _tasks(server, backend)
    writer, reader = DBEnv(backend), DBEnv(backend)
    writer.reset(tasks["insert"])
    reader.reset(tasks["count"])
    assert _sql(writer, "INSERT INTO singer (name, country, birth_year) VALUES ('Gil', 'Peru', 1999)") == \
        "OK: 1 row affected."
    assert '"Gil"' in _sql(writer, "SELECT id, name FROM singer WHERE name = 'Gil'")
    assert "[7]" in _sql(writer, "SELECT id FROM singer WHERE name = 'Gil'")  # the copied counter goes on at 7
    assert '"Gil"' not in _sql(reader, "SELECT name FROM singer WHERE name = 'Gil'")
    assert _sql(reader, "SELECT count(*) FROM singer").endswith("[6]")
    second = DBEnv(backend)
    second.reset(tasks["insert"])
    assert _sql(second, "SELECT count(*) FROM singer").endswith("[6]")  # another write episode: its own copy
    assert _commit(writer, []).reward == 1.0
    assert _commit(second, []).reward == 0.0
    assert _commit(reader, [6]).reward == 1.0
    assert checksums(server)["singer"][0] == len(SINGERS)


@pytest.mark.slow
def test_oracle_ceiling_equals_the_sqlite_copy_through_the_cli(server, tmp_path):
    from tiderl.cli import main

    ceilings = {}
    for name, source in (("sqlite", str(server.sqlite)), (server.name, server.reader_url)):
        out = tmp_path / f"{name}.json"
        started = time.perf_counter()
        code = main(["eval", "--env", "db", "--db", source, "--questions", str(server.questions), "--oracle",
                     "--json", str(out), f"run_dir={tmp_path / name}", "data.eval_size=100"])
        assert code == 0
        greedy = json.loads(out.read_text())["greedy"]
        ceilings[name] = (greedy["success"], greedy["n"], time.perf_counter() - started)
    assert ceilings["sqlite"][:2] == ceilings[server.name][:2] == (1.0, len(QUESTIONS) + len(WRITES) + 1)
    print("\noracle ceiling: " + ", ".join(f"{k} {s:.3f} ({n} questions, {t:.1f} s)" for k, (s, n, t) in
                                           ceilings.items()))


def test_gold_results_and_write_hashes_agree_across_dialects(server):
    """The result-set rules hold for server types (decimals, dates, NULLs, identifier case): each
    question's gold rows on the server match those on SQLite, and after each gold write the
    tables hash alike."""
    remote, local = ServerBackend(server.reader_url), open_database(server.sqlite)
    gold_remote, gold_local = _tasks(server, remote), _tasks(server, local)
    for question_id, _, sql in QUESTIONS:
        ours, theirs = gold_remote[question_id].answer, gold_local[question_id].answer
        assert ours["ordered"] == theirs["ordered"]
        assert result_sets_match(ours["rows"], theirs["rows"], ordered=ours["ordered"]), (question_id, ours, theirs)
    for question_id, _, _, sql in WRITES:
        hashes = []
        for backend in (remote, local):
            session = backend.open([], writable=True)
            try:
                session.execute(sql, max_rows=0, timeout_s=5)
                hashes.append(database_hash(session, list(TABLES)))
            finally:
                session.close()
        assert hashes[0] == hashes[1], question_id


def test_limits_hold_on_the_server(server):
    backend = ServerBackend(server.reader_url)
    session = backend.open([], False)
    try:
        sleep = "SELECT pg_sleep(5)" if server.kind == "postgresql" else "SELECT SLEEP(5)"
        started = time.perf_counter()
        with pytest.raises(SQLError, match="longer than the 0.3 s limit"):
            session.execute(sleep, max_rows=5, timeout_s=0.3)
        assert time.perf_counter() - started < 1.5
        many = ("SELECT g FROM generate_series(1, 10000000) g" if server.kind == "postgresql"
                else "SELECT seq FROM seq_1_to_10000000")
        started = time.perf_counter()
        result = session.execute(many, max_rows=20, timeout_s=5)
        assert len(result.rows) == 20 and result.more_rows == ROW_COUNT_CAP and result.more_rows_capped
        big = "SELECT repeat('x', 2000000)"
        with pytest.raises(SQLError, match="too big"):
            session.execute(big, max_rows=5, timeout_s=5)
        assert session.execute("SELECT count(*) FROM singer", max_rows=5, timeout_s=1).rows == [(6,)]  # goes on
        print(f"\n{server.name}: 10 million rows counted to the cap in {time.perf_counter() - started:.2f} s")
    finally:
        session.close()


def test_server_urls_and_mistakes_name_the_fix(server):
    assert server_dialect("postgresql+psycopg://u@h/db") == "postgresql" and server_dialect("mariadb://h/db") == "mysql"
    assert server_dialect("sqlite:///x.db") is None and server_dialect("/path/file.sqlite") is None
    assert redact_url("mysql://bob:s3cret@host/db") == "mysql://bob:***@host/db"
    bad = server.reader_url.replace("/music", "/nonexistent")
    with pytest.raises(ValueError, match="cannot connect|Fix"):
        ServerBackend(bad)
    backend = ServerBackend(server.reader_url, max_sessions=1, wait_s=0.2)
    session = backend.open([], False)
    with pytest.raises(RuntimeError, match="max_sessions"):
        backend.open([], False)
    session.close()
    backend.open([], False).close()
    assert backend.tables and {t.name for t in backend.tables} == set(TABLES)
    expected = {"postgresql": "PostgreSQL: quote names with double quotes",
                "mysql": "MariaDB: quote names with backticks"}
    assert expected[server.kind] in DBEnv(backend).system_prompt()
    # Every scheme of the dialect reaches the same server (a SQLAlchemy driver suffix is ignored).
    schemes = (("postgresql", "postgres", "postgresql+psycopg") if server.kind == "postgresql"
               else ("mysql", "mariadb", "mysql+pymysql"))
    for scheme in schemes:
        url = scheme + server.reader_url[server.reader_url.index("://"):]
        other = ServerBackend(url, isolate=False)
        session = other.open([], False)
        assert session.execute("SELECT count(*) FROM singer", max_rows=5, timeout_s=2).rows == [(6,)], url
        session.close()
        other.release_idle()


@pytest.mark.slow
def test_concurrent_episodes_against_one_server(server):
    """Many episodes in flight at once (threads, as the rollout runs them), each isolated: every
    oracle episode succeeds. Measures episodes/s against the same episodes on the SQLite copy."""
    rates = {}
    for name, backend in (("sqlite", open_database(server.sqlite)), (server.name, ServerBackend(server.reader_url))):
        tasks = list(_tasks(server, backend).values())
        scripts = [(task, oracle_turns(task, backend)) for task in tasks]
        episodes = scripts * 3
        failures = []
        lock = threading.Lock()

        def work(part):
            for task, turns in part:
                reward = replay_turns(DBEnv(backend), task, turns).reward
                if reward != 1.0:
                    with lock:
                        failures.append(task.task_id)

        threads = [threading.Thread(target=work, args=(episodes[i::8],)) for i in range(8)]
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        elapsed = time.perf_counter() - started
        assert failures == []
        rates[name] = len(episodes) / elapsed
    print("\nepisodes/s with 8 in flight: " + ", ".join(f"{k} {v:.1f}" for k, v in rates.items()))


def test_the_server_setup_passes_the_environment_contract(server):
    from tiderl.config import load_config
    from tiderl.envs.check import assert_environment
    from tiderl.envs.setup import load_setup

    overrides = ("data.source=db_file", f"env.options.db_path={server.reader_url}",
                 f"env.options.questions={server.questions}", "data.eval_size=6")
    assert assert_environment("db", *overrides, episodes=3).ok
    setup = load_setup(load_config(None, ["env.name=db", *overrides]))
    assert setup.eval_chunk_size == 32  # at most max_sessions episodes at once in tiderl eval
    assert {t.meta["database"] for t in setup.eval_tasks} == {server.reader_url}


def test_missing_servers_and_drivers_name_the_fix(monkeypatch):
    """Without the binaries the fixture skips with the fix (`make db-servers`, TIDERL_PG_BIN);
    without a driver the backend says which package to install. No server is started."""
    import sys

    from tiderl.envs.db import servers

    monkeypatch.delenv("TIDERL_PG_BIN", raising=False)
    monkeypatch.delenv("TIDERL_MYSQL_BIN", raising=False)
    monkeypatch.setattr(servers.shutil, "which", lambda name: None)
    monkeypatch.setattr(servers.glob, "glob", lambda pattern: [])
    monkeypatch.setattr(servers, "_executable", lambda folder, name: None)
    with pytest.raises(SkipServer, match="make db-servers.*TIDERL_PG_BIN"):
        ThrowawayPostgres()
    with pytest.raises(SkipServer, match="make db-servers.*TIDERL_MYSQL_BIN"):
        ThrowawayMariaDB()
    monkeypatch.setitem(sys.modules, "psycopg", None)
    monkeypatch.setitem(sys.modules, "pymysql", None)
    with pytest.raises(ImportError, match=r"pip install 'psycopg\[binary\]'"):
        ServerBackend("postgresql://u@/db")
    with pytest.raises(ImportError, match="pip install 'PyMySQL'"):
        ServerBackend("mysql://u@localhost/db")
    with pytest.raises(ValueError, match="not a PostgreSQL or MySQL URL") as info:
        ServerBackend("oracle://u:secret@h/db")
    assert "secret" not in str(info.value)


# -- the connection pool ----------------------------------------------------------------------------------


def _reader_connections(server):
    """Connections the reader role holds on the server now (read as the superuser)."""
    if server.kind == "postgresql":
        sql = f"SELECT count(*) FROM pg_stat_activity WHERE usename = '{READER}'"
    else:
        sql = f"SELECT count(*) FROM information_schema.processlist WHERE user = '{READER}'"
    return int(server.server.execute(sql)[0][0])


@pytest.mark.parametrize("isolate", [False, True], ids=["in_process", "worker"])
def test_pooled_connections_are_reset_between_episodes(server, isolate):
    """One connection serves episode after episode, and nothing of one episode reaches the next:
    not its writes (the temporary copies are dropped), not its session state (a MySQL user
    variable; PostgreSQL's temporary sequences and prepared statements), not its transaction."""
    backend = ServerBackend(server.reader_url, isolate=isolate, max_sessions=4, pool_size=1)
    tasks = _tasks(server, backend)
    backend_id = "SELECT pg_backend_pid()" if server.kind == "postgresql" else "SELECT CONNECTION_ID()"
    ids = set()
    for round_ in range(3):
        writer = DBEnv(backend)
        writer.reset(tasks["insert"])
        assert _sql(writer, "INSERT INTO singer (name, country, birth_year) VALUES ('Gil', 'Peru', 1999)") == \
            "OK: 1 row affected."
        assert "[7]" in _sql(writer, "SELECT id FROM singer WHERE name = 'Gil'")  # a fresh copy, counter at 7
        ids.add(_sql(writer, backend_id).splitlines()[-1])
        if server.kind == "mysql":
            assert _sql(writer, "SELECT @seen").endswith("[null]")  # the last episode's variable is gone
            _sql(writer, "SELECT @seen := 'episode %d'" % round_)
        assert _commit(writer, []).reward == 1.0
        reader = DBEnv(backend)
        reader.reset(tasks["count"])
        ids.add(_sql(reader, backend_id).splitlines()[-1])
        assert _sql(reader, "SELECT count(*) FROM singer").endswith("[6]")
        if server.kind == "mysql":
            assert _sql(reader, "SELECT @seen").endswith("[null]")
        assert _commit(reader, [6]).reward == 1.0
    assert len(ids) == 1, ids  # the same server connection every time
    if not isolate:
        assert backend.connections_opened == 1
    assert checksums(server)["singer"][0] == len(SINGERS)


def test_more_episodes_in_flight_than_sessions_all_finish_isolated(server):
    """12 write episodes at once on a backend of 4 sessions and a pool of 2: all finish (the rest
    wait for a session), each sees its own insert and none of the others', and the server never
    holds more than 4 of the backend's connections."""
    baseline = _reader_connections(server)
    backend = ServerBackend(server.reader_url, isolate=False, max_sessions=4, pool_size=2)
    tasks = _tasks(server, backend)
    peak, stop, errors, seen = [0], threading.Event(), [], {}

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], _reader_connections(server) - baseline)
            time.sleep(0.005)

    def episode(number):
        try:
            env = DBEnv(backend)
            env.reset(tasks["insert"])
            _sql(env, f"INSERT INTO singer (name, country, birth_year) VALUES ('N{number}', 'X', 2000)")
            time.sleep(0.05)  # stay in flight while the others run
            seen[number] = _sql(env, "SELECT name FROM singer WHERE country = 'X'")
            env.close()
        except Exception as exc:  # reported below
            errors.append(repr(exc))

    watcher = threading.Thread(target=watch)
    watcher.start()
    threads = [threading.Thread(target=episode, args=(n,)) for n in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    stop.set()
    watcher.join()
    assert errors == []
    assert all(seen[n].startswith("1 row") and f'"N{n}"' in seen[n] for n in range(12)), seen
    assert 1 <= peak[0] <= 4, peak
    assert len(backend._idle) <= 2 and backend.connections_opened <= 12
    backend.release_idle()
    assert checksums(server)["singer"][0] == len(SINGERS)


# -- training against a server ----------------------------------------------------------------------------


@pytest.mark.slow
def test_tiderl_train_on_a_server_database(server, tmp_path):
    """`tiderl train` with a tiny model for 2 steps on the server's questions (data.train_files and
    data.eval_files, env.options.db_path=URL): 8 episodes in flight on 8 sessions and a pool of 2
    connections, the ledger balanced, every table's checksum unchanged."""
    if server.kind != "postgresql":
        pytest.skip("training is exercised on PostgreSQL (MariaDB's sessions are the same code path)")
    from tiderl.cli import main
    from tiderl.embedded.tiny import init_tiny_model, tiny_qwen2_config, train_tokenizer
    from tiderl.envs.db.env import DEFAULT_SYSTEM_PROMPT
    from tiderl.models.loading import save_model_dir

    lines = server.questions.read_text().splitlines()
    train_file, eval_file = tmp_path / "train.jsonl", tmp_path / "held.jsonl"
    train_file.write_text("\n".join(lines[:14]) + "\n")
    eval_file.write_text("\n".join(lines[14:]) + "\n")
    texts = [DEFAULT_SYSTEM_PROMPT, *(json.loads(x)["question"] for x in lines), *(sql for _, _, sql in QUESTIONS)]
    tokenizer = train_tokenizer(texts * 2, vocab_size=600)
    model = save_model_dir(init_tiny_model(tiny_qwen2_config(len(tokenizer), hidden_size=32, num_layers=1, num_heads=2,
                                                             num_kv_heads=1, max_position_embeddings=4096), seed=0),
                           tokenizer, tmp_path / "model")
    before = checksums(server)
    baseline = _reader_connections(server)
    peak, stop = [0], threading.Event()

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], _reader_connections(server) - baseline)
            time.sleep(0.01)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        code = main(["train", f"--run-dir={tmp_path / 'run'}", "env.name=db", "data.source=db_file",
                     f"env.options.db_path={server.reader_url}", "env.options.max_sessions=8", "env.options.pool_size=2",
                     f"data.train_files=[{train_file}]", f"data.eval_files=[{eval_file}]", f"model.path={model}",
                     "algo.name=grpo", "algo.group_size=2", "rollout.batch_size=8", "rollout.max_new_tokens=8",
                     "env.max_turns=2", "env.max_total_tokens=3000", "train.micro_batch_tokens=8192", "train.steps=2",
                     "train.save_final=false", "eval.every=0", "log.progress=false", "log.tensorboard=false",
                     "system.trainer_threads=1"])
    finally:
        stop.set()
        watcher.join()
    assert code == 0
    summary = json.loads((tmp_path / "run" / "system.json").read_text())
    ledger = summary["ledger"]
    assert ledger["trained"] == 16 and ledger["unsettled"] == 0
    assert ledger["started"] == sum(v for k, v in ledger.items() if k not in ("started", "unsettled")), ledger
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in rows) == 2
    assert 2 <= peak[0] <= 8, peak  # episodes ran at once, never past max_sessions
    assert checksums(server) == before
    print(f"\ntrain on {server.name}: 2 steps, ledger {ledger}, at most {peak[0]} connections at once")


# -- the concurrency benchmark ----------------------------------------------------------------------------


@pytest.mark.slow
def test_db_servers_benchmark_quick():
    """benchmarks/db_servers.py --quick: starts its own servers, every oracle episode scores 1 (it
    raises otherwise), one row per backend at 1, 8 and 32 in flight, the ratio on the last line."""
    import importlib.util
    import re
    from pathlib import Path

    from tiderl.envs.db import servers

    for cls in (servers.ThrowawayPostgres, servers.ThrowawayMariaDB):
        try:
            (servers.find_postgres_bin if cls is servers.ThrowawayPostgres else servers.find_mysql_bin)()
        except SkipServer as exc:
            pytest.skip(str(exc))
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "db_servers.py"
    spec = importlib.util.spec_from_file_location("db_servers_benchmark", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    lines = bench.main(["--quick"])
    rows = {line.split()[0]: line for line in lines if line.split()[0] in ("sqlite", "postgresql", "mariadb")}
    assert set(rows) == {"sqlite", "postgresql", "mariadb"}, lines
    for line in rows.values():
        rates = [float(x) for x in re.findall(r"([\d.]+) e/s", line)]
        assert len(rates) == 3 and all(r > 0 for r in rates), line
    assert re.fullmatch(r"episodes/s at 32 in flight relative to SQLite: postgresql [\d.]+x, mariadb [\d.]+x",
                        lines[-1]), lines[-1]


def test_scratch_database_on_the_server_takes_percent_signs(server):
    """AgentBench DB as upstream runs it: task tables in a scratch database on the server (the
    SQLAlchemy backend). A literal % reaches the server as written, although PyMySQL and psycopg
    format statements with their parameters (`LIKE '%Cal%'` once failed as "unsupported format
    character")."""
    from tiderl.envs.db.backend import TableSpec
    from tiderl.envs.db.env import make_backend

    name = f"scratch_{server.kind}"
    server.server.create_database(name)
    url = server.server.url(database=name)
    url = url.replace("postgresql://", "postgresql+psycopg://").replace("mysql://", "mysql+pymysql://")
    backend = make_backend(url)
    spec = TableSpec("NBA Draft", (("player", "TEXT"), ("school", "TEXT")),
                     (("Ana", "California"), ("Bo", "Texas"), ("Cy", "100% Cal")))
    session = backend.open([spec], writable=False)
    try:
        quoted = '"NBA Draft"' if server.kind == "postgresql" else "`NBA Draft`"
        rows = session.execute(f"SELECT player FROM {quoted} WHERE school LIKE '%Cal%'", max_rows=5, timeout_s=5).rows
        assert sorted(r[0] for r in rows) == ["Ana", "Cy"]
        assert session.execute(f"SELECT count(*) FROM {quoted} WHERE school LIKE '100%%'", max_rows=5,
                               timeout_s=5).rows[0][0] == 1  # the agent's own %% is two wildcards, as written
    finally:
        session.close()


@pytest.mark.slow
@pytest.mark.data
def test_dbbench_dev_on_the_server_as_upstream_runs_it(server):
    """AgentBench DB's dev split with each task's table in a scratch database on the server (the
    SQLAlchemy backend), as upstream runs it on MySQL: the oracle's ceiling per backend, as
    docs/env_db.md reports it (skipped without the data)."""
    from tiderl.envs.db.env import make_backend
    from tiderl.envs.db.oracle import gold_matches_answer_md5, oracle_ceiling
    from tiderl.envs.db.tasks import dbbench_dir, load_dbbench_tasks

    folder = dbbench_dir()
    if not (folder / "dev.jsonl").is_file():
        pytest.skip(f"AgentBench dbbench not found under {folder} (set TIDERL_DATA_DIR to the folder holding "
                    "agentbench_dbbench/)")
    tasks = load_dbbench_tasks(folder, "dev")
    name = f"dbbench_{server.kind}"
    server.server.create_database(name)
    url = server.server.url(database=name)
    backend = make_backend(url.replace("postgresql://", "postgresql+psycopg://").replace("mysql://", "mysql+pymysql://"))
    report = oracle_ceiling(tasks, lambda: DBEnv(backend))
    md5 = [gold_matches_answer_md5(t, backend) for t in tasks]
    md5 = [m for m in md5 if m is not None]
    if server.kind == "mysql":  # dbbench's SQL is MySQL's: the writes all run, the hints as on SQLite
        assert round(report["success"] * 60) == 44 and list(report["by_type"]["INSERT"]) == [20, 20]
        assert sum(md5) == len(md5) == 40  # every gold table hashes to AgentBench's own answer_md5
    else:  # double-quoted strings and mixed-case bare names: almost nothing runs on PostgreSQL
        assert report["success"] < 0.05
    print(f"\ndbbench dev on {server.name}: {report['success']:.3f}, answer_md5 {sum(md5)}/{len(md5)}")
