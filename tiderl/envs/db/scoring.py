"""Scoring committed answers of SELECT-type DB tasks (AgentBench's convention, own code).

The gold answer of a SELECT-type task is a list of values (AgentBench stores MySQL-rendered
strings such as "1.0" or "1174.0"). A committed list matches when it has the same length and
its values can be paired one to one with the gold values, each pair matching:

- numbers (ints, floats, numeric strings such as "1.0", " 2e3 ", "1,174") match numerically
  within a relative tolerance (so 1, 1.0 and "1.0" are all equal, and "1,174" equals 1174);
- anything else matches as text after normalisation: case-folded, whitespace runs collapsed to
  one space, ends stripped. NULL is the text "none" (a Python-rendered NULL is "None").

Pairing ignores order (a multiset comparison: duplicates count) unless `ordered` is set.
"""

from __future__ import annotations

import math
import re
from typing import Any, Sequence

DEFAULT_REL_TOL = 1e-6
DEFAULT_ABS_TOL = 1e-9

# Decimal or scientific notation, optionally with comma thousands separators in groups of
# three ("1,174" is 1174; tables write numbers that way, gold labels do not). "nan", "inf",
# "1,17" or "1,2,3" are text.
_NUMBER = re.compile(r"[+-]?(\d{1,3}(,\d{3})+(\.\d*)?|\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?")


def as_number(value: Any) -> float | None:
    """The value as a float when it is a number or a string holding exactly one, else None."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
        return float(value.strip().replace(",", ""))
    return None


def normalize_text(value: Any) -> str:
    """Case-folded text with whitespace runs collapsed and the ends stripped."""
    return " ".join(str(value).split()).casefold()


def values_match(predicted: Any, gold: Any, rel_tol: float = DEFAULT_REL_TOL,
                 abs_tol: float = DEFAULT_ABS_TOL) -> bool:
    """Whether one committed value matches one gold value (see the module docstring)."""
    a, b = as_number(predicted), as_number(gold)
    if a is not None and b is not None:
        return math.isclose(a, b, rel_tol=rel_tol, abs_tol=abs_tol)
    return normalize_text(predicted) == normalize_text(gold)


def flatten_answers(answers: Sequence[Any]) -> list[Any]:
    """Rows flattened into cells: `[[1, "a"], [2, "b"]]` -> `[1, "a", 2, "b"]`; scalars stay.
    Agents often commit rows as they saw them; the gold lists are flat cells."""
    flat: list[Any] = []
    for value in answers:
        if isinstance(value, (list, tuple)):
            flat.extend(value)
        else:
            flat.append(value)
    return flat


def answers_match(predicted: Sequence[Any], gold: Sequence[Any], ordered: bool = False,
                  rel_tol: float = DEFAULT_REL_TOL, abs_tol: float = DEFAULT_ABS_TOL) -> bool:
    """Whether a committed answer list matches the gold list (see the module docstring)."""
    if len(predicted) != len(gold):
        return False
    if ordered:
        return all(values_match(p, g, rel_tol, abs_tol) for p, g in zip(predicted, gold))
    # Tolerant equality is not transitive, so pair values with a bipartite matching (Kuhn's
    # augmenting paths; the lists are short) instead of sorting.
    candidates = [[j for j, g in enumerate(gold) if values_match(p, g, rel_tol, abs_tol)] for p in predicted]
    owner: dict[int, int] = {}

    def assign(i: int, seen: set[int]) -> bool:
        for j in candidates[i]:
            if j not in seen:
                seen.add(j)
                if j not in owner or assign(owner[j], seen):
                    owner[j] = i
                    return True
        return False

    return all(assign(i, set()) for i in range(len(predicted)))
