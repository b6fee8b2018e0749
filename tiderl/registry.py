"""Every extension point of tiderl, by name: one table each, and how a name becomes an object.

A config names a built-in by its short name (a key of a table) or a user's own object by its
import path (`env.name: mypkg.myenv:MyEnv`), so extending tiderl never needs an edit inside
it. The tables hold import paths, not objects: this module imports neither torch nor any
tiderl module, so the config loader can check names without loading models, Ray or SQL.

| config key | table | what the name must give | contract |
| --- | --- | --- | --- |
| `env.name` | `ENVIRONMENTS` | `setup(cfg) -> Setup`, optionally `Options`, `sources`, `warm_start` | `tiderl.envs.registration` |
| `rollout.engine` | `ENGINES` | an `Engine` class | `tiderl.rollout.base.Engine` |
| `system.backend` | `BACKENDS` | a `RolloutBackend` class with `from_run(run, preparations)` | `tiderl.system.scheduler` |
| `algo.advantage`, `algo.policy_loss` | `tiderl.algos.registry` | pure functions | `docs/extending.md` |

docs/extending.md walks through each with a complete example.
"""

from __future__ import annotations

import importlib
from typing import Any

# Each built-in environment's registration (`tiderl.envs.registration.BuiltinEnvironment`: its
# setup, options, data sources and warm start), in its own package. The first is the default.
ENVIRONMENTS: dict[str, str] = {
    "kg": "tiderl.envs.kg.registration:ENVIRONMENT",
    "db": "tiderl.envs.db.registration:ENVIRONMENT",
    "math": "tiderl.envs.math.registration:ENVIRONMENT",
    "code": "tiderl.envs.code.registration:ENVIRONMENT",
    "repo": "tiderl.envs.repo.registration:ENVIRONMENT",
}

ENGINES: dict[str, str] = {
    "torch": "tiderl.rollout.torch_engine:TorchEngine",
    "http": "tiderl.rollout.http_engine:HttpEngine",
}

BACKENDS: dict[str, str] = {
    "local": "tiderl.system.local:LocalRollout",
    "ray": "tiderl.system.ray_backend:RayRollout",
}


def is_import_path(name: str) -> bool:
    """True for "module:attribute" strings (a user's own function or class)."""
    module, sep, attr = name.partition(":")
    parts = module.split(".") + attr.split(".")
    return bool(sep) and all(p.isidentifier() for p in parts)


def check_name(table: dict[str, str], name: str) -> str:
    """'' when `name` is in `table` or is an import path, else what is wrong with it."""
    if name in table or is_import_path(name):
        return ""
    return f"{name!r} is neither one of {', '.join(map(repr, table))} nor a 'module:attribute' import path"


def load_object(target: str, what: str = "object") -> Any:
    """The object an import path "module:attr.sub" names. The errors say which part is missing
    and how to fix it."""
    module_name, _, attr = target.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportError(f"{what} {target!r}: cannot import module {module_name!r} ({exc}). Fix: make it "
                          "importable (installed, or on PYTHONPATH) or correct the name.") from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise AttributeError(f"{what} {target!r}: module {module_name!r} has no {attr!r}. Fix: "
                                 "name a function or class that the module defines.")
        obj = getattr(obj, part)
    return obj


def resolve(table: dict[str, str], name: str, what: str) -> Any:
    """The object `name` stands for: a built-in from `table`, or a user's import path."""
    problem = check_name(table, name)
    if problem:
        raise ValueError(f"{what}: {problem}")
    return load_object(table.get(name, name), what)
