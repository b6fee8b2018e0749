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
    tasks = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            entry = row["entry_point"]
            tests = f"{row['test']}\n\ncheck({entry})\n"
            tasks.append(Task(
                task_id=row["task_id"],
                prompt=HUMANEVAL_INSTRUCTION.format(prompt=row["prompt"]),
                answer={"tests": tests},
                meta={"source": "humaneval", "prelude": row["prompt"], "entry_points": [entry],
                      "visible_tests": docstring_examples(row["prompt"], entry),
                      "reference": row["prompt"] + row["canonical_solution"]},
            ))
    return tasks


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
        asserts = list(row["test_list"])
        tests = "\n".join(list(row.get("test_imports") or []) + asserts) + "\n"
        text = " ".join(str(row["prompt"]).split())
        tasks.append(Task(
            task_id=f"mbpp/{tid}",
            prompt=MBPP_INSTRUCTION.format(text=text, test=asserts[0]),
            answer={"tests": tests},
            meta={"source": "mbpp", "prelude": "", "entry_points": called_functions("\n".join(asserts)),
                  "visible_tests": asserts[:1], "reference": row["code"]},
        ))
    return tasks
