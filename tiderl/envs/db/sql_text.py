"""Reading SQL text without a database: tokens, statement splitting, statement kinds, and a
conservative guess of the tables and columns a statement touches.

These functions are the first safety layer of the SQL environment and the knowledge-unit
extractor of the backends that have no authorizer hook (DuckDB, SQLAlchemy). They are pure and
never raise on any input string.

The tokenizer knows the quoting rules the AgentBench tasks use (SQLite and MySQL flavours):
`'string'` (with `''` escapes), `"identifier"`, `` `identifier` ``, `[identifier]`, `-- line`
and `/* block */` comments. An unterminated quote or comment runs to the end of the text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Sequence

# Statement kinds, by first keyword. Anything else (DDL, PRAGMA, ATTACH, VACUUM, transactions,
# SET, COPY, ...) is refused by the environment before it reaches a database.
READ_KEYWORDS = frozenset({"SELECT", "WITH", "VALUES"})
WRITE_KEYWORDS = frozenset({"INSERT", "UPDATE", "DELETE", "REPLACE"})

READ = "read"
WRITE = "write"
OTHER = "other"
EMPTY = "empty"


@dataclass(frozen=True)
class Token:
    """One lexical token.

    kind: "word" (bare identifier or keyword), "ident" (quoted identifier, `text` unquoted),
        "string" (string literal, `text` unquoted), "number", "punct" (one character),
        "semicolon".
    text: the token's text (quotes removed for "ident" and "string").
    start: offset of the token's first character in the source text.
    """

    kind: str
    text: str
    start: int


_CLOSING = {'"': '"', "`": "`", "[": "]"}
_NUMBER = re.compile(r"0[xX][0-9a-fA-F]+|(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?")


def tokenize(sql: str) -> list[Token]:
    """The tokens of `sql`, comments and whitespace dropped. Never raises."""
    tokens: list[Token] = []
    i, n = 0, len(sql)
    while i < n:
        ch = sql[i]
        if ch.isspace():
            i += 1
        elif sql.startswith("--", i):
            end = sql.find("\n", i)
            i = n if end == -1 else end + 1
        elif sql.startswith("/*", i):
            end = sql.find("*/", i + 2)
            i = n if end == -1 else end + 2
        elif ch == "'":
            text, i_next = _quoted(sql, i, "'")
            tokens.append(Token("string", text, i))
            i = i_next
        elif ch in _CLOSING:
            text, i_next = _quoted(sql, i, _CLOSING[ch])
            tokens.append(Token("ident", text, i))
            i = i_next
        elif ch.isalpha() or ch == "_" or ord(ch) > 127:
            j = i + 1
            while j < n and _is_name_char(sql[j]):
                j += 1
            tokens.append(Token("word", sql[i:j], i))
            i = j
        elif ch.isdigit() or (ch == "." and i + 1 < n and sql[i + 1].isdigit()):
            match = _NUMBER.match(sql, i)
            j = match.end() if match else i + 1
            kind = "number"
            if j < n and _is_name_char(sql[j]):
                # MySQL allows bare names that start with a digit (1952_British_Grand_Prix_0).
                kind = "word"
                while j < n and _is_name_char(sql[j]):
                    j += 1
            tokens.append(Token(kind, sql[i:j], i))
            i = j
        elif ch == ";":
            tokens.append(Token("semicolon", ";", i))
            i += 1
        else:
            tokens.append(Token("punct", ch, i))
            i += 1
    return tokens


def _is_name_char(ch: str) -> bool:
    """Whether `ch` continues a bare name (letters, digits, _, $, any non-ASCII character)."""
    return ch.isalnum() or ch in "_$" or ord(ch) > 127


def _quoted(sql: str, start: int, close: str) -> tuple[str, int]:
    """The unquoted body of the quoted token at `start` and the offset just after it.
    A doubled closing character inside is an escaped one (SQL's rule for '' and "")."""
    parts = []
    i = start + 1
    while True:
        end = sql.find(close, i)
        if end == -1:
            parts.append(sql[i:])
            return "".join(parts), len(sql)
        parts.append(sql[i:end])
        if close != "]" and sql.startswith(close * 2, end):
            parts.append(close)
            i = end + 2
            continue
        return "".join(parts), end + 1


def split_statements(sql: str) -> list[str]:
    """The statements of `sql` (separated by top-level `;`), stripped, empty ones dropped.

    Semicolons inside strings, quoted identifiers and comments do not split. A statement made
    of comments only counts as empty.
    """
    statements = []
    start = 0
    has_token = False
    for token in tokenize(sql):
        if token.kind == "semicolon":
            if has_token:
                statements.append(sql[start:token.start].strip())
            start, has_token = token.start + 1, False
        else:
            has_token = True
    if has_token:
        statements.append(sql[start:].strip())
    return statements


def statement_kind(sql: str) -> tuple[str, str]:
    """(kind, keyword) of one statement: kind is READ, WRITE, OTHER or EMPTY, and keyword the
    upper-cased first keyword ("" when empty).

    Leading parentheses are skipped (`(SELECT ...)`). A WITH statement is a WRITE when a data
    modifying keyword follows its common table expressions at top level (SQLite allows
    `WITH c AS (...) DELETE FROM t ...`), so a read-only task cannot sneak a write behind WITH.
    """
    tokens = [t for t in tokenize(sql) if t.kind != "semicolon"]
    words = [t for t in tokens if not (t.kind == "punct" and t.text == "(")]
    if not words:
        return EMPTY, ""
    first = words[0]
    keyword = first.text.upper() if first.kind == "word" else ""
    if keyword in WRITE_KEYWORDS:
        return WRITE, keyword
    if keyword == "WITH" and _top_level_write(tokens):
        return WRITE, keyword
    if keyword in READ_KEYWORDS:
        return READ, keyword
    return OTHER, keyword or first.text[:20]


def _top_level_write(tokens: Sequence[Token]) -> bool:
    """Whether a data-modifying keyword appears outside any parentheses."""
    depth = 0
    for t in tokens:
        if t.kind == "punct" and t.text == "(":
            depth += 1
        elif t.kind == "punct" and t.text == ")":
            depth = max(0, depth - 1)
        elif depth == 0 and t.kind == "word" and t.text.upper() in WRITE_KEYWORDS:
            return True
    return False


def has_top_level_order_by(sql: str) -> bool:
    """Whether the statement's own result is ordered: ORDER BY outside any parentheses (an
    ORDER BY inside a subquery or window does not order the result)."""
    depth = 0
    previous = None
    for t in tokenize(sql):
        if t.kind == "punct" and t.text == "(":
            depth += 1
        elif t.kind == "punct" and t.text == ")":
            depth = max(0, depth - 1)
        elif depth == 0 and t.kind == "word":
            if t.text.upper() == "BY" and previous is not None and previous.upper() == "ORDER":
                return True
            previous = t.text
            continue
        previous = None
    return False


def referenced_units(sql: str, tables: dict[str, Sequence[str]]) -> set[str]:
    """A conservative guess of the knowledge units one statement touches, without a database.

    tables: the task's tables, name -> column names.
    Returns "table:<t>" for each task table whose name appears as an identifier (bare or
    quoted, compared case-insensitively; string literals and comments never count), and
    "column:<t>.<c>" for each column of those tables whose name appears as an identifier, or
    for all their columns when the statement has a `*` that selects columns (`SELECT *`,
    `t.*`, `, *`; not `COUNT(*)` or a multiplication).

    Conservative means: a column name that also names something else (an alias, a column of
    an unreferenced table) may be counted; a column reached only through `*` of a subquery is.
    """
    tokens = tokenize(sql)
    names = {t.text.casefold() for t in tokens if t.kind in ("word", "ident")}
    star = _selects_star(tokens)
    units: set[str] = set()
    for table, columns in tables.items():
        if table.casefold() not in names:
            continue
        units.add(f"table:{table}")
        for column in columns:
            if star or column.casefold() in names:
                units.add(f"column:{table}.{column}")
    return units


def _selects_star(tokens: Sequence[Token]) -> bool:
    """Whether a `*` stands for columns: it follows SELECT, DISTINCT, ALL, a comma or a dot."""
    for previous, token in zip(tokens, tokens[1:]):
        if token.kind == "punct" and token.text == "*":
            if previous.kind == "word" and previous.text.upper() in ("SELECT", "DISTINCT", "ALL"):
                return True
            if previous.kind == "punct" and previous.text in (",", "."):
                return True
    return False


def quote_identifier(name: str) -> str:
    """`name` as a double-quoted SQL identifier (standard SQL; SQLite, DuckDB, PostgreSQL)."""
    return '"' + name.replace('"', '""') + '"'


def quote_bare_names(sql: str, names: Iterable[str]) -> str:
    """`sql` with every bare word equal to one of `names` (case-insensitively) double-quoted.

    For MySQL-flavoured gold statements whose table names start with a digit or are keywords,
    which SQLite only accepts quoted. Quoted identifiers, strings and comments are untouched.
    """
    wanted = {n.casefold(): n for n in names}
    pieces = []
    last = 0
    for token in tokenize(sql):
        if token.kind == "word" and token.text.casefold() in wanted:
            pieces.append(sql[last:token.start])
            pieces.append(quote_identifier(token.text))
            last = token.start + len(token.text)
    pieces.append(sql[last:])
    return "".join(pieces)
