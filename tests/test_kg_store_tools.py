"""TripleStore and KGToolbox on the hand-written graph of support.py (TRIPLES, drawn there);
expected values derived in comments."""

from __future__ import annotations

import pytest

from support import metaqa_dir, small_store
from tiderl.envs.kg.store import TripleStore, inverse, load_metaqa_kb, load_tsv_triples
from tiderl.envs.kg.tools import KGToolbox


# -- store -----------------------------------------------------------------------------------


def test_store_indexes_forward_and_inverse_edges():
    store = small_store()
    assert store.num_triples == 12
    # A duplicate adds nothing (neither count nor inverse edge).
    assert store.add("F1", "directed_by", "D1") is False
    assert store.num_triples == 12
    # 10 entities: F1 F2 F3 D1 D2 "Ann Lee" A2 1990 2001 Drama.
    assert store.entities() == sorted(["F1", "F2", "F3", "D1", "D2", "Ann Lee", "A2", "1990", "2001", "Drama"])
    assert store.relations("F1") == ["directed_by", "has_genre", "release_year", "starred_actors"]
    assert store.relations("D1") == ["directed_by_inv"]
    assert store.relations("nobody") == []
    assert store.neighbors("D1", "directed_by_inv") == {"F1", "F2"}
    assert store.neighbors("2001", "release_year_inv") == {"F2", "F3"}
    assert store.expand({"F1", "F2"}, "starred_actors") == {"Ann Lee", "A2"}
    assert store.entities_with("has_genre") == {"F1", "F3"}
    assert store.has_entity("Ann Lee") and not store.has_entity("Ann")
    assert store.numeric_values("F2", "release_year") == [2001.0]
    assert inverse("directed_by") == "directed_by_inv" and inverse("directed_by_inv") == "directed_by"


def test_store_rejects_reserved_and_empty_names():
    store = TripleStore()
    with pytest.raises(ValueError, match="reserved"):
        store.add("a", "knows_inv", "b")
    with pytest.raises(ValueError, match="empty"):
        store.add("a", "", "b")


def test_numeric_values_skip_words():
    store = TripleStore(attribute_relations={"has_imdb_rating"})
    store.add("M", "has_imdb_rating", "good")
    store.add("M", "has_imdb_rating", "7.5")
    assert store.numeric_values("M", "has_imdb_rating") == [7.5]


def test_loaders_parse_and_name_bad_lines(tmp_path):
    kb = tmp_path / "kb.txt"
    kb.write_text("Kismet|directed_by|William Dieterle\n\nKismet|release_year|1944\n", encoding="utf-8")
    store = load_metaqa_kb(kb)
    assert store.num_triples == 2
    assert store.neighbors("William Dieterle", "directed_by_inv") == {"Kismet"}
    assert store.numeric_values("Kismet", "release_year") == [1944.0]

    bad = tmp_path / "bad.txt"
    bad.write_text("a|r|b\n\nonly|two\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad\.txt:3:"):
        load_metaqa_kb(bad)

    tsv = tmp_path / "t.tsv"
    tsv.write_text("a\tr\tb c\n", encoding="utf-8")
    assert load_tsv_triples(tsv).neighbors("a", "r") == {"b c"}
    tsv.write_text("a\tr\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"t\.tsv:1:"):
        load_tsv_triples(tsv)

    with pytest.raises(FileNotFoundError, match="data.metaqa_dir"):
        load_metaqa_kb(tmp_path / "missing.txt")


@pytest.mark.data
def test_real_kb_loads_completely():
    # Load time is not asserted here (speed belongs in benchmarks): ~0.9 s on 2 idle cores.
    store = load_metaqa_kb(metaqa_dir() / "kb.txt")
    # README: 133,582 unique triples, 43,234 entities.
    assert store.num_triples == 133_582
    assert len(store.entities()) == 43_234
    assert "William Dieterle" in store.neighbors("Kismet", "directed_by")


# -- toolbox ---------------------------------------------------------------------------------


def test_get_neighbors_creates_variables_and_chains():
    tb = KGToolbox(small_store())
    assert tb.call("get_neighbors", {"variable": "D1", "relation": "directed_by_inv"}) == "Variable #0: 2 entities"
    assert tb.variables == [{"F1", "F2"}]
    # #0 = {F1, F2}; their actors: F1 -> Ann Lee, A2; F2 -> A2  => {Ann Lee, A2}.
    assert tb.call("get_neighbors", {"variable": "#0", "relation": "starred_actors"}) == "Variable #1: 2 entities"
    assert tb.variables[1] == {"Ann Lee", "A2"}
    assert tb.call("get_neighbors", {"variable": "F3", "relation": "directed_by"}) == "Variable #2: 1 entity"
    assert tb.resolve_answer("#1") == {"Ann Lee", "A2"}
    assert tb.resolve_answer("#3") is None and tb.resolve_answer("F1") is None
    assert (tb.num_calls, tb.num_errors) == (3, 0)
    # touched: the (entity, relation) pairs expanded and every entity reached.
    assert tb.touched == {
        ("D1", "directed_by_inv"), "F1", "F2",
        ("F1", "starred_actors"), ("F2", "starred_actors"), "Ann Lee", "A2",
        ("F3", "directed_by"), "D2",
    }


def test_get_relations_is_the_union_over_a_variable():
    tb = KGToolbox(small_store())
    assert tb.call("get_relations", {"variable": "D1"}) == "Relations: directed_by_inv"
    tb.call("get_neighbors", {"variable": "D1", "relation": "directed_by_inv"})
    # F1 has all four relations, F2 lacks has_genre: the union is all four.
    assert tb.call("get_relations", {"variable": "#0"}) == (
        "Relations: directed_by, has_genre, release_year, starred_actors"
    )


def test_intersection_argmax_argmin_count_attributes():
    tb = KGToolbox(small_store())
    tb.call("get_neighbors", {"variable": "D1", "relation": "directed_by_inv"})       # #0 = {F1, F2}
    tb.call("get_neighbors", {"variable": "Ann Lee", "relation": "starred_actors_inv"})  # #1 = {F1, F3}
    assert tb.call("intersection", {"variable1": "#0", "variable2": "#1"}) == "Variable #2: 1 entity"
    assert tb.variables[2] == {"F1"}
    # An entity name works as an argument too: {F2} & {F1, F3} is empty, still a variable.
    assert tb.call("intersection", {"variable1": "F2", "variable2": "#1"}) == "Variable #3: 0 entities"
    # #1 = {F1: 1990, F3: 2001}: max 2001 -> {F3}, min 1990 -> {F1}.
    assert tb.call("argmax", {"variable": "#1", "attribute": "release_year"}) == "Variable #4: 1 entity"
    assert tb.variables[4] == {"F3"}
    assert tb.call("argmin", {"variable": "#1", "attribute": "release_year"}) == "Variable #5: 1 entity"
    assert tb.variables[5] == {"F1"}
    # Ties are kept: {F1, F2, F3} by year -> F2 and F3 share the max 2001.
    tb.call("get_neighbors", {"variable": "#0", "relation": "starred_actors"})  # #6 = {Ann Lee, A2}
    tb.call("get_neighbors", {"variable": "#6", "relation": "starred_actors_inv"})  # #7 = {F1, F2, F3}
    assert tb.variables[7] == {"F1", "F2", "F3"}
    tb.call("argmax", {"variable": "#7", "attribute": "release_year"})
    assert tb.variables[8] == {"F2", "F3"}
    # count answers a number and makes no variable.
    assert tb.call("count", {"variable": "#7"}) == "Count: 3"
    assert len(tb.variables) == 9
    assert tb.call("get_attributes", {"variable": "#7"}) == "Attributes: release_year"
    assert tb.call("get_attributes", {"variable": "D1"}) == "'D1' has no attributes."
    assert tb.num_errors == 0


def test_max_listed_lists_small_sets_only():
    tb = KGToolbox(small_store(), max_listed=2)
    assert tb.call("get_neighbors", {"variable": "D1", "relation": "directed_by_inv"}) == (
        "Variable #0: 2 entities (F1, F2)"
    )
    tb.call("get_neighbors", {"variable": "Ann Lee", "relation": "starred_actors_inv"})  # #1 = {F1, F3}
    tb.call("get_neighbors", {"variable": "#0", "relation": "starred_actors"})  # #2 = {Ann Lee, A2}
    # 3 films > max_listed=2: not listed.
    assert tb.call("get_neighbors", {"variable": "#2", "relation": "starred_actors_inv"}) == "Variable #3: 3 entities"
    with pytest.raises(ValueError, match="max_listed"):
        KGToolbox(small_store(), max_listed=-1)


@pytest.mark.parametrize(
    "name, arguments, expected",
    [
        ("fly", {"variable": "D1"}, "Error: unknown tool 'fly'. Available tools: get_relations, get_neighbors,"),
        ("get_relations", {"variable": "#9"}, "Error: variable #9 does not exist. No variables exist yet"),
        ("get_relations", {"variable": "Foo"},
         "Error: entity 'Foo' not found. Use an exact entity name from the question or a variable like #0."),
        ("get_relations", {"variable": "[D1]"}, "Error: entity '[D1]' not found. Drop the square brackets: use 'D1'."),
        ("get_neighbors", {"variable": "D1"},
         "Error: get_neighbors is missing argument 'relation'. Call it as get_neighbors(variable, relation)."),
        ("count", {"variable": "D1", "extra": 1}, "Error: count got unexpected argument 'extra'."),
        ("count", {"variable": 3}, "Error: argument 'variable' of count must be a string"),
        ("count", ["D1"], "Error: arguments of count must be a JSON object, got list."),
        ("get_neighbors", {"variable": "D1", "relation": "starred_actors"},
         "Error: relation 'starred_actors' not found for 'D1'. Call get_relations(D1)"),
        ("argmax", {"variable": "D1", "attribute": "directed_by_inv"}, "Error: 'directed_by_inv' is not an attribute."),
        ("argmin", {"variable": "D1", "attribute": "release_year"},
         "Error: no entity in 'D1' has a numeric 'release_year'."),
    ],
)
def test_bad_calls_return_error_observations(name, arguments, expected):
    tb = KGToolbox(small_store())
    observation = tb.call(name, arguments)
    assert observation.startswith(expected), observation
    assert (tb.num_calls, tb.num_errors, tb.variables) == (1, 1, [])


def test_unknown_variable_names_the_defined_ones():
    tb = KGToolbox(small_store())
    tb.call("get_neighbors", {"variable": "D1", "relation": "directed_by_inv"})
    tb.call("get_neighbors", {"variable": "#0", "relation": "directed_by"})
    assert tb.call("count", {"variable": "#5"}) == "Error: variable #5 does not exist. Defined variables: #0 to #1."
    assert (tb.num_calls, tb.num_errors) == (3, 1)


def test_hidden_entities_never_come_back():
    tb = KGToolbox(small_store(), hidden={"F1"})
    # D1 directed F1 and F2; F1 is hidden.
    tb.call("get_neighbors", {"variable": "D1", "relation": "directed_by_inv"})
    assert tb.variables == [{"F2"}]
    # D2 directed only F3; hiding F3 leaves nothing: an error that says why, and no variable.
    tb = KGToolbox(small_store(), hidden={"F3"})
    observation = tb.call("get_neighbors", {"variable": "D2", "relation": "directed_by_inv"})
    assert observation.startswith("Error: relation 'directed_by_inv' from 'D2' leads only back to the question's topic")
    assert tb.variables == [] and tb.num_errors == 1
