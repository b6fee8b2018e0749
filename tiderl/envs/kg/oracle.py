"""Scripted oracles for the KG environment and the ceiling they measure.

An oracle's turns are Hermes `<tool_call>` texts, parsed with the agent's own parser and
stepped through `KGEnv` exactly as a model's turns would be, so the fraction of tasks it
solves is the environment's ceiling: what a perfect policy could score through these tools.

* MetaQA: `tasks.oracle_turns` walks the qtype relation path (`metaqa_ceiling`).
* AgentBench: `agentbench.gold_turns` replays the record's gold trace. On Freebase (a SPARQL
  endpoint) that is AgentBench's own ceiling; on `agentbench.trace_graph`'s synthetic graphs it
  checks the machinery only (`synthetic_trace_env`).
"""

from __future__ import annotations

import random
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Callable, Sequence

from tiderl.envs.kg.agentbench import trace_graph
from tiderl.envs.kg.env import KGEnv
from tiderl.envs.kg.rdf import FREEBASE, RdfSchema, parse_rdf, to_ntriples
from tiderl.envs.kg.store import TripleStore
from tiderl.envs.kg.tasks import load_metaqa_questions, oracle_turns
from tiderl.envs.protocol import Action, StepResult, Task


def replay_turns(env: KGEnv, task: Task, turns: Sequence[str],
                 parse: Callable[[str], Action] | None = None) -> tuple[StepResult, list[str]]:
    """Play assistant turns through `env` (reset, one `step` per turn, parsed with the Hermes
    parser unless `parse` is given). Returns the final StepResult (`env.finish("max_turns")`
    when the turns run out first) and every observation in order."""
    if parse is None:
        from tiderl.agent.tool_parser import parse_hermes_tool_calls as parse
    env.reset(task)
    observations: list[str] = []
    for turn in turns:
        result = env.step(parse(turn))
        observations += result.observations
        if result.done:
            return result, observations
    return env.finish("max_turns"), observations


def compare_sets(predicted: set[str], gold: set[str]) -> str:
    """How a predicted answer set relates to the gold one: equal, superset (the prediction
    holds all of gold and more), subset, overlap or disjoint."""
    if predicted == gold:
        return "equal"
    if predicted > gold:
        return "superset"
    if predicted < gold:
        return "subset"
    return "overlap" if predicted & gold else "disjoint"


def oracle_ceiling(tasks: Sequence[Task], env_for: Callable[[Task], KGEnv], turns_for: Callable[[Task], list[str]],
                   group: Callable[[Task], str] = lambda t: "") -> dict[str, Any]:
    """Replay `turns_for(task)` on `env_for(task)` for every task.

    Returns {"n", "success" (fraction), "by_group": {group: [successes, n]}, "failed": [task
    ids], "failure_kinds": {compare_sets kind: count} (the oracle's answer vs gold),
    "tool_errors": error observations in all}.
    """
    by_group: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    failed: list[str] = []
    kinds: Counter[str] = Counter()
    errors = 0
    for task in tasks:
        env = env_for(task)
        result, observations = replay_turns(env, task, turns_for(task))
        errors += sum(o.startswith("Error") for o in observations)
        ok = bool(result.info.get("success"))
        by_group[group(task)][0] += int(ok)
        by_group[group(task)][1] += 1
        if not ok:
            failed.append(task.task_id)
            predicted = _final_answer_set(env, task, observations)
            kinds[compare_sets(predicted, set(task.answer))] += 1
    n = len(tasks)
    return {"n": n, "success": (n - len(failed)) / n if n else 0.0, "by_group": dict(sorted(by_group.items())),
            "failed": failed, "failure_kinds": dict(sorted(kinds.items())), "tool_errors": errors}


def _final_answer_set(env: KGEnv, task: Task, observations: list[str]) -> set[str]:
    """The set the episode answered with: its last variable, topic excluded as the env scores."""
    variables = env.toolbox.variables if env.toolbox is not None else []
    predicted = set(variables[-1]) if variables else set()
    if task.meta.get("exclude_topic"):
        predicted.discard(task.meta.get("topic"))
    return predicted


def metaqa_ceiling(store: TripleStore, data_dir: str | Path, hops: int, split: str = "test",
                   sample: int | None = None, seed: int = 0) -> dict[str, Any]:
    """The qtype-path oracle on MetaQA's `hops`-hop questions (all, or a seeded `sample`)."""
    tasks = load_metaqa_questions(data_dir, hops, split=split, sample=sample, seed=seed)
    env = KGEnv(store)
    return oracle_ceiling(tasks, lambda task: env, lambda task: oracle_turns(task, random.Random(0)))


def synthetic_trace_env(task: Task, schema: RdfSchema = FREEBASE) -> KGEnv:
    """A KGEnv over `agentbench.trace_graph(task)`, written as N-Triples and loaded back in
    memory under `schema` (so the RDF path is exercised too)."""
    return KGEnv(parse_rdf(to_ntriples(trace_graph(task), schema), "nt", schema))
