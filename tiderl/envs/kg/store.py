"""An indexed in-memory triple store for knowledge-graph environments.

Every forward triple `(s, r, o)` is stored together with its inverse edge `(o, r_inv, s)`
(the AgentBench convention), so an agent can walk any edge in both directions with
`get_neighbors`. Lookups are dictionary hits: `entity -> relation -> set of entities`.

Attribute relations are ordinary edges whose object is a value (a year, a rating). They are
listed in `attribute_relations`; `argmax`/`argmin` parse their objects as floats. They stay
traversable like any other relation, because MetaQA asks questions such as "when was [X]
released" whose answers are the year entities themselves.

The store implements `backend.KGBackend`, so the KG tools run on it directly. Graphs whose ids
are not readable names (Freebase mids, RDF IRIs) can carry labels (`add_label`): the tools then
accept an exact label wherever they accept an id.
"""

from __future__ import annotations

from pathlib import Path
from typing import Collection, Iterable, Iterator

from tiderl.envs.kg.backend import numeric_value

INVERSE_SUFFIX = "_inv"

# MetaQA's value-like relations. Only `release_year` parses as a number in MetaQA's kb.txt
# (its ratings and votes are words such as "good" or "famous"); non-numeric values are skipped
# by `numeric_values`, so listing them is harmless and keeps `get_attributes` informative.
METAQA_ATTRIBUTE_RELATIONS = ("release_year", "has_imdb_rating", "has_imdb_votes")


def inverse(relation: str) -> str:
    """The relation that walks `relation` backwards: `r` <-> `r_inv`."""
    if relation.endswith(INVERSE_SUFFIX):
        return relation[: -len(INVERSE_SUFFIX)]
    return relation + INVERSE_SUFFIX


class TripleStore:
    """Triples indexed by subject and relation, with inverse edges added automatically.

    attribute_relations: forward relations whose objects are values (see module docstring).
    add_inverse: add the `r_inv` edge of every triple (default). Off for graphs that already
        hold both directions as named relations (Freebase's reverse properties); the objects
        are still entities then, with no relation of their own unless the graph gives one.
    """

    def __init__(self, attribute_relations: Iterable[str] = (), add_inverse: bool = True) -> None:
        self.attribute_relations: frozenset[str] = frozenset(attribute_relations)
        self.add_inverse = add_inverse
        # id -> display name, and name -> ids (names need not be unique).
        self._labels: dict[str, str] = {}
        self._ids_by_label: dict[str, set[str]] = {}
        # entity -> relation -> objects; holds forward and inverse edges.
        self._edges: dict[str, dict[str, set[str]]] = {}
        # relation -> entities that have at least one edge of it (for sampling topics).
        self._subjects: dict[str, set[str]] = {}
        self._num_triples = 0

    def _link(self, s: str, r: str, o: str) -> bool:
        by_relation = self._edges.setdefault(s, {})
        objects = by_relation.get(r)
        if objects is None:
            objects = by_relation[r] = set()
            self._subjects.setdefault(r, set()).add(s)
        if o in objects:
            return False
        objects.add(o)
        return True

    def add(self, s: str, r: str, o: str) -> bool:
        """Add `(s, r, o)` and its inverse `(o, r_inv, s)`; returns False for a duplicate."""
        if not s or not r or not o:
            raise ValueError(f"triple ({s!r}, {r!r}, {o!r}) has an empty part: all three must be non-empty")
        if self.add_inverse and r.endswith(INVERSE_SUFFIX):
            raise ValueError(
                f"relation {r!r} ends with {INVERSE_SUFFIX!r}, which is reserved for the inverse edges "
                "the store adds itself: rename the relation"
            )
        if not self._link(s, r, o):
            return False
        if self.add_inverse:
            self._link(o, inverse(r), s)
        else:
            # The object is an entity even without edges of its own.
            self._edges.setdefault(o, {})
        self._num_triples += 1
        return True

    def add_label(self, entity: str, name: str) -> None:
        """Make `entity` findable by the name `name` (`find_entities`). An entity with several
        names is displayed with the smallest, a choice that does not depend on their order.
        A label alone does not make an entity: it needs an edge."""
        self._ids_by_label.setdefault(name, set()).add(entity)
        shown = self._labels.get(entity)
        self._labels[entity] = name if shown is None else min(shown, name)

    @property
    def num_triples(self) -> int:
        """Distinct forward triples (inverse edges not counted)."""
        return self._num_triples

    def has_entity(self, name: str) -> bool:
        """True when `name` appears as subject or object of any triple."""
        return name in self._edges

    def entities(self) -> list[str]:
        """All entity names, sorted (a deterministic order for samplers)."""
        return sorted(self._edges)

    def relations(self, entity: str) -> list[str]:
        """The relations (forward and `_inv`) leaving `entity`, sorted; [] for an unknown entity."""
        return sorted(self._edges.get(entity, {}))

    def neighbors(self, entity: str, relation: str) -> set[str]:
        """The entities reached from `entity` along `relation` (a fresh set; empty if none)."""
        return set(self._edges.get(entity, {}).get(relation, ()))

    def expand(self, entities: Iterable[str], relation: str) -> set[str]:
        """The union of `neighbors(e, relation)` over `entities` (a fresh set)."""
        reached: set[str] = set()
        for e in entities:
            reached.update(self._edges.get(e, {}).get(relation, ()))
        return reached

    def entities_with(self, relation: str) -> set[str]:
        """The entities that have at least one `relation` edge (a fresh set)."""
        return set(self._subjects.get(relation, ()))

    def triples(self) -> Iterator[tuple[str, str, str]]:
        """Every forward triple `(s, r, o)` once (not the inverse edges the store added)."""
        for s, by_relation in self._edges.items():
            for r, objects in by_relation.items():
                if not (self.add_inverse and r.endswith(INVERSE_SUFFIX)):
                    for o in objects:
                        yield s, r, o

    def relation_names(self) -> list[str]:
        """Every relation name in the store, forward and `_inv`, sorted."""
        return sorted(self._subjects)

    def numeric_values(self, entity: str, attribute: str) -> list[float]:
        """The values of `attribute` on `entity` that parse with `backend.numeric_value`
        (numbers and ISO dates), ascending.

        Values that are not numbers are skipped: MetaQA mixes words into value relations.
        """
        values = (numeric_value(raw) for raw in self._edges.get(entity, {}).get(attribute, ()))
        return sorted(v for v in values if v is not None)

    # -- the KGBackend protocol (see backend.py) ----------------------------------------------

    def find_entities(self, name: str) -> list[str]:
        """The ids labelled exactly `name`, sorted."""
        return sorted(self._ids_by_label.get(name, ()))

    def labels(self, entities: Iterable[str]) -> dict[str, str]:
        """id -> label for those of `entities` that have one."""
        return {e: self._labels[e] for e in entities if e in self._labels}

    def relations_of(self, entities: Collection[str]) -> set[str]:
        """The union of `relations(e)` over `entities`."""
        found: set[str] = set()
        for e in entities:
            found.update(self._edges.get(e, ()))
        return found

    def is_attribute(self, relation: str) -> bool:
        """True for the declared `attribute_relations`."""
        return relation in self.attribute_relations

    def attributes_of(self, entities: Collection[str]) -> set[str]:
        """The declared attribute relations any of `entities` has (whatever their values)."""
        return self.relations_of(entities) & self.attribute_relations

    def attribute_values(self, entities: Iterable[str], attribute: str) -> dict[str, list[float]]:
        """entity -> `numeric_values(entity, attribute)`, for entities that have at least one."""
        found = {e: self.numeric_values(e, attribute) for e in entities}
        return {e: values for e, values in found.items() if values}


def _open_data_file(path: str | Path, what: str) -> Path:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"{what} not found at {path}: point the config field data.metaqa_dir (or the path you "
            "passed) at the folder that holds it"
        )
    return path


def load_metaqa_kb(
    path: str | Path, attribute_relations: Iterable[str] = METAQA_ATTRIBUTE_RELATIONS
) -> TripleStore:
    """Load MetaQA's kb.txt (`subject|relation|object` per line; blank lines skipped).

    Raises ValueError naming the line number of a malformed line.
    """
    store = TripleStore(attribute_relations)
    with _open_data_file(path, "MetaQA kb.txt").open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            line = line.rstrip("\r\n")
            if not line.strip():
                continue
            parts = line.split("|")
            if len(parts) != 3 or not all(parts):
                raise ValueError(
                    f"{path}:{number}: expected 'subject|relation|object' with three non-empty "
                    f"parts, got {line!r}"
                )
            store.add(parts[0], parts[1], parts[2])
    return store


def load_tsv_triples(path: str | Path, attribute_relations: Iterable[str] = ()) -> TripleStore:
    """Load tab-separated `subject<TAB>relation<TAB>object` lines (blank lines skipped).

    Raises ValueError naming the line number of a malformed line.
    """
    store = TripleStore(attribute_relations)
    with _open_data_file(path, "triples file").open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            line = line.rstrip("\r\n")
            if not line.strip():
                continue
            parts = line.split("\t")
            if len(parts) != 3 or not all(parts):
                raise ValueError(
                    f"{path}:{number}: expected 'subject<TAB>relation<TAB>object' with three "
                    f"non-empty parts, got {line!r}"
                )
            store.add(parts[0], parts[1], parts[2])
    return store
