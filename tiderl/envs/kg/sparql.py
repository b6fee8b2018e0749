"""A KG backend that asks a SPARQL endpoint: Freebase on Virtuoso, Wikidata, or a local store.

`SparqlBackend` implements `backend.KGBackend` with a handful of query shapes (below), run
through a `SparqlClient`:

* `HttpSparqlClient`: the SPARQL 1.1 protocol over plain HTTP (urllib): GET with `?query=`
  while the URL stays short, form-encoded POST otherwise, JSON results. Works with Virtuoso,
  Blazegraph, Fuseki, QLever, Wikidata's service (give it a User-Agent header) and oxigraph.
* `OxigraphClient`: a pyoxigraph `Store` in the same process (tests, small graphs).

How RDF terms become ids, which predicates are relations, labels and attributes: see
`rdf.RdfSchema`; the rules are the ones `rdf.store_from_terms` applies when a file is loaded in
memory, so the two backends answer alike. Every query writes its terms as full IRIs or escaped
literals (no PREFIX declarations, nothing the agent typed is pasted in unescaped), and entity
sets are sent in batches of `batch_size` through `VALUES`.

A literal has no IRI, so its id (its lexical form) cannot say which term it was. The backend
remembers the exact term of every id it has returned; an id it has never returned (typed by
the agent, e.g. the year `1990` of a question) is tried as its IRI and as the few literal
forms it could be (`literal_candidates`). So an id is assumed to name one RDF term: a graph
holding both `<ns:1990>` and `"1990"` would be seen through whichever the backend met first
(the in-memory loader merges them into one node).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any, Collection, Iterable, Iterator, Protocol, Sequence
from urllib.parse import urlencode

from tiderl.envs.kg.backend import BackendError, BackendLimitError, numeric_value
from tiderl.envs.kg.rdf import (
    NUMERIC_DATATYPES,
    XSD,
    RdfSchema,
    Term,
    require_pyoxigraph,
    id_of_iri,
    id_of_term,
    iri_of,
    keep_predicate,
    literal,
    rdf_format,
    term_from_oxigraph,
)
from tiderl.envs.kg.store import INVERSE_SUFFIX

Bindings = list[dict[str, Term]]


class SparqlError(BackendError):
    """The endpoint failed (unreachable, HTTP error, bad response). Not the agent's fault, so
    it is not turned into an observation: the episode ends with an error."""


class SparqlClient(Protocol):
    """Runs SPARQL queries."""

    def select(self, query: str) -> Bindings:
        """The solutions of a SELECT query: one dict per row, variable name -> Term (unbound
        variables are absent)."""
        ...

    def ask(self, query: str) -> bool:
        """The answer of an ASK query."""
        ...


# -- HTTP --------------------------------------------------------------------------------------


def term_from_json(value: dict[str, str]) -> Term:
    """A term of SPARQL 1.1 JSON results (`typed-literal` is Virtuoso's older spelling)."""
    kind = value.get("type")
    if kind == "uri":
        return Term("uri", value["value"])
    if kind in ("literal", "typed-literal"):
        return literal(value["value"], value.get("datatype", ""), value.get("xml:lang", ""))
    if kind == "bnode":
        return Term("bnode", value["value"])
    raise SparqlError(f"SPARQL JSON result has a term of unknown type {kind!r}: {value}")


def parse_results_json(doc: Any) -> Bindings | bool:
    """A parsed `application/sparql-results+json` document: rows for SELECT, a bool for ASK."""
    if isinstance(doc, dict) and isinstance(doc.get("boolean"), bool):
        return doc["boolean"]
    try:
        rows = doc["results"]["bindings"]
        return [{name: term_from_json(value) for name, value in row.items()} for row in rows]
    except (KeyError, TypeError, AttributeError) as e:
        raise SparqlError(f"not a SPARQL JSON results document ({e!r}): {str(doc)[:200]}") from e


def build_request(
    endpoint: str,
    query: str,
    method: str = "auto",
    headers: dict[str, str] | None = None,
    default_graph: str | None = None,
    max_get_chars: int = 2000,
) -> urllib.request.Request:
    """The HTTP request for `query` under the SPARQL 1.1 protocol.

    method: "GET", "POST" (form-encoded) or "auto" (GET while the encoded query fits in
    `max_get_chars`, POST beyond: servers and proxies cap URL lengths).
    """
    if method not in ("auto", "GET", "POST"):
        raise ValueError(f"method must be 'auto', 'GET' or 'POST', got {method!r}")
    params = {"query": query}
    if default_graph:
        params["default-graph-uri"] = default_graph
    encoded = urlencode(params)
    all_headers = {"Accept": "application/sparql-results+json", "User-Agent": "tiderl-kg/0.1"}
    all_headers.update(headers or {})
    if method == "GET" or (method == "auto" and len(encoded) <= max_get_chars):
        separator = "&" if "?" in endpoint else "?"
        return urllib.request.Request(endpoint + separator + encoded, headers=all_headers, method="GET")
    all_headers["Content-Type"] = "application/x-www-form-urlencoded"
    return urllib.request.Request(endpoint, data=encoded.encode("utf-8"), headers=all_headers, method="POST")


class HttpSparqlClient:
    """A SPARQL endpoint over HTTP.

    endpoint: the query URL (e.g. `http://localhost:3001/sparql` for AgentBench's Virtuoso).
    method, max_get_chars, default_graph, headers: see `build_request`.
    timeout_s: per request. retries: extra attempts after a connection error, a timeout or an
        HTTP 5xx/429 (with 0.5 s, 1 s, ... waits); 4xx errors (a bad query) are not retried.
    """

    def __init__(self, endpoint: str, *, method: str = "auto", timeout_s: float = 60.0,
                 headers: dict[str, str] | None = None, default_graph: str | None = None,
                 max_get_chars: int = 2000, retries: int = 1) -> None:
        if not endpoint.startswith(("http://", "https://")):
            raise ValueError(f"SPARQL endpoint must be an http(s) URL, got {endpoint!r}")
        self.endpoint = endpoint
        self.method = method
        self.timeout_s = timeout_s
        self.headers = dict(headers or {})
        self.default_graph = default_graph
        self.max_get_chars = max_get_chars
        self.retries = retries
        self.num_requests = 0
        build_request(endpoint, "ASK {}", method)  # validates method now, not on the first call

    def select(self, query: str) -> Bindings:
        result = parse_results_json(self._fetch(query))
        if isinstance(result, bool):
            raise SparqlError(f"{self.endpoint} answered a SELECT query with a boolean")
        return result

    def ask(self, query: str) -> bool:
        result = parse_results_json(self._fetch(query))
        if not isinstance(result, bool):
            raise SparqlError(f"{self.endpoint} answered an ASK query with rows")
        return result

    def _fetch(self, query: str) -> Any:
        request = build_request(self.endpoint, query, self.method, self.headers, self.default_graph,
                                self.max_get_chars)
        for attempt in range(self.retries + 1):
            self.num_requests += 1
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    body = response.read()
                return json.loads(body.decode("utf-8"))
            except urllib.error.HTTPError as e:
                detail = e.read()[:300].decode("utf-8", "replace")
                transient = e.code >= 500 or e.code == 429
                error = SparqlError(f"{self.endpoint} answered HTTP {e.code}: {detail} (query: {query[:200]})")
            except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
                transient = True
                error = SparqlError(f"cannot reach SPARQL endpoint {self.endpoint}: {e}")
            except (ValueError, UnicodeDecodeError) as e:
                raise SparqlError(f"{self.endpoint} sent a response that is not JSON: {e}") from e
            if not transient or attempt == self.retries:
                raise error
            time.sleep(0.5 * 2 ** attempt)
        raise AssertionError("unreachable")


# -- in process ----------------------------------------------------------------------------------


class OxigraphClient:
    """Queries a pyoxigraph `Store` in this process."""

    def __init__(self, store: Any) -> None:
        self.store = store

    @classmethod
    def from_rdf(cls, data: str | bytes, format: str) -> "OxigraphClient":
        """A fresh in-memory store loaded with RDF text (`format`: nt, ttl or nq)."""
        store = require_pyoxigraph().Store()
        store.load(data.encode("utf-8") if isinstance(data, str) else data, format=rdf_format(format))
        return cls(store)

    def select(self, query: str) -> Bindings:
        solutions = self.store.query(query)
        names = [v.value for v in solutions.variables]
        return [{name: term_from_oxigraph(row[name]) for name in names if row[name] is not None}
                for row in solutions]

    def ask(self, query: str) -> bool:
        return bool(self.store.query(query))


# -- queries (pure) --------------------------------------------------------------------------


def values_clause(variable: str, terms: Iterable[Term]) -> str:
    """`VALUES ?variable { ... }` over `terms`."""
    return f"VALUES ?{variable} {{ {' '.join(t.sparql() for t in terms)} }}"


def _sparql_string(text: str) -> str:
    return literal(text).sparql()


def predicate_filter(variable: str, schema: RdfSchema) -> str:
    """A SPARQL boolean expression true exactly when `keep_predicate` keeps `?variable`."""
    parts = []
    if schema.label_predicates:
        parts.append(f"?{variable} NOT IN ({', '.join(f'<{p}>' for p in schema.label_predicates)})")
    if schema.include_predicates:
        parts.append("(" + " || ".join(f"STRSTARTS(STR(?{variable}), {_sparql_string(p)})"
                                       for p in schema.include_predicates) + ")")
    parts += [f"!STRSTARTS(STR(?{variable}), {_sparql_string(p)})" for p in schema.exclude_predicates]
    return " && ".join(parts) or "true"


def has_entity_query(terms: Sequence[Term], schema: RdfSchema) -> str:
    """ASK: is any of `terms` the subject or object of a kept edge (blank nodes excluded)?"""
    return (f"ASK {{ {values_clause('t', terms)} {{ ?t ?p ?x }} UNION {{ ?x ?p ?t }} "
            f"FILTER(!isBlank(?x) && {predicate_filter('p', schema)}) }}")


def relations_query(terms: Sequence[Term], schema: RdfSchema, backwards: bool) -> str:
    """SELECT ?p: the kept predicates leaving (or, `backwards`, entering) any of `terms`."""
    pattern = "?x ?p ?t" if backwards else "?t ?p ?x"
    return (f"SELECT DISTINCT ?p WHERE {{ {values_clause('t', terms)} {pattern} . "
            f"FILTER(!isBlank(?x) && {predicate_filter('p', schema)}) }}")


def edges_query(terms: Sequence[Term], predicate: str, backwards: bool, limit: int) -> str:
    """SELECT ?t ?x: the edges along `predicate` from (or, `backwards`, into) any of `terms`."""
    pattern = f"?x <{predicate}> ?t" if backwards else f"?t <{predicate}> ?x"
    return (f"SELECT DISTINCT ?t ?x WHERE {{ {values_clause('t', terms)} {pattern} . "
            f"FILTER(!isBlank(?x)) }} LIMIT {limit}")


def numeric_sample_query(predicate: str, sample: int) -> str:
    """ASK: is one of the first `sample` objects of `predicate` a numeric or date literal?
    (Bounded on purpose: on Freebase an unbounded scan of a large predicate times out.)"""
    datatypes = ", ".join(f"<{d}>" for d in NUMERIC_DATATYPES)
    return (f"ASK {{ {{ SELECT ?o WHERE {{ ?s <{predicate}> ?o }} LIMIT {sample} }} "
            f"FILTER(isLiteral(?o) && datatype(?o) IN ({datatypes})) }}")


def labels_query(terms: Sequence[Term], schema: RdfSchema) -> str:
    """SELECT ?t ?l: the labels of `terms` in no language or `schema.label_language`."""
    predicates = values_clause("p", (Term("uri", p) for p in schema.label_predicates))
    language = _sparql_string(schema.label_language.lower())
    return (f"SELECT ?t ?l WHERE {{ {values_clause('t', terms)} {predicates} ?t ?p ?l . "
            f"FILTER(isLiteral(?l) && (lang(?l) = \"\" || lcase(lang(?l)) = {language})) }}")


def find_query(name: str, schema: RdfSchema) -> str:
    """SELECT ?t: the subjects labelled exactly `name` (untagged or in the label language)."""
    predicates = values_clause("p", (Term("uri", p) for p in schema.label_predicates))
    names = values_clause("l", (literal(name), literal(name, lang=schema.label_language)))
    return f"SELECT DISTINCT ?t WHERE {{ {predicates} {names} ?t ?p ?l }}"


# The literal datatypes an id typed by the agent is tried as, when it reads as a number or date.
_CANDIDATE_DATATYPES = tuple(XSD + t for t in ("integer", "decimal", "double", "gYear", "gYearMonth",
                                                "date", "dateTime"))


def literal_candidates(entity_id: str, schema: RdfSchema) -> list[Term]:
    """The literal terms `entity_id` may stand for: a plain string, one in the label language,
    and, when it reads as a number or date, that text under each numeric/date datatype."""
    terms = [literal(entity_id), literal(entity_id, lang=schema.label_language)]
    if numeric_value(entity_id) is not None:
        terms += [literal(entity_id, datatype) for datatype in _CANDIDATE_DATATYPES]
    return terms


def _batches(items: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


# -- the backend ---------------------------------------------------------------------------------


class SparqlBackend:
    """`KGBackend` over a SPARQL client (see the module docstring).

    schema: how terms map to ids, which predicates are relations (`rdf.RdfSchema`).
    max_results: most edges one lookup fetches; beyond it `expand` raises `BackendLimitError`
        (the tools report it to the agent) rather than silently truncate a set.
    batch_size: entities per VALUES block. attribute_sample: objects inspected to decide whether
        a predicate is a numeric attribute (when the schema does not list them).
    cache_size: ids whose exact RDF term is remembered (cleared when full).
    """

    def __init__(self, client: SparqlClient, schema: RdfSchema = RdfSchema(), *, max_results: int = 10_000,
                 batch_size: int = 100, attribute_sample: int = 100, cache_size: int = 1_000_000) -> None:
        if max_results < 1 or batch_size < 1 or attribute_sample < 1:
            raise ValueError(f"max_results, batch_size and attribute_sample must be >= 1, got "
                             f"{max_results}, {batch_size}, {attribute_sample}")
        self.client = client
        self.schema = schema
        self.max_results = max_results
        self.batch_size = batch_size
        self.attribute_sample = attribute_sample
        self.cache_size = cache_size
        self._terms: dict[str, set[Term]] = {}
        self._has_entity: dict[str, bool] = {}
        self._is_attribute: dict[str, bool] = {}

    # -- ids <-> terms --

    def _id(self, term: Term) -> str | None:
        """The id of a result term, remembering the term for later queries."""
        entity_id = id_of_term(term, self.schema)
        if entity_id is not None:
            if len(self._terms) >= self.cache_size:
                self._terms.clear()
            self._terms.setdefault(entity_id, set()).add(term)
        return entity_id

    def terms_of(self, entity_id: str) -> list[Term]:
        """The RDF terms an id stands for: the term(s) it was returned as, or (never returned)
        its IRI and the literal forms it could be. Sorted, for reproducible queries."""
        terms = self._terms.get(entity_id)
        if not terms:
            terms = {Term("uri", iri_of(entity_id, self.schema)), *literal_candidates(entity_id, self.schema)}
        return sorted(terms, key=lambda t: (t.kind, t.value, t.datatype, t.lang))

    def _term_batches(self, entities: Iterable[str]) -> Iterator[list[Term]]:
        for batch in _batches(sorted(set(entities)), self.batch_size):
            yield [term for entity_id in batch for term in self.terms_of(entity_id)]

    def _relation(self, relation: str) -> tuple[str, bool] | None:
        """(predicate IRI, walk backwards) for a relation id; None when it is no relation."""
        backwards = self.schema.inverse_relations and relation.endswith(INVERSE_SUFFIX)
        base = relation[: -len(INVERSE_SUFFIX)] if backwards else relation
        predicate = iri_of(base, self.schema)
        return (predicate, backwards) if keep_predicate(predicate, self.schema) else None

    def _edges(self, entities: Iterable[str], relation: str) -> list[tuple[str, str]]:
        """(entity, reached id) pairs along `relation`; BackendLimitError beyond max_results."""
        resolved = self._relation(relation)
        if resolved is None:
            return []
        predicate, backwards = resolved
        pairs: set[tuple[str, str]] = set()
        for terms in self._term_batches(entities):
            for row in self.client.select(edges_query(terms, predicate, backwards, self.max_results + 1)):
                source, target = self._id(row["t"]), self._id(row["x"])
                if source is not None and target is not None:
                    pairs.add((source, target))
            if len(pairs) > self.max_results:
                raise BackendLimitError(f"relation '{relation}' reaches more than {self.max_results} entities")
        return sorted(pairs)

    # -- KGBackend --

    def has_entity(self, entity: str) -> bool:
        if entity not in self._has_entity:
            if len(self._has_entity) >= self.cache_size:
                self._has_entity.clear()
            self._has_entity[entity] = self.client.ask(has_entity_query(self.terms_of(entity), self.schema))
        return self._has_entity[entity]

    def find_entities(self, name: str) -> list[str]:
        found = {self._id(row["t"]) for row in self.client.select(find_query(name, self.schema))}
        return sorted(e for e in found if e is not None)

    def labels(self, entities: Iterable[str]) -> dict[str, str]:
        found: dict[str, str] = {}
        for terms in self._term_batches(entities):
            for row in self.client.select(labels_query(terms, self.schema)):
                entity_id = self._id(row["t"])
                if entity_id is not None:
                    name = row["l"].value
                    found[entity_id] = min(found.get(entity_id, name), name)
        return found

    def relations_of(self, entities: Collection[str]) -> set[str]:
        found: set[str] = set()
        directions = (False, True) if self.schema.inverse_relations else (False,)
        for terms in self._term_batches(entities):
            for backwards in directions:
                suffix = INVERSE_SUFFIX if backwards else ""
                for row in self.client.select(relations_query(terms, self.schema, backwards)):
                    found.add(id_of_iri(row["p"].value, self.schema) + suffix)
        return found

    def expand(self, entities: Iterable[str], relation: str) -> set[str]:
        return {target for _, target in self._edges(entities, relation)}

    def is_attribute(self, relation: str) -> bool:
        declared = self.schema.attribute_relations
        if declared is not None:
            return relation in declared
        if relation not in self._is_attribute:
            resolved = self._relation(relation)
            # The reverse of an attribute walks from values to entities: not an attribute.
            numeric = resolved is not None and not resolved[1] and self.client.ask(
                numeric_sample_query(resolved[0], self.attribute_sample))
            self._is_attribute[relation] = numeric
        return self._is_attribute[relation]

    def attributes_of(self, entities: Collection[str]) -> set[str]:
        return {r for r in self.relations_of(entities) if self.is_attribute(r)}

    def attribute_values(self, entities: Iterable[str], attribute: str) -> dict[str, list[float]]:
        values: dict[str, list[float]] = {}
        for source, target in self._edges(entities, attribute):
            value = numeric_value(target)
            if value is not None:
                values.setdefault(source, []).append(value)
        return {e: sorted(v) for e, v in values.items()}


def sparql_backend(endpoint: str, schema: RdfSchema, **client_options: Any) -> SparqlBackend:
    """A backend for the SPARQL endpoint at `endpoint` (`HttpSparqlClient` options as keywords)."""
    return SparqlBackend(HttpSparqlClient(endpoint, **client_options), schema)


def oxigraph_backend(data: str | bytes, format: str, schema: RdfSchema = RdfSchema(),
                     **backend_options: Any) -> SparqlBackend:
    """A backend over a fresh in-process pyoxigraph store holding RDF text `data`."""
    return SparqlBackend(OxigraphClient.from_rdf(data, format), schema, **backend_options)


__all__: list[str] = [
    "HttpSparqlClient", "OxigraphClient", "SparqlBackend", "SparqlClient", "SparqlError", "build_request",
    "literal_candidates", "oxigraph_backend", "parse_results_json", "sparql_backend",
]
