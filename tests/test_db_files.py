"""Questions over a database file the user already has (SQLite and DuckDB): read-only, the
oracle through `tiderl eval --db ... --questions ... --oracle`, and the result-set rules."""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3

import pytest

from tiderl.cli import main
from tiderl.envs.db.env import DBEnv, open_database_file
from tiderl.envs.db.questions import load_questions
from tiderl.envs.db.scoring import committed_rows, result_sets_match
from tiderl.envs.db.sql_text import has_top_level_order_by
from tiderl.envs.protocol import Action, ToolCall

SCHEMA = [
    "CREATE TABLE singer (id INTEGER PRIMARY KEY, name TEXT, country TEXT, birth_year INTEGER, net_worth REAL)",
    "CREATE TABLE concert (id INTEGER PRIMARY KEY, singer_id INTEGER, year INTEGER, venue TEXT)",
]
SINGERS = [(1, "Ana", "France", 1948, 10.5), (2, "Bo", "Sweden", 1975, 3.25), (3, "Cy", "France", 1990, None),
           (4, "Di", "Chile", 1962, 7.0), (5, "Ed", None, 1948, 1.0 / 3)]
CONCERTS = [(1, 1, 2019, "Olympia"), (2, 1, 2021, "Bercy"), (3, 2, 2021, "Globen"), (4, 4, 2022, "Olympia"),
            (5, 4, 2022, "Olympia")]
QUESTIONS = [
    ("How many singers are there?", "SELECT count(*) FROM singer"),
    ("Names of French singers, alphabetically.", "SELECT name FROM singer WHERE country = 'France' ORDER BY name"),
    ("Singers and birth years born before 1970.", "SELECT name, birth_year FROM singer WHERE birth_year < 1970"),
    ("Average net worth.", "SELECT avg(net_worth) FROM singer"),
    ("Singers without a country.", "SELECT name FROM singer WHERE country IS NULL"),
    ("Venues of all concerts (with repeats).", "SELECT venue FROM concert"),
    ("Concerts per singer, most first.", "SELECT singer_id, count(*) AS n FROM concert GROUP BY singer_id "
                                         "ORDER BY n DESC, singer_id"),
    ("Net worth of Cy.", "SELECT net_worth FROM singer WHERE name = 'Cy'"),
    ("Singers who never gave a concert.", "SELECT name FROM singer WHERE id NOT IN (SELECT singer_id FROM concert)"),
    ("Latest concert year per venue.", "SELECT venue, max(year) FROM concert GROUP BY venue"),
    ("Singers born in 2050.", "SELECT name FROM singer WHERE birth_year = 2050"),
    ("Third of Ed's net worth, times three.", "SELECT net_worth * 3 FROM singer WHERE name = 'Ed'"),
]


def _build_sqlite(path):
    conn = sqlite3.connect(path)
    for ddl in SCHEMA:
        conn.execute(ddl)
    conn.executemany("INSERT INTO singer VALUES (?, ?, ?, ?, ?)", SINGERS)
    conn.executemany("INSERT INTO concert VALUES (?, ?, ?, ?)", CONCERTS)
    conn.commit()
    conn.close()


def _build_duckdb(path):
    duckdb = pytest.importorskip("duckdb")
    conn = duckdb.connect(str(path))
    conn.execute("CREATE TABLE singer (id INTEGER, name VARCHAR, country VARCHAR, birth_year INTEGER, net_worth DOUBLE)")
    conn.execute("CREATE TABLE concert (id INTEGER, singer_id INTEGER, year INTEGER, venue VARCHAR)")
    conn.executemany("INSERT INTO singer VALUES (?, ?, ?, ?, ?)", SINGERS)
    conn.executemany("INSERT INTO concert VALUES (?, ?, ?, ?)", CONCERTS)
    conn.close()


@pytest.fixture(params=["sqlite", "duckdb"])
def database(request, tmp_path):
    path = tmp_path / f"music.{request.param}"
    (_build_sqlite if request.param == "sqlite" else _build_duckdb)(path)
    questions = tmp_path / "questions.jsonl"
    lines = [json.dumps({"id": f"m{i}", "question": q, "sql": sql}) for i, (q, sql) in enumerate(QUESTIONS)]
    lines.append(json.dumps({"id": "given", "question": "Countries of Ana and Bo.", "answer": ["France", "Sweden"]}))
    lines.append(json.dumps({"id": "del", "question": "Delete the concerts of 2022.", "type": "DELETE",
                             "sql": "DELETE FROM concert WHERE year = 2022"}))
    questions.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path, questions


def _fingerprint(folder):
    """Every file of the folder with its sha256 and mtime (a new -wal/-journal file shows too)."""
    return {p.name: (hashlib.sha256(p.read_bytes()).hexdigest(), os.stat(p).st_mtime_ns)
            for p in sorted(folder.iterdir()) if p.suffix != ".json"}


HOSTILE = ["DROP TABLE singer", "DELETE FROM singer", "INSERT INTO singer VALUES (9, 'x', 'y', 1, 1)",
           "UPDATE singer SET name = 'x'", "ATTACH DATABASE 'other.db' AS o", "PRAGMA journal_mode = WAL",
           "PRAGMA writable_schema = 1", "CREATE TABLE x (a)", "VACUUM", "VACUUM INTO 'copy.db'",
           "WITH c AS (SELECT 1) DELETE FROM singer", "COPY singer TO 'out.csv'", "CHECKPOINT",
           "SELECT length(printf('%.*c', 2000000000, 'x'))",
           "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c"]


def _call(env, name, **arguments):
    return env.step(Action(text="", tool_calls=[ToolCall(name, arguments)]))


@pytest.mark.slow
def test_oracle_scores_one_through_the_cli_and_the_file_is_untouched(database, tmp_path, capsys):
    path, questions = database
    before = _fingerprint(tmp_path)
    # hostile statements through the env, in a question and in a write task (scratch copy)
    env = DBEnv(str(path), limits=__import__("tiderl.envs.db.tools", fromlist=["Limits"]).Limits(timeout_s=0.5))
    tasks = {t.task_id: t for t in load_questions(questions, env.backend)}
    for task_id in ("m0", "del"):
        env.reset(tasks[task_id])
        for sql in HOSTILE:
            observation = _call(env, "execute_sql", query=sql).observations[0]
            assert isinstance(observation, str)
        env.finish("max_turns")
    out = tmp_path / "result.json"
    code = main(["eval", "--env", "db", "--db", str(path), "--questions", str(questions), "--oracle",
                 "--json", str(out), f"run_dir={tmp_path / 'run'}"])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["greedy"]["n"] == len(QUESTIONS) + 2
    assert result["greedy"]["success"] == 1.0
    assert _fingerprint(tmp_path) == before
    print(f"\noracle on {path.suffix}: {result['greedy']['success']:.3f} ({result['greedy']['n']} questions)")


def test_a_dbenv_on_a_file_reads_the_schema_and_scores_wrong_answers_zero(database):
    path, questions = database
    env = DBEnv(str(path))
    tasks = {t.task_id: t for t in load_questions(questions, env.backend)}
    assert env.reset(tasks["m1"]) == "Names of French singers, alphabetically."
    assert "concert" in _call(env, "list_tables").observations[0]
    assert "birth_year" in env.step(Action(text="", tool_calls=[ToolCall("describe_table", {"name": "singer"})])).observations[0]
    wrong = _call(env, "commit_final_answer", answers=["Cy", "Ana"])  # wrong order: ORDER BY counts
    assert wrong.done and wrong.reward == 0.0
    env.reset(tasks["m1"])
    assert _call(env, "commit_final_answer", answers=[["Ana"], ["Cy"]]).reward == 1.0
    env.reset(tasks["m0"])
    assert _call(env, "commit_final_answer", answers=[4]).reward == 0.0
    env.reset(tasks["del"])  # a write task: the scratch copy takes the right statement
    _call(env, "execute_sql", query="DELETE FROM concert WHERE year = 2022")
    assert _call(env, "commit_final_answer", answers=[]).reward == 1.0
    env.reset(tasks["del"])
    _call(env, "execute_sql", query="DELETE FROM concert WHERE year = 2021")
    assert _call(env, "commit_final_answer", answers=[]).reward == 0.0


def test_bad_files_and_questions_name_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="Fix"):
        open_database_file(tmp_path / "missing.sqlite")
    (tmp_path / "text.sqlite").write_text("not a database")
    with pytest.raises(ValueError, match="neither a SQLite nor a DuckDB"):
        open_database_file(tmp_path / "text.sqlite")
    db = tmp_path / "m.sqlite"
    _build_sqlite(db)
    backend = open_database_file(db)
    bad = tmp_path / "q.jsonl"
    for line, message in [('{"sql": "SELECT 1"}', "no 'question'"), ("[1]", "not a JSON object"),
                          ('{"question": "q"}', "no gold SQL"),
                          ('{"question": "q", "sql": "SELECT nope FROM singer"}', "gold SQL fails")]:
        bad.write_text(line + "\n")
        with pytest.raises(ValueError, match=message):
            load_questions(bad, backend)


def test_result_set_rules():
    gold = [["a", 1], ["b", 2.5], ["b", 2.5]]
    # order matters only when ordered (the gold SQL has a top-level ORDER BY)
    assert result_sets_match([["b", 2.5], ["a", 1], ["b", 2.5]], gold)
    assert not result_sets_match([["b", 2.5], ["a", 1], ["b", 2.5]], gold, ordered=True)
    assert result_sets_match([["a", 1], ["b", 2.5], ["b", 2.5]], gold, ordered=True)
    # duplicates count
    assert not result_sets_match([["a", 1], ["b", 2.5]], gold)
    assert not result_sets_match([["a", 1], ["a", 1], ["b", 2.5]], gold)
    # numbers within a relative tolerance of 1e-6, numeric text is a number, text is normalised
    assert result_sets_match([["A ", "1.0"], ["b", 2.5000001], ["B", "2.5"]], gold)
    assert not result_sets_match([["a", 1], ["b", 2.51], ["b", 2.5]], gold)
    # NULL matches only NULL or the text null/none
    assert result_sets_match([[None]], [[None]]) and result_sets_match([["NULL"]], [[None]])
    assert not result_sets_match([[0]], [[None]]) and not result_sets_match([[""]], [[None]])
    # column order counts, names do not exist in the answer
    assert not result_sets_match([[1, "a"], [2.5, "b"], [2.5, "b"]], gold)
    # flat lists: one value per row for one column, or whole rows in row-major order
    assert committed_rows([1, 2], 1) == [[1], [2]] and committed_rows(["a", 1], 2) == [["a", 1]]
    assert committed_rows([1, 2, 3], 2) is None
    assert result_sets_match(["a", 1, "b", 2.5, "b", 2.5], gold)
    # an empty result matches only an empty answer
    assert result_sets_match([], []) and not result_sets_match([None], [])
    assert has_top_level_order_by("SELECT a FROM t ORDER BY a")
    assert not has_top_level_order_by("SELECT a FROM (SELECT a FROM t ORDER BY a LIMIT 3)")
    assert not has_top_level_order_by("SELECT rank() OVER (ORDER BY a) FROM t")


def test_the_file_setup_passes_the_environment_contract(database):
    from tiderl.envs.check import assert_environment

    path, questions = database
    report = assert_environment("db", "data.source=db_file", f"env.options.db_path={path}",
                                f"env.options.questions={questions}", "data.eval_size=6", episodes=3)
    assert report.ok


def test_file_setup_needs_both_paths(database):
    from tiderl.config import load_config
    from tiderl.envs.setup import load_setup

    path, _ = database
    cfg = load_config(None, ["env.name=db", "data.source=db_file", f"env.options.db_path={path}"])
    with pytest.raises(ValueError, match="needs env.options.questions.*--questions"):
        load_setup(cfg)
