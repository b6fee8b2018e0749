"""Print the oracle ceiling of the DB environment on AgentBench's dbbench splits.

    python -m tiderl.envs.db [--data-dir DIR] [--backend sqlite|duckdb|URL] [--split dev ...]
    python -m tiderl.envs.db --server postgres|mariadb     # on a throwaway server (servers.py)

For each split: the fraction of tasks the scripted oracle (the record's own SQL, then commit)
solves through the environment, per answer type; how many gold tables of write tasks hash to
AgentBench's own `answer_md5`; and (--show-failed) the ids of the tasks the oracle fails.
`--server` starts a throwaway PostgreSQL or MariaDB (`make db-servers`) and runs the tasks in a
scratch database there through the SQLAlchemy backend, each task's table created in it, as
AgentBench does on MySQL.
"""

from __future__ import annotations

import argparse
import time

from tiderl.envs.db.env import DBEnv, make_backend
from tiderl.envs.db.oracle import gold_matches_answer_md5, oracle_ceiling
from tiderl.envs.db.tasks import SPLITS, load_dbbench_tasks


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default=None, help="data root holding agentbench_dbbench/ "
                        "(default: $TIDERL_DATA_DIR, else ../shared/data)")
    parser.add_argument("--backend", default="sqlite", help="sqlite, duckdb or a SQLAlchemy URL")
    parser.add_argument("--split", action="append", choices=SPLITS, help="repeatable; default: all splits")
    parser.add_argument("--show-failed", action="store_true", help="list the task ids the oracle fails")
    parser.add_argument("--server", choices=("postgres", "mariadb"),
                        help="start a throwaway server and use a scratch database on it (overrides --backend)")
    args = parser.parse_args(argv)
    server = None
    if args.server:
        from tiderl.envs.db.servers import ThrowawayMariaDB, ThrowawayPostgres

        server = ThrowawayPostgres() if args.server == "postgres" else ThrowawayMariaDB()
        server.create_database("scratch")
        url = server.url(database="scratch")
        args.backend = url.replace("postgresql://", "postgresql+psycopg://").replace("mysql://", "mysql+pymysql://")
    try:
        _report(args, make_backend(args.backend))
    finally:
        if server is not None:
            server.stop()


def _report(args: argparse.Namespace, backend: object) -> None:
    for split in args.split or list(SPLITS):
        start = time.perf_counter()
        tasks = load_dbbench_tasks(args.data_dir, split)
        report = oracle_ceiling(tasks, lambda: DBEnv(backend))
        solved = round(report["success"] * report["n"])
        print(f"{split}: oracle ceiling {report['success']:.3f} ({solved}/{report['n']}) "
              f"on {args.backend} in {time.perf_counter() - start:.1f} s")
        for kind, (ok, n) in report["by_type"].items():
            print(f"  {kind:<16} {ok:>3}/{n:<3}")
        checks = [gold_matches_answer_md5(t, backend) for t in tasks]
        checks = [c for c in checks if c is not None]
        print(f"  gold tables of write tasks matching AgentBench's answer_md5: {sum(checks)}/{len(checks)}")
        if args.show_failed:
            print("  failed: " + " ".join(report["failed"]))


if __name__ == "__main__":
    main()
