"""Math tasks: readers for the benchmark files under the data root, and `arithmetic`, a task
family tiderl generates offline.

| source | file (under the data root) | answers |
| --- | --- | --- |
| `gsm8k` | `gsm8k/test.jsonl` (`question`, `answer` ending `#### 18`) | the number after `####`, thousands separators removed |
| `math500` | `math500/test.jsonl` (`problem`, `answer`, `subject`, `level`, `unique_id`) | the LaTeX `answer` as written |
| `aime24`, `aime25` | `aime/aime24.jsonl`, `aime/aime25.jsonl` (`problem`, `answer` string) | the integer (`"025"` -> `25`) |
| `amc23` | `aime/amc23.jsonl` (`problem`, `answer` float) | the number (`27.0` -> `27`) |
| `arithmetic` | none: generated from `data.seed` | an integer or a decimal |

Each benchmark file is a test set: all of its questions are evaluation tasks and none is
trained on. A task's `answer` is the gold answer as text (what math-verify compares with) and
`meta["dataset"]` names its source.

`arithmetic` (see `ARITHMETIC_KINDS`): questions whose answer one calculator call finds, in
eight kinds (bare and worded addition, subtraction and multiplication with 2-3 digit numbers,
and linear equations `a x + b = c` / `a x - b = c` with an integer solution). Each task's meta
has `expression` (the calculation that answers it) and `confusion` (a plausible wrong
calculation: the opposite operation), which the embedded tiny model's demonstrations use. The
train and held-out splits are disjoint sets of questions drawn with one seed.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from tiderl.envs.math.extract import last_boxed
from tiderl.envs.protocol import Task
from tiderl.envs.setup import read_records

BENCHMARK_FILES = {
    "gsm8k": "gsm8k/test.jsonl",
    "math500": "math500/test.jsonl",
    "aime24": "aime/aime24.jsonl",
    "aime25": "aime/aime25.jsonl",
    "amc23": "aime/amc23.jsonl",
}

# The largest integer a gold answer may hold (every benchmark answer is far below it).
MAX_GOLD_DIGITS = 30

_THOUSANDS = re.compile(r"^-?\d{1,3}(,\d{3})+(\.\d+)?$")


def _records(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found")
    return read_records(path)


def _field(record: dict[str, Any], names: tuple[str, ...], where: str) -> Any:
    for name in names:
        if record.get(name) not in (None, ""):
            return record[name]
    raise ValueError(f"{where}: no {' or '.join(names)} field")


def integer_text(value: Any, where: str) -> str:
    """An integer answer (`"025"`, `27.0`, `"1,600"`) as plain digits, bounded in size."""
    text = str(value).strip().replace(",", "")
    if len(text.lstrip("-")) > MAX_GOLD_DIGITS + 2:
        raise ValueError(f"{where}: answer {text[:40]!r} has more than {MAX_GOLD_DIGITS} digits")
    try:
        number = float(text)
    except ValueError:
        raise ValueError(f"{where}: answer {text[:40]!r} is not a number") from None
    if not number.is_integer():
        raise ValueError(f"{where}: answer {text!r} is not an integer")
    return str(int(text)) if re.fullmatch(r"-?\d+", text) else str(int(number))


def gsm8k_answer(solution: str) -> str:
    """The final answer of a GSM8K solution (after `####`), thousands separators removed."""
    if "####" not in solution:
        raise ValueError("no '####' final-answer marker")
    answer = solution.rsplit("####", 1)[1].strip()
    return answer.replace(",", "") if _THOUSANDS.match(answer) else answer


def load_benchmark(root: Path, source: str) -> list[Task]:
    """Every task of benchmark `source` (a key of `BENCHMARK_FILES`) under the data root."""
    path = root / BENCHMARK_FILES[source]
    tasks = []
    for i, record in enumerate(_records(path)):
        where = f"{path}: record {i + 1}"
        meta: dict[str, Any] = {"dataset": source}
        if source == "gsm8k":
            prompt = _field(record, ("question",), where)
            answer = gsm8k_answer(str(_field(record, ("answer",), where)))
            task_id = f"gsm8k-{i}"
        elif source == "math500":
            prompt = _field(record, ("problem",), where)
            answer = str(_field(record, ("answer",), where)).strip()
            meta |= {"subject": record.get("subject", ""), "level": record.get("level", 0)}
            task_id = f"math500-{record.get('unique_id', i)}"
        else:
            prompt = _field(record, ("problem", "question"), where)
            answer = integer_text(_field(record, ("answer",), where), where)
            task_id = f"{source}-{record.get('id', i)}"
        tasks.append(Task(task_id, str(prompt), answer, meta))
    return tasks


# Where a record keeps what, when data.fields does not say (the first present and non-empty wins).
FIELD_NAMES = {"question": ("question", "problem", "prompt"), "answer": ("answer", "solution"),
               "id": ("id", "unique_id")}


def reference_answer(text: str) -> str:
    """The gold answer in a record's answer field: after GSM8K's `####` (thousands separators
    removed), else the last `\\boxed{}` (MATH's `solution`), else the text as it is (MATH-500's
    `answer`, a bare number)."""
    if "####" in text:
        return gsm8k_answer(text)
    boxed = last_boxed(text)
    return (boxed if boxed is not None else text).strip()


def file_tasks(paths: list[Path], fields: dict[str, str]) -> list[Task]:
    """The tasks of `data.train_files` / `data.eval_files` (`read_records`): each record's question
    and answer (`reference_answer`) from the fields `fields` names, else from `FIELD_NAMES`; task
    id `<folder>/<file stem>-<id>` (the record's id, else its index)."""
    tasks = []
    names = {key: (fields[key],) if key in fields else default for key, default in FIELD_NAMES.items()}
    for path in paths:
        for i, record in enumerate(read_records(path)):
            where = f"{path}: record {i + 1}"
            try:
                question = _field(record, names["question"], where)
                answer = reference_answer(str(_field(record, names["answer"], where)))
            except ValueError as exc:
                raise ValueError(f"{exc}. Fix: name the record's fields in data.fields, e.g. {{question: problem, "
                                 "answer: solution}") from None
            key = next((record[n] for n in names["id"] if record.get(n) not in (None, "")), i)
            tasks.append(Task(f"{path.parent.name}/{path.stem}-{key}", str(question), answer,
                              {"dataset": f"{path.parent.name}/{path.stem}", "file": str(path)}))
    return tasks


# -- the generated arithmetic family ----------------------------------------------------------


@dataclass(frozen=True)
class Kind:
    """One question template: the text, the calculation that answers it and a plausible wrong
    one (the opposite operation), over numbers drawn by `draw`."""

    name: str
    template: str
    expression: str
    confusion: str
    draw: Callable[[random.Random], dict[str, int]]


def _two(rng: random.Random) -> dict[str, int]:
    a, b = rng.randint(10, 999), rng.randint(10, 999)
    return {"a": max(a, b), "b": min(a, b)}  # subtraction questions stay non-negative


def _times(rng: random.Random) -> dict[str, int]:
    return {"a": rng.randint(11, 99), "b": rng.randint(3, 99)}


def _linear(sign: int) -> Callable[[random.Random], dict[str, int]]:
    def draw(rng: random.Random) -> dict[str, int]:
        a, x, b = rng.randint(2, 9), rng.randint(2, 99), rng.randint(1, 99)
        return {"a": a, "b": b, "c": a * x + sign * b}

    return draw


NAMES = ("Ada", "Ben", "Cleo", "Dev", "Emma", "Femi", "Gus", "Hana")

ARITHMETIC_KINDS: tuple[Kind, ...] = (
    Kind("add", "What is {a} plus {b}?", "{a} + {b}", "{a} - {b}", _two),
    Kind("sub", "What is {a} minus {b}?", "{a} - {b}", "{a} + {b}", _two),
    Kind("mul", "What is {a} times {b}?", "{a} * {b}", "{a} + {b}", _times),
    Kind("word_add", "{name} has {a} marbles and finds {b} more. How many marbles does {name} have now?",
         "{a} + {b}", "{a} - {b}", _two),
    Kind("word_sub", "{name} has {a} marbles and gives {b} away. How many marbles are left?",
         "{a} - {b}", "{a} + {b}", _two),
    Kind("word_mul", "There are {a} boxes with {b} pens in each. How many pens are there?",
         "{a} * {b}", "{a} + {b}", _times),
    Kind("linear_plus", "Solve for x: {a}x + {b} = {c}.", "({c} - {b}) / {a}", "({c} + {b}) / {a}", _linear(+1)),
    Kind("linear_minus", "Solve for x: {a}x - {b} = {c}.", "({c} + {b}) / {a}", "({c} - {b}) / {a}", _linear(-1)),
)


def arithmetic_tasks(seed: int, num_train: int, num_eval: int) -> tuple[list[Task], list[Task]]:
    """`num_train` training and `num_eval` held-out arithmetic tasks, all with distinct
    questions, kinds in equal turns (seeded, deterministic)."""
    from tiderl.envs.math.calculator import calculate

    rng = random.Random(f"arithmetic-{seed}")
    tasks: list[Task] = []
    seen: set[str] = set()
    while len(tasks) < num_train + num_eval:
        kind = ARITHMETIC_KINDS[len(tasks) % len(ARITHMETIC_KINDS)]
        values: dict[str, Any] = {**kind.draw(rng), "name": rng.choice(NAMES)}
        prompt = kind.template.format(**values)
        if prompt in seen:
            continue
        seen.add(prompt)
        expression = kind.expression.format(**values)
        meta = {"dataset": "arithmetic", "kind": kind.name, "expression": expression,
                "confusion": kind.confusion.format(**values)}
        tasks.append(Task(f"arith-{len(tasks)}", prompt, calculate(expression), meta))
    order = list(range(len(tasks)))
    rng.shuffle(order)
    shuffled = [tasks[i] for i in order]
    return shuffled[:num_train], shuffled[num_train:]


# -- the small arithmetic family (learnable by the embedded tiny model) ---------------------------


def _small(rng: random.Random) -> dict[str, int]:
    return {"a": rng.randint(10, 49), "b": rng.randint(1, 9)}


def _small_equation(sign: int) -> Callable[[random.Random], dict[str, int]]:
    def draw(rng: random.Random) -> dict[str, int]:
        a, b = rng.randint(10, 49), rng.randint(1, 9)
        return {"a": a, "b": b, "c": a + sign * b}

    return draw


# Questions over a two-digit number a (10-49) and a digit b (1-9), each answered by one
# calculator call whose operands are copied from the question; `confusion` is the opposite
# operation. Small numbers on purpose: digits are single tokens for the tiny model's tokenizer,
# so a calculator call copies at most five digit tokens (`arithmetic`'s 2-3 digit operands
# were more than its warm start learned to copy; docs/env_math.md).
SMALL_ARITHMETIC_KINDS: tuple[Kind, ...] = (
    Kind("add", "What is {a} plus {b}?", "{a} + {b}", "{a} - {b}", _small),
    Kind("sub", "What is {a} minus {b}?", "{a} - {b}", "{a} + {b}", _small),
    Kind("word_add", "{name} has {a} marbles and finds {b} more. How many marbles does {name} have now?",
         "{a} + {b}", "{a} - {b}", _small),
    Kind("word_sub", "{name} has {a} marbles and gives {b} away. How many marbles are left?",
         "{a} - {b}", "{a} + {b}", _small),
    Kind("eq_plus", "Solve for x: x + {b} = {c}.", "{c} - {b}", "{c} + {b}", _small_equation(+1)),
    Kind("eq_minus", "Solve for x: x - {b} = {c}.", "{c} + {b}", "{c} - {b}", _small_equation(-1)),
)


def held_out_pair(a: int, b: int, seed: int, fraction: float = 0.25) -> bool:
    """Whether the number pair (a, b) belongs to the held-out split (a string-seeded draw, the
    same in every process): every question over a held-out pair is an evaluation question."""
    return random.Random(f"small-arithmetic-split-{seed}|{a}|{b}").random() < fraction


def small_arithmetic_tasks(seed: int, num_train: int, num_eval: int) -> tuple[list[Task], list[Task]]:
    """`num_train` training and `num_eval` held-out `small_arithmetic` tasks, one draw per kind
    in turn (a kind whose questions run out is skipped; seeded, deterministic). The split is by number pair (`held_out_pair`): no held-out
    question shares its pair (a, b) with any training question, in any kind or wording, so a
    held-out success needs numbers copied that were never trained together."""
    from tiderl.envs.math.calculator import calculate

    rng = random.Random(f"small-arithmetic-{seed}")
    splits: dict[bool, list[Task]] = {False: [], True: []}
    wanted = {False: num_train, True: num_eval}
    seen: set[str] = set()
    misses = 0  # draws since the last new question: the family is exhausted after many
    turn = -1
    while misses < 5_000 and not all(len(splits[k]) >= wanted[k] for k in splits):
        turn += 1
        misses += 1
        kind = SMALL_ARITHMETIC_KINDS[turn % len(SMALL_ARITHMETIC_KINDS)]
        values: dict[str, Any] = {**kind.draw(rng), "name": rng.choice(NAMES)}
        held = held_out_pair(values["a"], values["b"], seed)
        prompt = kind.template.format(**values)
        if prompt in seen or len(splits[held]) >= wanted[held]:
            continue
        seen.add(prompt)
        misses = 0
        expression = kind.expression.format(**values)
        meta = {"dataset": "small_arithmetic", "kind": kind.name, "expression": expression,
                "confusion": kind.confusion.format(**values), "pair": [values["a"], values["b"]]}
        task_id = f"small-{'eval' if held else 'train'}-{len(splits[held])}"
        splits[held].append(Task(task_id, prompt, calculate(expression), meta))
    if len(splits[False]) < num_train or len(splits[True]) < num_eval:
        raise ValueError(f"small_arithmetic: found {len(splits[False])} training and {len(splits[True])} held-out "
                         f"distinct questions, fewer than asked ({num_train}, {num_eval}): lower "
                         "env.options.num_train_tasks or data.eval_size")
    return splits[False], splits[True]


# -- one-digit arithmetic without carry (single turn, no calculator) ------------------------------


def _digits(rng: random.Random) -> dict[str, int]:
    raise NotImplementedError("digit questions are enumerated, not drawn: see digit_arithmetic_tasks")


# One digit plus or minus one digit, no carry and no borrow (b <= a, a + b <= 9), so the answer
# and its confusion (the opposite operation) are both one digit: a tiny model can answer by
# itself, with no calculator and no number to copy.
DIGIT_ARITHMETIC_KINDS: tuple[Kind, ...] = (
    Kind("add", "What is {a} plus {b}?", "{a} + {b}", "{a} - {b}", _digits),
    Kind("sub", "What is {a} minus {b}?", "{a} - {b}", "{a} + {b}", _digits),
    Kind("word_add", "{name} has {a} marbles and finds {b} more. How many marbles does {name} have now?",
         "{a} + {b}", "{a} - {b}", _digits),
    Kind("word_sub", "{name} has {a} marbles and gives {b} away. How many marbles are left?",
         "{a} - {b}", "{a} + {b}", _digits),
)


def digit_arithmetic_tasks(seed: int, num_train: int, num_eval: int) -> tuple[list[Task], list[Task]]:
    """Every distinct `digit_arithmetic` question (30 digit pairs; bare, and worded with each of
    `NAMES`: 540 questions), shuffled with `seed`: the first `num_eval` are held out, the next
    `num_train` (or all the rest, when fewer are left) train. The split is by question: a held-out question never appears in training,
    but its digit fact (say 3 + 4) does, under another wording."""
    from tiderl.envs.math.calculator import calculate

    pairs = [(a, b) for a in range(10) for b in range(a + 1) if a + b <= 9]
    tasks = []
    for kind in DIGIT_ARITHMETIC_KINDS:
        for a, b in pairs:
            for name in (NAMES if "{name}" in kind.template else NAMES[:1]):
                values = {"a": a, "b": b, "name": name}
                expression = kind.expression.format(**values)
                meta = {"dataset": "digit_arithmetic", "kind": kind.name, "expression": expression,
                        "confusion": kind.confusion.format(**values), "pair": [a, b]}
                tasks.append(Task("", kind.template.format(**values), calculate(expression), meta))
    if num_eval >= len(tasks):
        raise ValueError(f"digit_arithmetic has {len(tasks)} distinct questions, data.eval_size={num_eval} "
                         "leaves none to train on: lower data.eval_size")
    random.Random(f"digit-arithmetic-{seed}").shuffle(tasks)
    for i, task in enumerate(tasks):
        task.task_id = f"digit-{i}"
    return tasks[num_eval:num_eval + num_train], tasks[:num_eval]


# -- place value: a three-digit number's tens and hundreds (single turn, no calculator) -----------


def _one_number(rng: random.Random) -> dict[str, int]:
    raise NotImplementedError("place_value questions are enumerated, not drawn: see place_value_tasks")


# Questions about one three-digit number n (100-999) whose answer is a prefix of n's digits
# followed by zeros (n times ten, a hundred or a thousand; the multiple of ten or of a hundred at
# or below n; the count of whole tens or hundreds in n), so the tiny model answers by copying
# digits (tokenised one by one) from the question, not by computing. Every question ends with
# n and a question mark, so the digit to copy next always sits at the same distance back from
# the answer, whatever the kind; what the kind decides is how many digits to copy and how many
# zeros to write. `confusion` is a neighbouring variant (ten for a hundred, tens for hundreds), a
# plausible mistake whose answer is made the same way. Expressions use the calculator's `//`,
# so the calculator oracle and `calculate` give every answer.
PLACE_VALUE_KINDS: tuple[Kind, ...] = (
    Kind("times_one", "What is one times {n}?", "{n}", "{n} * 10", _one_number),
    Kind("times_ten", "What is ten times {n}?", "{n} * 10", "{n} * 100", _one_number),
    Kind("times_hundred", "What is a hundred times {n}?", "{n} * 100", "{n} * 10", _one_number),
    Kind("times_thousand", "What is a thousand times {n}?", "{n} * 1000", "{n} * 100", _one_number),
    Kind("floor_ten", "What is the multiple of ten at or below {n}?", "{n} // 10 * 10", "{n} // 100 * 100",
         _one_number),
    Kind("floor_hundred", "What is the multiple of a hundred at or below {n}?", "{n} // 100 * 100",
         "{n} // 10 * 10", _one_number),
    Kind("count_tens", "How many whole tens are in {n}?", "{n} // 10", "{n} // 100", _one_number),
    Kind("count_hundreds", "How many whole hundreds are in {n}?", "{n} // 100", "{n} // 10", _one_number),
)


def held_out_number(n: int, seed: int, fraction: float = 0.25) -> bool:
    """Whether the number n belongs to `place_value`'s held-out split (a string-seeded draw, the
    same in every process): every question about a held-out number is an evaluation question."""
    return random.Random(f"place-value-split-{seed}|{n}").random() < fraction


def place_value_tasks(seed: int, num_train: int, num_eval: int) -> tuple[list[Task], list[Task]]:
    """`num_train` training and `num_eval` held-out `place_value` tasks (every kind of
    `PLACE_VALUE_KINDS` about every number 100-999, split by number with `held_out_number`,
    each split shuffled with `seed` and cut to its size). No held-out question is about a number
    any training question uses, so a held-out success needs digits copied from a number never
    trained on."""
    from tiderl.envs.math.calculator import calculate

    splits: dict[bool, list[Task]] = {False: [], True: []}
    for n in range(100, 1000):
        held = held_out_number(n, seed)
        for kind in PLACE_VALUE_KINDS:
            expression = kind.expression.format(n=n)
            meta = {"dataset": "place_value", "kind": kind.name, "expression": expression,
                    "confusion": kind.confusion.format(n=n), "number": n}
            splits[held].append(Task("", kind.template.format(n=n), calculate(expression), meta))
    train, held_out = splits[False], splits[True]
    if num_train > len(train) or num_eval > len(held_out):
        raise ValueError(f"place_value has {len(train)} training and {len(held_out)} held-out questions "
                         f"(seed {seed}), fewer than asked ({num_train}, {num_eval}): lower "
                         "env.options.num_train_tasks or data.eval_size")
    rng = random.Random(f"place-value-{seed}")
    rng.shuffle(train)
    rng.shuffle(held_out)
    train, held_out = train[:num_train], held_out[:num_eval]
    for prefix, tasks in (("train", train), ("eval", held_out)):
        for i, task in enumerate(tasks):
            task.task_id = f"place-{prefix}-{i}"
    return train, held_out
