"""Print the oracle ceiling of the KG environment.

    python -m tiderl.envs.kg metaqa [--data-dir DIR] [--hops 1 2 3] [--sample N] [--split test]
    python -m tiderl.envs.kg agentbench [--data-dir DIR] [--split dev ...] [--endpoint URL]

metaqa: the fraction of MetaQA questions the qtype-path oracle solves through the env, and how
its failing answers relate to gold. agentbench: the gold traces replayed through the env, on
Freebase when --endpoint names its SPARQL endpoint, else on synthetic per-question graphs
built from the traces (a check of the machinery, not of Freebase).
"""

from __future__ import annotations

import argparse
import time

from tiderl.envs.kg.agentbench import SPLITS, gold_turns, load_agentbench_kg_tasks
from tiderl.envs.kg.env import KGEnv
from tiderl.envs.kg.oracle import metaqa_ceiling, oracle_ceiling, synthetic_trace_env
from tiderl.envs.kg.rdf import FREEBASE
from tiderl.envs.setup import data_root
from tiderl.envs.kg.sparql import sparql_backend
from tiderl.envs.kg.store import load_metaqa_kb


def _print(label: str, report: dict, seconds: float, show_failed: bool) -> None:
    solved = round(report["success"] * report["n"])
    print(f"{label}: oracle ceiling {report['success']:.4f} ({solved}/{report['n']}) in {seconds:.1f} s; "
          f"failing answers vs gold: {report['failure_kinds'] or 'none'}; tool errors: {report['tool_errors']}")
    if len(report["by_group"]) > 1:
        for group, (ok, n) in report["by_group"].items():
            print(f"  {group:<16} {ok:>5}/{n:<5}")
    if show_failed and report["failed"]:
        print("  failed: " + " ".join(report["failed"]))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dataset", choices=["metaqa", "agentbench"])
    parser.add_argument("--data-dir", default=None, help="data root holding metaqa/ and agentbench_kg/ "
                        "(default: $TIDERL_DATA_DIR, else ../shared/data)")
    parser.add_argument("--hops", type=int, nargs="+", default=[1, 2, 3], help="metaqa: hop counts")
    parser.add_argument("--sample", type=int, default=None, help="metaqa: a seeded sample per hop count (default all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--split", action="append", default=None, help="repeatable; metaqa: test or dev "
                        "(default test); agentbench: dev, std, kg_rl_all (default all)")
    parser.add_argument("--endpoint", default=None, help="agentbench: Freebase SPARQL endpoint URL")
    parser.add_argument("--show-failed", action="store_true", help="list the task ids the oracle fails")
    args = parser.parse_args(argv)
    root = data_root(args.data_dir or "")

    if args.dataset == "metaqa":
        store = load_metaqa_kb(root / "metaqa" / "kb.txt")
        for split in args.split or ["test"]:
            for hops in args.hops:
                start = time.perf_counter()
                report = metaqa_ceiling(store, root / "metaqa", hops, split, args.sample, args.seed)
                _print(f"MetaQA {hops}-hop {split}", report, time.perf_counter() - start, args.show_failed)
        return

    if args.endpoint:
        backend = sparql_backend(args.endpoint, FREEBASE)
        env_for, where = (lambda task: KGEnv(backend)), f"Freebase at {args.endpoint}"
    else:
        env_for, where = synthetic_trace_env, "synthetic trace graphs (no Freebase)"
    for split in args.split or list(SPLITS):
        start = time.perf_counter()
        tasks = load_agentbench_kg_tasks(root, split)
        report = oracle_ceiling(tasks, env_for, gold_turns, group=lambda t: str(t.meta["source"]))
        _print(f"AgentBench KG {split} on {where}", report, time.perf_counter() - start, args.show_failed)


if __name__ == "__main__":
    main()
