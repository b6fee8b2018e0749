"""The one interface the KG tools use for every lookup, whatever holds the graph.

A backend answers questions about entity *ids*: plain strings such as `Kismet` (MetaQA, where
an entity's id is its name), `m.0zd6` (a Freebase mid) or the lexical form of a literal value
(`1944`). Relations are strings too; a backend that walks edges backwards names the reverse of
`r` as `r_inv` (see `store.inverse`).

Implementations: `store.TripleStore` (in memory: MetaQA kb.txt, TSV, N-Triples/Turtle through
`rdf.load_rdf_file`) and `sparql.SparqlBackend` (an in-process pyoxigraph store or any SPARQL
endpoint over HTTP). `KGToolbox` needs nothing else, which is what makes the tools behave the
same on every backend.
"""

from __future__ import annotations

import math
import re
from typing import Collection, Iterable, Protocol, runtime_checkable


class BackendError(RuntimeError):
    """The backend itself failed (an unreachable endpoint, a broken response): not the agent's
    fault, so the tools do not turn it into an observation; the episode ends with an error and
    the task can be retried."""


class BackendLimitError(Exception):
    """A lookup would return more than the backend is configured to fetch (e.g. a relation
    reaching a million entities on Freebase). The tools turn it into an `Error:` observation:
    it is a consequence of the agent's choice, not a failure of the backend."""


@runtime_checkable
class KGBackend(Protocol):
    """What the seven KG tools need from a knowledge graph. Every method is read-only.

    All set-valued answers are fresh sets the caller may modify. Unknown entities are not
    errors here: they simply have no relations, neighbours, labels or values.
    """

    def has_entity(self, entity: str) -> bool:
        """True when `entity` is an id in the graph (subject or object of a kept edge)."""
        ...

    def find_entities(self, name: str) -> list[str]:
        """The ids whose label is exactly `name`, sorted ([] when none, or no labels)."""
        ...

    def labels(self, entities: Iterable[str]) -> dict[str, str]:
        """A display name for each of `entities` that has a label (ids without one are left out)."""
        ...

    def relations_of(self, entities: Collection[str]) -> set[str]:
        """The union of the relations leaving any of `entities` (forward and `_inv`)."""
        ...

    def expand(self, entities: Iterable[str], relation: str) -> set[str]:
        """The entities reached from any of `entities` along `relation`.

        May raise `BackendLimitError` when the result is larger than the backend fetches.
        """
        ...

    def is_attribute(self, relation: str) -> bool:
        """True when `relation` holds values that argmax/argmin can compare."""
        ...

    def attributes_of(self, entities: Collection[str]) -> set[str]:
        """The attribute relations (see `is_attribute`) that any of `entities` has."""
        ...

    def attribute_values(self, entities: Iterable[str], attribute: str) -> dict[str, list[float]]:
        """entity -> its values of `attribute` that parse with `numeric_value`, ascending;
        entities with no such value are left out."""
        ...


# An ISO 8601 date or date-time, as xsd:date, xsd:gYearMonth, xsd:dateTime write it (Freebase
# stores most of its comparable attributes, e.g. time.event.end_date, this way). The year has at
# most 15 digits: `int` refuses thousands of digits and a float cannot hold hundreds, and the
# text may be a model's tool argument.
_ISO_DATE = re.compile(
    r"(-?\d{4,15})(?:-(\d{2})(?:-(\d{2}))?)?"
    r"(?:T(\d{2}):(\d{2})(?::(\d{2}(?:\.\d+)?))?)?"
    r"(?:Z|[+-]\d{2}:\d{2})?"
)
_DAYS_PER_YEAR = 12 * 31  # an upper bound: keeps the mapping monotone without a calendar


def numeric_value(text: str) -> float | None:
    """`text` as a comparable number, or None when it is not one.

    A float literal (`7.5`, `1944`) is its value; an ISO date or date-time (`2001-05-03`,
    `1987-10`, `2001-05-03T10:00:00Z`) maps monotonically to a fractional year, so later dates
    compare larger (the time zone is ignored). NaN is not a value: it cannot be ordered.
    """
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is not None:
        return None if math.isnan(value) else value
    match = _ISO_DATE.fullmatch(text.strip())
    if match is None:
        return None
    year, month, day, hour, minute, second = match.groups()
    days = (int(month or 1) - 1) * 31 + int(day or 1) - 1
    seconds = int(hour or 0) * 3600 + int(minute or 0) * 60 + float(second or 0)
    return int(year) + (days + seconds / 86400) / _DAYS_PER_YEAR
