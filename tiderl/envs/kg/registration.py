"""The knowledge-graph environment as `env.name` finds it: its options, data sources, warm start
and `tiderl eval` shortcut (`tiderl.envs.registration`). Imports nothing heavy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tiderl.envs.registration import BuiltinEnvironment, EvalFlag, check_drift
from tiderl.options import need, opt, section

# data.source values: generated questions on a synthetic movie graph (the default), MetaQA,
# AgentBench KG over a Freebase SPARQL endpoint (tiderl/envs/kg/setup.py).
SOURCES = ("embedded", "metaqa", "agentbench_kg")


@dataclass
class DriftOptions:
    """A world that changes during training (online learning; `tiderl/envs/drift.py`,
    docs/online.md): in-memory graphs (embedded, metaqa), on the local or the Ray backend."""

    every_steps: int = opt(0, "Optimizer steps between two changes of the world (0 = no drift).")
    fraction: float = opt(0.2, "Share of the facts (kind=facts) or of the relations (kind=relations) one "
                          "change touches.")
    kind: str = opt("relations", "What changes: 'facts' (triples get new objects) or 'relations' (relation "
                    "names are permuted, so the tool calls that worked stop working).", ("facts", "relations"))


@dataclass
class KGOptions:
    """The knowledge-graph environment's options (`env.options.*` with this environment)."""

    hops: list[int] = opt([1, 2], "Question hop counts to train and evaluate on (generated questions have 1 "
                          "or 2 hops; MetaQA's test questions also 3, evaluated but not trained).")
    num_films: int = opt(150, "data.source=embedded: films in the generated world.")
    num_people: int = opt(120, "data.source=embedded: people in the generated world.")
    eval_fraction: float = opt(0.2, "data.source=embedded: fraction of topic entities held out for evaluation.")
    num_train_tasks: int = opt(4000, "data.source=metaqa: template questions generated for training.")
    max_listed: int = opt(0, "List entity names in observations of sets up to this size.")
    sparql_endpoint: str = opt("", "data.source=agentbench_kg: the Freebase SPARQL endpoint URL to query.")
    drift: DriftOptions = section(DriftOptions, "The world changes every drift.every_steps steps (online learning).")

    def check(self, cfg: Any) -> None:
        need(bool(self.hops) and all(h in (1, 2, 3) for h in self.hops), "hops",
             f"{self.hops} must be a non-empty list of 1, 2, 3", "use [1, 2]")
        need(0 < self.eval_fraction < 1, "eval_fraction", "must be in (0, 1)", "use 0.2")
        need(self.max_listed >= 0, "max_listed", "must be >= 0", "use 0 (no names listed)")
        need(cfg.data.source != "agentbench_kg" or bool(self.sparql_endpoint), "sparql_endpoint",
             "AgentBench KG questions need a Freebase SPARQL endpoint",
             "set env.options.sparql_endpoint=http://host:port/sparql")
        need(cfg.data.source == "agentbench_kg" or not self.sparql_endpoint, "sparql_endpoint",
             f"set, but data.source={cfg.data.source} keeps its graph in memory (only agentbench_kg queries an "
             "endpoint), so it would be ignored", "remove env.options.sparql_endpoint, or set data.source=agentbench_kg")
        check_drift(self.drift, cfg, "a drifting world")


ENVIRONMENT = BuiltinEnvironment(
    setup_path="tiderl.envs.kg.setup:setup",
    Options=KGOptions,
    sources=SOURCES,
    warm_start_path="tiderl.envs.kg.warm_start:WARM_START",
    task_files=True,
    task_fields=("question", "answer", "topic", "path", "id"),
    eval_flags=(EvalFlag("--hops", ("env.options.hops=[{}]",), "shortcut for env.options.hops=[...], e.g. 1,2,3"),),
    former_keys={"data.hops": "hops", "data.num_films": "num_films", "data.num_people": "num_people",
                 "data.eval_fraction": "eval_fraction", "data.num_train_tasks": "num_train_tasks",
                 "env.max_listed": "max_listed", "env.sparql_endpoint": "sparql_endpoint", "env.drift": "drift"},
)
