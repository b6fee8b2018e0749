"""DBEnv: the tools as observations, scoring of SELECT and write tasks, knowledge units, the
safety of the source database, the oracle, and one run through the agent loop."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from support import SCHOOLS, STORED_ROWS, T
from tiderl.agent.tool_parser import parse_hermes_tool_calls
from tiderl.envs.db.backend import rows_hash
from tiderl.envs.db.env import DBEnv, is_write_task
from tiderl.envs.db.oracle import oracle_turns, replay_turns, tool_call_text
from tiderl.envs.db.sqlite_backend import SQLiteBackend
from tiderl.envs.db.tasks import task_from_record
from tiderl.envs.db.tools import TOOL_ARGUMENTS, Limits
from tiderl.envs.protocol import Action, Task, ToolCall

FINAL_KEYS = {"success", "reward_parts", "answer_type", "knowledge_units", "tool_calls", "tool_errors",
              "answer_size"}
TABLE_UNIT = "table:School Location Table"


def col(name: str) -> str:
    return f"column:School Location Table.{name}"


def select_task(values: list, answer_type: str = "counting", gold_sql: str = "") -> Task:
    return Task("q1", "How many schools are in San Diego?", {"values": values, "ordered": False},
                {"tables": [SCHOOLS.to_dict()], "answer_type": answer_type, "gold_sql": gold_sql})


def write_task(gold_sql: str, answer_type: str = "UPDATE") -> Task:
    return Task("w1", "Set the students of Madison High School to 950.", {"gold_sql": gold_sql},
                {"tables": [SCHOOLS.to_dict()], "answer_type": answer_type, "gold_sql": gold_sql})


MADISON_950 = f"UPDATE {T} SET Students = 950 WHERE School = 'Madison High School'"


def sql(query: str) -> ToolCall:
    return ToolCall("execute_sql", {"query": query})


def commit(*answers) -> ToolCall:
    return ToolCall("commit_final_answer", {"answers": list(answers)})


def act(*calls: ToolCall, errors: tuple[str, ...] = ()) -> Action:
    return Action(text="", tool_calls=list(calls), parse_errors=list(errors))


@pytest.fixture
def backend(tmp_path):
    return SQLiteBackend(tmp_path / "cache")


@pytest.fixture
def env(backend):
    return DBEnv(backend)


# -- the protocol surface ----------------------------------------------------------------------


def test_tool_schemas_match_the_tools(backend):
    env = DBEnv(backend, Limits(max_rows=7))
    schemas = env.tool_schemas()
    assert [s["function"]["name"] for s in schemas] == list(TOOL_ARGUMENTS)
    for schema in schemas:
        params = schema["function"]["parameters"]
        assert params["required"] == [a for a, _, _ in TOOL_ARGUMENTS[schema["function"]["name"]]]
        for arg, json_type, _ in TOOL_ARGUMENTS[schema["function"]["name"]]:
            assert params["properties"][arg]["type"] == json_type
    assert "at most 7 rows" in schemas[0]["function"]["description"]
    schemas[0]["function"]["name"] = "edited"
    assert env.tool_schemas()[0]["function"]["name"] == "execute_sql"
    assert "commit_final_answer" in env.system_prompt()
    assert DBEnv(backend, system_prompt="custom").system_prompt() == "custom"


def test_select_task_success_with_units(env):
    assert env.reset(select_task(["2.0"])) == "How many schools are in San Diego?"
    result = env.step(act(sql(f"SELECT COUNT(*) FROM {T} WHERE Location = 'San Diego'")))
    assert not result.done
    assert result.observations == ['1 row; columns: ["COUNT(*)"]\n[2]']
    assert result.info == {"tool_calls": 1, "tool_errors": 0}
    final = env.step(act(commit(2)))
    assert final.done and final.reward == 1.0 and final.observations == []
    assert set(final.info) >= FINAL_KEYS
    assert final.info["success"] == 1.0 and final.info["reward_parts"] == {"outcome": 1.0}
    assert final.info["answer_type"] == "counting"
    assert final.info["knowledge_units"] == [col("Location"), TABLE_UNIT]
    assert (final.info["tool_calls"], final.info["tool_errors"], final.info["answer_size"]) == (2, 0, 1)


@pytest.mark.parametrize("answers, reward", [
    (["2"], 1.0), ([2.0], 1.0), ([[2]], 1.0),       # a row [2] is flattened to its cell
    ([3], 0.0), ([2, 2], 0.0), ([], 0.0), (["two"], 0.0),
])
def test_select_scoring(env, answers, reward):
    env.reset(select_task(["2.0"]))
    assert env.step(act(commit(*answers))).reward == reward


def test_multi_value_answers_ignore_order(env):
    env.reset(select_task(["Madison High School", "Lincoln High School"], "comparison"))
    result = env.step(act(sql(f"SELECT School FROM {T} WHERE Location = 'San Diego' ORDER BY School")))
    rows = [json.loads(line) for line in result.observations[0].splitlines()[1:]]
    assert rows == [["Lincoln High School"], ["Madison High School"]]
    assert env.step(act(commit(*rows))).reward == 1.0


def test_ordered_answers_need_the_order(env):
    task = select_task(["Madison High School", "Lincoln High School"], "ranking")
    task.answer["ordered"] = True
    env.reset(task)
    assert env.step(act(commit("Lincoln High School", "Madison High School"))).reward == 0.0
    env.reset(task)
    assert env.step(act(commit("Madison High School", "Lincoln High School"))).reward == 1.0


def test_only_successful_statements_add_units(env):
    env.reset(select_task(["2"]))
    result = env.step(act(
        sql(f"SELECT School FROM {T} WHERE NoSuchColumn = 1"),   # fails: no units
        sql(f"SELECT \"Date moved\" FROM {T} LIMIT 1"),
        ToolCall("describe_table", {"name": "School Location Table"}),  # schema, not data
    ))
    assert result.observations[0].startswith("Error: no such column")
    final = env.finish("max_turns")
    assert final.info["knowledge_units"] == [col("Date moved"), TABLE_UNIT]
    assert final.info["tool_errors"] == 1


# -- errors become observations ------------------------------------------------------------------


@pytest.mark.parametrize("call, message", [
    (ToolCall("run_sql", {"query": "SELECT 1"}), "unknown tool 'run_sql'"),
    (ToolCall("execute_sql", {}), "missing argument 'query'"),
    (ToolCall("execute_sql", {"query": "SELECT 1", "db": "x"}), "unexpected argument 'db'"),
    (ToolCall("execute_sql", {"query": 5}), "must be a JSON string"),
    (ToolCall("commit_final_answer", {"answers": "2"}), "must be a JSON array"),
    (ToolCall("commit_final_answer", {"answers": [{"a": 1}]}), "JSON array of values"),
    (ToolCall("describe_table", {"name": "Schools"}), 'no table named "Schools"'),
    (sql(""), "the query is empty"),
    (sql("-- nothing"), "the query is empty"),
    (sql("SELECT 1; SELECT 2"), "one SQL statement per call, got 2"),
    (sql("SELECT " + "1 + " * 1000 + "1"), "the limit is 2000"),
    (sql(f"DROP TABLE {T}"), "DROP statements are not allowed; only SELECT statements are"),
    (sql("PRAGMA writable_schema = ON"), "PRAGMA statements are not allowed"),
    (sql(f"DELETE FROM {T}"), "this task is read-only: DELETE is not allowed"),
    (sql(f"WITH c AS (SELECT 1) DELETE FROM {T}"), "this task is read-only"),
    (sql("SELECT * FROM nosuchtable"), "no such table: nosuchtable"),
    (sql("SELEC 1"), "SELEC statements are not allowed"),
    (sql(f"SELECT * FROM {T} WHERE"), "incomplete input"),
    (sql("SELECT 'a\x00b'"), "null character"),
    (sql("SELECT '\ud800'"), "lone UTF-16 surrogate"),
])
def test_malformed_calls_become_error_observations(env, call, message):
    env.reset(select_task(["2"]))
    result = env.step(act(call))
    assert not result.done
    assert len(result.observations) == 1 and result.observations[0].startswith("Error: ")
    assert message in result.observations[0]
    assert result.info == {"tool_calls": 1, "tool_errors": 1}


def test_parse_errors_and_silence(env):
    env.reset(select_task(["2"]))
    result = env.step(act(ToolCall("list_tables", {}), errors=("tool call 1: invalid JSON",)))
    assert result.observations == ["Error: tool call 1: invalid JSON", 'Tables: ["School Location Table"]']
    assert result.info == {"tool_calls": 2, "tool_errors": 1}
    silent = env.step(Action(text="I think the answer is 2."))
    assert len(silent.observations) == 1 and "No tool call" in silent.observations[0]


def test_describe_table_accepts_case_and_quotes(env):
    env.reset(select_task(["2"]))
    result = env.step(act(ToolCall("describe_table", {"name": "`school location table`"})))
    assert result.observations == ['Table "School Location Table" has 4 columns (name, type):\n'
                                   '"School" TEXT\n"Location" TEXT\n"Date moved" YEAR\n"Students" INT']


def test_row_limit_note(backend):
    env = DBEnv(backend, Limits(max_rows=2))
    env.reset(select_task(["2"]))
    text = env.step(act(sql(f"SELECT School FROM {T} ORDER BY School"))).observations[0]
    lines = text.splitlines()
    assert lines[0] == '5 rows; columns: ["School"]'
    assert lines[1:3] == ['["Burroughs High School"]', '["Central High School"]']
    assert lines[3].startswith("(3 more rows not shown: at most 2 rows")


def test_observation_character_limit(backend):
    env = DBEnv(backend, Limits(max_observation_chars=300))
    env.reset(select_task(["2"]))
    text = env.step(act(sql(f"SELECT * FROM {T}"))).observations[0]
    assert len(text) <= 300
    shown = len(text.splitlines()) - 2  # minus the header and the note
    assert 0 < shown < 5 and f"({5 - shown} more rows not shown" in text


def test_statement_time_limit_is_an_error_observation(backend):
    env = DBEnv(backend, Limits(timeout_s=0.2))
    env.reset(select_task(["2"]))
    endless = "WITH RECURSIVE r(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM r) SELECT count(*) FROM r"
    result = env.step(act(sql(endless)))
    assert result.observations == ["Error: the statement ran longer than the 0.2 s limit and was stopped"]


def test_commit_ends_the_turn(env):
    env.reset(select_task(["2"]))
    final = env.step(act(commit(2), sql("SELECT 1"), sql("SELECT 2")))
    assert final.done and final.reward == 1.0 and final.info["ignored_calls"] == 2
    assert final.info["tool_calls"] == 1
    with pytest.raises(RuntimeError, match="reset"):
        env.step(act(sql("SELECT 1")))


def test_finish_scores_zero_with_the_final_keys(env):
    env.reset(select_task(["2"]))
    env.step(act(sql(f"SELECT COUNT(*) FROM {T}")))
    final = env.finish("max_turns")
    assert final.done and final.reward == 0.0
    assert set(final.info) >= FINAL_KEYS and final.info["finish_reason"] == "max_turns"
    assert final.info["knowledge_units"] == [TABLE_UNIT]


def test_step_before_reset_raises(env):
    with pytest.raises(RuntimeError, match="reset"):
        env.step(act(sql("SELECT 1")))


# -- write tasks -------------------------------------------------------------------------------------


@pytest.mark.parametrize("statements, reward", [
    ([MADISON_950], 1.0),
    # The same change written differently scores the same.
    ([f"UPDATE {T} SET Students = '950' WHERE School LIKE 'Madison%'"], 1.0),
    ([f"UPDATE {T} SET Students = 951 WHERE School = 'Madison High School'",
      f"UPDATE {T} SET Students = Students - 1 WHERE School = 'Madison High School'"], 1.0),
    ([], 0.0),
    ([f"UPDATE {T} SET Students = 950"], 0.0),
    ([MADISON_950, f"INSERT INTO {T} VALUES ('x', 'y', 1, 2)"], 0.0),
])
def test_write_task_scored_by_table_hash(env, statements, reward):
    task = write_task(MADISON_950)
    assert is_write_task(task)
    env.reset(task)
    for statement in statements:
        assert env.step(act(sql(statement))).observations[0].startswith("OK: ")
    final = env.step(act(commit()))
    assert final.reward == reward and final.info["answer_type"] == "UPDATE"


def test_write_episodes_start_from_the_original_table(env, backend):
    source = backend.source_path([SCHOOLS])
    before = hashlib.sha256(source.read_bytes()).hexdigest()
    env.reset(write_task(MADISON_950))
    env.step(act(sql(f"DELETE FROM {T}")))
    assert env.step(act(sql(f"SELECT COUNT(*) FROM {T}"))).observations[0].endswith("[0]")
    env.step(act(commit()))
    env.reset(write_task(MADISON_950))
    assert env.step(act(sql(f"SELECT COUNT(*) FROM {T}"))).observations[0].endswith("[5]")
    assert hashlib.sha256(source.read_bytes()).hexdigest() == before


def test_a_gold_statement_that_fails_is_reported(env):
    env.reset(write_task("UPDATE nosuchtable SET a = 1"))
    final = env.step(act(commit()))
    assert final.reward == 0.0 and "no such table" in final.info["gold_error"]


def test_mysql_style_gold_with_a_digit_led_table_name():
    spec = SCHOOLS.to_dict() | {"name": "1952_Prix"}
    task = Task("w2", "Insert a school.", {"gold_sql": "INSERT INTO 1952_Prix (School) VALUES ('New')"},
                {"tables": [spec], "answer_type": "INSERT",
                 "gold_sql": "INSERT INTO 1952_Prix (School) VALUES ('New')"})
    env = DBEnv()
    env.reset(task)
    assert env.step(act(sql("INSERT INTO 1952_Prix (School) VALUES ('New')"))).observations[0].startswith("Error")
    assert env.step(act(sql("INSERT INTO \"1952_Prix\" (School) VALUES ('New')"))).observations[0] == \
        "OK: 1 row affected."
    assert env.step(act(commit())).reward == 1.0


# -- adversarial statements leave the source database byte-for-byte unchanged --------------------


ADVERSARIAL = [
    f"DROP TABLE {T}",
    "ATTACH DATABASE '{source}' AS src",
    "ATTACH DATABASE '{source}' AS src; DELETE FROM src." + T,
    "PRAGMA writable_schema = ON",
    "PRAGMA writable_schema = ON; UPDATE sqlite_master SET sql = 'x'",
    "SELECT load_extension('/nonexistent/evil')",
    "SELECT 1; DROP TABLE " + T,
    f"DELETE FROM {T}; VACUUM",
    "VACUUM INTO '{source}.copy'",
    "UPDATE sqlite_master SET sql = ''",
    f"ALTER TABLE {T} RENAME TO gone",
    "BEGIN; DELETE FROM " + T + "; COMMIT",
    f"SELECT * FROM {T} WHERE School = '" + "x" * 50_000 + "'",
    f"DELETE FROM {T}",
    f"UPDATE {T} SET Students = 0",
    f"INSERT INTO {T} SELECT * FROM {T}",
    f"WITH c AS (SELECT 1) DELETE FROM {T}",
]


@pytest.mark.parametrize("writable", [False, True])
def test_adversarial_statements_leave_the_source_file_unchanged(backend, writable, tmp_path):
    task = write_task(MADISON_950) if writable else select_task(["2"])
    source = backend.source_path([SCHOOLS])
    before = hashlib.sha256(source.read_bytes()).hexdigest()
    env = DBEnv(backend)
    env.reset(task)
    observations = []
    for statement in ADVERSARIAL:
        observations += env.step(act(sql(statement.replace("{source}", str(source))))).observations
    env.step(act(commit()))
    assert hashlib.sha256(source.read_bytes()).hexdigest() == before
    assert not Path(f"{source}.copy").exists()
    # Everything was refused except, in a write task, the data writes (the last four), which
    # went to the episode's scratch copy.
    plain_writes = ADVERSARIAL[-4:] if writable else []
    for statement, observation in zip(ADVERSARIAL, observations):
        assert observation.startswith("OK: ") == (statement in plain_writes), (statement, observation)
    # A fresh episode sees the original rows.
    session = backend.open([SCHOOLS], writable=False)
    try:
        assert session.table_hash("School Location Table") == rows_hash(STORED_ROWS)
    finally:
        session.close()


# -- tasks from records, the oracle, the agent loop --------------------------------------------------


RECORD = {
    "description": "How many schools moved in 1969?",
    "add_description": "The name of this table is School Location Table, and the headers of this table are "
                       "School,Location,Date moved,Students.",
    "label": ["2.0"],
    "table": {"table_name": SCHOOLS.name,
              "table_info": {"columns": [{"name": c, "type": t} for c, t in SCHOOLS.columns],
                             "rows": [list(r) for r in SCHOOLS.rows]}},
    "type": ["counting"],
    "sql": {"query": f"SELECT COUNT(*) FROM {T} WHERE `Date moved` = 1969;"},
}


def test_task_from_record():
    task = task_from_record(RECORD, "dbbench-dev-0007", "dev")
    assert task.prompt == RECORD["description"] + "\n" + RECORD["add_description"]
    assert task.answer == {"values": ["2.0"], "ordered": False}
    assert task.meta["answer_type"] == "counting" and task.meta["gold_sql"] == RECORD["sql"]["query"]
    assert task.meta["tables"] == [SCHOOLS.to_dict()]
    write = task_from_record(RECORD | {"type": ["UPDATE"], "label": [MADISON_950], "answer_md5": "x"}, "w", "dev")
    assert write.answer == {"gold_sql": MADISON_950} and write.meta["answer_md5"] == "x"


def test_oracle_turns_replay_to_success(backend):
    task = task_from_record(RECORD, "t", "dev")
    turns = oracle_turns(task, backend)
    assert turns == [
        tool_call_text("execute_sql", {"query": f"SELECT COUNT(*) FROM {T} WHERE `Date moved` = 1969"}),
        tool_call_text("commit_final_answer", {"answers": [2]}),
    ]
    assert parse_hermes_tool_calls(turns[1]).tool_calls == [commit(2)]
    result = replay_turns(DBEnv(backend), task, turns)
    assert result.reward == 1.0
    assert result.info["knowledge_units"] == [col("Date moved"), TABLE_UNIT]
    # Wrong hint SQL: the oracle commits what it returns and fails.
    wrong = task_from_record(RECORD | {"sql": {"query": f"SELECT COUNT(*) FROM {T}"}}, "t2", "dev")
    assert replay_turns(DBEnv(backend), wrong, oracle_turns(wrong, backend)).reward == 0.0
    # A write task's oracle runs the gold statement, then commits nothing.
    update = write_task(MADISON_950)
    assert oracle_turns(update, backend)[-1] == tool_call_text("commit_final_answer", {"answers": []})
    assert replay_turns(DBEnv(backend), update, oracle_turns(update, backend)).reward == 1.0


def test_oracle_through_the_agent_loop(backend):
    pytest.importorskip("transformers")
    from tiderl.agent.loop import ScriptedEngine, play_episodes
    from tiderl.embedded.tiny import train_tokenizer
    from tiderl.rollout.base import SamplingParams

    tasks = [task_from_record(RECORD, "select", "dev"), write_task(MADISON_950)]
    scripts = {t.prompt: oracle_turns(t, backend) for t in tasks}
    env = DBEnv(backend)
    corpus = [env.system_prompt(), json.dumps(env.tool_schemas())] + [t.prompt for t in tasks]
    corpus += [turn for turns in scripts.values() for turn in turns]
    tokenizer = train_tokenizer(corpus * 2, vocab_size=400)
    out = play_episodes(ScriptedEngine(tokenizer, scripts), tokenizer, lambda: DBEnv(backend), tasks,
                        SamplingParams(max_new_tokens=400), max_turns=4, max_total_tokens=6000)
    assert [t.stop_reason for t in out] == ["answer", "answer"]
    # Once (a shuffled run on a loaded machine) the write task scored 0: say why if it happens again.
    assert [t.reward for t in out] == [1.0, 1.0], [t.env_info for t in out]
    assert out[0].env_info["knowledge_units"] == [col("Date moved"), TABLE_UNIT]
    assert out[1].env_info["knowledge_units"] == [col("School"), col("Students"), TABLE_UNIT]
