"""The embedded tiny model's warm start on the knowledge graph (`tiderl.envs.registration.WarmStart`).

Demonstrations are oracle traces of training questions (`get_neighbors` per hop, then
`Final Answer: #k`) with *systematic* relation confusions: every relation has a fixed confusable
partner (another relation of the same kind of entity) and its own confusion rate drawn around
`model.warmstart.relation_noise`. The demonstrations are therefore wrong in a consistent way for
some relations, so the warm-started policy succeeds sometimes, not always, under sampling *and*
under greedy decoding: exactly what RL can fix. (With uniform noise the right relation would stay
the argmax, and greedy decoding would already be near perfect.)
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

from tiderl.envs.kg.store import TripleStore
from tiderl.envs.kg.tasks import tool_call_text
from tiderl.envs.protocol import Task
from tiderl.envs.registration import WarmStart
from tiderl.envs.setup import Setup

if TYPE_CHECKING:
    from tiderl.config import RunConfig


def confusion_table(store: TripleStore, relations: list[str], noise: float,
                    seed: int) -> dict[str, tuple[str, float]]:
    """For each relation: (its confusable partner, the rate at which demonstrations confuse it).

    The partner is another relation that most subjects of `relation` also have (so the confused
    call runs, it just answers a different question). Rates are drawn uniformly in
    [noise - 0.3, noise + 0.3], clipped to [0, 0.9], so some relations are mostly right in the
    demonstrations and some mostly wrong.
    """
    rng = random.Random(seed)
    table: dict[str, tuple[str, float]] = {}
    for rel in sorted(relations):
        subjects = sorted(store.entities_with(rel))[:50]
        counts: dict[str, int] = {}
        for s in subjects:
            for other in store.relations(s):
                if other != rel:
                    counts[other] = counts.get(other, 0) + 1
        if not counts:
            continue
        best = max(counts.values())
        candidates = sorted(r for r, c in counts.items() if c >= 0.5 * best)
        rate = min(max(noise + rng.uniform(-0.3, 0.3), 0.0), 0.9)
        table[rel] = (rng.choice(candidates), rate)
    return table


def oracle_script(task: Task, table: dict[str, tuple[str, float]], rng: random.Random) -> list[str]:
    """The assistant turns of one (possibly confused) demonstration for `task`."""
    turns = []
    variable = task.meta["topic"]
    for hop, rel in enumerate(task.meta["path"]):
        partner, rate = table.get(rel, (rel, 0.0))
        chosen = partner if rng.random() < rate else rel
        turns.append(tool_call_text("get_neighbors", {"variable": variable, "relation": chosen}))
        variable = f"#{hop}"
    turns.append(f"Final Answer: {variable}")
    return turns


def demonstrations(setup: Setup, cfg: "RunConfig", rng: random.Random) -> tuple[list[Task], list[list[str]], dict[str, Any]]:
    """`model.warmstart.num_traces` training questions drawn with `rng`, each with its confused
    oracle script, and the confusion table for the build report."""
    if setup.store is None or not setup.train_tasks or any("path" not in t.meta for t in setup.train_tasks):
        raise ValueError(f"the embedded tiny model is built on an in-memory graph with generated training questions "
                         f"(data.source embedded or metaqa), not data.source={setup.name}. Fix: pass a real model "
                         "(model.path=DIR; tiderl eval --model DIR), or evaluate the oracle (tiderl eval --oracle)")
    ws = cfg.model.warmstart
    relations = sorted({r for t in setup.train_tasks for r in t.meta["path"]})
    table = confusion_table(setup.store, relations, ws.relation_noise, cfg.seed)
    tasks = [rng.choice(setup.train_tasks) for _ in range(ws.num_traces)]
    scripts = [oracle_script(t, table, rng) for t in tasks]
    return tasks, scripts, {"confusions": {r: [p, round(rate, 3)] for r, (p, rate) in table.items()}}


# A drifting world starts as the fixed one, and the in-memory graph it is built on has no endpoint.
WARM_START = WarmStart(demonstrations=demonstrations, unkeyed_options=("drift", "sparql_endpoint"))
