"""AgentBench KG tasks: action parsing, loading, and gold-trace replay on synthetic graphs.

There is no Freebase endpoint here. The gold traces are replayed on graphs built from each
trace (`trace_graph`): in memory for every record of dev and std, and for a sample of
kg_rl_all; in SPARQL (in process and over loopback HTTP) for a few, asserting the observations
match the in-memory ones. What this cannot check: that Freebase holds what the traces expect.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from support import data_roots, sparql_server
from tiderl.envs.kg.agentbench import (
    created_variables,
    gold_calls,
    gold_turns,
    load_agentbench_kg_tasks,
    parse_action,
    trace_graph,
)
from tiderl.envs.kg.env import KGEnv
from tiderl.envs.kg.oracle import oracle_ceiling, replay_turns, synthetic_trace_env
from tiderl.envs.kg.rdf import FREEBASE, XSD, parse_rdf, to_ntriples
from tiderl.envs.kg.sparql import HttpSparqlClient, OxigraphClient, SparqlBackend
from tiderl.envs.kg.tools import TOOL_ARGUMENTS
from tiderl.envs.protocol import Task, ToolCall

# The example of the data README: "how many mac models used motorola 68040 processors?"
MAC_ACTIONS = [
    "get_relations(m.0zd6)", "get_neighbors(m.0zd6,computer.computer.includes_models)",
    "get_relations(m.05397)", "get_neighbors(m.05397,computer.computer_processor.used_in_computers)",
    "intersection(#0,#1)", "count(#2)",
]


def mac_task() -> Task:
    return Task("mac", "how many mac models used motorola 68040 processors?\nEntities: [mac], [Motorola 68040]",
                ["1"], {"entities": {"mac": "m.0zd6", "Motorola 68040": "m.05397"}, "actions": MAC_ACTIONS,
                        "count_creates_variable": True, "topic": "m.0zd6"})


def agentbench_dir() -> Path:
    """The AgentBench KG folder, or skip (where: support.data_roots)."""
    roots = data_roots()
    for root in roots:
        if (root / "agentbench_kg" / "dev.json").is_file():
            return root / "agentbench_kg"
    pytest.skip(f"AgentBench KG data not found under {', '.join(map(str, roots))}: set TIDERL_DATA_DIR to the "
                "folder that holds agentbench_kg/")


# -- parsing and the synthetic graph (no data needed) --------------------------------------------


def test_parse_action_and_variable_numbering():
    assert parse_action("get_neighbors(m.0zd6,computer.computer.includes_models)") == ToolCall(
        "get_neighbors", {"variable": "m.0zd6", "relation": "computer.computer.includes_models"})
    assert parse_action(" intersection(#0, #1) ") == ToolCall("intersection", {"variable1": "#0", "variable2": "#1"})
    assert parse_action("count(#2)") == ToolCall("count", {"variable": "#2"})
    # Two-argument tools split at the last comma: an entity argument may hold one.
    assert parse_action("get_neighbors(Paris, Texas,film.film.directed_by)").arguments["variable"] == "Paris, Texas"
    for bad in ("fly(m.1)", "get_neighbors(m.1)", "count()", "get_relations m.1"):
        with pytest.raises(ValueError, match="gold action"):
            parse_action(bad)
    # get_relations and get_attributes create nothing; count does (AgentBench's counting answers).
    assert created_variables(gold_calls(mac_task())) == [None, 0, None, 1, 2, 3]


def test_trace_graph_of_the_readme_example():
    graph = trace_graph(mac_task())
    # Built backwards: count(#2) = 1 -> #2 = {m.0tdrl0}; intersection(#0, #1) -> #0 = {m.0tdrl0,
    # m.0tdrl1}, #1 = {m.0tdrl0, m.0tdrl2} (a distractor each, variable1 first); the two
    # get_neighbors calls make them from the named entities.
    assert sorted(graph.edges) == [
        ("m.05397", "computer.computer_processor.used_in_computers", "m.0tdrl0"),
        ("m.05397", "computer.computer_processor.used_in_computers", "m.0tdrl2"),
        ("m.0zd6", "computer.computer.includes_models", "m.0tdrl0"),
        ("m.0zd6", "computer.computer.includes_models", "m.0tdrl1"),
    ]
    assert graph.values == [] and graph.labels == {"m.0zd6": "mac", "m.05397": "Motorola 68040"}
    assert gold_turns(mac_task())[-1] == "Final Answer: #3"
    result, observations = replay_turns(synthetic_trace_env(mac_task()), mac_task(), gold_turns(mac_task()))
    assert observations == [
        "Relations: computer.computer.includes_models", "Variable #0: 2 entities",
        "Relations: computer.computer_processor.used_in_computers", "Variable #1: 2 entities",
        "Variable #2: 1 entity", "Count: 1, stored as Variable #3",
    ]
    assert result.reward == 1.0 and result.info["knowledge_units"] == [
        "entity:m.0tdrl0", "entity:m.0tdrl1", "entity:m.0tdrl2",
        "entity_relation:m.05397|computer.computer_processor.used_in_computers",
        "entity_relation:m.0zd6|computer.computer.includes_models",
    ]


def test_argmax_traces_get_comparable_values_and_names_work_as_arguments():
    task = Task("a", "which team won last?\nEntities: [Lou Seal]", ["m.0117q3yz"], {
        "entities": {"Lou Seal": "m.03_dwn"}, "count_creates_variable": True, "topic": "m.03_dwn",
        "actions": ["get_neighbors(m.03_dwn,sports.mascot.team)",
                    "get_neighbors(#0,sports.sports_team.championships)", "argmax(#1,time.event.end_date)"]})
    graph = trace_graph(task)
    # Backwards: #2 = the answer; argmax(#1) -> #1 = {answer, distractor m.0tdrl0}, the winner
    # with the later date; #1 comes from one member of #0 (fresh: m.0tdrl1), #0 from the mascot.
    assert sorted(graph.values) == [("m.0117q3yz", "time.event.end_date", "2005-06-01", XSD + "date"),
                                    ("m.0tdrl0", "time.event.end_date", "1999-01-01", XSD + "date")]
    assert sorted(graph.edges) == [("m.03_dwn", "sports.mascot.team", "m.0tdrl1"),
                                   ("m.0tdrl1", "sports.sports_team.championships", "m.0117q3yz"),
                                   ("m.0tdrl1", "sports.sports_team.championships", "m.0tdrl0")]
    store = parse_rdf(to_ntriples(graph, FREEBASE), "nt", FREEBASE)
    assert store.attribute_relations == {"time.event.end_date"}
    # The agent may name the entity as the prompt does instead of by mid.
    turns = [t.replace('"m.03_dwn"', '"Lou Seal"') for t in gold_turns(task)]
    result, observations = replay_turns(KGEnv(store), task, turns)
    assert result.reward == 1.0 and not any(o.startswith("Error") for o in observations)


# -- the real records ------------------------------------------------------------------------------


@pytest.mark.data
def test_loader_reads_every_split():
    folder = agentbench_dir()
    sizes = {split: len(load_agentbench_kg_tasks(folder, split)) for split in ("dev", "std", "kg_rl_all")}
    assert sizes == {"dev": 20, "std": 150, "kg_rl_all": 1214}  # the data README's counts
    assert len(load_agentbench_kg_tasks(folder.parent, "test")) == 150  # the data root works too
    first = load_agentbench_kg_tasks(folder, "dev")[0]
    assert first.task_id == "agentbench-kg-dev-0" and first.answer == ["m.05ch8k4"]
    assert first.prompt.endswith("\nEntities: [Did you see that thing? That’s Sidat-Singh! The Syracuse Walking "
                                 "Dream!], [Pat Connaughton]")
    assert first.meta["entities"] == {"Did you see that thing? That’s Sidat-Singh! The Syracuse Walking Dream!":
                                      "m.09rl290", "Pat Connaughton": "m.0j50kb6"}
    assert first.meta["answer_names"] == {"m.05ch8k4": "Guard"} and first.meta["answer_type"] == "Entity"
    assert first.meta["topic"] == "m.09rl290" and first.meta["count_creates_variable"] is True
    with pytest.raises(ValueError, match="unknown AgentBench KG split"):
        load_agentbench_kg_tasks(folder, "train2")


@pytest.mark.data
def test_every_gold_trace_has_the_shape_the_tools_take():
    folder = agentbench_dir()
    count = 0
    for split in ("dev", "std", "kg_rl_all"):
        for task in load_agentbench_kg_tasks(folder, split):
            calls = gold_calls(task)
            made = 0
            for c, created in zip(calls, created_variables(calls)):
                assert tuple(c.arguments) == TOOL_ARGUMENTS[c.name], task.task_id
                for value in c.arguments.values():
                    ref = re.fullmatch(r"#(\d+)", value)
                    # A variable is used only after the call that creates it.
                    assert ref is None or int(ref.group(1)) < made, (task.task_id, c)
                made += created is not None
            # Counting questions end with count and have a number as their answer.
            assert (calls[-1].name == "count") == (task.meta["answer_type"] == "Value"), task.task_id
            assert task.answer and gold_turns(task)[-1] == f"Final Answer: #{made - 1}"
            count += 1
    assert count == 1384


@pytest.mark.data
def test_gold_traces_replay_on_synthetic_graphs():
    folder = agentbench_dir()
    tasks = load_agentbench_kg_tasks(folder, "dev") + load_agentbench_kg_tasks(folder, "std")
    tasks += load_agentbench_kg_tasks(folder, "kg_rl_all")[::10]
    report = oracle_ceiling(tasks, synthetic_trace_env, gold_turns)
    assert (report["success"], report["tool_errors"], report["n"]) == (1.0, 0, 292), report["failed"][:5]


@pytest.mark.data
def test_gold_traces_observe_the_same_on_sparql_and_in_memory():
    tasks = load_agentbench_kg_tasks(agentbench_dir(), "dev")
    for i, task in enumerate(tasks):
        nt = to_ntriples(trace_graph(task), FREEBASE)
        memory = replay_turns(KGEnv(parse_rdf(nt, "nt", FREEBASE), max_listed=5), task, gold_turns(task))
        backends = [SparqlBackend(OxigraphClient.from_rdf(nt, "nt"), FREEBASE)]
        if i < 3:  # a few over HTTP too (each starts a server)
            with sparql_server(nt) as (url, _):
                backends.append(SparqlBackend(HttpSparqlClient(url), FREEBASE))
                for backend in backends:
                    other = replay_turns(KGEnv(backend, max_listed=5), task, gold_turns(task))
                    assert other[1] == memory[1] and other[0].info == memory[0].info, task.task_id
        else:
            other = replay_turns(KGEnv(backends[0], max_listed=5), task, gold_turns(task))
            assert other[1] == memory[1] and other[0].info == memory[0].info, task.task_id
        assert memory[0].reward == 1.0
