"""HumanEval and MBPP as code tasks.

A code task (`Task`) is a function to write:
    prompt: the first user message (the function's description);
    answer: {"tests": the hidden test code, run after the solution; it raises on a failure};
    meta: "source" ("humaneval" or "mbpp"), "prelude" (code placed before the agent's code:
        HumanEval's prompt with the signature, docstring, imports and helpers; "" for MBPP),
        "entry_points" (the functions the tests call), "visible_tests" (assert statements the
        agent may run with `run_tests`), "reference" (the reference solution, for the oracle).

HumanEval (`HumanEval.jsonl.gz`, 164 problems): the hidden test is the problem's
`check(candidate)` called on the entry point; the visible tests are the examples of the
docstring (doctest `>>>` lines, or `f(...) == / ==> / ➞ / => / -> value` lines) whose value is a
Python literal. MBPP (`sanitized-mbpp.json`, 427 problems): the prompt is the task text plus the
first assert (the usual MBPP prompt); visible = that assert; hidden = every assert with the
task's `test_imports`. Evaluation split = task ids 11-510 (257 problems), training = the rest
but 1-10 (the few-shot prompts).
"""

from __future__ import annotations

import ast
import doctest
import gzip
import json
import re
from pathlib import Path

from tiderl.envs.protocol import Task
from tiderl.envs.setup import field_names, read_records, record_field

HUMANEVAL_FILE = Path("humaneval") / "HumanEval.jsonl.gz"
MBPP_FILE = Path("mbpp") / "sanitized-mbpp.json"
MBPP_EVAL_IDS = range(11, 511)
MBPP_PROMPT_IDS = range(1, 11)

HUMANEVAL_INSTRUCTION = (
    "Complete this Python function. Write the whole function (signature included, with any "
    "imports and helpers it needs).\n\n```python\n{prompt}```"
)
MBPP_INSTRUCTION = "{text}\nYour code should pass this test:\n{test}"

# Docstring examples that HumanEval's canonical solutions contradict (measured: the reference
# fails them); they are not shown as visible tests.
HUMANEVAL_WRONG_EXAMPLES = frozenset({
    "assert median([-10, 4, 6, 1000, 10, 20]) == 15.0",
    "assert sort_array([1, 5, 2, 3, 4]) == [1, 2, 3, 4, 5]",
    "assert sort_array([-2, -3, -4, -5, -6]) == [-6, -5, -4, -3, -2]",
    'assert bf("Earth", "Mercury") == ("Venus")',
})

_EXAMPLE = re.compile(r"^\s*(?:>>>\s*)?(?P<call>{name}\(.*\))\s*(?:==>|==|➞|=>|->|⇒)\s*(?P<value>.+?)\s*$")


def _literal(text: str) -> bool:
    try:
        ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return False
    return True


def _literal_call(source: str) -> bool:
    """Whether `source` is one call whose arguments are all Python literals."""
    try:
        node = ast.parse(source, mode="eval").body
    except SyntaxError:
        return False
    if not isinstance(node, ast.Call):
        return False
    return all(_literal(ast.unparse(a)) for a in [*node.args, *(k.value for k in node.keywords)])


def docstring_examples(prompt: str, entry_point: str) -> list[str]:
    """Assert statements made of the examples in a HumanEval prompt: doctest examples of a
    call whose printed result is a Python literal, then lines `f(...) ==> value` (and the
    ==, ➞, =>, -> spellings). Examples whose arguments or value are not literals are skipped,
    and so are `HUMANEVAL_WRONG_EXAMPLES`."""
    asserts: list[str] = []
    try:
        examples = doctest.DocTestParser().get_examples(prompt)
    except ValueError:
        examples = []
    for ex in examples:
        # The docstring's closing quotes often follow the last example's output directly.
        want_lines = [w for w in ex.want.splitlines() if not w.strip().startswith(('"""', "'''"))]
        source, want = ex.source.strip(), "\n".join(want_lines).strip()
        if want and _literal(want) and "\n" not in source and _literal_call(source):
            asserts.append(f"assert {source} == {want}")
    if not asserts:
        pattern = re.compile(_EXAMPLE.pattern.replace("{name}", re.escape(entry_point)))
        for line in prompt.splitlines():
            match = pattern.match(line)
            if match and _literal(match["value"]) and _literal_call(match["call"]):
                statement = f"assert {match['call']} == {match['value']}"
                try:
                    ast.parse(statement)
                except SyntaxError:
                    continue
                asserts.append(statement)
    return [a for a in dict.fromkeys(asserts) if a not in HUMANEVAL_WRONG_EXAMPLES]


def called_functions(test_code: str) -> list[str]:
    """Names called in `test_code` (in order, once each), for the functions the tests use."""
    try:
        tree = ast.parse(test_code)
    except SyntaxError:
        return []
    names = [n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
    return list(dict.fromkeys(names))


def load_humaneval(root: Path) -> list[Task]:
    """The 164 HumanEval problems as code tasks (module docstring)."""
    path = root / HUMANEVAL_FILE
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [humaneval_task(row, row["task_id"]) for row in (json.loads(line) for line in f if line.strip())]


def humaneval_task(row: dict, task_id: str) -> Task:
    """A HumanEval record (`prompt`, `test`, `entry_point`, `canonical_solution`) as a code task."""
    entry = row["entry_point"]
    return Task(
        task_id=task_id,
        prompt=HUMANEVAL_INSTRUCTION.format(prompt=row["prompt"]),
        answer={"tests": f"{row['test']}\n\ncheck({entry})\n"},
        meta={"source": "humaneval", "prelude": row["prompt"], "entry_points": [entry],
              "visible_tests": docstring_examples(row["prompt"], entry),
              "reference": row["prompt"] + (row.get("canonical_solution") or "")},
    )


def load_mbpp(root: Path, split: str) -> list[Task]:
    """The sanitized MBPP problems of `split` ("eval": task ids 11-510; "train": the others but
    the few-shot prompts 1-10) as code tasks (module docstring)."""
    if split not in ("eval", "train"):
        raise ValueError(f"MBPP split {split!r}: use 'eval' or 'train'")
    rows = json.loads((root / MBPP_FILE).read_text(encoding="utf-8"))
    tasks = []
    for row in rows:
        tid = int(row["task_id"])
        in_eval = tid in MBPP_EVAL_IDS
        if (split == "eval") != in_eval or (split == "train" and tid in MBPP_PROMPT_IDS):
            continue
        tasks.append(mbpp_task(row["prompt"], list(row["test_list"]), list(row.get("test_imports") or []),
                               row["code"], f"mbpp/{tid}"))
    return tasks


def mbpp_task(text: str, asserts: list[str], imports: list[str], reference: str, task_id: str) -> Task:
    """An MBPP problem (its text, its assert statements, the imports they need, the reference
    code) as a code task: the text and the first assert are shown, every assert is hidden."""
    tests = "\n".join(imports + asserts) + "\n"
    text = " ".join(str(text).split())
    return Task(
        task_id=task_id,
        prompt=MBPP_INSTRUCTION.format(text=text, test=asserts[0]),
        answer={"tests": tests},
        meta={"source": "mbpp", "prelude": "", "entry_points": called_functions("\n".join(asserts)),
              "visible_tests": asserts[:1], "reference": reference},
    )


# -- your own task files (data.train_files, data.eval_files) ------------------------------------

# The fields of a code record, per role (first present wins; data.fields names others): MBPP's
# (`text` or sanitized MBPP's `prompt`, `test_list`, `code`) and HumanEval's (`prompt`, `test`,
# `entry_point`, `canonical_solution`). A record with an entry point is read as HumanEval's.
FIELD_NAMES = {"question": ("text", "prompt", "question"), "tests": ("test_list", "test", "tests"),
               "entry_point": ("entry_point",), "reference": ("code", "canonical_solution", "reference"),
               "id": ("task_id", "id")}
FIELDS_EXAMPLE = "{question: description, tests: checks, reference: solution}"


def file_tasks(paths: list[Path], fields: dict[str, str]) -> list[Task]:
    """The code tasks of `data.train_files` / `data.eval_files` (`read_records`): a HumanEval-shaped
    record (with an entry point) as `humaneval_task`, any other as an MBPP problem (`mbpp_task`;
    its tests a list of assert statements, or test code whose assert lines are its asserts).
    Task id `<folder>/<file stem>-<id>` (the record's id, else its index). A record without a
    question or tests, with tests that are not Python, or an entry point that is not a name, is an
    error naming the file, the record, the field and the fix."""
    names = field_names(FIELD_NAMES, fields)
    tasks = []
    for path in paths:
        for i, record in enumerate(read_records(path)):
            where = f"{path}: record {i + 1}"
            key = next((record[n] for n in names["id"] if record.get(n) not in (None, "")), i)
            task_id = f"{path.parent.name}/{path.stem}-{key}"
            question = record_field(record, names["question"], where, FIELDS_EXAMPLE)
            tests = record_field(record, names["tests"], where, FIELDS_EXAMPLE)
            tests_field = next(n for n in names["tests"] if record.get(n) not in (None, ""))
            reference = next((record[n] for n in names["reference"] if record.get(n)), "")
            entry = next((record[n] for n in names["entry_point"] if record.get(n)), None)
            if entry is not None:
                if not str(entry).isidentifier():
                    raise ValueError(f"{where}: {names['entry_point'][0]} {entry!r} is not a function name. Fix: "
                                     "give the name of the function the tests check")
                _check_python(str(tests), where, tests_field)
                if not re.search(r"^def check\(", str(tests), re.MULTILINE):
                    raise ValueError(f"{where}: field {tests_field} defines no check(candidate), which "
                                     "HumanEval's tests call with the entry point. Fix: define it, or give the tests "
                                     "as a list of assert statements without an entry_point")
                row = {"prompt": str(question), "test": str(tests), "entry_point": str(entry),
                       "canonical_solution": str(reference)}
                task = humaneval_task(row, task_id)
            else:
                asserts = _asserts(tests, where, tests_field)
                imports = [str(x) for x in record.get("test_imports") or []]
                task = mbpp_task(str(question), asserts, imports, str(reference), task_id)
            task.meta["file"] = str(path)
            tasks.append(task)
    return tasks


def _check_python(code: str, where: str, name: str) -> None:
    try:
        ast.parse(code)
    except SyntaxError as exc:
        raise ValueError(f"{where}: field {name} is not Python ({exc.msg}, line {exc.lineno}). Fix: give the "
                         "test code as written, or name the right field in data.fields") from None


def _asserts(tests: object, where: str, name: str) -> list[str]:
    """An MBPP record's tests as assert statements: a list of them, or the assert lines of test code."""
    if isinstance(tests, str):
        _check_python(tests, where, name)
        asserts = [line.strip() for line in tests.splitlines() if line.strip().startswith("assert")]
    elif isinstance(tests, (list, tuple)) and all(isinstance(t, str) for t in tests):
        asserts = [t.strip() for t in tests]
        for n, statement in enumerate(asserts, 1):
            _check_python(statement, where, name)
            if not statement.startswith("assert"):
                raise ValueError(f"{where}: item {n} of field {name} is not an assert statement ({statement[:60]!r}). "
                                 "Fix: list assert statements only, as MBPP's test_list does, or give test code")
    else:
        raise ValueError(f"{where}: field {name} is a {type(tests).__name__}; expected a list of assert "
                         "statements or test code. Fix: give the tests as MBPP's test_list or HumanEval's test")
    if not asserts:
        raise ValueError(f"{where}: field {name} holds no assert statement, so no answer could fail. Fix: give "
                         "the tests as assert statements (MBPP's test_list), or HumanEval's test with an entry_point")
    return asserts
