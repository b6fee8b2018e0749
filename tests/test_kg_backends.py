"""KG backends: the in-memory store, RDF loading, SPARQL in process and over loopback HTTP.

The central test plays one tool-call sequence through KGEnv on five backends loaded with the
same triples and asserts identical observations, final info and knowledge units, all equal to
values derived by hand from the small graph of support.py (TRIPLES).
"""

from __future__ import annotations

import pytest

from support import EX, LABELS, SCHEMA, small_graph, small_store, sparql_server
from tiderl.envs.kg.backend import KGBackend, numeric_value
from tiderl.envs.kg.env import KGEnv
from tiderl.envs.kg.rdf import (
    FREEBASE,
    FREEBASE_NS,
    WIKIDATA,
    XSD,
    RdfSchema,
    Term,
    id_of_iri,
    iri_of,
    literal,
    load_rdf_file,
    parse_rdf,
    safe_iri,
    to_ntriples,
)
from tiderl.envs.kg.sparql import (
    HttpSparqlClient,
    OxigraphClient,
    SparqlBackend,
    SparqlError,
    build_request,
    parse_results_json,
)
from tiderl.envs.kg.store import TripleStore
from tiderl.envs.kg.tools import ObservationLimits
from tiderl.envs.protocol import Action, Task, ToolCall

pyoxigraph = pytest.importorskip("pyoxigraph", reason="pyoxigraph is needed for RDF parsing and SPARQL")


def labelled_small_store() -> TripleStore:
    store = small_store()
    for entity, name in LABELS.items():
        store.add_label(entity, name)
    return store


@pytest.fixture(scope="module")
def small_nt() -> str:
    return to_ntriples(small_graph(), SCHEMA)


@pytest.fixture(scope="module")
def http_url(small_nt):
    with sparql_server(small_nt) as (url, methods):
        yield url, methods


# -- pure parts ------------------------------------------------------------------------------


def test_numeric_value_orders_numbers_and_dates():
    assert numeric_value("7.5") == 7.5 and numeric_value("1944") == 1944.0 and numeric_value("-0500") == -500.0
    assert numeric_value("good") is None and numeric_value("nan") is None and numeric_value("") is None
    # 1944-10-08: (10 - 1) * 31 + 8 - 1 = 286 days into a 372-day year.
    assert numeric_value("1944-10-08") == pytest.approx(1944 + 286 / 372)
    dates = ["2000-12-31", "2001", "2001-01-01T00:00:01Z", "2001-05", "2001-05-02", "2001-05-02T10:00:00"]
    values = [numeric_value(d) for d in dates]
    assert values == sorted(values) and len(set(values)) == len(values)


def test_ids_and_iris_round_trip():
    assert iri_of("Ann Lee", SCHEMA) == EX + "Ann%20Lee" and id_of_iri(EX + "Ann%20Lee", SCHEMA) == "Ann Lee"
    assert iri_of("Grégoire Colin", SCHEMA) == EX + "Gr%C3%A9goire%20Colin"
    assert iri_of("100%", SCHEMA) == EX + "100%25" and id_of_iri(EX + "100%25", SCHEMA) == "100%"
    # A colon in a name is not a scheme: "Alien: Resurrection" stays in the namespace.
    assert id_of_iri(iri_of("Alien: Resurrection", SCHEMA), SCHEMA) == "Alien: Resurrection"
    # Characters that could end an IRI in a query are encoded.
    assert iri_of('a>b"c {x}', SCHEMA) == EX + "a%3Eb%22c%20%7Bx%7D"
    assert safe_iri("http://x.org/a b<c>") == "http://x.org/a%20b%3Cc%3E"
    # IRIs outside the namespaces keep their full text; so does a local name that looks like
    # an IRI (its compact form would expand to a different IRI).
    assert id_of_iri("http://other.org/x", SCHEMA) == "http://other.org/x" == iri_of("http://other.org/x", SCHEMA)
    assert id_of_iri(EX + "http://x.org/y", SCHEMA) == EX + "http://x.org/y"
    assert id_of_iri(FREEBASE_NS + "m.0zd6", FREEBASE) == "m.0zd6"
    assert iri_of("people.person.gender", FREEBASE) == FREEBASE_NS + "people.person.gender"
    assert id_of_iri("http://www.wikidata.org/prop/direct/P31", WIKIDATA) == "wdt:P31"
    assert iri_of("Q42", WIKIDATA) == "http://www.wikidata.org/entity/Q42"
    with pytest.raises(ValueError, match="empty id prefix"):
        RdfSchema(namespaces=((EX, ""), ("http://b.org/", "")))


def test_terms_escape_for_queries():
    assert literal('say "hi"\n\\').sparql() == '"say \\"hi\\"\\n\\\\"'
    assert literal("1", XSD + "integer").sparql() == f'"1"^^<{XSD}integer>'
    assert literal("x", XSD + "string") == literal("x") and literal("Kismet", lang="EN").sparql() == '"Kismet"@en'
    assert Term("uri", "http://x.org/a b").sparql() == "<http://x.org/a%20b>"


def test_http_requests_and_results_parsing():
    get = build_request("http://h/sparql", "ASK {}", headers={"User-Agent": "me"})
    assert get.get_method() == "GET" and get.full_url == "http://h/sparql?query=ASK+%7B%7D"
    assert get.get_header("User-agent") == "me" and get.get_header("Accept") == "application/sparql-results+json"
    with_graph = build_request("http://h/sparql?timeout=5", "ASK {}", default_graph="http://g")
    assert with_graph.full_url == "http://h/sparql?timeout=5&query=ASK+%7B%7D&default-graph-uri=http%3A%2F%2Fg"
    post = build_request("http://h/sparql", "SELECT * WHERE { ?s ?p ?o }", max_get_chars=10)
    assert post.get_method() == "POST" and post.data.startswith(b"query=SELECT")
    assert post.get_header("Content-type") == "application/x-www-form-urlencoded"
    with pytest.raises(ValueError, match="method"):
        build_request("http://h/sparql", "ASK {}", method="PUT")

    doc = {"head": {"vars": ["a", "b"]}, "results": {"bindings": [
        {"a": {"type": "uri", "value": "http://x/1"}, "b": {"type": "literal", "value": "K", "xml:lang": "en"}},
        {"a": {"type": "bnode", "value": "b0"},
         "b": {"type": "typed-literal", "value": "3", "datatype": XSD + "integer"}},
        {"a": {"type": "literal", "value": "s", "datatype": XSD + "string"}},
    ]}}
    assert parse_results_json(doc) == [
        {"a": Term("uri", "http://x/1"), "b": Term("literal", "K", "", "en")},
        {"a": Term("bnode", "b0"), "b": Term("literal", "3", XSD + "integer")},
        {"a": Term("literal", "s")},
    ]
    assert parse_results_json({"head": {}, "boolean": False}) is False
    with pytest.raises(SparqlError, match="not a SPARQL JSON results document"):
        parse_results_json({"rows": []})


# -- RDF loading -------------------------------------------------------------------------------

TURTLE = """
@prefix ex: <http://example.org/kg/> .
@prefix rdfs: <http://www.w3.org/2000/01/rdf-schema#> .
@prefix xsd: <http://www.w3.org/2001/XMLSchema#> .
ex:Kismet ex:directed_by ex:William%20Dieterle ;
    ex:release_year "1944"^^xsd:gYear ;
    ex:premiere "1944-10-08"^^xsd:date ;
    rdfs:label "Kismet (film)"@en, "Kismet"@en, "Kismet (Film)"@de ;
    ex:has_tags [ ex:note "anonymous" ] ;
    ex:tagline "A plain string" .
ex:William%20Dieterle rdfs:label "William Dieterle" .
<http://other.org/x> ex:directed_by ex:Kismet .
"""


def test_turtle_loads_with_labels_literals_and_inferred_attributes(tmp_path):
    store = parse_rdf(TURTLE, "ttl", SCHEMA)
    # The blank node and its triple are skipped; literals are entities named by their text.
    assert store.entities() == sorted(["Kismet", "William Dieterle", "1944", "1944-10-08", "A plain string",
                                       "http://other.org/x"])
    assert store.relations("Kismet") == ["directed_by", "directed_by_inv", "premiere", "release_year", "tagline"]
    # gYear and date are comparable; a plain string is not.
    assert store.attribute_relations == {"premiere", "release_year"}
    assert store.numeric_values("Kismet", "premiere") == [pytest.approx(1944 + 286 / 372)]
    # English and untagged labels count; the smallest is shown; German is ignored.
    assert store.labels(["Kismet", "William Dieterle", "1944"]) == {"Kismet": "Kismet",
                                                                      "William Dieterle": "William Dieterle"}
    assert store.find_entities("Kismet (film)") == ["Kismet"] and store.find_entities("Kismet (Film)") == []

    no_tagline = parse_rdf(TURTLE, "ttl", RdfSchema(namespaces=((EX, ""),), exclude_predicates=(EX + "tagline",)))
    assert "tagline" not in no_tagline.relations("Kismet") and not no_tagline.has_entity("A plain string")

    path = tmp_path / "g.ttl"
    path.write_text(TURTLE, encoding="utf-8")
    assert sorted(load_rdf_file(path, SCHEMA).triples()) == sorted(store.triples())
    with pytest.raises(FileNotFoundError, match="RDF file"):
        load_rdf_file(tmp_path / "missing.nt")
    with pytest.raises(SyntaxError):
        parse_rdf("<http://a> <http://b> .", "nt")
    with pytest.raises(ValueError, match="unknown RDF format"):
        parse_rdf(TURTLE, "xml")


def test_store_without_inverse_edges_keeps_objects_as_entities():
    store = TripleStore(add_inverse=False)
    store.add("m.a", "x.y.knows_inv", "m.b")  # `_inv` is an ordinary name when the store adds no inverses
    assert store.has_entity("m.b") and store.relations("m.b") == [] and store.relations("m.a") == ["x.y.knows_inv"]
    assert list(store.triples()) == [("m.a", "x.y.knows_inv", "m.b")]


def test_backends_agree_lookup_by_lookup():
    """Each protocol method gives the same answer on the Turtle graph in memory and in SPARQL."""
    memory = parse_rdf(TURTLE, "ttl", SCHEMA)
    sparql = SparqlBackend(OxigraphClient.from_rdf(TURTLE, "ttl"), SCHEMA)
    for backend in (memory, sparql):
        assert isinstance(backend, KGBackend)
    ids = ["Kismet", "William Dieterle", "1944", "1944-10-08", "A plain string", "http://other.org/x", "anonymous",
           "Nobody"]
    for entity in ids:
        assert memory.has_entity(entity) == sparql.has_entity(entity), entity
        assert memory.relations_of([entity]) == sparql.relations_of([entity]), entity
    assert memory.relations_of(ids) == sparql.relations_of(ids)
    assert memory.labels(ids) == sparql.labels(ids)
    for name in ("Kismet", "Kismet (film)", "Kismet (Film)", "William Dieterle"):
        assert memory.find_entities(name) == sparql.find_entities(name), name
    for relation in ("directed_by", "directed_by_inv", "release_year", "release_year_inv", "tagline", "premiere"):
        assert memory.expand(ids, relation) == sparql.expand(ids, relation), relation
        assert memory.is_attribute(relation) == sparql.is_attribute(relation), relation
        assert memory.attribute_values(ids, relation) == sparql.attribute_values(ids, relation), relation
    assert memory.attributes_of(ids) == sparql.attributes_of(ids) == {"premiere", "release_year"}


# -- the same tool calls on every backend -------------------------------------------------------

# (tool call, expected observation), derived by hand from TRIPLES and LABELS. max_listed=3 and
# ObservationLimits(max_items=3): F1 has 4 relations, so relation lists are cut after 3.
SEQUENCE: list[tuple[tuple[str, dict[str, str]], str]] = [
    (("get_relations", {"variable": "F1"}),
     "Relations: directed_by, has_genre, release_year, ... (1 more not shown; 4 in all)"),
    (("get_neighbors", {"variable": "D1", "relation": "directed_by_inv"}),
     "Variable #0: 2 entities (F1 (First Film), F2)"),
    (("get_neighbors", {"variable": "#0", "relation": "starred_actors"}),
     "Variable #1: 2 entities (A2 (Bo Chen), Ann Lee)"),
    (("get_neighbors", {"variable": "Ann Lee", "relation": "starred_actors_inv"}),
     "Variable #2: 2 entities (F1 (First Film), F3)"),
    (("intersection", {"variable1": "#0", "variable2": "#2"}), "Variable #3: 1 entity (F1 (First Film))"),
    (("get_attributes", {"variable": "#2"}), "Attributes: release_year"),
    # #2 = {F1: 1990, F3: 2001}.
    (("argmax", {"variable": "#2", "attribute": "release_year"}), "Variable #4: 1 entity (F3)"),
    (("argmin", {"variable": "#2", "attribute": "release_year"}), "Variable #5: 1 entity (F1 (First Film))"),
    (("count", {"variable": "#1"}), "Count: 2"),
    # A year is a literal in RDF and an entity in memory: the tools cannot tell.
    (("get_relations", {"variable": "2001"}), "Relations: release_year_inv"),
    (("get_neighbors", {"variable": "2001", "relation": "release_year_inv"}), "Variable #6: 2 entities (F2, F3)"),
    # Labels work as names.
    (("get_relations", {"variable": "Bo Chen"}), "Relations: starred_actors_inv"),
    (("get_neighbors", {"variable": "First Film", "relation": "directed_by"}), "Variable #7: 1 entity (D1)"),
    (("get_neighbors", {"variable": "#1", "relation": "starred_actors_inv"}),
     "Variable #8: 3 entities (F1 (First Film), F2, F3)"),
    (("get_relations", {"variable": "#8"}),
     "Relations: directed_by, has_genre, release_year, ... (1 more not shown; 4 in all)"),
    # Errors.
    (("get_relations", {"variable": "Nobody"}),
     "Error: entity 'Nobody' not found. Use an exact entity name from the question or a variable like #0."),
    (("get_relations", {"variable": "[D1]"}), "Error: entity '[D1]' not found. Drop the square brackets: use 'D1'."),
    (("get_relations", {"variable": 'x" } ; DROP ALL ; #'}),
     "Error: entity 'x\" } ; DROP ALL ; #' not found. Use an exact entity name from the question or a variable "
     "like #0."),
    (("count", {"variable": "#42"}), "Error: variable #42 does not exist. Defined variables: #0 to #8."),
    (("get_neighbors", {"variable": "D2", "relation": "starred_actors"}),
     "Error: relation 'starred_actors' not found for 'D2'. Call get_relations(D2) to see the relations it has."),
    (("argmax", {"variable": "#0", "attribute": "directed_by"}),
     "Error: 'directed_by' is not an attribute. Call get_attributes(#0) to see the attributes it has."),
]

# What the successful calls explored: get_neighbors' (input entity, relation) pairs and results,
# argmax/argmin's (entity with a value, attribute) pairs and winners.
UNITS = [
    "entity:A2", "entity:Ann Lee", "entity:D1", "entity:F1", "entity:F2", "entity:F3",
    "entity_relation:2001|release_year_inv", "entity_relation:A2|starred_actors_inv",
    "entity_relation:Ann Lee|starred_actors_inv", "entity_relation:D1|directed_by_inv",
    "entity_relation:F1|directed_by", "entity_relation:F1|release_year", "entity_relation:F1|starred_actors",
    "entity_relation:F2|starred_actors", "entity_relation:F3|release_year",
]


def play_sequence(backend) -> tuple[list[str], dict]:
    env = KGEnv(backend, max_listed=3, limits=ObservationLimits(max_items=3))
    env.reset(Task("seq", "which film with Ann Lee came out last?", ["F3"], {"topic": "Ann Lee"}))
    observations = []
    for (name, arguments), _ in SEQUENCE:
        step = env.step(Action("", [ToolCall(name, arguments)]))
        observations += step.observations
    final = env.step(Action("Final Answer: #4"))
    assert final.done
    return observations, final.info


def test_tool_sequence_is_identical_on_every_backend(small_nt, http_url):
    url, methods = http_url
    backends = {
        "memory": labelled_small_store(),
        "rdf file": parse_rdf(small_nt, "nt", SCHEMA),
        "oxigraph": SparqlBackend(OxigraphClient.from_rdf(small_nt, "nt"), SCHEMA),
        "oxigraph, batches of 1": SparqlBackend(OxigraphClient.from_rdf(small_nt, "nt"), SCHEMA, batch_size=1),
        "http GET": SparqlBackend(HttpSparqlClient(url, method="GET"), SCHEMA),
        "http POST": SparqlBackend(HttpSparqlClient(url, method="POST"), SCHEMA),
    }
    expected = [observation for _, observation in SEQUENCE]
    for name, backend in backends.items():
        observations, info = play_sequence(backend)
        assert observations == expected, name
        assert (info["success"], info["tool_calls"], info["tool_errors"]) == (1.0, len(SEQUENCE), 6), name
        assert info["knowledge_units"] == UNITS, name
    # Both HTTP methods really went over the wire.
    assert {"GET", "POST"} <= set(methods)


def test_sparql_limits_and_failures(small_nt, http_url):
    url, _ = http_url
    capped = SparqlBackend(OxigraphClient.from_rdf(small_nt, "nt"), SCHEMA, max_results=1)
    env = KGEnv(capped)
    env.reset(Task("t", "q", ["F1"], {"topic": "D1"}))
    step = env.step(Action("", [ToolCall("get_neighbors", {"variable": "D1", "relation": "directed_by_inv"}),
                                ToolCall("get_neighbors", {"variable": "D2", "relation": "directed_by_inv"})]))
    # D1 directed 2 films (over the cap of 1): an error observation; D2 directed 1: fine.
    assert step.observations == [
        "Error: relation 'directed_by_inv' reaches more than 1 entities from 'D1': too many to use. Narrow the set "
        "first (e.g. with intersection) or follow another relation.",
        "Variable #0: 1 entity",
    ]
    # A broken query is the endpoint's 400, a dead endpoint a connection error: both raise
    # SparqlError (the agent loop ends that episode), neither becomes an observation.
    with pytest.raises(SparqlError, match="HTTP 400"):
        HttpSparqlClient(url).select("SELEC nothing")
    dead = SparqlBackend(HttpSparqlClient("http://127.0.0.1:9/sparql", retries=0, timeout_s=5), SCHEMA)
    env = KGEnv(dead)
    env.reset(Task("t", "q", ["F1"], {"topic": "D1"}))
    with pytest.raises(SparqlError, match="cannot reach"):
        env.step(Action("", [ToolCall("get_relations", {"variable": "D1"})]))
    with pytest.raises(ValueError, match="http"):
        HttpSparqlClient("ftp://x/sparql")


class RecordingClient:
    """Passes queries to a client and keeps them."""

    def __init__(self, client) -> None:
        self.client, self.queries = client, []

    def select(self, query: str):
        self.queries.append(query)
        return self.client.select(query)

    def ask(self, query: str) -> bool:
        self.queries.append(query)
        return self.client.ask(query)


def test_ids_the_backend_returned_are_queried_as_the_term_it_saw(small_nt):
    client = RecordingClient(OxigraphClient.from_rdf(small_nt, "nt"))
    backend = SparqlBackend(client, SCHEMA)
    # Never seen: "2001" is tried as an IRI and as literals, the integer among them.
    assert backend.has_entity("2001")
    assert f"<{EX}2001>" in client.queries[-1] and f'"2001"^^<{XSD}integer>' in client.queries[-1]
    # F1, F2 came back as IRIs, 1990 as an integer literal: later queries use just those terms.
    assert backend.expand(["D1"], "directed_by_inv") == {"F1", "F2"}
    assert backend.expand(["F1"], "release_year") == {"1990"}
    backend.relations_of(["F1", "1990"])
    assert f"VALUES ?t {{ \"1990\"^^<{XSD}integer> <{EX}F1> }}" in client.queries[-1]  # ids sorted
    assert '"F1"' not in client.queries[-1] and f"<{EX}1990>" not in client.queries[-1]
