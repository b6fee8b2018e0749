"""A generated shop database (`data.source: shop`): the DB environment's task for the embedded
tiny model, and for online learning over a database whose rows change.

Two tables, each keyed by its name (so a drifting database changes values, never which row a
question is about):

    customers(name TEXT PRIMARY KEY, city TEXT, country TEXT, age INTEGER, joined INTEGER)
    products(name TEXT PRIMARY KEY, category TEXT, brand TEXT, price INTEGER, stock INTEGER)

Every question asks one column of one row, by the row's name ("Which city does the customer 'Kera'
live in?"), with its gold SQL (`SELECT city FROM customers WHERE name = 'Kera'`), so an
episode is a query and a commit of its one cell. The name is quoted in the question as in the SQL, so
both hold the same tokens after the same token (` '`): a held-out name is copied, not remembered, and
a byte-level tokenizer splits ` Kera` (a word after a space) and `Kera` (after a quote) differently.
A name is one word: the embedded tiny model learned to copy a name's first word from the question
into its query but not the second (docs/env_db.md). Eight kinds, one per (table, column). Held-out
questions are about rows no training question mentions (a fifth of each table), so success on
them is reading the database, not remembering answers.

The database and its two question files are written once per content into the system's temporary
folder (`tiderl-shop-<digest>`), the same in every process; `tiderl.envs.db.setup.shop_setup` then
reads them as `data.source=db_file` reads a user's file, drift included (`env.options.drift`).

The warm start (`WARM_START`) demonstrates a query and a commit per question, with a systematic
mistake: each kind has a confusable partner column of its table (city and country, age and joined,
category and brand, price and stock) and its own rate of asking the partner instead, spread around
`model.warmstart.relation_noise`, so the warm-started policy is right for some kinds and wrong for
others: what RL can fix.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import shutil
import sqlite3
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tiderl.envs.protocol import Task
from tiderl.envs.registration import WarmStart
from tiderl.envs.setup import Setup

if TYPE_CHECKING:
    from tiderl.config import RunConfig

# Bump when the generated content changes (it is part of the folder's name).
VERSION = 3
ROWS = 200  # per table
HELD_OUT_EVERY = 5  # every fifth row of each table is held out

CITIES = {"Lisbon": "Portugal", "Porto": "Portugal", "Lyon": "France", "Paris": "France", "Oslo": "Norway",
          "Bergen": "Norway", "Osaka": "Japan", "Kyoto": "Japan", "Lima": "Peru", "Cusco": "Peru",
          "Quito": "Ecuador", "Dakar": "Senegal"}
CATEGORIES = ["lamp", "chair", "kettle", "backpack", "guitar", "jacket", "camera", "bicycle"]
BRANDS = ["Arvo", "Brisk", "Corva", "Delta", "Elmo", "Fjord", "Gala", "Helio"]
SYLLABLES = ["ka", "ra", "vo", "le", "mi", "so", "ta", "ne", "du", "pe", "lo", "ri", "sa", "bo", "fi", "gu"]

# kind -> (table, column, question with {name}, the partner column a demonstration confuses it with)
KINDS: dict[str, tuple[str, str, str, str]] = {
    "customer_city": ("customers", "city", "Which city does the customer '{name}' live in?", "country"),
    "customer_country": ("customers", "country", "Which country is the customer '{name}' from?", "city"),
    "customer_age": ("customers", "age", "How old is the customer '{name}'?", "joined"),
    "customer_joined": ("customers", "joined", "In which year did the customer '{name}' join?", "age"),
    "product_category": ("products", "category", "What kind of product is '{name}'?", "brand"),
    "product_brand": ("products", "brand", "Which brand makes the product '{name}'?", "category"),
    "product_price": ("products", "price", "What is the price of the product '{name}'?", "stock"),
    "product_stock": ("products", "stock", "How many units of the product '{name}' are in stock?", "price"),
}


def _names(rng: random.Random, count: int) -> list[str]:
    """`count` distinct capitalised two-syllable names, in a `rng`-shuffled order."""
    names = sorted({(a + b).capitalize() for a in SYLLABLES for b in SYLLABLES})
    rng.shuffle(names)
    return names[:count]


def shop_rows(seed: int) -> dict[str, list[tuple[Any, ...]]]:
    """The rows of both tables, drawn from `seed` (the same rows for the same seed).

    Both tables use one list of names, the products' shifted by one row against the customers', so
    every name a held-out row has (rows 0, 5, 10, ...) is a training row's name in the other table:
    the tokenizer and the warm start see each name (a held-out question still asks about a row no
    training question mentions)."""
    rng = random.Random(f"shop-{seed}")
    names = _names(rng, ROWS)
    customers = []
    for name in names:
        city = rng.choice(sorted(CITIES))
        customers.append((name, city, CITIES[city], rng.randint(18, 79), rng.randint(2005, 2024)))
    products = [(names[(i + 1) % ROWS], rng.choice(CATEGORIES), rng.choice(BRANDS), rng.randint(5, 400),
                 rng.randint(0, 150)) for i in range(ROWS)]
    return {"customers": customers, "products": products}


def shop_questions(rows: dict[str, list[tuple[Any, ...]]]) -> tuple[list[dict], list[dict]]:
    """(training, held-out) question records (`tiderl.envs.db.questions` form, `type` = the kind):
    every kind of every row; a row's questions are held out when its index is a multiple of
    HELD_OUT_EVERY."""
    train, held_out = [], []
    for kind, (table, column, template, _) in KINDS.items():
        for index, row in enumerate(rows[table]):
            name = row[0]
            record = {"id": f"{kind}-{index:03d}", "question": template.format(name=name), "type": kind,
                      "sql": f"SELECT {column} FROM {table} WHERE name = '{name}'"}
            (held_out if index % HELD_OUT_EVERY == 0 else train).append(record)
    return train, held_out


def write_shop(folder: Path, seed: int) -> tuple[Path, Path, Path]:
    """Write shop.sqlite, train.jsonl and eval.jsonl into `folder` (created); returns their paths."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = shop_rows(seed)
    database = folder / "shop.sqlite"
    with sqlite3.connect(database) as conn:
        conn.execute("CREATE TABLE customers (name TEXT PRIMARY KEY, city TEXT, country TEXT, age INTEGER, "
                     "joined INTEGER)")
        conn.execute("CREATE TABLE products (name TEXT PRIMARY KEY, category TEXT, brand TEXT, price INTEGER, "
                     "stock INTEGER)")
        conn.executemany("INSERT INTO customers VALUES (?, ?, ?, ?, ?)", rows["customers"])
        conn.executemany("INSERT INTO products VALUES (?, ?, ?, ?, ?)", rows["products"])
    conn.close()
    paths = [database]
    for name, records in zip(("train", "eval"), shop_questions(rows)):
        path = folder / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        paths.append(path)
    return paths[0], paths[1], paths[2]


def shop_files(seed: int) -> tuple[Path, Path, Path]:
    """The shop's database and question files for `seed`, written once into the system's temporary
    folder (a folder per content, replaced atomically, so processes that race write the same)."""
    digest = hashlib.sha256(f"{VERSION}|{seed}|{ROWS}|{HELD_OUT_EVERY}|{sorted(KINDS.items())}".encode())
    folder = Path(tempfile.gettempdir()) / f"tiderl-shop-{digest.hexdigest()[:12]}"
    names = (folder / "shop.sqlite", folder / "train.jsonl", folder / "eval.jsonl")
    if not all(p.is_file() for p in names):
        scratch = Path(tempfile.mkdtemp(prefix="tiderl-shop-", dir=folder.parent))
        write_shop(scratch, seed)
        try:
            os.replace(scratch, folder)
        except OSError:  # another process finished first; its files are the same
            shutil.rmtree(scratch, ignore_errors=True)
    return names


def confusion_rates(noise: float, seed: int) -> dict[str, float]:
    """Per kind, the rate at which demonstrations query the partner column: evenly spaced over
    [noise - 0.3, noise + 0.3] (clipped to [0, 0.9]) and dealt to the kinds in a `seed`-shuffled
    order, so some kinds are mostly right in the demonstrations and some mostly wrong."""
    kinds = sorted(KINDS)
    rates = [min(max(noise - 0.3 + 0.6 * i / (len(kinds) - 1), 0.0), 0.9) for i in range(len(kinds))]
    random.Random(f"shop-confusions-{seed}").shuffle(rates)
    return dict(zip(kinds, rates))


def demonstrations(setup: Setup, cfg: "RunConfig", rng: random.Random) -> tuple[list[Task], list[list[str]], dict[str, Any]]:
    """`model.warmstart.num_traces` training questions drawn with `rng`, each with the oracle's turns
    (a query, a commit of its result) for its own column, or for the partner column at the kind's
    rate (`confusion_rates`)."""
    if setup.name != "shop" or setup.oracle is None:
        raise ValueError(f"the embedded tiny model of the DB environment is built on data.source=shop, not "
                         f"data.source={setup.name}. Fix: set data.source=shop, or pass a real model "
                         "(model.path=DIR; tiderl eval --model DIR)")
    rates = confusion_rates(cfg.model.warmstart.relation_noise, cfg.seed)
    tasks = [rng.choice(setup.train_tasks) for _ in range(cfg.model.warmstart.num_traces)]
    scripts = []
    for task in tasks:
        kind = task.meta["answer_type"]
        _, column, _, partner = KINDS[kind]
        shown = task
        if rng.random() < rates[kind]:
            sql = task.meta["gold_sql"].replace(f"SELECT {column} ", f"SELECT {partner} ", 1)
            shown = dataclasses.replace(task, meta={**task.meta, "gold_sql": sql})
        scripts.append(setup.oracle(shown))
    return tasks, scripts, {"confusion_rates": {k: round(r, 3) for k, r in rates.items()}}


# A drifting database starts as the fixed one; the others cannot change what the model learns.
WARM_START = WarmStart(demonstrations=demonstrations, key_modules=("tiderl.envs.db.shop",),
                       unkeyed_options=("drift", "timeout_s", "max_sessions", "pool_size", "backend"))
