"""A Spider-shaped check: Spider's dev questions and gold SQL over SQLite files built from its
`tables.json` schemas (Spider ships no database contents here, so each table gets three
synthetic rows whose key-like values line up across tables, making joins return rows).
Checks that the questions load through `load_questions`, which gold SQL runs on SQLite, and
that the oracle solves every loaded question through the env."""

from __future__ import annotations

import json
import os
import sqlite3

import pytest

from tiderl.envs.db.backend import SQLError
from tiderl.envs.db.env import DBEnv, open_database_file
from tiderl.envs.db.oracle import oracle_ceiling
from tiderl.envs.db.questions import gold_rows, load_questions
from tiderl.envs.db.sql_text import quote_identifier
from tiderl.envs.setup import data_root

# Three databases keep the suite fast; TIDERL_SPIDER_ALL=1 checks all 20 dev databases.
DATABASES = ("concert_singer", "pets_1", "flight_2")
_TYPES = {"number": "NUMERIC", "text": "TEXT", "time": "TEXT", "boolean": "INTEGER"}


def _value(kind: str, i: int):
    return {"number": i, "boolean": i % 2, "time": f"2020-01-0{i}"}.get(kind, f"v{i}")


def build_spider_sqlite(schema: dict, path) -> None:
    """A SQLite file with the schema's tables, each holding rows i = 1, 2, 3."""
    conn = sqlite3.connect(path)
    columns = schema["column_names_original"]
    for index, table in enumerate(schema["table_names_original"]):
        if table.lower().startswith("sqlite_"):  # SQLite's own (sqlite_sequence): made by AUTOINCREMENT
            continue
        cols = [(name, schema["column_types"][k]) for k, (t, name) in enumerate(columns) if t == index]
        ddl = ", ".join(f"{quote_identifier(n)} {_TYPES.get(kind, 'TEXT')}" for n, kind in cols)
        conn.execute(f"CREATE TABLE {quote_identifier(table)} ({ddl})")
        marks = ", ".join("?" for _ in cols)
        conn.executemany(f"INSERT INTO {quote_identifier(table)} VALUES ({marks})",
                         [[_value(kind, i) for _, kind in cols] for i in (1, 2, 3)])
    conn.commit()
    conn.close()


@pytest.fixture(scope="module")
def spider():
    folder = data_root() / "spider_dev"
    if not (folder / "tables.json").is_file():
        pytest.skip(f"Spider dev not found under {folder} (set TIDERL_DATA_DIR to the folder holding spider_dev/)")
    schemas = {s["db_id"]: s for s in json.loads((folder / "tables.json").read_text())}
    questions = json.loads((folder / "dev.json").read_text())
    return schemas, questions


def test_spider_questions_load_and_the_oracle_solves_them(spider, tmp_path):
    schemas, questions = spider
    total = runs = 0
    databases = sorted({q["db_id"] for q in questions}) if os.environ.get("TIDERL_SPIDER_ALL") else DATABASES
    for db_id in databases:
        path = tmp_path / f"{db_id}.sqlite"
        build_spider_sqlite(schemas[db_id], path)
        backend = open_database_file(path)
        lines = []
        for index, q in enumerate(x for x in questions if x["db_id"] == db_id):
            total += 1
            try:
                gold_rows(backend, q["query"])
            except SQLError:
                continue
            lines.append(json.dumps({"id": f"{db_id}-{index}", "question": q["question"], "sql": q["query"]}))
        runs += len(lines)
        file = tmp_path / f"{db_id}.jsonl"
        file.write_text("\n".join(lines) + "\n")
        tasks = load_questions(file, backend)
        report = oracle_ceiling(tasks, lambda: DBEnv(backend))
        assert report["success"] == 1.0, report["failed"][:5]
    assert runs >= 0.95 * total
    print(f"\nSpider dev on schema-built SQLite ({len(databases)} databases): gold SQL runs for {runs}/{total}; "
          f"oracle 1.000 on all {runs}")
