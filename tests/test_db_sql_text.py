"""SQL text helpers of the DB env and its scoring: statement splitting and kinds, the
conservative knowledge-unit reader, answer matching and table hashing."""

from __future__ import annotations

import pytest

from tiderl.envs.db.backend import canonical_value, portable_column, rows_hash
from tiderl.envs.db.scoring import answers_match, as_number, flatten_answers, values_match
from tiderl.envs.db.sql_text import (
    EMPTY,
    OTHER,
    READ,
    WRITE,
    quote_bare_names,
    referenced_units,
    split_statements,
    statement_kind,
    tokenize,
)

# -- splitting and kinds ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "sql, expected",
    [
        ("SELECT 1", ["SELECT 1"]),
        ("SELECT 1;", ["SELECT 1"]),
        ("SELECT ';' ; SELECT 2;", ["SELECT ';'", "SELECT 2"]),
        ('SELECT "a;b" FROM t', ['SELECT "a;b" FROM t']),
        ("SELECT `x;` FROM [t;]", ["SELECT `x;` FROM [t;]"]),
        ("SELECT 'it''s; fine'", ["SELECT 'it''s; fine'"]),
        ("SELECT 1; -- trailing; comment\n", ["SELECT 1"]),
        ("/* a; b */ SELECT 1", ["/* a; b */ SELECT 1"]),
        ("SELECT 1;;  ;", ["SELECT 1"]),
        ("", []),
        ("  ;; -- only a comment", []),
        ("DELETE FROM t; DROP TABLE t", ["DELETE FROM t", "DROP TABLE t"]),
        ("SELECT 'unterminated; still one", ["SELECT 'unterminated; still one"]),
    ],
)
def test_split_statements(sql, expected):
    assert split_statements(sql) == expected


@pytest.mark.parametrize(
    "sql, kind, keyword",
    [
        ("select * from t", READ, "SELECT"),
        ("  ((SELECT 1))", READ, "SELECT"),
        ("-- note\nVALUES (1)", READ, "VALUES"),
        ("WITH c AS (SELECT 1) SELECT * FROM c", READ, "WITH"),
        # A write hidden behind WITH is still a write.
        ("WITH c AS (SELECT 1) DELETE FROM t WHERE a IN c", WRITE, "WITH"),
        ("with c as (select 'delete') select * from c", READ, "WITH"),
        ("insert into t values (1)", WRITE, "INSERT"),
        ("REPLACE INTO t VALUES (1)", WRITE, "REPLACE"),
        ("UPDATE t SET a = 1", WRITE, "UPDATE"),
        ("DROP TABLE t", OTHER, "DROP"),
        ("PRAGMA writable_schema = ON", OTHER, "PRAGMA"),
        ("ATTACH DATABASE 'x' AS y", OTHER, "ATTACH"),
        ("VACUUM INTO '/tmp/x'", OTHER, "VACUUM"),
        ("'just a string'", OTHER, "just a string"),
        ("   ", EMPTY, ""),
    ],
)
def test_statement_kind(sql, kind, keyword):
    assert statement_kind(sql) == (kind, keyword)


def test_tokenizer_reads_digit_led_names_as_words_and_numbers_as_numbers():
    kinds = [(t.kind, t.text) for t in tokenize("INSERT INTO 1952_Prix (a) VALUES (1.5e+3, 17, .5, 0x1F)")]
    assert ("word", "1952_Prix") in kinds
    assert [text for kind, text in kinds if kind == "number"] == ["1.5e+3", "17", ".5", "0x1F"]
    assert [(t.kind, t.text) for t in tokenize("17ORDER BY")] == [("word", "17ORDER"), ("word", "BY")]


def test_quote_bare_names_quotes_only_bare_table_names():
    sql = "INSERT INTO 1952_Prix (Pos) VALUES ('1952_Prix')"
    assert quote_bare_names(sql, ["1952_prix"]) == "INSERT INTO \"1952_Prix\" (Pos) VALUES ('1952_Prix')"
    assert quote_bare_names('SELECT * FROM "t"', ["t"]) == 'SELECT * FROM "t"'


# -- conservative knowledge units ---------------------------------------------------------------

TABLES = {"School Table": ["School", "City", "Year"], "other": ["x"]}


@pytest.mark.parametrize(
    "sql, expected",
    [
        ('SELECT City FROM "School Table" WHERE Year > 1960',
         {"table:School Table", "column:School Table.City", "column:School Table.Year"}),
        ("SELECT COUNT(*) FROM `school table`", {"table:School Table"}),
        ("SELECT * FROM [School Table]",
         {"table:School Table", "column:School Table.School", "column:School Table.City",
          "column:School Table.Year"}),
        ("SELECT t.* FROM `School Table` t", {"table:School Table", "column:School Table.School",
                                              "column:School Table.City", "column:School Table.Year"}),
        # Names inside string literals and comments do not count; 2 * 3 is no column star.
        ("SELECT 'School Table', 2 * 3 -- other", set()),
        ("SELECT x FROM other", {"table:other", "column:other.x"}),
    ],
)
def test_referenced_units(sql, expected):
    assert referenced_units(sql, TABLES) == expected


# -- answer matching ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "predicted, gold, match",
    [
        (1, "1.0", True),
        ("17", "17.0", True),
        (2011.0000000001, "2011.0", True),
        (2011.01, "2011.0", False),
        ("1,174", "1174.0", True),
        ("1,17", "117", False),  # not a thousands separator: compared as text
        ("  Giza ", "giza", True),
        ("Giza  Governorate", "giza governorate", True),
        ("Giza", "Gizah", False),
        (None, "None", True),
        ("nan", "NaN", True),  # text, not a number
        (True, "1", True),
    ],
)
def test_values_match(predicted, gold, match):
    assert values_match(predicted, gold) is match


def test_as_number_accepts_only_plain_numbers():
    assert as_number(" -2.5e1 ") == -25.0
    assert as_number("12,345,678.5") == 12345678.5
    assert as_number("1e") is None and as_number("inf") is None and as_number("5 km") is None


def test_answers_match_is_a_multiset_comparison_unless_ordered():
    assert answers_match(["b", "a"], ["a", "b"])
    assert not answers_match(["b", "a"], ["a", "b"], ordered=True)
    assert not answers_match(["a", "a"], ["a"])
    assert not answers_match(["a", "a", "b"], ["a", "b", "b"])
    assert answers_match([], [])


def test_answers_match_finds_a_pairing_where_greedy_would_not():
    # p1 is within 1e-6 of both gold values, p2 only of 1.0: taking 1.0 for p1 first would
    # leave p2 unmatched, the matching must pair p1 with 1.0000015 instead.
    assert answers_match([1.0000008, 1.0], [1.0, 1.0000015])
    assert not answers_match([1.0000008, 1.0000008], [1.0, 1.0000030])


def test_flatten_answers_flattens_rows_one_level():
    assert flatten_answers([[1, "a"], [2, "b"], 3]) == [1, "a", 2, "b", 3]


# -- table hashing and portable columns -------------------------------------------------------------


def test_rows_hash_is_order_independent_and_counts_duplicates():
    rows = [(1, "a"), (2, "b"), (3, None)]
    assert rows_hash(rows) == rows_hash(list(reversed(rows)))
    assert rows_hash(rows) != rows_hash(rows + [(1, "a")])
    assert rows_hash([(1, "a")]) == rows_hash([(1.0, "a")])  # equal numbers hash alike
    assert rows_hash([(1, "a")]) != rows_hash([("1", "a")])  # a string is not a number
    assert rows_hash([(None, "a")]) != rows_hash([("None", "a")])


def test_canonical_value():
    assert canonical_value(5.0) == 5 and canonical_value(2.5) == 2.5
    assert canonical_value(b"\x01\xff") == "x'01ff'"


@pytest.mark.parametrize(
    "declared, cells, expected",
    [
        ("INT", ["1", " 2 ", None], ("integer", [1, 2, None])),
        ("YEAR", ["1980"], ("integer", [1980])),
        ("INT", ["1", "—"], ("text", ["1", "—"])),
        ("DECIMAL(6,3)", ["2.5", 3], ("real", [2.5, 3.0])),
        ("DECIMAL", ["2,900"], ("text", ["2,900"])),
        ("TEXT", [5, "x"], ("text", ["5", "x"])),
        ("DATE", ["2001-01-01"], ("text", ["2001-01-01"])),
    ],
)
def test_portable_column(declared, cells, expected):
    assert portable_column(declared, cells) == expected
