"""The knowledge-graph tools (AgentBench's KG tool set) and their per-episode state.

A `KGToolbox` lives for one episode. Set-valued results become variables `#0, #1, ...` that
later calls (and the final answer) refer to. Every argument named `variable*` accepts either
a variable (`#k`), an exact entity id, a name from the task's entity map (AgentBench gives
`name -> mid`), or an exact label the backend knows (when exactly one entity carries it).

Every lookup goes through the `backend.KGBackend` protocol, so the tools behave identically on
the in-memory `TripleStore` and on a SPARQL endpoint (`sparql.SparqlBackend`).

The toolbox never raises on bad input from the agent: unknown tools, unknown variables or
entities, missing/extra/mistyped arguments and relations the entity lacks all come back as an
observation starting with `Error:` that says what was wrong and what to do instead. The agent
reads it and can recover; `num_errors` counts them. Whatever the agent wrote is echoed through
`shown` (valid text, at most a line long), and any other exception a tool raises becomes an
`Error:` observation too; only a failing backend (`BackendError`) ends the episode.

Observations stay short because a tiny model reads them: a new variable is reported as
`Variable #0: 3 entities`, and its entity names are listed only when the set has at most
`max_listed` members (default 0: never list); an entity with a label is listed as `id (label)`.
Every list in an observation (relations, attributes, listed entities) is bounded by
`ObservationLimits`: past `max_items` items or `max_chars` characters it ends with a note
saying how many were left out.

`hidden` entities never appear in a `get_neighbors` result. The env hides the topic entity of
multi-hop MetaQA-style questions, whose gold answers exclude the topic at every hop (an agent
cannot subtract sets with these tools, so the convention lives in the environment).

`count(variable)` answers with a number and creates no variable: a count is not a set of
entities, so it could not be a `Final Answer: #k` anyway. AgentBench's counting questions are
answered with the count itself; with `count_creates_variable` the count becomes a variable
holding one value (`{"3"}`) so `Final Answer: #k` can name it.

`touched` records what successful calls explored; `knowledge_units()` renders it as sorted
strings (`entity:<id>`, `entity_relation:<id>|<relation>`) for a curiosity bonus.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

from tiderl.agent.text import shown, valid_text
from tiderl.envs.kg.backend import BackendError, BackendLimitError, KGBackend

logger = logging.getLogger(__name__)

_VARIABLE = re.compile(r"#(\d+)")

# A variable number longer than this reads as NO_SUCH_VARIABLE: no episode makes a billion
# variables, and a model may write `#` followed by thousands of digits, which `int` refuses to
# parse past Python's digit limit.
_MAX_VARIABLE_DIGITS = 9
NO_SUCH_VARIABLE = 10**_MAX_VARIABLE_DIGITS

# name -> argument names, in the order the tools take them.
TOOL_ARGUMENTS: dict[str, tuple[str, ...]] = {
    "get_relations": ("variable",),
    "get_neighbors": ("variable", "relation"),
    "intersection": ("variable1", "variable2"),
    "get_attributes": ("variable",),
    "argmax": ("variable", "attribute"),
    "argmin": ("variable", "attribute"),
    "count": ("variable",),
}


class ToolError(Exception):
    """An agent mistake; its message becomes the `Error:` observation (never leaves the toolbox)."""


@dataclass(frozen=True)
class ObservationLimits:
    """The most one list in an observation shows: `max_items` items and `max_chars` characters
    of items (separators included). What does not fit is counted in a note."""

    max_items: int = 100
    max_chars: int = 4000

    def __post_init__(self) -> None:
        if self.max_items < 1 or self.max_chars < 1:
            raise ValueError(f"ObservationLimits needs max_items >= 1 and max_chars >= 1, got "
                             f"max_items={self.max_items}, max_chars={self.max_chars}")


def bounded_list(items: Sequence[str], limits: ObservationLimits) -> str:
    """`items` joined by ", ", or the longest prefix within `limits` followed by
    `... (N more not shown; M in all)`. An item is never cut: a cut name cannot be copied."""
    shown: list[str] = []
    length = 0
    for item in items[: limits.max_items]:
        added = len(item) + (2 if shown else 0)
        if length + added > limits.max_chars:
            break
        shown.append(item)
        length += added
    if len(shown) == len(items):
        return ", ".join(items)
    hidden = len(items) - len(shown)
    note = f"({hidden} more not shown; {len(items)} in all)"
    return f"{', '.join(shown)}, ... {note}" if shown else f"... {note}"


def knowledge_units(touched: Iterable[tuple[str, str] | str]) -> list[str]:
    """`touched` as sorted strings: `entity:<id>` for an entity, `entity_relation:<id>|<relation>`
    for an (entity, relation) pair."""
    return sorted(f"entity_relation:{u[0]}|{u[1]}" if isinstance(u, tuple) else f"entity:{u}" for u in touched)


def variable_number(ref: str) -> int | None:
    """k when `ref` is a variable reference `#k`, else None. A number of more than nine digits
    (leading zeros aside) is `NO_SUCH_VARIABLE`, a variable no episode has."""
    match = _VARIABLE.fullmatch(ref)
    if match is None:
        return None
    digits = match.group(1).lstrip("0") or "0"
    return int(digits) if len(digits) <= _MAX_VARIABLE_DIGITS else NO_SUCH_VARIABLE


def _signature(name: str) -> str:
    return f"{name}({', '.join(TOOL_ARGUMENTS[name])})"


def _check_arguments(name: str, arguments: Any) -> dict[str, str]:
    """The arguments of `name` as stripped valid text (`valid_text`), or ToolError naming what
    is missing/extra/mistyped."""
    if not isinstance(arguments, dict):
        raise ToolError(
            f"arguments of {name} must be a JSON object, got {type(arguments).__name__}. "
            f"Call it as {_signature(name)}."
        )
    expected = TOOL_ARGUMENTS[name]
    missing = [a for a in expected if a not in arguments]
    if missing:
        raise ToolError(f"{name} is missing argument '{missing[0]}'. Call it as {_signature(name)}.")
    extra = sorted(a for a in arguments if a not in expected)
    if extra:
        raise ToolError(f"{name} got unexpected argument '{shown(extra[0])}'. Call it as {_signature(name)}.")
    for a in expected:
        if not isinstance(arguments[a], str):
            raise ToolError(
                f"argument '{a}' of {name} must be a string (a variable like #0 or an entity name), "
                f"got {type(arguments[a]).__name__}."
            )
    # Valid text: a lone surrogate (a JSON escape the model wrote) names nothing in any graph,
    # and a backend that encodes its arguments (an IRI, a query) would raise on it.
    return {a: valid_text(arguments[a]).strip() for a in expected}


def _describe(ref: str) -> str:
    """How an error names the thing the agent referred to (cut to a line, valid text)."""
    return shown(ref) if ref.startswith("#") else f"'{shown(ref)}'"


class KGToolbox:
    """One episode's tool state over a knowledge graph (any `KGBackend`; `store` for history).

    variables: the entity sets created so far; `#k` is `variables[k]`.
    hidden: entities get_neighbors never returns (see the module docstring).
    limits: bounds on listed relations/attributes/entities (default `ObservationLimits()`).
    entity_names: name -> id, tried before ids and labels (AgentBench's per-question map).
    count_creates_variable: count also stores its number as a variable (AgentBench).
    num_calls / num_errors: tool calls made / those that returned an `Error:` observation.
    touched: knowledge units the agent reached, for a curiosity bonus: `(entity, relation)`
        pairs it expanded with get_neighbors or compared with argmax/argmin, and the entity ids
        those calls returned (plain strings).
    """

    def __init__(
        self,
        store: KGBackend,
        max_listed: int = 0,
        hidden: Iterable[str] = (),
        *,
        limits: ObservationLimits | None = None,
        entity_names: Mapping[str, str] | None = None,
        count_creates_variable: bool = False,
    ) -> None:
        if max_listed < 0:
            raise ValueError(f"max_listed must be >= 0 (0 = never list entities), got {max_listed}")
        self.store = store
        self.max_listed = max_listed
        self.hidden = frozenset(hidden)
        self.limits = ObservationLimits() if limits is None else limits
        self.entity_names = dict(entity_names or {})
        self.count_creates_variable = count_creates_variable
        self.variables: list[set[str]] = []
        self.num_calls = 0
        self.num_errors = 0
        self.touched: set[tuple[str, str] | str] = set()
        self._tools: dict[str, Callable[[dict[str, str]], str]] = {
            "get_relations": self._get_relations,
            "get_neighbors": self._get_neighbors,
            "intersection": self._intersection,
            "get_attributes": self._get_attributes,
            "argmax": lambda args: self._arg_extreme(args, max),
            "argmin": lambda args: self._arg_extreme(args, min),
            "count": self._count,
        }

    def call(self, name: str, arguments: Any) -> str:
        """Run tool `name`; returns its observation, or an `Error: ...` observation for any agent
        mistake and for any other exception inside a tool (logged: it is a bug to fix, but one
        odd argument must not end the episode). Only a failing backend raises (`BackendError`,
        e.g. `sparql.SparqlError`: an unreachable endpoint is not the agent's fault; the agent
        loop ends that episode)."""
        self.num_calls += 1
        try:
            if not isinstance(name, str) or name not in self._tools:
                raise ToolError(f"unknown tool '{shown(name)}'. Available tools: {', '.join(TOOL_ARGUMENTS)}.")
            return self._tools[name](_check_arguments(name, arguments))
        except ToolError as e:
            self.num_errors += 1
            return f"Error: {e}"
        except BackendError:
            raise
        except Exception as e:  # noqa: BLE001 - no model output may crash the episode
            self.num_errors += 1
            logger.warning("KG tool %s raised on arguments %s", shown(name), shown(arguments), exc_info=e)
            return (f"Error: {shown(name)} failed on these arguments ({type(e).__name__}: {shown(str(e))}). "
                    "Check the arguments and try again.")

    def knowledge_units(self) -> list[str]:
        """What successful calls explored so far, as sorted strings (see `knowledge_units`)."""
        return knowledge_units(self.touched)

    def resolve_answer(self, ref: str) -> set[str] | None:
        """The entity set of variable `ref` (`#k`), or None when `ref` names no existing variable."""
        k = variable_number(ref.strip())
        if k is None or k >= len(self.variables):
            return None
        return set(self.variables[k])

    # -- helpers -------------------------------------------------------------------------

    def _resolve(self, ref: str) -> set[str]:
        """The entities `ref` stands for: a variable `#k`, a name of the task's entity map, an
        entity id, or a label exactly one entity carries."""
        k = variable_number(ref)
        if k is not None:
            if k >= len(self.variables):
                defined = (
                    f"Defined variables: #0 to #{len(self.variables) - 1}."
                    if self.variables
                    else "No variables exist yet: start from an entity name in the question."
                )
                raise ToolError(f"variable {shown(ref)} does not exist. {defined}")
            return self.variables[k]
        found = self._lookup(ref)
        if found is not None:
            return {found}
        hint = "Use an exact entity name from the question or a variable like #0."
        if ref.startswith("[") and ref.endswith("]") and self._lookup(ref[1:-1]) is not None:
            hint = f"Drop the square brackets: use '{shown(ref[1:-1])}'."
        raise ToolError(f"entity '{shown(ref)}' not found. {hint}")

    def _lookup(self, name: str) -> str | None:
        """The id `name` refers to, None when none; ToolError when it is ambiguous or mapped to
        an id the graph lacks."""
        mapped = self.entity_names.get(name)
        if mapped is not None:
            if not self.store.has_entity(mapped):
                raise ToolError(f"entity '{shown(name)}' ({mapped}) is not in the knowledge graph.")
            return mapped
        if self.store.has_entity(name):
            return name
        ids = self.store.find_entities(name)
        if len(ids) > 1:
            raise ToolError(f"'{shown(name)}' names {len(ids)} entities: {bounded_list(ids, self.limits)}. "
                            "Use one of these ids instead.")
        return ids[0] if ids else None

    def _listing(self, entities: set[str]) -> str:
        """The sorted entities, `id (label)` where a label differs from the id, bounded."""
        ordered = sorted(entities)
        labels = self.store.labels(ordered)
        shown = [f"{e} ({labels[e]})" if labels.get(e, e) != e else e for e in ordered]
        return bounded_list(shown, self.limits)

    def _new_variable(self, entities: set[str]) -> str:
        self.variables.append(entities)
        k = len(self.variables) - 1
        noun = "entity" if len(entities) == 1 else "entities"
        text = f"Variable #{k}: {len(entities)} {noun}"
        if 0 < len(entities) <= self.max_listed:
            text += f" ({self._listing(entities)})"
        return text

    # -- tools ---------------------------------------------------------------------------

    def _get_relations(self, args: dict[str, str]) -> str:
        entities = self._resolve(args["variable"])
        relations = sorted(self.store.relations_of(entities))
        if not relations:
            return f"{_describe(args['variable'])} has no relations."
        return f"Relations: {bounded_list(relations, self.limits)}"

    def _get_neighbors(self, args: dict[str, str]) -> str:
        ref, relation = args["variable"], args["relation"]
        entities = self._resolve(ref)
        try:
            reached = self.store.expand(entities, relation)
        except BackendLimitError as e:
            raise ToolError(f"{shown(str(e), 300)} from {_describe(ref)}: too many to use. Narrow the set first "
                            "(e.g. with intersection) or follow another relation.") from e
        if not reached:
            raise ToolError(
                f"relation '{shown(relation)}' not found for {_describe(ref)}. "
                f"Call get_relations({shown(ref)}) to see the relations it has."
            )
        reached -= self.hidden
        if not reached:
            raise ToolError(
                f"relation '{shown(relation)}' from {_describe(ref)} leads only back to the question's topic "
                "entity. Try another relation."
            )
        self.touched.update((e, relation) for e in entities)
        self.touched.update(reached)
        return self._new_variable(reached)

    def _intersection(self, args: dict[str, str]) -> str:
        first = self._resolve(args["variable1"])
        second = self._resolve(args["variable2"])
        return self._new_variable(first & second)

    def _get_attributes(self, args: dict[str, str]) -> str:
        entities = self._resolve(args["variable"])
        present = sorted(self.store.attributes_of(entities))
        if not present:
            return f"{_describe(args['variable'])} has no attributes."
        return f"Attributes: {bounded_list(present, self.limits)}"

    def _arg_extreme(self, args: dict[str, str], pick: Callable[..., float]) -> str:
        """argmax/argmin: the entities whose value is the max/min; an entity with several
        values counts with its largest (argmax) or smallest (argmin)."""
        ref, attribute = args["variable"], args["attribute"]
        entities = self._resolve(ref)
        if not self.store.is_attribute(attribute):
            raise ToolError(
                f"'{shown(attribute)}' is not an attribute. Call get_attributes({shown(ref)}) to see the attributes "
                "it has."
            )
        scores = {e: pick(values) for e, values in self.store.attribute_values(entities, attribute).items()}
        if not scores:
            raise ToolError(
                f"no entity in {_describe(ref)} has a numeric '{shown(attribute)}'. "
                f"Call get_attributes({shown(ref)}) to see the attributes it has."
            )
        best = pick(scores.values())
        winners = {e for e, v in scores.items() if v == best}
        self.touched.update((e, attribute) for e in scores)
        self.touched.update(winners)
        return self._new_variable(winners)

    def _count(self, args: dict[str, str]) -> str:
        entities = self._resolve(args["variable"])
        if not self.count_creates_variable:
            return f"Count: {len(entities)}"
        self.variables.append({str(len(entities))})
        return f"Count: {len(entities)}, stored as Variable #{len(self.variables) - 1}"
