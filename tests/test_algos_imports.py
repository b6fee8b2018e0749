"""tiderl.algos is pure functions: at import time it reaches nothing of the trainer, the system
or the config loader (checked on the source, so no import order can hide a violation)."""

from __future__ import annotations

import ast
from pathlib import Path

import tiderl.algos

ALGOS = Path(tiderl.algos.__file__).parent


def _import_time_imports(tree: ast.Module) -> list[str]:
    """Modules imported when the file is imported: everything but function bodies and
    `if TYPE_CHECKING:` blocks."""
    found: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append(node.module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def test_algos_imports_only_itself_and_types_from_tiderl() -> None:
    files = sorted(ALGOS.glob("*.py"))
    assert {"advantages.py", "losses.py", "registry.py"} <= {f.name for f in files}
    for path in files:
        for module in _import_time_imports(ast.parse(path.read_text())):
            if module == "tiderl" or module.startswith("tiderl."):
                assert module.startswith("tiderl.algos") or module == "tiderl.types", (
                    f"{path.name} imports {module} at import time")


def test_the_check_sees_what_it_must() -> None:
    tree = ast.parse("import tiderl.train.step\nfrom tiderl.config import X\n"
                     "if TYPE_CHECKING:\n    from tiderl.system import Y\n"
                     "def f():\n    from tiderl.loop import Z\n")
    assert _import_time_imports(tree) == ["tiderl.train.step", "tiderl.config"]
