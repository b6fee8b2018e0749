"""A database whose rows change during training (`env.options.drift` of the DB environment,
tiderl/envs/db/drift.py): phases are seeded copies (the user's file never written, every process
building the same ones), gold answers follow the phase an episode plays in, an episode keeps the
phase it started in, and a bad configuration names the field and the fix."""

from __future__ import annotations

import hashlib
import json
import pickle
import sqlite3

import pytest

from tiderl.agent.tool_parser import parse_hermes_tool_calls
from tiderl.config import ConfigError, load_config
from tiderl.envs.db.drift import DriftingDatabase, change_rows
from tiderl.envs.db.oracle import replay_turns
from tiderl.envs.setup import load_setup

COUNTRIES = ["France", "Sweden", "Chile", "Japan"]
SINGERS = [(i, f"s{i:02d}", COUNTRIES[i % 4], 1940 + 2 * i) for i in range(1, 31)]
QUESTIONS = [
    {"id": "french", "question": "How many singers are from France?",
     "sql": "SELECT count(*) FROM singer WHERE country = 'France'"},
    {"id": "old", "question": "Names of singers born before 1960, alphabetically.",
     "sql": "SELECT name FROM singer WHERE birth_year < 1960 ORDER BY name"},
    {"id": "per", "question": "Singers per country.", "sql": "SELECT country, count(*) FROM singer GROUP BY country"},
    {"id": "drop", "question": "Delete the Chilean singers.", "type": "DELETE",
     "sql": "DELETE FROM singer WHERE country = 'Chile'"},
]


def _build(path, kind):
    if kind == "duckdb":
        duckdb = pytest.importorskip("duckdb")
        conn = duckdb.connect(str(path))
        conn.execute("CREATE TABLE singer (id INTEGER PRIMARY KEY, name VARCHAR UNIQUE, country VARCHAR, "
                     "birth_year INTEGER)")
    else:
        conn = sqlite3.connect(path)
        conn.execute("CREATE TABLE singer (id INTEGER PRIMARY KEY, name TEXT UNIQUE, country TEXT, birth_year INTEGER)")
    conn.executemany("INSERT INTO singer VALUES (?, ?, ?, ?)", SINGERS)
    if kind != "duckdb":
        conn.commit()
    conn.close()


@pytest.fixture(params=["sqlite", "duckdb"])
def files(request, tmp_path):
    path = tmp_path / f"music.{request.param}"
    _build(path, request.param)
    questions = tmp_path / "questions.jsonl"
    questions.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    return path, questions


def _args(path, questions, *more):
    return ["env.name=db", "data.source=db_file", f"env.options.db_path={path}", f"env.options.questions={questions}",
            "data.eval_size=2", *more]


def _rows(backend):
    session = backend.open([], False)
    try:
        return session.execute("SELECT * FROM singer ORDER BY id", max_rows=1000, timeout_s=10).rows
    finally:
        session.close()


def test_phases_are_seeded_copies_and_the_users_file_is_never_written(files):
    path, _ = files
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    world = DriftingDatabase(path, every_steps=3, fraction=0.3, seed=7)
    original = _rows(world.backend(0))
    assert [tuple(r) for r in original] == SINGERS
    world.at_step(2)
    assert world.current()[0] == 0
    world.at_step(3)
    phase, backend = world.current()
    changed = [a for a, b in zip(original, _rows(backend)) if tuple(a) != tuple(b)]
    assert phase == 1 and 4 <= len(changed) <= 9  # 30 % of 30 rows, less what a constraint or an equal value kept
    assert {tuple(r)[0] for r in _rows(backend)} == {s[0] for s in SINGERS}  # the primary key never changes
    # Another process (a pickled copy, as a Ray worker gets) builds the same phases from the file.
    copy = pickle.loads(pickle.dumps(world))
    assert copy.current()[0] == 1 and _rows(copy.backend(2)) == _rows(world.backend(2))
    assert _rows(world.backend(2)) != _rows(world.backend(1))
    assert hashlib.sha256(path.read_bytes()).hexdigest() == digest


def test_change_rows_skips_what_a_constraint_refuses(tmp_path):
    import random

    conn = sqlite3.connect(tmp_path / "u.sqlite", isolation_level=None)
    conn.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, code TEXT UNIQUE)")
    conn.executemany("INSERT INTO t VALUES (?, ?)", [(i, f"c{i}") for i in range(10)])
    # The only column outside the key is UNIQUE: every copied value collides, so nothing changes.
    assert change_rows(conn, ["t"], 0.5, random.Random(0)) == 0
    assert conn.execute("SELECT count(DISTINCT code) FROM t").fetchone()[0] == 10


def test_gold_answers_follow_the_phase_an_episode_plays_in(files):
    path, questions = files
    setup = load_setup(load_config(None, _args(path, questions, "env.options.drift.every_steps=2",
                                                  "env.options.drift.fraction=0.5")))
    tasks = {t.task_id: t for t in setup.train_tasks + setup.eval_tasks}
    setup.on_step(0)
    env0 = setup.make_env()
    env0.reset(tasks["per"])  # an episode that starts in phase 0 ...
    turns0 = setup.oracle(tasks["per"])
    setup.on_step(2)  # ... keeps it after the world moves
    for turn in turns0[:-1]:
        env0.step(parse_hermes_tool_calls(turn))
    last = env0.step(parse_hermes_tool_calls(turns0[-1]))
    assert last.reward == 1.0 and last.info["drift_phase"] == 0
    moved = 0
    for task_id in ("french", "old", "per", "drop"):
        now = replay_turns(setup.make_env(), tasks[task_id], setup.oracle(tasks[task_id]))
        assert now.reward == 1.0 and now.info["drift_phase"] == 1, (task_id, now.info)
        if task_id != "drop":  # phase 0's answer, committed in phase 1
            stale = replay_turns(setup.make_env(), tasks[task_id], turns0 if task_id == "per" else
                                 _oracle_at_phase_0(path, questions, tasks[task_id]))
            moved += stale.reward == 0.0
    assert moved >= 2  # half the rows changed: most answers did


def _oracle_at_phase_0(path, questions, task):
    setup = load_setup(load_config(None, _args(path, questions)))
    return setup.oracle(task)


def test_a_bad_drift_configuration_names_the_field_and_the_fix(files, tmp_path):
    path, questions = files
    with pytest.raises(ConfigError, match="drift.fraction.*every_steps > 0"):
        load_config(None, _args(path, questions, "env.options.drift.fraction=0.5"))
    with pytest.raises(ConfigError, match="drift.every_steps.*data.source=db_file"):
        load_config(None, ["env.name=db", "env.options.drift.every_steps=2"])
    with pytest.raises(ConfigError, match="drift.every_steps.*server database"):
        load_config(None, ["env.name=db", "data.source=db_file", "env.options.db_path=postgresql://u@h/db",
                           "env.options.drift.every_steps=2"])
    given = tmp_path / "given.jsonl"
    given.write_text(json.dumps({"id": "g", "question": "Countries of s01?", "answer": ["Sweden"]}) + "\n"
                     + "".join(json.dumps(q) + "\n" for q in QUESTIONS))
    with pytest.raises(ValueError, match="no gold SQL.*'sql'"):
        load_setup(load_config(None, _args(path, given, "env.options.drift.every_steps=2")))


def test_a_drifting_database_passes_the_environment_contract(files):
    from tiderl.envs.check import assert_environment

    path, questions = files
    report = assert_environment("db", "data.source=db_file", f"env.options.db_path={path}",
                                f"env.options.questions={questions}", "data.eval_size=2",
                                "env.options.drift.every_steps=1", "env.options.drift.fraction=0.5", episodes=3)
    assert report.ok
