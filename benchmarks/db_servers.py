"""Episodes per second of the DB environment on a PostgreSQL and a MariaDB server against the
SQLite path, on the same database, at 1, 8 and 32 episodes in flight.

The policy is the scripted oracle (`oracle_turns`: the gold SQL through `execute_sql`, then the
commit), so the time measured is the environment's: opening the episode's session (on a server a
pooled connection's transaction, plus the temporary copies of a write task), the statements,
scoring, closing (after one untimed episode per thread, which starts the worker processes and
fills the connection pool). Every episode must score 1 (a wrong one stops the benchmark). The servers are
throwaway ones (`tiderl/envs/db/servers.py`: `make db-servers` installs them); the database is a
generated music database (200 singers, 2,000 concerts) loaded into each server and a SQLite file,
with 12 questions and 3 write tasks. Episodes run in threads, as the rollout runs them, with
sessions in worker processes (the default); the servers' backends also run without the pool
(`pool_size=0`: a new connection per episode) to show what the pool saves.

    .venv/bin/python benchmarks/db_servers.py            # 3 passes over the tasks per setting
    .venv/bin/python benchmarks/db_servers.py --quick    # 1 pass, no pool-off rows: a smoke test

Prints one row per backend with episodes/s at each number in flight; the last line gives each
server's rate as a fraction of SQLite's at the most in flight. Exits 0 with a "skipped" line when
neither server can be started here.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sqlite3
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tiderl.envs.db.env import DBEnv, open_database  # noqa: E402
from tiderl.envs.db.oracle import oracle_turns, replay_turns  # noqa: E402
from tiderl.envs.db.questions import load_questions  # noqa: E402
from tiderl.envs.db.server_backend import ServerBackend  # noqa: E402
from tiderl.envs.db.servers import SkipServer, ThrowawayMariaDB, ThrowawayPostgres  # noqa: E402

IN_FLIGHT = (1, 8, 32)
COUNTRIES = ["France", "Sweden", "Chile", "Peru", "Japan", "Kenya", None]
VENUES = ["Olympia", "Bercy", "Globen", "Movistar Arena", "Budokan", "Zenith"]
QUESTIONS = [
    ("How many singers are there?", "SELECT count(*) FROM singer"),
    ("Singers from Chile born after 1980.", "SELECT name FROM singer WHERE country = 'Chile' AND birth_year > 1980"),
    ("Singers per country.", "SELECT country, count(*) FROM singer GROUP BY country"),
    ("Average ticket price per venue.", "SELECT venue, avg(ticket_price) FROM concert GROUP BY venue"),
    ("The five richest singers.", "SELECT name FROM singer ORDER BY net_worth DESC, id LIMIT 5"),
    ("Singers without a country.", "SELECT name FROM singer WHERE country IS NULL"),
    ("Concerts in 2021 at the Olympia.", "SELECT id FROM concert WHERE year = 2021 AND venue = 'Olympia'"),
    ("Singers who never gave a concert.",
     "SELECT name FROM singer WHERE id NOT IN (SELECT singer_id FROM concert)"),
    ("Concerts per singer, most first.",
     "SELECT singer_id, count(*) AS n FROM concert GROUP BY singer_id ORDER BY n DESC, singer_id LIMIT 10"),
    ("Total takings per year.", "SELECT year, sum(ticket_price) FROM concert GROUP BY year"),
    ("Who played the Budokan in 2022?",
     "SELECT DISTINCT s.name FROM singer s JOIN concert c ON c.singer_id = s.id WHERE c.venue = 'Budokan' "
     "AND c.year = 2022"),
    ("Debuts in the 1990s.", "SELECT name, debut FROM singer WHERE debut BETWEEN '1990-01-01' AND '1999-12-31'"),
]
WRITES = [
    ("DELETE", "Delete the concerts of 2019.", "DELETE FROM concert WHERE year = 2019"),
    ("INSERT", "Add Gil from Peru, born 1999.", "INSERT INTO singer (name, country, birth_year) VALUES ('Gil', 'Peru', 1999)"),
    ("UPDATE", "Raise prices at the Zenith by 10.", "UPDATE concert SET ticket_price = ticket_price + 10 WHERE venue = 'Zenith'"),
]
DDL = {
    "postgresql": ["CREATE TABLE singer (id SERIAL PRIMARY KEY, name VARCHAR(40) NOT NULL, country VARCHAR(40), "
                   "birth_year INTEGER, net_worth NUMERIC(12,2), debut DATE)",
                   "CREATE TABLE concert (id INTEGER PRIMARY KEY, singer_id INTEGER, year INTEGER, venue VARCHAR(40), "
                   "ticket_price NUMERIC(8,2))"],
    "mysql": ["CREATE TABLE singer (id INT AUTO_INCREMENT PRIMARY KEY, name VARCHAR(40) NOT NULL, country VARCHAR(40), "
              "birth_year INT, net_worth DECIMAL(12,2), debut DATE) ENGINE=InnoDB",
              "CREATE TABLE concert (id INT PRIMARY KEY, singer_id INT, year INT, venue VARCHAR(40), "
              "ticket_price DECIMAL(8,2)) ENGINE=InnoDB"],
    "sqlite": ["CREATE TABLE singer (id INTEGER PRIMARY KEY, name VARCHAR(40) NOT NULL, country VARCHAR(40), "
               "birth_year INTEGER, net_worth DECIMAL(12,2), debut DATE)",
               "CREATE TABLE concert (id INTEGER PRIMARY KEY, singer_id INTEGER, year INTEGER, venue VARCHAR(40), "
               "ticket_price DECIMAL(8,2))"],
}
READER = "tiderl_reader"


def music_rows(seed: int = 0) -> tuple[list[tuple], list[tuple]]:
    """200 singers and 2,000 concerts, the same for every backend (prices in whole cents)."""
    rng = random.Random(seed)
    singers = [(i, f"Singer {i:03d}", rng.choice(COUNTRIES), rng.randint(1940, 2005),
                f"{rng.randint(0, 10_000_000) / 100:.2f}", f"{rng.randint(1960, 2023)}-{rng.randint(1, 12):02d}-"
                f"{rng.randint(1, 28):02d}") for i in range(1, 201)]
    concerts = [(i, rng.randint(1, 180), rng.randint(2015, 2024), rng.choice(VENUES),
                 f"{rng.randint(1000, 20000) / 100:.2f}") for i in range(1, 2001)]
    return singers, concerts


def load_server(server: Any, kind: str) -> str:
    """The music database on a throwaway server, with a read-only role; the reader's URL."""
    singers, concerts = music_rows()
    server.create_database("music")
    for ddl in DDL[kind]:
        server.execute(ddl, database="music")
    server.execute("INSERT INTO singer VALUES (%s, %s, %s, %s, %s, %s)", database="music", many=singers)
    server.execute("INSERT INTO concert VALUES (%s, %s, %s, %s, %s)", database="music", many=concerts)
    if kind == "postgresql":
        server.execute("SELECT setval('singer_id_seq', 200)", database="music")
        server.execute(f"CREATE ROLE {READER} LOGIN")
        server.execute(f"GRANT SELECT ON ALL TABLES IN SCHEMA public TO {READER}", database="music")
    else:
        server.execute(f"CREATE USER '{READER}'@'localhost'")
        server.execute(f"GRANT SELECT, CREATE TEMPORARY TABLES ON music.* TO '{READER}'@'localhost'")
    return server.url(user=READER, database="music")


def write_sqlite(path: Path) -> None:
    singers, concerts = music_rows()
    conn = sqlite3.connect(path)
    for ddl in DDL["sqlite"]:
        conn.execute(ddl)
    conn.executemany("INSERT INTO singer VALUES (?, ?, ?, ?, ?, ?)", [r[:4] + (float(r[4]), r[5]) for r in singers])
    conn.executemany("INSERT INTO concert VALUES (?, ?, ?, ?, ?)", [r[:4] + (float(r[4]),) for r in concerts])
    conn.commit()
    conn.close()


def write_questions(path: Path) -> None:
    lines = [{"id": f"q{i}", "question": q, "sql": sql} for i, (q, sql) in enumerate(QUESTIONS)]
    lines += [{"id": f"w{i}", "type": t, "question": q, "sql": sql} for i, (t, q, sql) in enumerate(WRITES)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")


def episodes_per_s(backend: Any, questions: Path, in_flight: int, passes: int) -> tuple[float, int]:
    """(episodes/s, episodes) of the oracle over every task `passes` times, `in_flight` threads."""
    tasks = load_questions(questions, backend)
    scripts = [(task, oracle_turns(task, backend)) for task in tasks]
    episodes = scripts * max(passes, -(-in_flight * passes // len(scripts)))
    failures: list[str] = []
    lock = threading.Lock()

    def work(part: list) -> None:
        for task, turns in part:
            reward = replay_turns(DBEnv(backend), task, turns).reward
            if reward != 1.0:
                with lock:
                    failures.append(task.task_id)

    def run(batch: list) -> float:
        threads = [threading.Thread(target=work, args=(batch[i::in_flight],)) for i in range(in_flight)]
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return time.perf_counter() - started

    run((scripts * in_flight)[:in_flight])  # untimed: starts the worker processes, fills the pool
    elapsed = run(episodes)
    if failures:
        raise RuntimeError(f"the oracle failed {len(failures)} episodes: {sorted(set(failures))}")
    return len(episodes) / elapsed, len(episodes)


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one pass per setting and no pool-off rows")
    parser.add_argument("--passes", type=int, default=3, help="passes over the 15 tasks per setting (default 3)")
    args = parser.parse_args(argv)
    passes = 1 if args.quick else args.passes
    lines: list[str] = []

    def say(line: str) -> None:
        lines.append(line)
        print(line, flush=True)

    with tempfile.TemporaryDirectory(prefix="tiderl-db-bench-") as folder:
        root = Path(folder)
        write_sqlite(root / "music.sqlite")
        write_questions(root / "questions.jsonl")
        backends: list[tuple[str, Any]] = [("sqlite", open_database(root / "music.sqlite"))]
        servers, skipped = [], []
        for kind, cls in (("postgresql", ThrowawayPostgres), ("mysql", ThrowawayMariaDB)):
            try:
                server = cls()
            except SkipServer as exc:
                skipped.append(f"{cls.__name__}: {str(exc).splitlines()[0]}")
                continue
            servers.append(server)
            url = load_server(server, kind)
            name = "postgresql" if kind == "postgresql" else "mariadb"
            backends.append((name, ServerBackend(url, max_sessions=max(IN_FLIGHT))))
            if not args.quick:
                backends.append((f"{name} (no pool)", ServerBackend(url, max_sessions=max(IN_FLIGHT), pool_size=0)))
        try:
            if len(backends) == 1:
                say("skipped: no server could be started (" + "; ".join(skipped) + ")")
                return lines
            for note in skipped:
                say(f"not measured: {note}")
            load = os.getloadavg()
            say(f"load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; {os.cpu_count()} cores; "
                f"{passes} pass(es) over {len(QUESTIONS) + len(WRITES)} tasks per setting")
            say(f"{'backend':<22}" + "".join(f"{f'{n} in flight':>16}" for n in IN_FLIGHT))
            rates: dict[str, dict[int, float]] = {}
            for name, backend in backends:
                rates[name] = {n: episodes_per_s(backend, root / "questions.jsonl", n, passes)[0] for n in IN_FLIGHT}
                say(f"{name:<22}" + "".join(f"{rates[name][n]:>12.1f} e/s" for n in IN_FLIGHT))
            most = max(IN_FLIGHT)
            ratios = ", ".join(f"{name} {rates[name][most] / rates['sqlite'][most]:.2f}x" for name, _ in backends[1:])
            say(f"episodes/s at {most} in flight relative to SQLite: {ratios}")
        finally:
            for name, backend in backends:
                getattr(backend, "release_idle", lambda: None)()
            for server in servers:
                server.stop()
    return lines


if __name__ == "__main__":
    main()
