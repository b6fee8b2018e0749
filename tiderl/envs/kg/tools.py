"""The knowledge-graph tools (AgentBench's KG tool set) and their per-episode state.

A `KGToolbox` lives for one episode. Set-valued results become variables `#0, #1, ...` that
later calls (and the final answer) refer to. Every argument named `variable*` accepts either
a variable (`#k`) or an exact entity name.

The toolbox never raises on bad input from the agent: unknown tools, unknown variables or
entities, missing/extra/mistyped arguments and relations the entity lacks all come back as an
observation starting with `Error:` that says what was wrong and what to do instead. The agent
reads it and can recover; `num_errors` counts them.

Observations stay short because a tiny model reads them: a new variable is reported as
`Variable #0: 3 entities`, and its entity names are listed only when the set has at most
`max_listed` members (default 0: never list).

`hidden` entities never appear in a `get_neighbors` result. The env hides the topic entity of
multi-hop MetaQA-style questions, whose gold answers exclude the topic at every hop (an agent
cannot subtract sets with these tools, so the convention lives in the environment).

`count(variable)` answers with a number and creates no variable: a count is not a set of
entities, so it could not be a `Final Answer: #k` anyway.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Iterable

from tiderl.envs.kg.store import TripleStore

_VARIABLE = re.compile(r"#(\d+)")

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


def _signature(name: str) -> str:
    return f"{name}({', '.join(TOOL_ARGUMENTS[name])})"


def _check_arguments(name: str, arguments: Any) -> dict[str, str]:
    """The arguments of `name` as strings, or ToolError naming what is missing/extra/mistyped."""
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
        raise ToolError(f"{name} got unexpected argument '{extra[0]}'. Call it as {_signature(name)}.")
    for a in expected:
        if not isinstance(arguments[a], str):
            raise ToolError(
                f"argument '{a}' of {name} must be a string (a variable like #0 or an entity name), "
                f"got {type(arguments[a]).__name__}."
            )
    return {a: arguments[a].strip() for a in expected}


def _describe(ref: str) -> str:
    """How an error names the thing the agent referred to."""
    return ref if ref.startswith("#") else f"'{ref}'"


class KGToolbox:
    """One episode's tool state over a `TripleStore`.

    variables: the entity sets created so far; `#k` is `variables[k]`.
    hidden: entities get_neighbors never returns (see the module docstring).
    num_calls / num_errors: tool calls made / those that returned an `Error:` observation.
    touched: knowledge units the agent reached, for a curiosity bonus: `(entity, relation)`
        pairs it expanded with get_neighbors and the entity names it reached (plain strings).
    """

    def __init__(self, store: TripleStore, max_listed: int = 0, hidden: Iterable[str] = ()) -> None:
        if max_listed < 0:
            raise ValueError(f"max_listed must be >= 0 (0 = never list entities), got {max_listed}")
        self.store = store
        self.max_listed = max_listed
        self.hidden = frozenset(hidden)
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
        """Run tool `name`; returns its observation, or an `Error: ...` observation. Never raises."""
        self.num_calls += 1
        try:
            if not isinstance(name, str) or name not in self._tools:
                raise ToolError(f"unknown tool '{name}'. Available tools: {', '.join(TOOL_ARGUMENTS)}.")
            return self._tools[name](_check_arguments(name, arguments))
        except ToolError as e:
            self.num_errors += 1
            return f"Error: {e}"

    def resolve_answer(self, ref: str) -> set[str] | None:
        """The entity set of variable `ref` (`#k`), or None when `ref` names no existing variable."""
        match = _VARIABLE.fullmatch(ref.strip())
        if match is None or int(match.group(1)) >= len(self.variables):
            return None
        return set(self.variables[int(match.group(1))])

    # -- helpers -------------------------------------------------------------------------

    def _resolve(self, ref: str) -> set[str]:
        """The entities `ref` stands for: a variable `#k` or one exact entity name."""
        match = _VARIABLE.fullmatch(ref)
        if match is not None:
            k = int(match.group(1))
            if k >= len(self.variables):
                defined = (
                    f"Defined variables: #0 to #{len(self.variables) - 1}."
                    if self.variables
                    else "No variables exist yet: start from an entity name in the question."
                )
                raise ToolError(f"variable #{k} does not exist. {defined}")
            return self.variables[k]
        if self.store.has_entity(ref):
            return {ref}
        hint = "Use an exact entity name from the question or a variable like #0."
        if ref.startswith("[") and ref.endswith("]") and self.store.has_entity(ref[1:-1]):
            hint = f"Drop the square brackets: use '{ref[1:-1]}'."
        raise ToolError(f"entity '{ref}' not found. {hint}")

    def _new_variable(self, entities: set[str]) -> str:
        self.variables.append(entities)
        k = len(self.variables) - 1
        noun = "entity" if len(entities) == 1 else "entities"
        text = f"Variable #{k}: {len(entities)} {noun}"
        if 0 < len(entities) <= self.max_listed:
            text += f" ({', '.join(sorted(entities))})"
        return text

    # -- tools ---------------------------------------------------------------------------

    def _get_relations(self, args: dict[str, str]) -> str:
        entities = self._resolve(args["variable"])
        relations = sorted({r for e in entities for r in self.store.relations(e)})
        if not relations:
            return f"{_describe(args['variable'])} has no relations."
        return f"Relations: {', '.join(relations)}"

    def _get_neighbors(self, args: dict[str, str]) -> str:
        ref, relation = args["variable"], args["relation"]
        entities = self._resolve(ref)
        reached = self.store.expand(entities, relation)
        if not reached:
            raise ToolError(
                f"relation '{relation}' not found for {_describe(ref)}. "
                f"Call get_relations({ref}) to see the relations it has."
            )
        reached -= self.hidden
        if not reached:
            raise ToolError(
                f"relation '{relation}' from {_describe(ref)} leads only back to the question's topic "
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
        present = sorted(
            {r for e in entities for r in self.store.relations(e) if r in self.store.attribute_relations}
        )
        if not present:
            return f"{_describe(args['variable'])} has no attributes."
        return f"Attributes: {', '.join(present)}"

    def _arg_extreme(self, args: dict[str, str], pick: Callable[..., float]) -> str:
        """argmax/argmin: the entities whose value is the max/min; an entity with several
        values counts with its largest (argmax) or smallest (argmin)."""
        ref, attribute = args["variable"], args["attribute"]
        entities = self._resolve(ref)
        if attribute not in self.store.attribute_relations:
            raise ToolError(
                f"'{attribute}' is not an attribute. Call get_attributes({ref}) to see the attributes "
                "it has."
            )
        scores = {}
        for e in entities:
            values = self.store.numeric_values(e, attribute)
            if values:
                scores[e] = pick(values)
        if not scores:
            raise ToolError(
                f"no entity in {_describe(ref)} has a numeric '{attribute}'. "
                f"Call get_attributes({ref}) to see the attributes it has."
            )
        best = pick(scores.values())
        return self._new_variable({e for e, v in scores.items() if v == best})

    def _count(self, args: dict[str, str]) -> str:
        entities = self._resolve(args["variable"])
        return f"Count: {len(entities)}"
