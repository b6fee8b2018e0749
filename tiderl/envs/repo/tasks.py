"""Repository-editing tasks: generated from HumanEval/MBPP, or read from task folders.

A repo task (`Task`):
    prompt: the instruction (the bug report);
    answer: {"hidden_tests": {path: source}}: test files written into the repository only to
        score it;
    meta: "files" ({path: source}: the repository the agent sees, its visible tests included),
        "visible_tests" (the visible test paths), "fix" (the oracle's edits: [{"path", "old",
        "new"}], applied in order with the edit tool), "source".

Generated tasks (`generate_tasks`): the reference solution of a HumanEval/MBPP problem becomes
`lib/core.py` of a small package (README.md, lib/__init__.py, lib/core.py,
tests/test_visible.py) with one injected bug: a flipped comparison (< and <=, > and >=, ==
and !=), a swapped + and -, an off-by-one integer constant, `and`/`or`, `True`/`False` or
`min`/`max`. Candidates are tried in a fixed-seed order per task, and the first is kept that
compiles, changes a line that is unique in the file (so the reverse edit is well defined), makes
the visible test fail and the hidden test fail, while the reference passes both (all checked
in the sandbox). The visible test holds the problem's visible examples; the hidden test is the
problem's full test. Problems without visible examples or where no candidate qualifies are left out
(docs/env_code.md gives the counts).

Task folders (`load_task_folders`), one folder per task (its name is the task id):
    task.md            the instruction (optional; a generic one otherwise)
    repo/              the repository the agent sees and edits; its tests/test_*.py are the
                       visible (failing) tests
    hidden_tests/      test_*.py files written into repo/tests/ only for scoring
    solution/          optional: fixed versions of files, at their repo/ paths (the oracle
                       replaces each file's content with the edit tool)
Test files are Python modules whose `test*` functions are called without arguments (plain
asserts; no fixtures, pytest is not needed).
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import random
import tokenize
from pathlib import Path

from tiderl.envs.code import harness
from tiderl.envs.code.sandbox import Sandbox
from tiderl.envs.protocol import Task

GENERATOR_VERSION = 2
PACKAGE = "lib"
MAX_CANDIDATES = 25

_OP_SWAPS = {"<": "<=", "<=": "<", ">": ">=", ">=": ">", "==": "!=", "!=": "==", "+": "-", "-": "+"}
_NAME_SWAPS = {"and": "or", "or": "and", "True": "False", "False": "True", "min": "max", "max": "min"}

INSTRUCTION = (
    "This repository's tests fail: {tests} does not pass. Find the bug in the package and fix it "
    "with edit_file, check with run_tests, then call submit. The package's purpose:\n{purpose}"
)
FOLDER_INSTRUCTION = ("This repository's tests fail. Find the bug and fix it with edit_file, check with "
                      "run_tests, then call submit.")


def mutations(source: str, seed: str) -> list[tuple[str, str, str]]:
    """Candidate bugs of `source` as (mutated source, mutated line, original line), in a
    fixed-seed order. Only tokens outside strings and comments change."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, SyntaxError, IndentationError):
        return []
    lines = source.splitlines(keepends=True)
    found = []
    for tok in tokens:
        new = None
        if tok.type == tokenize.OP and tok.string in _OP_SWAPS:
            new = _OP_SWAPS[tok.string]
        elif tok.type == tokenize.NAME and tok.string in _NAME_SWAPS:
            new = _NAME_SWAPS[tok.string]
        elif tok.type == tokenize.NUMBER and tok.string.isdigit() and int(tok.string) < 100:
            new = str(int(tok.string) + 1)
        if new is None or tok.start[0] != tok.end[0]:
            continue
        row, col = tok.start[0] - 1, tok.start[1]
        line = lines[row]
        changed = line[:col] + new + line[tok.end[1]:]
        mutated = "".join(lines[:row] + [changed] + lines[row + 1:])
        found.append((mutated, changed.rstrip("\n"), line.rstrip("\n")))
    random.Random(seed).shuffle(found)
    return found


def _package_files(core: str, purpose: str, visible: str) -> dict[str, str]:
    return {
        "README.md": f"# {PACKAGE}\n\n{purpose}\n\nRun the tests with the run_tests tool.\n",
        f"{PACKAGE}/__init__.py": f'"""{PACKAGE}: one function and its helpers."""\n\nfrom {PACKAGE}.core import *  # noqa: F401,F403\n',
        f"{PACKAGE}/core.py": core,
        "tests/test_visible.py": visible,
    }


# The head of a generated test module: every name of lib.core (underscored ones too, which
# `import *` would skip), then the problem's own test imports.
_IMPORT_CORE = (f"from {PACKAGE} import core as _core\n\n"
                "globals().update({k: v for k, v in vars(_core).items() if not k.startswith('__')})\n")


def _test_module(body: str, name: str, imports: str = "") -> str:
    indented = "\n".join("    " + line if line.strip() else "" for line in body.strip("\n").splitlines())
    return f"{_IMPORT_CORE}{imports}\n\ndef {name}():\n{indented}\n"


def repo_layout(code_task: Task) -> tuple[str, str, str, str] | None:
    """(reference core.py, purpose text, visible test module, hidden test module) of a code
    task (`tiderl.envs.code.data`), or None when it has no visible examples."""
    meta = code_task.meta
    visible = list(meta.get("visible_tests", []))
    if not visible:
        return None
    reference = meta["reference"]
    tests = code_task.answer["tests"]
    if meta["source"] == "humaneval":
        entry = meta["entry_points"][0]
        purpose = f"`{PACKAGE}.core.{entry}`, as its docstring describes."
        hidden_body = f"check({entry})"
        helpers = tests.replace("check(" + entry + ")", "").rstrip()
        hidden = f"{_IMPORT_CORE}{helpers}\n\n\ndef test_hidden():\n    {hidden_body}\n"
        imports = ""
    else:
        purpose = " ".join(code_task.prompt.split("\n")[0].split())
        hidden = _test_module(tests, "test_hidden")
        imports = "\n".join(line for line in tests.splitlines() if line.startswith(("import ", "from ")))
    return reference, purpose, _test_module("\n".join(visible), "test_examples", imports), hidden


async def _check(sandbox: Sandbox, files: dict[str, str], hidden: dict[str, str],
                 mutant: bool = False) -> tuple[bool, bool]:
    """(visible tests pass, hidden tests pass) of a repository; for a `mutant` whose visible
    tests pass the hidden ones are not run (it does not qualify either way): (True, True)."""
    visible = await sandbox.run(harness.repo_test_files(files, ["tests/test_visible.py"], False),
                                [sandbox.python, "-E", "-s", "-B", harness.RUNNER])
    if mutant and visible.ok:
        return True, True
    scored = await sandbox.run(harness.repo_test_files({**files, **hidden}, list(hidden), True),
                               [sandbox.python, "-E", "-s", "-B", harness.RUNNER])
    return visible.ok, harness.passed(scored.ok, scored.stdout)


async def make_repo_task(sandbox: Sandbox, code_task: Task) -> Task | None:
    """A repo task from a code task (module docstring), or None when none qualifies."""
    layout = repo_layout(code_task)
    if layout is None:
        return None
    reference, purpose, visible, hidden_module = layout
    hidden = {"tests/test_hidden.py": hidden_module}
    if await _check(sandbox, _package_files(reference, purpose, visible), hidden) != (True, True):
        return None
    for mutated, bad_line, good_line in mutations(reference, code_task.task_id)[:MAX_CANDIDATES]:
        if mutated.count(bad_line) != 1 or not bad_line.strip():
            continue
        try:
            compile(mutated, "core.py", "exec")
        except (SyntaxError, ValueError):
            continue
        files = _package_files(mutated, purpose, visible)
        if await _check(sandbox, files, hidden, mutant=True) == (False, False):
            return Task(
                task_id=f"repo/{code_task.task_id}",
                prompt=INSTRUCTION.format(tests="tests/test_visible.py", purpose=purpose),
                answer={"hidden_tests": hidden},
                meta={"files": files, "visible_tests": ["tests/test_visible.py"], "source": code_task.meta["source"],
                      "fix": [{"path": f"{PACKAGE}/core.py", "old": bad_line, "new": good_line}]},
            )
    return None


async def generate_tasks(sandbox: Sandbox, code_tasks: list[Task]) -> list[Task]:
    """Repo tasks from code tasks, concurrently; problems without a qualifying bug are left out."""
    made = await asyncio.gather(*(make_repo_task(sandbox, t) for t in code_tasks))
    return [t for t in made if t is not None]


def _cache_key(code_tasks: list[Task]) -> str:
    digest = hashlib.sha256(str(GENERATOR_VERSION).encode())
    for t in code_tasks:
        digest.update(json.dumps([t.task_id, t.meta.get("reference"), t.meta.get("visible_tests"), t.answer],
                                 sort_keys=True).encode())
    return digest.hexdigest()[:16]


def cached_tasks(sandbox: Sandbox, code_tasks: list[Task], cache_dir: Path) -> list[Task]:
    """`generate_tasks`, cached in `cache_dir` under a hash of the code tasks and the generator
    version (generation runs several sandboxed executions per problem)."""
    path = cache_dir / f"repo-tasks-{_cache_key(code_tasks)}.json"
    if path.is_file():
        rows = json.loads(path.read_text())
        return [Task(r["task_id"], r["prompt"], r["answer"], r["meta"]) for r in rows]
    from tiderl.envs.code.sandbox import run_sync

    tasks = run_sync(generate_tasks(sandbox, code_tasks))
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps([{"task_id": t.task_id, "prompt": t.prompt, "answer": t.answer, "meta": t.meta}
                               for t in tasks]))
    tmp.replace(path)
    return tasks


def _read_tree(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): p.read_text(encoding="utf-8")
            for p in sorted(folder.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}


def load_task_folder(folder: Path) -> Task:
    """One task folder (module docstring) as a repo task; ValueError names what is missing."""
    repo, hidden_dir = folder / "repo", folder / "hidden_tests"
    if not repo.is_dir() or not hidden_dir.is_dir():
        raise ValueError(f"task folder {folder}: needs repo/ and hidden_tests/ (docs/env_code.md, task folders)")
    files = _read_tree(repo)
    visible = sorted(p for p in files if p.startswith("tests/") and Path(p).name.startswith("test_") and p.endswith(".py"))
    hidden = {f"tests/hidden_{name}": text for name, text in _read_tree(hidden_dir).items()
              if name.endswith(".py") and "/" not in name}
    if not hidden:
        raise ValueError(f"task folder {folder}: hidden_tests/ holds no test_*.py file")
    fix = []
    if (folder / "solution").is_dir():
        for path, text in _read_tree(folder / "solution").items():
            if path not in files:
                raise ValueError(f"task folder {folder}: solution/{path} is not a file of repo/")
            if text != files[path]:
                fix.append({"path": path, "old": files[path], "new": text})
    instruction = (folder / "task.md").read_text(encoding="utf-8").strip() if (folder / "task.md").is_file() else FOLDER_INSTRUCTION
    return Task(task_id=f"repo/{folder.name}", prompt=instruction, answer={"hidden_tests": hidden},
                meta={"files": files, "visible_tests": visible, "fix": fix, "source": "folder"})


def load_task_folders(root: Path) -> list[Task]:
    """Every task folder directly under `root` (sorted by name)."""
    if not root.is_dir():
        raise FileNotFoundError(f"env.options.task_dir={str(root)!r} is not a folder. Fix: point it at a folder of task "
                                "folders (docs/env_code.md).")
    return [load_task_folder(p) for p in sorted(root.iterdir()) if p.is_dir()]
