"""What the server backends add that needs no server: answers compared across dialects (the
values PostgreSQL's and MySQL's drivers return against SQLite's), MySQL 8 against MariaDB, the
URL schemes of a MySQL-protocol server, the DB environment's server options, and question files
through `data.train_files` / `data.eval_files` on a SQLite file."""

from __future__ import annotations

import datetime
import json
import sqlite3
from decimal import Decimal

import pytest

from tiderl.config import ConfigError, load_config
from tiderl.envs.db.oracle import oracle_turns, replay_turns
from tiderl.envs.db.questions import json_cell
from tiderl.envs.db.scoring import result_sets_match
from tiderl.envs.db.server_backend import ServerBackend, is_mariadb, mysql_time_limit, server_dialect
from tiderl.envs.setup import load_setup

# One result as each driver returns it: SQLite (text dates, float decimals, 0/1 booleans), psycopg
# (Decimal, date, datetime, bool) and PyMySQL (Decimal, date, datetime, timedelta for TIME, 0/1).
SQLITE_ROWS = [[1, "Ana", 10.5, "1970-05-01", "1970-05-01 20:30:00", 1, "20:30:00", None],
               [2, "Bo", 3.25, "1995-09-12", "1995-09-12 08:00:00", 0, "08:00:00", 0.33]]
POSTGRES_ROWS = [[1, "Ana", Decimal("10.50"), datetime.date(1970, 5, 1), datetime.datetime(1970, 5, 1, 20, 30), True,
                  datetime.time(20, 30), None],
                 [2, "Bo", Decimal("3.25"), datetime.date(1995, 9, 12), datetime.datetime(1995, 9, 12, 8, 0), False,
                  datetime.time(8, 0), Decimal("0.330")]]
MYSQL_ROWS = [[1, "Ana", Decimal("10.50"), datetime.date(1970, 5, 1), datetime.datetime(1970, 5, 1, 20, 30), 1,
               datetime.timedelta(hours=20, minutes=30), None],
              [2, "Bo", Decimal("3.25"), datetime.date(1995, 9, 12), datetime.datetime(1995, 9, 12, 8, 0), 0,
               datetime.timedelta(hours=8), Decimal("0.33")]]


def _gold(rows):
    """A gold result as `load_questions` stores it: each cell through `json_cell`."""
    return [[json_cell(v) for v in row] for row in rows]


@pytest.mark.parametrize("server_rows", [POSTGRES_ROWS, MYSQL_ROWS], ids=["postgresql", "mysql"])
def test_server_typed_gold_rows_match_the_sqlite_rows(server_rows):
    gold = _gold(server_rows)
    assert gold[0][2] == "10.50" and gold[0][3] == "1970-05-01" and gold[0][4] == "1970-05-01 20:30:00"
    # Decimals against floats, dates and timestamps against text, booleans against 0/1, TIME both ways.
    assert result_sets_match(SQLITE_ROWS, gold)
    assert result_sets_match(_gold(SQLITE_ROWS), gold)
    assert result_sets_match(list(reversed(SQLITE_ROWS)), gold)  # no ORDER BY: a multiset
    assert not result_sets_match(list(reversed(SQLITE_ROWS)), gold, ordered=True)
    # What an agent commits after reading the observation (JSON: decimals and dates as text).
    assert result_sets_match(json.loads(json.dumps(gold)), _gold(SQLITE_ROWS))


@pytest.mark.parametrize("committed, gold, same", [
    ([[Decimal("0.1") + Decimal("0.2")]], [[0.30000000000000004]], True),  # decimal vs binary float
    ([["10.5"]], [[json_cell(Decimal("10.50"))]], True),                    # trailing zero of NUMERIC(10,2)
    ([["1E+1"]], [[10]], True),                                            # Decimal's exponent notation
    ([[None]], [[json_cell(None)]], True), ([["NULL"]], [[None]], True),    # NULL only as NULL or its name
    ([[0]], [[None]], False), ([[""]], [[None]], False),
    ([["1970-05-01"]], [[json_cell(datetime.date(1970, 5, 1))]], True),
    ([["1970-5-1"]], [[json_cell(datetime.date(1970, 5, 1))]], False),     # dates compare as their ISO text
    ([["1970-05-01"]], [[json_cell(datetime.datetime(1970, 5, 1))]], False),  # a timestamp keeps its time
    ([["FRANCE"]], [["France"]], True),                                    # text is case-folded
    ([["2019-03-03 10:00:00+00:00"]], [[json_cell(datetime.datetime(2019, 3, 3, 10, tzinfo=datetime.timezone.utc))]],
     True),
])
def test_cells_across_dialects(committed, gold, same):
    assert result_sets_match(committed, gold) is same


def test_identifier_case_is_not_compared():
    """`SELECT Name` on MySQL (column named as written) and `SELECT Name` on PostgreSQL (folded
    to `name`) give the same rows; only cells are compared, never column names."""
    assert result_sets_match([["Ana", 1948]], [["Ana", 1948]])
    assert not result_sets_match([[1948, "Ana"]], [["Ana", 1948]])  # column order counts


@pytest.mark.parametrize("version, mariadb, setting", [
    ("10.11.6-MariaDB-0+deb12u1", True, "max_statement_time = 2.000"),
    ("5.5.5-10.11.6-MariaDB", True, "max_statement_time = 2.000"),
    ("8.0.36", False, "max_execution_time = 2000"),
    ("8.4.0-log", False, "max_execution_time = 2000"),
])
def test_mysql_8_and_mariadb_get_their_own_time_limit(version, mariadb, setting):
    assert is_mariadb(version) is mariadb
    assert mysql_time_limit(is_mariadb(version), 2.0) == setting
    assert mysql_time_limit(False, 0.0001) == "max_execution_time = 1"  # never 0 (MySQL: no limit)


@pytest.mark.parametrize("url", ["mysql://u@localhost/db", "mysql+pymysql://u:pw@127.0.0.1:3306/db",
                                 "mariadb://u@localhost/db?unix_socket=m.sock", "MySQL://u@h/db",
                                 "mariadb+mariadbconnector://u@h/db"])
def test_mysql_protocol_url_schemes(url):
    assert server_dialect(url) == "mysql"


def test_server_backend_options_are_checked_before_connecting():
    with pytest.raises(ValueError, match="max_sessions=0"):
        ServerBackend("postgresql://u@/db", max_sessions=0)
    with pytest.raises(ValueError, match=r"pool_size=9: must be between 0 and max_sessions \(4\)"):
        ServerBackend("postgresql://u@/db", max_sessions=4, pool_size=9)


@pytest.mark.parametrize("override, message", [
    ("env.options.max_sessions=0", "env.options.max_sessions: is 0"),
    ("env.options.pool_size=-2", "env.options.pool_size: is -2"),
    ("env.options.pool_size=40", "env.options.pool_size: is 40, not between -1 and max_sessions"),
])
def test_db_server_options_name_the_field(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["env.name=db", "data.source=db_file", override])


def test_question_files_need_the_db_file_source():
    with pytest.raises(ConfigError, match="data.train_files: question files need a database.*data.source=db_file"):
        load_config(None, ["env.name=db", "data.train_files=[q.jsonl]"])
    with pytest.raises(ConfigError, match="data.fields: .*fixed field names"):
        load_config(None, ["env.name=db", "data.source=db_file", "data.fields={question: q}"])


def _music(path):
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE singer (id INTEGER PRIMARY KEY, name TEXT, country TEXT, birth_year INTEGER)")
    conn.executemany("INSERT INTO singer VALUES (?, ?, ?, ?)", [(1, "Ana", "France", 1948), (2, "Bo", "Sweden", 1975),
                                                               (3, "Cy", "France", 1990), (4, "Di", None, 1962)])
    conn.commit()
    conn.close()


def _questions(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


TRAIN = [{"question": "How many singers?", "sql": "SELECT count(*) FROM singer"},
         {"question": "French singers.", "sql": "SELECT name FROM singer WHERE country = 'France'"},
         {"question": "Remove Di.", "type": "DELETE", "sql": "DELETE FROM singer WHERE name = 'Di'"}]
HELD_OUT = [{"question": "Singers without a country.", "sql": "SELECT name FROM singer WHERE country IS NULL"},
            {"question": "Oldest singer.", "sql": "SELECT name FROM singer ORDER BY birth_year LIMIT 1"}]


def test_question_files_train_and_evaluate_on_a_sqlite_file(tmp_path):
    _music(tmp_path / "music.sqlite")
    train = _questions(tmp_path / "train.jsonl", TRAIN)
    held = _questions(tmp_path / "held.jsonl", HELD_OUT)
    base = ["env.name=db", "data.source=db_file", f"env.options.db_path={tmp_path / 'music.sqlite'}"]
    setup = load_setup(load_config(None, [*base, f"data.train_files=[{train}]", f"data.eval_files=[{held}]"]))
    assert [t.task_id for t in setup.train_tasks] == ["train/q00001", "train/q00002", "train/q00003"]
    assert [t.task_id for t in setup.eval_tasks] == ["held/q00001", "held/q00002"]
    assert setup.split == "held" and setup.eval_tasks[1].answer == {"rows": [["Ana"]], "ordered": True}
    # The gold answers are the database's, and the oracle scores 1 on every task through the env.
    for task in setup.train_tasks + setup.eval_tasks:
        assert replay_turns(setup.make_env(), task, oracle_turns(task, setup.make_env().backend)).reward == 1.0
    # A wrong answer scores 0 (the file's answers are what is checked).
    env = setup.make_env()
    assert replay_turns(env, setup.train_tasks[1], ['<tool_call>\n{"name": "commit_final_answer", "arguments": '
                                                     '{"answers": ["Ana"]}}\n</tool_call>']).reward == 0.0
    # Train files with env.options.questions: every question of the latter may be held out.
    setup = load_setup(load_config(None, [*base, f"env.options.questions={held}", f"data.train_files=[{train}]"]))
    assert len(setup.train_tasks) == 3 and [t.task_id for t in setup.eval_tasks] == ["q00001", "q00002"]
    # Eval files with env.options.questions: the latter all train.
    setup = load_setup(load_config(None, [*base, f"env.options.questions={train}", f"data.eval_files=[{held}]"]))
    assert [t.task_id for t in setup.train_tasks] == ["q00001", "q00002", "q00003"] and len(setup.eval_tasks) == 2


def test_question_file_mistakes_name_the_fix(tmp_path):
    _music(tmp_path / "music.sqlite")
    train = _questions(tmp_path / "train.jsonl", TRAIN)
    base = ["env.name=db", "data.source=db_file", f"env.options.db_path={tmp_path / 'music.sqlite'}"]
    with pytest.raises(ValueError, match="needs data.eval_files"):
        load_setup(load_config(None, [*base, f"data.train_files=[{train}]"]))
    with pytest.raises(ValueError, match="both data.train_files and data.eval_files"):
        load_setup(load_config(None, [*base, f"data.train_files=[{train}]", f"data.eval_files=[{train}]"]))
    with pytest.raises(FileNotFoundError, match="task file 'missing.jsonl' not found"):
        load_setup(load_config(None, [*base, "data.train_files=[missing.jsonl]", f"data.eval_files=[{train}]"]))
    bad = _questions(tmp_path / "bad.jsonl", [{"question": "?", "sql": "SELECT nope FROM singer"}])
    with pytest.raises(ValueError, match="bad.jsonl:1: the gold SQL fails"):
        load_setup(load_config(None, [*base, f"data.train_files=[{bad}]", f"data.eval_files=[{train}]"]))


def test_a_session_dropped_while_its_thread_holds_the_worker_pool_lock_closes_without_deadlock():
    """A finalizer runs inside whatever allocation triggers the collection, here one made while the
    thread holds the worker pool's lock, which closing a session takes again (the suite once hung
    so): the dropped session closes on another thread once the lock is free, and gives its slot back."""
    import gc
    import threading

    from tiderl.envs.db import worker
    from tiderl.envs.db.server_backend import _Slot

    closed = threading.Event()

    class Session:
        def close(self):
            with worker._IDLE_LOCK:  # as IsolatedSession.close does, through _keeps_room
                closed.set()

    slots = threading.BoundedSemaphore(1)
    slots.acquire()
    dropped = {"slot": _Slot(Session(), slots)}

    def drop_while_holding_the_lock():
        with worker._IDLE_LOCK:
            dropped.pop("slot")
            gc.collect()
            assert not closed.is_set()  # not closed here, under the lock

    holder = threading.Thread(target=drop_while_holding_the_lock, daemon=True)
    holder.start()
    holder.join(10)
    assert not holder.is_alive(), "dropping the session deadlocked on the worker pool's lock"
    assert closed.wait(10)
    assert slots.acquire(timeout=10)  # the slot came back
