"""No model output can crash or hang the DB environment: targeted cases that used to raise,
then 1,200 random and malformed agent outputs through reset/step/finish."""

from __future__ import annotations

import json
import random
import sqlite3
import time

import pytest

from tiderl.agent.tool_parser import parse_hermes_tool_calls
from tiderl.envs.db.backend import TableSpec
from tiderl.envs.db.env import DBEnv, make_backend
from tiderl.envs.db.tools import Limits
from tiderl.envs.protocol import Action, Task, ToolCall

TABLE = TableSpec("Team Roster", (("name", "TEXT"), ("age", "INT"), ("score", "REAL")),
                  (("Ana", 31, 2.5), ("Bo", 24, 3.0), ("Cy", 24, None)))
READ_TASK = Task("read", "How old is Ana?", {"values": ["31"]},
                 {"tables": [TABLE.to_dict()], "answer_type": "other"})
WRITE_TASK = Task("write", "Remove Bo.", {"gold_sql": "DELETE FROM `Team Roster` WHERE name = 'Bo'"},
                  {"tables": [TABLE.to_dict()], "answer_type": "DELETE"})
LIMITS = Limits(timeout_s=0.3)


def _step(env, name, arguments):
    return env.step(Action(text="", tool_calls=[ToolCall(name, arguments)]))


def _valid(text):
    text.encode("utf-8")  # raises on a lone surrogate
    return True


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    return make_backend("sqlite", str(tmp_path_factory.mktemp("fuzzdb")))


def test_outputs_that_used_to_raise_become_error_observations(backend):
    env = DBEnv(backend, limits=LIMITS)
    env.reset(READ_TASK)
    for name, arguments in [("describe_table", {"name": "\ud83d"}), ("\ud83d\ude00\ud800", {}),
                            ("execute_sql", {"query": "SELECT '\udc00'"}), ("list_tables", {"x": "\ud800"})]:
        result = _step(env, name, arguments)
        assert not result.done and result.observations[0].startswith("Error:")
        assert _valid(result.observations[0])
    final = _step(env, "commit_final_answer", {"answers": [int("9" * 400)]})  # OverflowError before
    assert final.done and final.reward == 0.0
    with pytest.raises(RuntimeError, match="already ended.*reset\\(task\\)"):
        _step(env, "list_tables", {})
    with pytest.raises(RuntimeError, match="already ended"):
        env.finish("max_turns")
    env.reset(READ_TASK)  # a new episode works
    assert _step(env, "commit_final_answer", {"answers": [31]}).reward == 1.0


def test_huge_numbers_compare_without_error(backend):
    env = DBEnv(backend, limits=LIMITS)
    for answers in ([int("1" * 4000)], ["1" * 5000], [float("inf")], [1e308 * 10], ["1e400"]):
        env.reset(READ_TASK)
        assert _step(env, "commit_final_answer", {"answers": answers}).reward == 0.0


HOSTILE = [
    "DROP TABLE `Team Roster`", "DELETE FROM `Team Roster`", "INSERT INTO `Team Roster` VALUES ('x', 1, 1)",
    "UPDATE `Team Roster` SET age = 0", "ATTACH DATABASE '/tmp/x.db' AS x", "PRAGMA writable_schema = 1",
    "PRAGMA journal_mode = OFF", "CREATE TABLE t (a)", "VACUUM INTO '/tmp/copy.db'", "BEGIN", "COMMIT",
    "SELECT load_extension('x')", "SELECT zeroblob(1000000000)", "SELECT randomblob(2000000000)",
    "SELECT replace(hex(zeroblob(500000)), '0', 'xx')", "SELECT * FROM sqlite_master",
    "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c",
    "SELECT 1; DROP TABLE `Team Roster`", "select", ";;;", "SELECT '", "/* unterminated", "SELECT \"",
]
SLOW = "SELECT length(printf('%.*c', 2000000000, 'x'))"  # killed: keep it rare (costs ~1 s)
TOOLS = ["execute_sql", "commit_final_answer", "list_tables", "describe_table"]


def _random_value(rng, depth=0):
    kind = rng.randrange(10 if depth < 2 else 7)
    if kind == 0:
        return int("9" * rng.choice([1, 20, 400, 4000]))
    if kind == 1:
        return rng.choice([0.5, -1e308, 1e-300, 3.0])
    if kind == 2:
        return rng.choice(["", "\ud83d", "Ana", "x" * rng.choice([10, 3000, 100_000]), "null", "1,174", "\x00"])
    if kind == 3:
        return None
    if kind == 4:
        return rng.choice([True, False])
    if kind == 5:
        return rng.choice(HOSTILE)
    if kind == 6:
        return "".join(chr(rng.randrange(1, 0x2FFFF)) for _ in range(rng.randrange(1, 30)))
    if kind == 7:
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(0, 5))]
    return {rng.choice(["query", "answers", "name", "x", ""]): _random_value(rng, depth + 1)
            for _ in range(rng.randrange(0, 3))}


def _random_call(rng):
    name = rng.choice(TOOLS + ["drop_table", "", "\ud83d", "execute_sql "]) if rng.random() < 0.9 else 7
    if name == "execute_sql" and rng.random() < 0.6:
        arguments = {"query": SLOW if rng.random() < 0.01 else rng.choice(HOSTILE)}
    elif name == "commit_final_answer" and rng.random() < 0.5:
        arguments = {"answers": [_random_value(rng, 1) for _ in range(rng.randrange(0, 4))]}
    elif name == "describe_table" and rng.random() < 0.5:
        arguments = {"name": rng.choice(["Team Roster", "`team roster`", "\ud83d", "sqlite_master", ""])}
    else:
        arguments = _random_value(rng) if rng.random() < 0.5 else {}
    return name, arguments


def _random_output(rng):
    """One model turn: text, broken or well-formed <tool_call> blocks, or nothing."""
    kind = rng.randrange(6)
    if kind == 0:
        return rng.choice(["", " ", "Final Answer: 3", "FINAL ANSWER: #0", "\ud83d", "<tool_call>",
                           "</tool_call>", "<tool_call></tool_call>"])
    if kind == 1:  # broken JSON
        body = json.dumps({"name": "execute_sql", "arguments": {"query": "SELECT 1"}})
        cut = rng.randrange(len(body))
        return f"<tool_call>{body[:cut]}</tool_call>" + rng.choice(["", "tail", "<tool_call>{"])
    if kind == 2:  # lone-surrogate escapes typed out
        return '<tool_call>{"name": "describe_table", "arguments": {"name": "\\ud83d"}}</tool_call>'
    calls = []
    for _ in range(rng.randrange(1, 4)):
        name, arguments = _random_call(rng)
        try:
            text = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=rng.random() < 0.5)
        except (ValueError, TypeError):
            text = "{not json"
        calls.append(f"<tool_call>{text}</tool_call>")
    return "\n".join(calls)


def _file_database(tmp_path):
    path = tmp_path / "fuzz.sqlite"
    conn = sqlite3.connect(path)
    conn.execute('CREATE TABLE "Team Roster" (name TEXT, age INT, score REAL)')
    conn.executemany('INSERT INTO "Team Roster" VALUES (?, ?, ?)', TABLE.rows)
    conn.commit()
    conn.close()
    return path


@pytest.mark.slow
@pytest.mark.timeout(300)  # the hang guard: the fuzz takes seconds
def test_fuzz_1200_outputs_no_exception_no_hang(backend, tmp_path):
    rng = random.Random(11)
    file_path = _file_database(tmp_path)
    before = file_path.read_bytes()
    envs = [(DBEnv(backend, limits=LIMITS), READ_TASK), (DBEnv(backend, limits=LIMITS), WRITE_TASK),
            (DBEnv(str(file_path), limits=LIMITS), Task("file", "How old is Ana?", {"rows": [[31]], "ordered": False},
                                                        {"answer_type": "question"}))]
    outputs = episodes = slowest = 0.0
    start = time.monotonic()
    while outputs < 1200:
        env, task = envs[int(episodes) % len(envs)]
        env.reset(task)
        episodes += 1
        result = None
        for _ in range(rng.randrange(1, 8)):
            text = _random_output(rng)
            killed = int(outputs) % 400 == 399
            if killed:  # a statement SQLite cannot stop in-process: the worker is killed
                text = f'<tool_call>{json.dumps({"name": "execute_sql", "arguments": {"query": SLOW}})}</tool_call>'
            began = time.monotonic()
            result = env.step(parse_hermes_tool_calls(text))
            slowest = max(slowest, time.monotonic() - began)
            outputs += 1
            if killed:  # cut off at the statement limit, not run to its end
                assert any(f"{LIMITS.timeout_s:g} s limit" in o for o in result.observations), result.observations
            assert all(isinstance(o, str) and _valid(o) for o in result.observations)
            assert set(result.info) >= {"tool_calls", "tool_errors"}
            if result.done:
                break
        if result is None or not result.done:
            result = env.finish("max_turns")
        assert result.done and result.reward in (0.0, 1.0)
    took = time.monotonic() - start
    assert file_path.read_bytes() == before
    print(f"\nDB fuzz: {int(outputs)} outputs in {int(episodes)} episodes, 0 exceptions, slowest step "
          f"{slowest:.2f} s, {took:.1f} s in all")
