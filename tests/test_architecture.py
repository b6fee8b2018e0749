"""Architecture rules that the code must keep (docs/architecture.md): no import cycle anywhere in
tiderl/, nothing below the recipe imports it back, the recipe stays short, and every extension
point is a table entry rather than an if-chain."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "tiderl"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the tiderl modules it imports anywhere (top level, in functions, or for type
    checking): an import inside a function to dodge a cycle still counts as the cycle."""
    modules = {module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target.startswith("tiderl") and target != name:
                    edges.add(target)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle as a list of modules ([] when there is none)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return []


def test_the_import_graph_has_no_cycle():
    cycle = find_cycle(import_graph())
    assert not cycle, " -> ".join(cycle)


def test_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []


def test_nothing_imports_the_recipe_and_it_is_short():
    graph = import_graph()
    importers = sorted(m for m, edges in graph.items() if "tiderl.recipe" in edges and m != "tiderl.cli")
    assert importers == [], importers
    assert len((ROOT / "recipe.py").read_text().splitlines()) < 150


def test_the_recipe_shows_the_loop():
    """The loop is the recipe's own function, about 25 lines: next batch, trainer step, publish,
    then what follows a step; nothing else in tiderl runs optimizer steps in a loop of its own."""
    tree = ast.parse((ROOT / "recipe.py").read_text())
    [loop] = [n for n in tree.body if isinstance(n, ast.AsyncFunctionDef) and n.name == "loop"]
    assert loop.end_lineno - loop.lineno + 1 <= 30
    calls = [ast.unparse(n.func) for n in ast.walk(loop) if isinstance(n, ast.Call)]
    for call in ("pool.next_batch", "trainer.step", "pool.publish", "after_step"):
        assert call in calls, (call, calls)
    takers = sorted(str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py")
                    for n in ast.walk(ast.parse(p.read_text()))
                    if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "next_batch")
    assert takers == ["recipe.py"], takers


@pytest.mark.parametrize("layer, forbidden", [
    ("tiderl.algos", ("tiderl.train", "tiderl.system", "tiderl.run", "tiderl.recipe", "tiderl.rollout")),
    ("tiderl.envs", ("tiderl.train", "tiderl.system", "tiderl.run", "tiderl.recipe", "tiderl.rollout")),
    ("tiderl.rollout", ("tiderl.train", "tiderl.system", "tiderl.run", "tiderl.recipe", "tiderl.agent")),
    ("tiderl.system", ("tiderl.recipe",)),
    ("tiderl.train", ("tiderl.system", "tiderl.run", "tiderl.recipe")),
])
def test_layers_import_only_downwards(layer, forbidden):
    bad = sorted((m, e) for m, edges in import_graph().items() if m.startswith(layer)
                 for e in edges if e.startswith(forbidden))
    assert bad == [], bad


def test_algorithms_are_pure_functions_of_their_inputs():
    """tiderl/algos imports nothing of tiderl but itself, the wire format, the name tables, the
    options mechanism (its options dataclasses) and (for type annotations) the config: not the
    trainer, the system, the engines or the environments."""
    allowed = ("tiderl.algos", "tiderl.types", "tiderl.registry", "tiderl.options", "tiderl.config")
    bad = sorted((m, e) for m, edges in import_graph().items() if m.startswith("tiderl.algos")
                 for e in edges if not e.startswith(allowed))
    assert bad == [], bad


def test_no_module_branches_on_the_algorithm_name():
    """The trainer reads algorithm options, never `algo.name` (a preset's label)."""
    offenders = []
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute) and node.left.attr == "name":
                value = node.left.value
                if isinstance(value, ast.Attribute) and value.attr == "algo" or \
                        isinstance(value, ast.Name) and value.id in ("algo", "a"):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == [], offenders


def test_config_loading_imports_no_torch():
    import subprocess
    import sys

    code = "import sys; import tiderl.config as c; c.load_config('configs/kg_sao_tiny.yaml'); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT.parent, check=True)
    assert out.stdout.strip() == "False"


def _environment_names() -> set[str]:
    """Every built-in environment name and every data source a built-in registers."""
    from tiderl.envs.registration import builtin
    from tiderl.registry import ENVIRONMENTS

    return set(ENVIRONMENTS) | {source for name in ENVIRONMENTS for source in builtin(name).sources}


# OpenAI's error body has a field named "code", which is not the code environment.
NAME_NOT_AN_ENVIRONMENT = {("serve/server.py", "code"), ("serve/wire.py", "code")}


def environment_names_outside_envs(root: Path = ROOT) -> list[str]:
    """'file:line: text' for each string in tiderl/ outside tiderl/envs/ that is an environment
    name or a data source, or spells one as a setting (`env.name=kg`, `data.source: metaqa`,
    `--data metaqa`, `'kg'` inside a message); the registry's ENVIRONMENTS table is where the names
    belong."""
    import re

    names = _environment_names()
    alternatives = "|".join(sorted(map(re.escape, names), key=len, reverse=True))
    spelled = re.compile(rf"(?:env\.name|data\.source|--env|--data)\s*[=: ]\s*['\"`]?(?:{alternatives})\b"
                         rf"|'(?:{alternatives})'")
    found = []
    for path in sorted(root.rglob("*.py")):
        where = path.relative_to(root).as_posix()
        if where.startswith("envs/"):
            continue
        tree = ast.parse(path.read_text())
        table_keys = set()
        if where == "registry.py":  # the name table itself
            for node in ast.walk(tree):
                if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "ENVIRONMENTS":
                    table_keys = {id(key) for key in node.value.keys}
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Constant) and isinstance(node.value, str)) or id(node) in table_keys:
                continue
            text = node.value
            if (text in names and (where, text) not in NAME_NOT_AN_ENVIRONMENT) or spelled.search(text):
                found.append(f"{where}:{node.lineno}: {text[:80]!r}")
    return found


def test_environment_names_stay_in_the_environments():
    """No built-in environment name or data source outside tiderl/envs/ (the registry's name table
    aside): code that knows them branches on an environment, where the environment's registration
    (tiderl/envs/*/registration.py) should say what it needs."""
    assert environment_names_outside_envs() == []


def test_the_names_check_finds_names(tmp_path):
    (tmp_path / "envs").mkdir()
    (tmp_path / "envs" / "kg.py").write_text('SOURCE = "metaqa"\n')  # inside envs: fine
    (tmp_path / "run.py").write_text('if cfg.env.name == "kg":\n    HELP = "use env.name=db, or --data metaqa"\n'
                                     'OK = "the embedded default model"\n')
    assert [line.split(":")[:2] for line in environment_names_outside_envs(tmp_path)] == [["run.py", "1"], ["run.py", "2"]]


# -- the core's size ------------------------------------------------------------------------------

# Lines (as `wc -l` counts them) of each package of the core: "tiderl" is the top-level modules
# together, the others the subpackages outside tiderl/envs/ (the environments), tiderl/lab/
# (research tools) and tiderl/embedded/ (the embedded tiny models). Each budget is the package's
# size when it was last set: lower it when a package shrinks; a commit that raises one says why in
# its message (the history of every change is in `git log -p tests/test_architecture.py`).
PACKAGE_LINE_BUDGETS = {
    "tiderl": 2958,  # the CLI, config, run building, evaluation, the collective weight sync, trajectories
    "agent": 970,  # chat assembly (text and images), tool-call parsing, the episode loop
    "algos": 1521,  # estimators, losses, terms and their options: pure functions plus a table
    "metrics": 258,
    "models": 1259,  # loading (text models, VLMs and their processors), fetching, LoRA, vision inputs
    "rewards": 792,  # curiosity, rewards from models and judges, scoring off the event loop
    "rollout": 3429,  # the torch and HTTP engines, launched servers and their failover, weight syncs, LoRA on engines
    "serve": 1414,  # `tiderl serve`: the agent API, sessions with images, the engine server
    "system": 2878,  # the rollout pool, the local, Ray and agent backends, data-parallel ranks on Ray, cores
    "train": 1929,  # the step, forward passes, checkpoints, data parallelism, the image stage
}
# The whole core outside tiderl/envs/, tiderl/lab/ and tiderl/embedded/ (the sum of the budgets
# above). Issue 29's target is 14,000 lines with no feature or test lost; the honest cuts (dead code,
# test-only helpers moved to the tests, benchmark helpers to tiderl/lab, the embedded tiny models to
# tiderl/embedded, essays moved from docstrings to docs/) took it from 17,175 to 15,010, and the
# features of issues 30-35 since (launched servers and three weight syncs, LoRA on ranks and servers,
# images end to end, rewards from models, the stale policies, GPU placement) brought it to 17,375,
# and FSDP2 with a vision-language model to 17,405; the agent loop telling an environment that a turn
# was cut at its token limit (`Action.cut`) to 17,408.
# Lower this as the core shrinks, never by squeezing lines.
CORE_LINE_BUDGET = 17_408


def core_lines(root: Path = ROOT) -> dict[str, int]:
    """Lines per package of the core (see PACKAGE_LINE_BUDGETS)."""
    sizes: dict[str, int] = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).parts
        # Outside the core: the environments, the research tools, and the embedded tiny models (the
        # demo and CI kit behind model.path=tiny, not what a user deploys with a Hugging Face model),
        # which the core reaches only through EMBEDDED_SEAMS.
        if parts[0] in ("envs", "lab", "embedded"):
            continue
        package = "tiderl" if len(parts) == 1 else parts[0]
        sizes[package] = sizes.get(package, 0) + path.read_text().count("\n")
    return sizes


def _in_lab(module: str) -> bool:
    return module == "tiderl.lab" or module.startswith("tiderl.lab.")


def test_nothing_in_the_core_imports_the_lab():
    """tiderl/lab/ holds research tools (the simulator, the collapse rule, run statistics, the
    launchers of tests and benchmarks); only `tiderl simulate` reaches into it, from cli.py."""
    bad = sorted((m, e) for m, edges in import_graph().items() if not _in_lab(m) for e in edges
                 if _in_lab(e) and (m, e) != ("tiderl.cli", "tiderl.lab.simulate_cli"))
    assert bad == [], bad


# The only imports of tiderl/embedded/ from the core: the tiny model's options in the config, the
# cached build when model.path=tiny (a run, `tiderl serve`), and a tokenizer trained as the tiny
# model's for `tiderl eval --oracle` without a model.
EMBEDDED_SEAMS = {
    ("tiderl.config", "tiderl.embedded.options"),
    ("tiderl.run", "tiderl.embedded.build"),
    ("tiderl.serve.server", "tiderl.embedded.build"),
    ("tiderl.cli", "tiderl.embedded.tiny_vlm"),
}


def _outside_the_core(module: str) -> bool:
    return any(module == f"tiderl.{p}" or module.startswith(f"tiderl.{p}.") for p in ("envs", "lab", "embedded"))


def test_the_core_reaches_the_embedded_models_only_at_their_seams():
    found = {(m, e) for m, edges in import_graph().items() if not _outside_the_core(m) for e in edges
             if e.startswith("tiderl.embedded")}
    assert sorted(found - EMBEDDED_SEAMS) == [], "an import of tiderl.embedded outside EMBEDDED_SEAMS"
    assert found == EMBEDDED_SEAMS, f"seams that import it no more: {sorted(EMBEDDED_SEAMS - found)}"


@pytest.mark.parametrize("package", sorted(PACKAGE_LINE_BUDGETS))
def test_each_package_of_the_core_keeps_its_line_budget(package):
    lines = core_lines().get(package, 0)
    assert lines <= PACKAGE_LINE_BUDGETS[package], f"{package}: {lines} lines, budget {PACKAGE_LINE_BUDGETS[package]}"


def test_the_core_keeps_its_line_budget():
    sizes = core_lines()
    assert set(sizes) <= set(PACKAGE_LINE_BUDGETS), f"a new package of the core needs a budget: {sorted(sizes)}"
    assert sum(sizes.values()) <= CORE_LINE_BUDGET, f"{sum(sizes.values())} lines, budget {CORE_LINE_BUDGET}: {sizes}"
