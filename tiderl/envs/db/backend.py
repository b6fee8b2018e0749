"""The database backend interface of the SQL environment, and the helpers every backend shares.

A backend builds the database of one task from its table specs and opens one session per
episode. The interface is deliberately small:

    backend.open(tables, writable) -> session
    session.execute(sql, max_rows=..., timeout_s=...) -> QueryResult   (one statement)
    session.list_tables() / session.describe_table(name) / session.table_hash(name)
    session.close()

`writable=False` (SELECT-type tasks) means the agent's statements can never change the task
database; `writable=True` (INSERT/UPDATE/DELETE tasks) gives the episode a private scratch copy
whose final state is scored with `table_hash`. Every failure the agent can cause is a
`SQLError` whose message is shown to the agent; nothing else escapes `execute`.

Table hashes are computed here, in Python, from the rows a backend returns, so they mean the
same on every backend: an order-independent hash of the multiset of rows (see `rows_hash`).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol, Sequence

# Remaining rows are counted (to tell the agent how many were left out) up to this many.
ROW_COUNT_CAP = 100_000

# Longest string or blob a statement may build (SQLite: `SQLITE_LIMIT_LENGTH`) or return (every
# backend: `fetch_limited` refuses results holding a longer value).
MAX_VALUE_BYTES = 1_000_000

# Declared column types are copied into SQLite DDL; anything unusual becomes TEXT.
_SAFE_TYPE = re.compile(r"[A-Za-z][A-Za-z0-9_ ]*(\(\s*\d+\s*(,\s*\d+\s*)?\))?")


class SQLError(Exception):
    """The statement failed or was refused; the message is written for the agent."""


@dataclass(frozen=True)
class TableSpec:
    """One table of a task database.

    name: the table name, exactly as the task uses it (may contain spaces).
    columns: (column name, declared type) pairs in order; declared types are as the task
        record gives them (e.g. "TEXT", "INT", "DECIMAL(6,3)").
    rows: the rows, each a tuple with one value per column.
    """

    name: str
    columns: tuple[tuple[str, str], ...]
    rows: tuple[tuple[Any, ...], ...]

    @property
    def column_names(self) -> list[str]:
        return [c for c, _ in self.columns]

    def to_dict(self) -> dict[str, Any]:
        """The JSON form stored in `Task.meta["tables"]`."""
        return {
            "name": self.name,
            "columns": [{"name": c, "type": t} for c, t in self.columns],
            "rows": [list(r) for r in self.rows],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TableSpec":
        """The inverse of `to_dict`; raises ValueError naming the problem on a malformed spec."""
        try:
            columns = tuple((str(c["name"]), str(c.get("type") or "TEXT")) for c in data["columns"])
            rows = tuple(tuple(r) for r in data["rows"])
            name = str(data["name"])
        except (KeyError, TypeError) as exc:
            raise ValueError(f"table spec needs name, columns [{{name, type}}] and rows: {exc!r}") from None
        if not columns:
            raise ValueError(f"table {name!r} has no columns")
        bad = [i for i, r in enumerate(rows) if len(r) != len(columns)]
        if bad:
            raise ValueError(f"table {name!r}: row {bad[0]} has {len(rows[bad[0]])} values, "
                             f"expected {len(columns)}")
        return cls(name, columns, rows)


def specs_from_meta(meta: dict[str, Any]) -> list[TableSpec]:
    """The table specs of a task (`meta["tables"]`, a list of `TableSpec.to_dict()` forms)."""
    if "tables" not in meta:
        raise ValueError("task meta has no 'tables': a DB task carries its tables as table specs")
    return [TableSpec.from_dict(t) for t in meta["tables"]]


def spec_digest(tables: Sequence[TableSpec]) -> str:
    """A stable hex digest of table specs (names, types and rows): equal specs, equal digests."""
    text = json.dumps([t.to_dict() for t in tables], ensure_ascii=False, sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def sqlite_column_type(declared: str) -> str:
    """The declared type to put in SQLite DDL: as given when it looks like a type name
    (SQLite derives the column affinity from it), else TEXT."""
    declared = declared.strip()
    return declared if _SAFE_TYPE.fullmatch(declared) else "TEXT"


# -- portable column types (backends without SQLite's per-value affinity) ----------------------


def _as_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value) if value.is_integer() else None
    if isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d+\s*", value):
        return int(value)
    return None


def _as_float(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            return None
        return number if math.isfinite(number) else None
    return None


def portable_column(declared: str, cells: Sequence[Any]) -> tuple[str, list[Any]]:
    """("integer" | "real" | "text", converted cells) for one column.

    A column declared as an integer type (INT, INTEGER, YEAR, ...) is "integer" when every
    non-null cell converts exactly to an int; one declared DECIMAL/NUMERIC/FLOAT/REAL/DOUBLE is
    "real" when every non-null cell parses as a finite float. Otherwise, and for every other
    declared type (TEXT, DATE, TIME, ...), the column is "text" and cells become strings: task
    records hold values such as "2,900" in DECIMAL columns, which a strict database refuses.
    """
    upper = declared.upper()
    present = [c for c in cells if c is not None]
    if "INT" in upper or upper.startswith("YEAR"):
        converted = [_as_int(c) for c in present]
        if all(v is not None for v in converted):
            return "integer", [None if c is None else _as_int(c) for c in cells]
    if any(k in upper for k in ("DEC", "NUMERIC", "FLOA", "REAL", "DOUB")):
        converted = [_as_float(c) for c in present]
        if all(v is not None for v in converted):
            return "real", [None if c is None else _as_float(c) for c in cells]
    return "text", [None if c is None else str(c) for c in cells]


def portable_table(spec: TableSpec) -> tuple[list[tuple[str, str]], list[tuple[Any, ...]]]:
    """The spec's (column, portable type) pairs and its rows converted to those types.

    An empty column name (one dbbench table has one; SQLite accepts it, DuckDB and most
    servers do not) becomes `column<k>`, k counted from 1.
    """
    columns = []
    converted_columns = []
    for index, (name, declared) in enumerate(spec.columns):
        kind, cells = portable_column(declared, [row[index] for row in spec.rows])
        columns.append((name if name.strip() else f"column{index + 1}", kind))
        converted_columns.append(cells)
    rows = [tuple(col[i] for col in converted_columns) for i in range(len(spec.rows))]
    return columns, rows


# -- results and hashing --------------------------------------------------------------------


@dataclass
class QueryResult:
    """The outcome of one successful statement.

    columns / rows: the result set (at most `max_rows` rows); empty for a write.
    more_rows: rows left out by the row limit; a lower bound when `more_rows_capped`.
    rowcount: rows affected by a write (None for a read).
    units: knowledge units ("table:<t>", "column:<t>.<c>") the statement touched.
    """

    columns: list[str]
    rows: list[tuple[Any, ...]]
    more_rows: int = 0
    more_rows_capped: bool = False
    rowcount: int | None = None
    units: frozenset[str] = field(default_factory=frozenset)


def value_size(value: Any) -> int:
    """The size of a result cell in characters (text) or bytes (blobs); 0 for other values."""
    if isinstance(value, (str, bytes, bytearray)):
        return len(value)
    if isinstance(value, memoryview):
        return value.nbytes
    return 0


def check_value_sizes(rows: Sequence[Sequence[Any]], limit: int = MAX_VALUE_BYTES) -> None:
    """SQLError when a cell of `rows` is longer than `limit` (see MAX_VALUE_BYTES)."""
    for row in rows:
        for value in row:
            if value_size(value) > limit:
                raise SQLError(f"string or blob too big: a result value has {value_size(value):,} characters "
                               f"or bytes; the limit is {limit:,}")


def fetch_limited(fetchmany: Callable[[int], list[Any]], max_rows: int) -> tuple[list[tuple], int, bool]:
    """(first `max_rows` rows, rows left out, whether the count stopped at ROW_COUNT_CAP).
    Raises SQLError when a shown row holds a value over MAX_VALUE_BYTES."""
    rows = [tuple(r) for r in fetchmany(max_rows)] if max_rows > 0 else []
    check_value_sizes(rows)
    more = 0
    while more < ROW_COUNT_CAP:
        batch = fetchmany(min(1000, ROW_COUNT_CAP - more))
        if not batch:
            return rows, more, False
        more += len(batch)
    return rows, more, bool(fetchmany(1))


def canonical_value(value: Any) -> Any:
    """A value in the form table hashes use: equal numbers hash alike (5, 5.0 and
    Decimal("5") all give 5), strings stay strings (so "5" differs from 5), bytes become hex
    text, NULL stays None."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value) if value.is_integer() else value
    if isinstance(value, (bytes, bytearray, memoryview)):
        return "x'" + bytes(value).hex() + "'"
    # Decimal, date, time, ... : their text, which is what the agent would compare.
    try:
        number = float(value)
    except (TypeError, ValueError):
        return str(value)
    return canonical_value(number)


def rows_hash(rows: Iterable[Sequence[Any]]) -> str:
    """An order-independent hash of a multiset of rows: sha256 over the sorted sha256 of
    each row's canonical JSON. The same rows in any order give the same hash; a duplicated
    row changes it."""
    digests = sorted(
        hashlib.sha256(
            json.dumps([canonical_value(v) for v in row], ensure_ascii=False).encode("utf-8")
        ).hexdigest()
        for row in rows
    )
    return hashlib.sha256("\n".join(digests).encode("ascii")).hexdigest()


def database_hash(session: "DBSession", names: Sequence[str]) -> str:
    """One hash over several tables of a session (names sorted, each with its `table_hash`)."""
    parts = [f"{name}\t{session.table_hash(name)}" for name in sorted(names)]
    return hashlib.sha256("\n".join(parts).encode("utf-8")).hexdigest()


def units_for(tables: Sequence[TableSpec], touched: Iterable[tuple[str, str | None]]) -> frozenset[str]:
    """Knowledge units from (table, column-or-None) pairs a database reported, keeping only the
    task's tables and columns (matched case-insensitively, named as the spec names them)."""
    by_name = {t.name.casefold(): t for t in tables}
    units = set()
    for table, column in touched:
        spec = by_name.get((table or "").casefold())
        if spec is None:
            continue
        units.add(f"table:{spec.name}")
        if column:
            for name in spec.column_names:
                if name.casefold() == column.casefold():
                    units.add(f"column:{spec.name}.{name}")
    return frozenset(units)


class DBSession(Protocol):
    """One episode's connection to one task database."""

    def execute(self, sql: str, *, max_rows: int, timeout_s: float) -> QueryResult:
        """Run one statement; raises SQLError (message for the agent) on any failure."""
        ...

    def list_tables(self) -> list[str]:
        """The task's tables, sorted."""
        ...

    def describe_table(self, name: str) -> list[tuple[str, str]]:
        """(column, type) pairs of one task table; SQLError when there is no such table."""
        ...

    def table_hash(self, name: str) -> str:
        """`rows_hash` of all rows of one table as they are now."""
        ...

    def close(self) -> None:
        """Release the connection; a writable session's changes are discarded."""
        ...


class Backend(Protocol):
    """Builds task databases and opens sessions on them."""

    name: str

    def open(self, tables: Sequence[TableSpec], writable: bool) -> DBSession:
        """A session on a fresh database holding exactly `tables`."""
        ...
