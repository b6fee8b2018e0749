"""AgentBench dbbench through the DB env: loading, the oracle ceiling, agreement of the gold
tables with AgentBench's own table hashes, and safety on real tasks. Needs the data
(`agentbench_dbbench/` under $TIDERL_DATA_DIR or ../shared/data); skipped without it."""

from __future__ import annotations

import hashlib
import json
from collections import Counter

import pytest

from tiderl.envs.db.backend import SQLError, specs_from_meta
from tiderl.envs.db.env import DBEnv, default_backend, is_write_task
from tiderl.envs.db.oracle import gold_matches_answer_md5, gold_query_cells, oracle_ceiling, oracle_turns
from tiderl.envs.db.scoring import answers_match
from tiderl.envs.db.sqlite_backend import SQLiteBackend
from tiderl.envs.db.tasks import dbbench_dir, load_dbbench_tasks
from tiderl.envs.protocol import Action, ToolCall

pytestmark = pytest.mark.data

DATA = dbbench_dir()


@pytest.fixture(scope="module")
def dev():
    if not (DATA / "dev.jsonl").is_file():
        pytest.skip(f"AgentBench dbbench not found under {DATA} (set TIDERL_DATA_DIR to the folder holding "
                    "agentbench_dbbench/)")
    return load_dbbench_tasks(DATA, "dev")


@pytest.fixture(scope="module")
def standard():
    if not (DATA / "standard.jsonl").is_file():
        pytest.skip(f"AgentBench dbbench standard split not found under {DATA}")
    return load_dbbench_tasks(DATA, "standard")


def test_load_dev(dev):
    # The type counts of the data README.
    assert Counter(t.meta["answer_type"] for t in dev) == {
        "INSERT": 20, "UPDATE": 20, "other": 4, "comparison": 4, "counting": 3, "ranking": 3,
        "aggregation-SUM": 2, "aggregation-MAX": 2, "aggregation-MIN": 1, "aggregation-AVG": 1}
    assert len({t.task_id for t in dev}) == 60 and dev[0].task_id == "dbbench-dev-0000"
    with open(DATA / "dev.jsonl", encoding="utf-8") as lines:
        first = json.loads(next(lines))
    assert dev[0].prompt == first["description"] + "\n" + first["add_description"]
    assert dev[0].answer == {"values": first["label"], "ordered": False}
    table = specs_from_meta(dev[0].meta)[0]
    assert table.name == first["table"]["table_name"]
    assert len(table.rows) == len(first["table"]["table_info"]["rows"])
    writes = [t for t in dev if is_write_task(t)]
    assert all(t.answer["gold_sql"].upper().startswith(t.meta["answer_type"]) for t in writes)


def test_load_filters_and_errors(dev, tmp_path):
    updates = load_dbbench_tasks(DATA, "dev", types={"UPDATE"}, limit=5)
    assert len(updates) == 5 and {t.meta["answer_type"] for t in updates} == {"UPDATE"}
    with pytest.raises(ValueError, match="unknown dbbench split"):
        load_dbbench_tasks(DATA, "test")
    with pytest.raises(FileNotFoundError, match="agentbench_dbbench"):
        load_dbbench_tasks(tmp_path, "dev")


def test_oracle_ceiling_on_dev_is_where_the_gold_sql_reproduces_the_label(dev):
    report = oracle_ceiling(dev)
    by_type = report["by_type"]
    assert by_type["INSERT"] == [20, 20] and by_type["UPDATE"] == [20, 20]
    # SELECT-type: success exactly where the record's query, run on SQLite, gives the label.
    reproduced = set()
    for task in dev:
        if is_write_task(task):
            continue
        try:
            if answers_match(gold_query_cells(task), task.answer["values"]):
                reproduced.add(task.task_id)
        except SQLError:
            pass
    select_ids = {t.task_id for t in dev if not is_write_task(t)}
    assert select_ids - set(report["failed"]) == reproduced
    assert len(reproduced) == 3 and report["n"] == 60
    assert report["success"] == pytest.approx(43 / 60)
    print(f"\ndbbench dev oracle ceiling: {report['success']:.3f} ({60 - len(report['failed'])}/60); "
          f"SELECT-type {len(reproduced)}/20, writes 40/40")


@pytest.mark.slow
def test_oracle_ceiling_on_standard(standard):
    report = oracle_ceiling(standard)
    assert report["by_type"]["INSERT"] == [100, 100] and report["by_type"]["UPDATE"] == [100, 100]
    assert report["success"] == pytest.approx(238 / 300)
    print(f"\ndbbench standard oracle ceiling: {report['success']:.3f} (238/300); SELECT-type 38/100")


@pytest.mark.slow
def test_gold_tables_agree_with_agentbench_md5(dev, standard):
    """The env's gold tables (gold statement run on SQLite) are the tables AgentBench scored
    against (its MySQL hash, recomputed): all of dev, and 187 of 200 on standard, where the
    exceptions are mostly columns MySQL stores as numbers or times (rendered differently) and
    MySQL's accent-insensitive string comparison (dbbench-standard-0206)."""
    assert [gold_matches_answer_md5(t) for t in dev if is_write_task(t)] == [True] * 40
    assert sum(bool(gold_matches_answer_md5(t)) for t in standard if is_write_task(t)) == 187


def test_real_task_adversarial_statements_leave_the_source_unchanged(dev, tmp_path):
    backend = SQLiteBackend(tmp_path)
    for task in (next(t for t in dev if is_write_task(t)), dev[0]):
        source = backend.source_path(specs_from_meta(task.meta))
        before = hashlib.sha256(source.read_bytes()).hexdigest()
        name = specs_from_meta(task.meta)[0].name
        env = DBEnv(backend)
        env.reset(task)
        for query in [f'DROP TABLE "{name}"', f"ATTACH DATABASE '{source}' AS s", "PRAGMA writable_schema=1",
                      f'DELETE FROM "{name}"', f'SELECT 1; DELETE FROM "{name}"', "SELECT " + "1," * 5000 + "1"]:
            env.step(Action(text="", tool_calls=[ToolCall("execute_sql", {"query": query})]))
        env.finish("max_turns")
        assert hashlib.sha256(source.read_bytes()).hexdigest() == before


def test_oracle_turns_are_hermes_text(dev):
    turns = oracle_turns(dev[20], default_backend())
    assert all(t.startswith("<tool_call>\n{\"name\": ") and t.endswith("\n</tool_call>") for t in turns)
