"""The programs the code and repository environments run in the sandbox.

`visible_files` runs the agent's code against assert statements it may see, one by one, and
prints a line per test. `scoring_files` runs the hidden tests: it is the reward, so it is
hardened against the known ways a solution can pass tests without solving the task:

- the tests file is read and deleted before the solution runs (the solution cannot read it
  from disk);
- leaving early is a failure: SystemExit and every other exception from the solution or the
  tests fail the run, and `os._exit`, `os.kill`, `os.abort`, `os.exec*`, `os.fork`,
  `os.system`, `os.posix_spawn*` (and their `posix` twins) are replaced by functions that raise;
  an audit hook refuses to start processes, to load ctypes libraries and to walk the garbage
  collector's objects;
- the functions the tests call must return plain data: values of built-in and C types (whose
  methods cannot be replaced: numbers, text, None, `re.Match`, ...), lists, tuples, sets and
  dicts of plain data, or the standard library's Counter, OrderedDict, defaultdict, deque,
  Decimal and Fraction with their comparison untouched; so an object of the solution's own
  class that equals everything does not pass;
- the run passes only when the process exits 0 and prints `PASS_MARKER` as its last line.

What it does not stop: a solution that inspects its caller's frames (`sys._getframe`, kept
because `typing` and `collections.namedtuple` need it) can read the tests from memory.
"""

from __future__ import annotations

import json

PASS_MARKER = "__tiderl_hidden_tests_passed__"

# Installed before any untrusted code runs in a scoring process: early exits and process
# tricks raise instead (module docstring). Defines `exit_now`, `write`, `flush` for the scorer.
_GUARDS = r'''
import builtins, collections, decimal, fractions, os, posix, sys, types

write, flush = sys.__stdout__.write, sys.__stdout__.flush
exit_now = os._exit


def _refuse(*args, **kwargs):
    raise PermissionError("not allowed while the hidden tests run")


for _module in (os, posix):
    for _name in ("_exit", "kill", "killpg", "abort", "fork", "forkpty", "system", "posix_spawn", "posix_spawnp",
                  "execv", "execve", "execl", "execle", "execlp", "execlpe", "execvp", "execvpe", "spawnv", "spawnve"):
        if hasattr(_module, _name):
            setattr(_module, _name, _refuse)
_BLOCKED = {"subprocess.Popen", "os.exec", "os.posix_spawn", "os.spawn", "os.system", "os.fork", "os.forkpty",
            "ctypes.dlopen", "ctypes.dlsym", "gc.get_objects", "gc.get_referrers", "gc.get_referents"}


def _audit(event, args):
    if event in _BLOCKED:
        raise PermissionError(f"{event} is not allowed while the hidden tests run")


def fail(exc):
    sys.__stderr__.write(f"hidden tests failed: {type(exc).__name__}: {str(exc)[:500]}\n")
    sys.__stderr__.flush()
    exit_now(1)


def succeed():
    write("\n" + PASS_MARKER + "\n")
    flush()
    exit_now(0)
'''

_SCORER = r'''

def main():
    with open("tests.py", encoding="utf-8") as f:
        tests = f.read()
    with open("solution.py", encoding="utf-8") as f:
        solution = f.read()
    entry_points = json.loads(ENTRY_POINTS)
    os.remove("tests.py")
    os.remove("solution.py")
    sys.addaudithook(_audit)
    immutable = 1 << 8  # Py_TPFLAGS_IMMUTABLETYPE: built-in and C types, whose methods cannot be replaced
    containers = {list, tuple, set, frozenset, dict, collections.deque}
    stdlib = {collections.Counter: collections.Counter.__eq__, collections.OrderedDict: collections.OrderedDict.__eq__,
              collections.defaultdict: collections.defaultdict.__eq__, collections.deque: collections.deque.__eq__,
              decimal.Decimal: decimal.Decimal.__eq__, fractions.Fraction: fractions.Fraction.__eq__}

    def plain(value, depth=0):
        kind = type(value)
        if depth > 100 or (kind in stdlib and kind.__eq__ is not stdlib[kind]):
            return False
        if kind in containers or kind in stdlib and issubclass(kind, dict):
            items = value.items() if isinstance(value, dict) else ((v, None) for v in value)
            return all(plain(k, depth + 1) and plain(v, depth + 1) for k, v in items)
        return kind in stdlib or bool(kind.__flags__ & immutable)

    def checked(fn, name):
        def call(*args, **kwargs):
            result = fn(*args, **kwargs)
            if not plain(result):
                raise TypeError(f"{name} returned a {type(result).__name__}, not plain data")
            return result
        return call

    space = {"__name__": "solution", "__builtins__": builtins}
    try:
        exec(compile(solution, "solution.py", "exec"), space)
        for name in entry_points:
            if isinstance(space.get(name), types.FunctionType):
                space[name] = checked(space[name], name)
        exec(compile(tests, "tests.py", "exec"), space)
    except BaseException as exc:  # noqa: BLE001 - any way out but the end is a failure
        fail(exc)
    succeed()


main()
'''

# Runs test modules (every `test*` function a module defines, called without arguments) of a
# repository.
# Visible runs read the test files from disk and report each test; hidden runs read them,
# delete them and run them under the guards, passing only when every test passes.
_REPO_RUNNER = r'''
import importlib.util, traceback

sys.path.insert(0, os.getcwd())
config = json.loads(CONFIG)
sources = {}
for path in config["tests"]:
    with open(path, encoding="utf-8") as f:
        sources[path] = f.read()
if config["hidden"]:
    for path in config["tests"]:
        os.remove(path)
    sys.addaudithook(_audit)
failed = total = 0
try:
    for path, source in sources.items():
        name = "tiderl_tests_" + path.replace("/", "_").removesuffix(".py")
        module = types.ModuleType(name)
        module.__file__ = path
        sys.modules[name] = module
        try:
            exec(compile(source, path, "exec"), module.__dict__)
        except Exception as exc:
            failed += 1
            total += 1
            print(f"{path}: ERROR while importing: {type(exc).__name__}: {exc}")
            print("".join(traceback.format_exception(exc)[-3:]).rstrip())
            continue
        for test_name, test in list(vars(module).items()):
            # Only the module's own test functions: an imported `test_duplicate` is no test.
            if not (test_name.startswith("test") and callable(test) and getattr(test, "__module__", None) == name):
                continue
            total += 1
            try:
                test()
                print(f"{path}::{test_name} PASSED")
            except Exception as exc:
                failed += 1
                print(f"{path}::{test_name} FAILED: {type(exc).__name__}: {str(exc)[:300]}")
                print("".join(traceback.format_exception(exc)[-3:]).rstrip())
except BaseException as exc:  # noqa: BLE001 - leaving early is a failure
    if config["hidden"]:
        fail(exc)
    raise
print(f"{total - failed} of {total} tests passed")
if config["hidden"]:
    if failed or not total:
        fail(AssertionError(f"{failed} of {total} hidden tests failed"))
    succeed()
sys.exit(1 if failed or not total else 0)
'''

_VISIBLE = r'''
import sys, traceback

TESTS = json.loads(TESTS_JSON)
space = {"__name__": "solution"}
try:
    with open("solution.py", encoding="utf-8") as f:
        exec(compile(f.read(), "solution.py", "exec"), space)
except BaseException as exc:
    print(f"Your code failed to run: {type(exc).__name__}: {exc}")
    sys.exit(1)
failed = 0
for number, test in enumerate(TESTS, 1):
    try:
        exec(compile(test, f"test_{number}", "exec"), space)
        print(f"test {number}: passed")
    except AssertionError:
        failed += 1
        print(f"test {number}: FAILED: {test}")
    except BaseException as exc:
        failed += 1
        print(f"test {number}: ERROR: {test} raised {type(exc).__name__}: {str(exc)[:300]}")
print(f"{len(TESTS) - failed} of {len(TESTS)} tests passed")
sys.exit(1 if failed else 0)
'''


def solution_source(prelude: str, code: str) -> str:
    """The solution module: the task's prelude (HumanEval's signature and helpers), then the
    agent's code (which may redefine them)."""
    return f"{prelude}\n\n{code}\n" if prelude else f"{code}\n"


def scoring_files(prelude: str, code: str, tests: str, entry_points: list[str]) -> dict[str, str]:
    """The files of a hidden-test run (module docstring); run `main.py`, passed when
    `passed(result)`."""
    main = ("import json\nENTRY_POINTS = " + repr(json.dumps(entry_points)) + "\nPASS_MARKER = " + repr(PASS_MARKER)
            + _GUARDS + _SCORER)
    return {"main.py": main, "solution.py": solution_source(prelude, code), "tests.py": tests}


def visible_files(prelude: str, code: str, tests: list[str]) -> dict[str, str]:
    """The files of a visible-test run: one output line per test, then a summary."""
    main = "import json\nTESTS_JSON = " + repr(json.dumps(tests)) + _VISIBLE
    return {"main.py": main, "solution.py": solution_source(prelude, code)}


def repo_test_files(files: dict[str, str], tests: list[str], hidden: bool) -> dict[str, str]:
    """The files of a repository test run: the repository (`files`, test files included) and a
    runner `_tiderl_run_tests.py` that runs `tests` (paths); hidden runs are scored like
    `scoring_files` (pass marker last, guards on)."""
    config = json.dumps({"tests": tests, "hidden": hidden})
    main = "import json\nCONFIG = " + repr(config) + "\nPASS_MARKER = " + repr(PASS_MARKER) + _GUARDS + _REPO_RUNNER
    return {**files, RUNNER: main}


RUNNER = "_tiderl_run_tests.py"


def passed(status_ok: bool, stdout: str) -> bool:
    """Whether a scoring run passed: exit 0 and the marker as the last line of its output."""
    lines = stdout.rstrip("\n").splitlines()
    return status_ok and bool(lines) and lines[-1] == PASS_MARKER
