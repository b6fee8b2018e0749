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

import datetime
import math
import re
from collections import Counter
from decimal import Decimal
from typing import Any, Sequence

DEFAULT_REL_TOL = 1e-6
DEFAULT_ABS_TOL = 1e-9

# Decimal or scientific notation, optionally with comma thousands separators in groups of
# three ("1,174" is 1174; tables write numbers that way, gold labels do not). "nan", "inf",
# "1,17" or "1,2,3" are text.
_NUMBER = re.compile(r"[+-]?(\d{1,3}(,\d{3})+(\.\d*)?|\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?")


# Longest text read as a number (a number written with more characters is compared as text).
MAX_NUMBER_CHARS = 64


def json_cell(value: Any) -> Any:
    """A result cell as a JSON value, alike for every driver: numbers, text and null stay; blobs
    become x'hex'; a time of day or interval (PyMySQL's `timedelta` for MySQL's TIME) becomes
    `[-]HH:MM:SS[.ffffff]` as MySQL, PostgreSQL and SQLite write it; decimals, dates and the
    like become their text (`str`: "10.50", "1970-05-01", "1970-05-01 20:30:00")."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        return "x'" + bytes(value).hex() + "'"
    if isinstance(value, datetime.timedelta):
        sign, value = ("-", -value) if value < datetime.timedelta(0) else ("", value)
        hours, rest = divmod(value.days * 86400 + value.seconds, 3600)
        text = f"{sign}{hours:02d}:{rest // 60:02d}:{rest % 60:02d}"
        return text + (f".{value.microseconds:06d}" if value.microseconds else "")
    return str(value)


def as_number(value: Any) -> float | None:
    """The value as a finite float when it is a number or a string holding exactly one (at
    most MAX_NUMBER_CHARS characters), else None. Bounded: integers beyond float range and
    overlong numerals are not numbers (they compare as text), never an OverflowError."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int):
        if value.bit_length() > 1000:  # past float range
            return None
        return float(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Decimal):  # NUMERIC / DECIMAL as psycopg and PyMySQL return them
        return float(value) if value.is_finite() and value.adjusted() < 300 else None
    if isinstance(value, str) and len(value) <= MAX_NUMBER_CHARS and _NUMBER.fullmatch(value.strip()):
        number = float(value.strip().replace(",", ""))
        return number if math.isfinite(number) else None
    return None


def value_text(value: Any) -> str:
    """str(value), bounded: an integer too long for str() (Python refuses more than 4300
    digits) becomes a short placeholder instead of a ValueError."""
    try:
        return str(value)
    except ValueError:
        return f"<integer of {value.bit_length()} bits>"


def normalize_text(value: Any) -> str:
    """Case-folded text with whitespace runs collapsed and the ends stripped."""
    return " ".join(value_text(value).split()).casefold()


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
    candidates = [[j for j, g in enumerate(gold) if values_match(p, g, rel_tol, abs_tol)] for p in predicted]
    return _pairs_up(candidates)


def _pairs_up(candidates: list[list[int]]) -> bool:
    """Whether every item i can be paired with a distinct partner from candidates[i].
    Tolerant equality is not transitive, so this is a bipartite matching (Kuhn's augmenting
    paths; the lists are short) rather than a sort."""
    owner: dict[int, int] = {}

    def assign(i: int, seen: set[int]) -> bool:
        for j in candidates[i]:
            if j not in seen:
                seen.add(j)
                if j not in owner or assign(owner[j], seen):
                    owner[j] = i
                    return True
        return False

    return all(assign(i, set()) for i in range(len(candidates)))


# -- result sets (questions over a real database) ---------------------------------------------

_NULL_TEXTS = frozenset({"none", "null"})

# Unordered results longer than this must match exactly after normalisation (`_row_key`); the
# tolerant row matching is quadratic.
MAX_MATCHED_ROWS = 500


def _row_key(row: Sequence[Any]) -> tuple[Any, ...]:
    """A row in a hashable normal form: NULL, numbers as floats, text normalised."""
    key = []
    for cell in row:
        number = None if cell is None else as_number(cell)
        if cell is None or (isinstance(cell, str) and normalize_text(cell) in _NULL_TEXTS):
            key.append(("null",))
        elif number is not None:
            key.append(("number", number))
        else:
            key.append(("text", normalize_text(cell)))
    return tuple(key)


def cells_match(predicted: Any, gold: Any, rel_tol: float = DEFAULT_REL_TOL, abs_tol: float = DEFAULT_ABS_TOL) -> bool:
    """One committed cell against one gold cell: NULL (None) matches only NULL or the text
    "null"/"none"; otherwise `values_match` (numbers within tolerance, text normalised)."""
    if predicted is None or gold is None:
        other = gold if predicted is None else predicted
        return other is None or (isinstance(other, str) and normalize_text(other) in _NULL_TEXTS)
    return values_match(predicted, gold, rel_tol, abs_tol)


def committed_rows(answers: Sequence[Any], width: int) -> list[list[Any]] | None:
    """The committed answer read as rows of a result with `width` columns: nested arrays are
    rows as given; a flat list of values is cut into rows of `width` values (row-major), so a
    one-column result may be committed as `[v1, v2]` and a one-row result as `[a, b]`; None
    when a flat list does not divide into whole rows (or mixes rows and values)."""
    if all(isinstance(a, (list, tuple)) for a in answers):
        return [list(a) for a in answers]
    if any(isinstance(a, (list, tuple)) for a in answers) or width < 1 or len(answers) % width:
        return None
    return [list(answers[i:i + width]) for i in range(0, len(answers), width)]


def result_sets_match(answers: Sequence[Any], gold_rows: Sequence[Sequence[Any]], ordered: bool = False,
                      rel_tol: float = DEFAULT_REL_TOL, abs_tol: float = DEFAULT_ABS_TOL) -> bool:
    """Whether a committed answer equals a gold result set (the rules of docs/env_db.md):
    same number of rows; rows compared cell by cell in column order (column names are not
    compared) with `cells_match`; rows in the same order when `ordered` (the gold SQL has a
    top-level ORDER BY), else as a multiset (duplicates count, order does not). An empty
    gold result matches only an empty answer."""
    width = len(gold_rows[0]) if gold_rows else 1
    rows = committed_rows(answers, width)
    if rows is None or len(rows) != len(gold_rows):
        return False

    def same(p: Sequence[Any], g: Sequence[Any]) -> bool:
        return len(p) == len(g) and all(cells_match(a, b, rel_tol, abs_tol) for a, b in zip(p, g))

    if ordered:
        return all(same(p, g) for p, g in zip(rows, gold_rows))
    if Counter(map(_row_key, rows)) == Counter(map(_row_key, gold_rows)):
        return True  # equal after normalisation: no tolerance needed
    if len(rows) > MAX_MATCHED_ROWS:
        return False
    return _pairs_up([[j for j, g in enumerate(gold_rows) if same(p, g)] for p in rows])
