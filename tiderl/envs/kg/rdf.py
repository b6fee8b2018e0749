"""RDF graphs as KG backends: one schema that says how RDF terms become tiderl ids, and an
N-Triples/Turtle loader into the in-memory `TripleStore` (parsed by pyoxigraph).

The same `RdfSchema` configures `sparql.SparqlBackend`, and both apply the same rules, so a
graph loaded from a file and the same graph behind a SPARQL endpoint give the tools identical
answers:

* **ids**: an IRI under a configured namespace becomes `id_prefix + local part`
  (`http://rdf.freebase.com/ns/m.0zd6` -> `m.0zd6`), percent-decoded so names with spaces
  read naturally; other IRIs keep their full text; a literal's id is its lexical form
  (`"1944"^^xsd:integer` -> `1944`). Blank nodes are skipped: they have no stable id.
* **relations**: every predicate the include/exclude prefixes keep, except label predicates.
* **labels**: objects of `label_predicates` whose language tag is empty or `label_language`;
  an entity with several shows the smallest (a deterministic choice).
* **attributes**: `attribute_relations` when given, else inferred: predicates with a numeric or
  date literal object (`NUMERIC_DATATYPES`).

pyoxigraph is imported only when a function here needs it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping
from urllib.parse import quote, unquote

from tiderl.envs.kg.store import TripleStore

XSD = "http://www.w3.org/2001/XMLSchema#"
XSD_STRING = XSD + "string"
RDF_LANG_STRING = "http://www.w3.org/1999/02/22-rdf-syntax-ns#langString"
RDFS_LABEL = "http://www.w3.org/2000/01/rdf-schema#label"

# Datatypes whose values argmax/argmin compare (an inferred attribute has one of them).
NUMERIC_DATATYPES: tuple[str, ...] = tuple(XSD + t for t in (
    "integer", "decimal", "double", "float", "int", "long", "short", "byte",
    "nonNegativeInteger", "positiveInteger", "nonPositiveInteger", "negativeInteger",
    "unsignedInt", "unsignedLong", "unsignedShort", "unsignedByte",
    "date", "dateTime", "gYear", "gYearMonth",
))

# Characters left as they are when a local name goes into an IRI; everything else
# (spaces, quotes, <>, non-ASCII, and `%` itself) is percent-encoded, so decoding is exact.
_IRI_SAFE = ":/.-_~#@!$&'()*+,;="
_ABSOLUTE_IRI = re.compile(r"(?:[A-Za-z][A-Za-z0-9+.-]*://|urn:)\S*")


@dataclass(frozen=True)
class RdfSchema:
    """How an RDF graph maps onto the KG tools (see the module docstring).

    namespaces: (namespace IRI, id prefix) pairs. At most one may have the empty id prefix.
    label_predicates: predicate IRIs whose objects are display names, not edges.
    label_language: the language tag accepted for labels besides none.
    include_predicates / exclude_predicates: IRI prefixes; a predicate is a relation when it
        starts with an include prefix (or none are given) and with no exclude prefix.
    attribute_relations: relation ids argmax/argmin compare; None = infer from datatypes.
    inverse_relations: offer `r_inv` for every relation `r` (walk edges backwards). Off for
        graphs that name both directions themselves (Freebase).
    """

    namespaces: tuple[tuple[str, str], ...] = ()
    label_predicates: tuple[str, ...] = (RDFS_LABEL,)
    label_language: str = "en"
    include_predicates: tuple[str, ...] = ()
    exclude_predicates: tuple[str, ...] = ()
    attribute_relations: tuple[str, ...] | None = None
    inverse_relations: bool = True

    def __post_init__(self) -> None:
        defaults = [base for base, prefix in self.namespaces if prefix == ""]
        if len(defaults) > 1:
            raise ValueError(f"RdfSchema.namespaces has {len(defaults)} namespaces with the empty id prefix "
                             f"({defaults}): give all but one an id prefix such as 'wd:'")


FREEBASE_NS = "http://rdf.freebase.com/ns/"

# Freebase as AgentBench serves it (Virtuoso): ids are mids and property paths without a prefix;
# reverse properties exist as named relations, so no `_inv`. type.object.name is the label.
# Only per-object bookkeeping (type.object.*: names, types, keys), the key namespace and W3C
# vocabularies (rdf:type, owl:sameAs) are left out: AgentBench's gold traces do walk other
# housekeeping-looking domains, e.g. common.image.appears_in_topic_gallery.
FREEBASE = RdfSchema(
    namespaces=((FREEBASE_NS, ""),),
    label_predicates=(FREEBASE_NS + "type.object.name",),
    label_language="en",
    exclude_predicates=(FREEBASE_NS + "type.object.", "http://rdf.freebase.com/key/", "http://www.w3.org/"),
    inverse_relations=False,
)

# Wikidata's truthy statements: entities `Q42`, relations `wdt:P31`, rdfs:label names.
WIKIDATA = RdfSchema(
    namespaces=(("http://www.wikidata.org/entity/", ""), ("http://www.wikidata.org/prop/direct/", "wdt:")),
    label_predicates=(RDFS_LABEL,),
    label_language="en",
    include_predicates=("http://www.wikidata.org/prop/direct/",),
    inverse_relations=True,
)


# -- terms and ids ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Term:
    """One RDF term as SPARQL JSON results describe it.

    kind: "uri", "literal" or "bnode". For literals `datatype` is "" for plain strings
    (xsd:string) and language-tagged ones (`lang` set); see `literal`.
    """

    kind: str
    value: str
    datatype: str = ""
    lang: str = ""

    def sparql(self) -> str:
        """The term in SPARQL syntax (`<iri>`, `"text"@en`, `"1"^^<...#integer>`)."""
        if self.kind == "uri":
            return f"<{safe_iri(self.value)}>"
        if self.kind == "bnode":
            raise ValueError(f"blank node _:{self.value} cannot be written into a query")
        text = '"' + _escape_string(self.value) + '"'
        if self.lang:
            return f"{text}@{self.lang}"
        return f"{text}^^<{self.datatype}>" if self.datatype else text


def literal(value: str, datatype: str = "", lang: str = "") -> Term:
    """A literal term in normal form: xsd:string and rdf:langString are left implicit, so
    terms from different sources (parsers, JSON results) compare equal."""
    if lang or datatype in (XSD_STRING, RDF_LANG_STRING):
        datatype = ""
    return Term("literal", value, datatype, lang.lower())


def _escape_string(text: str) -> str:
    return (text.replace("\\", "\\\\").replace('"', '\\"')
            .replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t"))


def safe_iri(iri: str) -> str:
    """`iri` with the characters SPARQL and N-Triples forbid inside `<...>` percent-encoded
    (so text from the agent can never break out of an IRI)."""
    return "".join(c if c > " " and c not in '<>"{}|^`\\' else quote(c, safe="") for c in iri)


def is_absolute_iri(text: str) -> bool:
    """True for ids that are full IRIs (`http://...`, `urn:...`), not compact names."""
    return _ABSOLUTE_IRI.fullmatch(text) is not None


def _by_prefix_length(namespaces: Iterable[tuple[str, str]], index: int) -> list[tuple[str, str]]:
    return sorted(namespaces, key=lambda pair: len(pair[index]), reverse=True)


def iri_of(entity_id: str, schema: RdfSchema) -> str:
    """The IRI an id stands for: the namespace of its id prefix (longest first), a full IRI as
    it is, else the default (empty-prefix) namespace; with no default namespace the id itself."""
    for base, prefix in _by_prefix_length(schema.namespaces, 1):
        if prefix and entity_id.startswith(prefix):
            return base + quote(entity_id[len(prefix):], safe=_IRI_SAFE)
    if is_absolute_iri(entity_id):
        return safe_iri(entity_id)
    for base, prefix in schema.namespaces:
        if prefix == "":
            return base + quote(entity_id, safe=_IRI_SAFE)
    return safe_iri(entity_id)


def id_of_iri(iri: str, schema: RdfSchema) -> str:
    """The id of an IRI; `iri_of(id_of_iri(x)) == x` for every IRI (a compact form that would
    not map back, e.g. a local name that itself looks like an IRI, keeps the full IRI)."""
    for base, prefix in _by_prefix_length(schema.namespaces, 0):
        if iri.startswith(base) and len(iri) > len(base):
            local = unquote(iri[len(base):])
            candidate = prefix + local
            if iri_of(candidate, schema) == iri:
                return candidate
    return iri


def id_of_term(term: Term, schema: RdfSchema) -> str | None:
    """The id of a term: compact IRI, a literal's lexical form, None for a blank node."""
    if term.kind == "uri":
        return id_of_iri(term.value, schema)
    if term.kind == "literal":
        return term.value
    return None


def keep_predicate(iri: str, schema: RdfSchema) -> bool:
    """True when predicate `iri` is a relation under `schema` (labels never are)."""
    if iri in schema.label_predicates:
        return False
    if schema.include_predicates and not iri.startswith(schema.include_predicates):
        return False
    return not iri.startswith(schema.exclude_predicates) if schema.exclude_predicates else True


def is_label(term: Term, schema: RdfSchema) -> bool:
    """True for a literal in an accepted label language (none, or `schema.label_language`)."""
    return term.kind == "literal" and term.lang in ("", schema.label_language.lower())


# -- parsing into a TripleStore ---------------------------------------------------------------

_FORMATS = {"nt": "N_TRIPLES", "ntriples": "N_TRIPLES", "n-triples": "N_TRIPLES",
            "ttl": "TURTLE", "turtle": "TURTLE", "nq": "N_QUADS", "nquads": "N_QUADS"}


def require_pyoxigraph() -> Any:
    try:
        import pyoxigraph
    except ImportError as e:  # an optional dependency: say how to get it
        raise ImportError("RDF parsing and in-process SPARQL need pyoxigraph: pip install pyoxigraph") from e
    return pyoxigraph


def rdf_format(name: str) -> Any:
    """pyoxigraph's RdfFormat for `nt`/`ntriples`, `ttl`/`turtle` or `nq`/`nquads`."""
    key = name.lower().lstrip(".")
    if key not in _FORMATS:
        raise ValueError(f"unknown RDF format {name!r}: use one of {sorted(_FORMATS)}")
    return getattr(require_pyoxigraph().RdfFormat, _FORMATS[key])


def term_from_oxigraph(node: Any) -> Term:
    """A pyoxigraph NamedNode / Literal / BlankNode as a `Term`."""
    ox = require_pyoxigraph()
    if isinstance(node, ox.NamedNode):
        return Term("uri", node.value)
    if isinstance(node, ox.Literal):
        return literal(node.value, node.datatype.value, node.language or "")
    return Term("bnode", node.value)


def parse_terms(data: str | bytes | None = None, format: str | None = None,
                path: str | Path | None = None) -> Iterator[tuple[Term, Term, Term]]:
    """The triples of N-Triples/Turtle/N-Quads `data` (or the file at `path`; the format is
    then guessed from its extension when not given), as Terms. Raises SyntaxError naming the
    position of the first malformed statement."""
    ox = require_pyoxigraph()
    fmt = rdf_format(format) if format else None
    if path is not None:
        if fmt is None:
            fmt = rdf_format(Path(path).suffix)
        quads = ox.parse(path=str(path), format=fmt)
    else:
        if fmt is None:
            raise ValueError("parse_terms(data=...) needs format= (nt, ttl or nq)")
        quads = ox.parse(data.encode("utf-8") if isinstance(data, str) else data, format=fmt)
    for quad in quads:
        yield term_from_oxigraph(quad.subject), term_from_oxigraph(quad.predicate), term_from_oxigraph(quad.object)


def store_from_terms(triples: Iterable[tuple[Term, Term, Term]], schema: RdfSchema = RdfSchema()) -> TripleStore:
    """A `TripleStore` holding `triples` under `schema`'s rules (module docstring)."""
    edges: list[tuple[str, str, str]] = []
    labels: list[tuple[str, str]] = []
    inferred: set[str] = set()
    for s, p, o in triples:
        if s.kind == "bnode" or o.kind == "bnode":
            continue
        subject = id_of_term(s, schema)
        if p.value in schema.label_predicates:
            if is_label(o, schema):
                labels.append((subject, o.value))
            continue
        if not keep_predicate(p.value, schema):
            continue
        relation = id_of_iri(p.value, schema)
        if o.kind == "literal" and o.datatype in NUMERIC_DATATYPES:
            inferred.add(relation)
        edges.append((subject, relation, id_of_term(o, schema)))

    declared = schema.attribute_relations
    store = TripleStore(attribute_relations=inferred if declared is None else declared,
                        add_inverse=schema.inverse_relations)
    for s, r, o in edges:
        store.add(s, r, o)
    for entity, name in labels:
        store.add_label(entity, name)
    return store


def load_rdf_file(path: str | Path, schema: RdfSchema = RdfSchema(), format: str | None = None) -> TripleStore:
    """Load an N-Triples / Turtle / N-Quads file (format from the extension unless given)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"RDF file {path} not found: pass the path of an .nt, .ttl or .nq file")
    return store_from_terms(parse_terms(path=path, format=format), schema)


def parse_rdf(data: str | bytes, format: str, schema: RdfSchema = RdfSchema()) -> TripleStore:
    """Load RDF text (`format`: nt, ttl or nq) into a `TripleStore`."""
    return store_from_terms(parse_terms(data=data, format=format), schema)


# -- writing ---------------------------------------------------------------------------------


@dataclass
class GraphSpec:
    """A graph in tiderl ids, ready to write as RDF with `to_ntriples`.

    edges: (subject, relation, object) with entity objects.
    values: (subject, relation, lexical value, datatype IRI) with literal objects.
    labels: id -> display name.
    """

    edges: list[tuple[str, str, str]] = field(default_factory=list)
    values: list[tuple[str, str, str, str]] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_store(cls, store: TripleStore, literal_relations: Mapping[str, str] | None = None) -> "GraphSpec":
        """The forward triples and labels of `store` (e.g. MetaQA's kb.txt, to serve it over
        SPARQL). literal_relations: relation -> datatype IRI for relations whose objects should
        be written as typed literals instead of entities."""
        typed = dict(literal_relations or {})
        graph = cls(labels=store.labels(store.entities()))
        for s, r, o in sorted(store.triples()):
            if r in typed:
                graph.values.append((s, r, o, typed[r]))
            else:
                graph.edges.append((s, r, o))
        return graph


def to_ntriples(graph: GraphSpec, schema: RdfSchema) -> str:
    """`graph` as N-Triples text, every id turned into an IRI with `iri_of` (so loading the text
    with `schema` gives the ids back); labels use the first label predicate and language."""
    memo: dict[str, str] = {}  # ids repeat a lot (a MetaQA film is in ~10 triples)

    def iri(x: str) -> str:
        if x not in memo:
            memo[x] = f"<{iri_of(x, schema)}>"
        return memo[x]

    lines = [f"{iri(s)} {iri(r)} {iri(o)} ." for s, r, o in graph.edges]
    lines += [f"{iri(s)} {iri(r)} {literal(v, datatype).sparql()} ." for s, r, v, datatype in graph.values]
    if graph.labels:
        predicate = f"<{schema.label_predicates[0]}>"
        lang = schema.label_language
        lines += [f"{iri(e)} {predicate} {literal(name, lang=lang).sparql()} ." for e, name in graph.labels.items()]
    return "\n".join(lines) + "\n"
