"""Observation limits, name resolution, count variables and knowledge units (hand-derived)."""

from __future__ import annotations

import pytest

from support import small_store
from tiderl.envs.kg.env import KGEnv
from tiderl.envs.kg.store import TripleStore
from tiderl.envs.kg.tools import KGToolbox, ObservationLimits, bounded_list, knowledge_units
from tiderl.envs.protocol import Action, Task, ToolCall


def call(name: str, **arguments: str) -> ToolCall:
    return ToolCall(name=name, arguments=arguments)


def test_bounded_list_counts_what_it_leaves_out():
    items = ["a", "b", "c", "d", "e"]
    assert bounded_list(items, ObservationLimits()) == "a, b, c, d, e"
    assert bounded_list(items, ObservationLimits(max_items=3)) == "a, b, c, ... (2 more not shown; 5 in all)"
    assert bounded_list(items, ObservationLimits(max_items=5)) == "a, b, c, d, e"
    # "ab" is 2 characters, ", cd" would bring it to 6 > 5.
    assert bounded_list(["ab", "cd"], ObservationLimits(max_chars=5)) == "ab, ... (1 more not shown; 2 in all)"
    assert bounded_list(["ab", "cd"], ObservationLimits(max_chars=6)) == "ab, cd"
    # An item is never cut: one that does not fit is left out whole.
    assert bounded_list(["abcdefgh", "x"], ObservationLimits(max_chars=4)) == "... (2 more not shown; 2 in all)"
    assert bounded_list([], ObservationLimits(max_items=1)) == ""
    with pytest.raises(ValueError, match="max_items"):
        ObservationLimits(max_items=0)


def test_long_relation_and_entity_lists_are_truncated():
    store = TripleStore()
    for i in range(30):
        store.add("hub", f"rel_{i:02d}", f"e{i:02d}")
        store.add("hub", "links", f"e{i:02d}")
    tb = KGToolbox(store, max_listed=50, limits=ObservationLimits(max_items=4, max_chars=1000))
    # 30 rel_* plus links: 31 relations, sorted: links, rel_00, rel_01, ...
    assert tb.call("get_relations", {"variable": "hub"}) == (
        "Relations: links, rel_00, rel_01, rel_02, ... (27 more not shown; 31 in all)")
    assert tb.call("get_neighbors", {"variable": "hub", "relation": "links"}) == (
        "Variable #0: 30 entities (e00, e01, e02, e03, ... (26 more not shown; 30 in all))")
    # The default limits (100 items, 4000 characters) leave these short lists alone.
    tb = KGToolbox(store)
    assert tb.call("get_relations", {"variable": "hub"}).count(",") == 30


def test_names_from_the_task_map_and_labels_resolve_to_ids():
    store = TripleStore(add_inverse=False)
    store.add("m.01", "film.film.directed_by", "m.02")
    store.add("m.03", "film.film.directed_by", "m.02")
    store.add_label("m.01", "Twin")
    store.add_label("m.03", "Twin")
    store.add_label("m.02", "Someone")
    tb = KGToolbox(store, max_listed=5, entity_names={"the director": "m.02", "a ghost": "m.99"})
    assert tb.call("get_relations", {"variable": "Someone"}) == "'Someone' has no relations."
    assert tb.call("get_neighbors", {"variable": "m.01", "relation": "film.film.directed_by"}) == (
        "Variable #0: 1 entity (m.02 (Someone))")
    assert tb.call("count", {"variable": "the director"}) == "Count: 1"
    assert tb.call("count", {"variable": "a ghost"}) == "Error: entity 'a ghost' (m.99) is not in the knowledge graph."
    assert tb.call("count", {"variable": "Twin"}) == (
        "Error: 'Twin' names 2 entities: m.01, m.03. Use one of these ids instead.")
    assert tb.call("count", {"variable": "[Someone]"}) == (
        "Error: entity '[Someone]' not found. Drop the square brackets: use 'Someone'.")
    assert (tb.num_calls, tb.num_errors) == (6, 3)


def test_count_can_store_its_number_for_a_final_answer():
    # "How many films did D1 direct?" AgentBench-style: the answer is the count itself.
    task = Task("c", "how many films did [D1] direct?", ["2"], {"topic": "D1", "count_creates_variable": True})
    env = KGEnv(small_store())
    env.reset(task)
    step = env.step(Action("", [call("get_neighbors", variable="D1", relation="directed_by_inv"),
                                call("count", variable="#0")]))
    assert step.observations == ["Variable #0: 2 entities", "Count: 2, stored as Variable #1"]
    assert env.toolbox.variables[1] == {"2"}
    final = env.step(Action("Final Answer: #1"))
    assert final.reward == 1.0 and final.info["answer_size"] == 1
    # Without the flag count makes no variable (the MetaQA behaviour).
    env.reset(Task("c", "q", ["2"], {"topic": "D1"}))
    assert env.step(Action("", [call("count", variable="D1")])).observations == ["Count: 1"]
    assert env.toolbox.variables == []


def test_knowledge_units_in_the_final_info():
    assert knowledge_units({("F1", "directed_by"), "D1", "A b", ("A b", "x|y")}) == [
        "entity:A b", "entity:D1", "entity_relation:A b|x|y", "entity_relation:F1|directed_by"]

    env = KGEnv(small_store())
    env.reset(Task("t", "which films did [D1] direct?", ["F1", "F2"], {"topic": "D1"}))
    step = env.step(Action("", [
        call("get_relations", variable="D1"),                            # no unit: lists, reaches nothing
        call("get_neighbors", variable="D1", relation="directed_by_inv"),  # (D1, directed_by_inv), F1, F2
        call("get_neighbors", variable="D1", relation="starred_actors"),   # an error: no unit
        call("intersection", variable1="#0", variable2="F1"),            # no unit: a subset of known ones
    ]))
    assert "knowledge_units" not in step.info  # only the final step carries them
    final = env.step(Action("Final Answer: #0"))
    assert final.done and final.info["knowledge_units"] == [
        "entity:F1", "entity:F2", "entity_relation:D1|directed_by_inv"]

    # finish (a turn limit) reports them too; argmax adds (entity with a value, attribute) pairs.
    env.reset(Task("t", "q", ["F3"], {"topic": "Ann Lee"}))
    env.step(Action("", [call("argmax", variable="Ann Lee", attribute="release_year"),   # error: no value
                         call("get_neighbors", variable="Ann Lee", relation="starred_actors_inv"),
                         call("argmax", variable="#0", attribute="release_year")]))
    result = env.finish("max_turns")
    assert result.info["knowledge_units"] == [
        "entity:F1", "entity:F3", "entity_relation:Ann Lee|starred_actors_inv",
        "entity_relation:F1|release_year", "entity_relation:F3|release_year"]
    # A hidden topic is never reached, so it is never a unit.
    env.reset(Task("t", "q", ["F2"], {"topic": "F1", "exclude_topic": True}))
    env.step(Action("", [call("get_neighbors", variable="F1", relation="directed_by"),
                         call("get_neighbors", variable="#0", relation="directed_by_inv")]))
    assert "entity:F1" not in env.finish("max_turns").info["knowledge_units"]
