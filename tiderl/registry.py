"""Every extension point of tiderl, by name: one table each, and how a name becomes an object.

A config names a built-in by its short name (a key of a table) or a user's own object by its
import path (`env.name: mypkg.myenv:MyEnv`), so extending tiderl never needs an edit inside it.
The tables hold import paths, not objects: this module imports no torch and nothing of tiderl
but `tiderl.options`, so the config loader can check names and build each component's options
without loading models, Ray or SQL. What each name must give: docs/architecture.md, "Extension
points"; docs/extending.md walks through each with a complete example.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from tiderl.options import Components, ConfigError

# Each built-in environment's registration (`tiderl.envs.registration.BuiltinEnvironment`: its
# setup, options, data sources and warm start), in its own package. The first is the default.
ENVIRONMENTS: dict[str, str] = {
    "kg": "tiderl.envs.kg.registration:ENVIRONMENT",
    "db": "tiderl.envs.db.registration:ENVIRONMENT",
    "math": "tiderl.envs.math.registration:ENVIRONMENT",
    "code": "tiderl.envs.code.registration:ENVIRONMENT",
    "repo": "tiderl.envs.repo.registration:ENVIRONMENT",
    "visual_grid": "tiderl.envs.visual.registration:GRID",
    "visual_table": "tiderl.envs.visual.registration:TABLE",
}

ENGINES: dict[str, str] = {
    "torch": "tiderl.rollout.torch_engine:TorchEngine",
    "http": "tiderl.rollout.http_engine:HttpEngine",
}
ENGINE_OPTIONS: dict[str, str] = {
    "torch": "tiderl.rollout.options:TorchEngineOptions",
    "http": "tiderl.rollout.options:HttpEngineOptions",
}

BACKENDS: dict[str, str] = {
    "local": "tiderl.system.local:LocalRollout",
    "ray": "tiderl.system.ray_backend:RayRollout",
    "agent": "tiderl.serve.agent:AgentRollout",
}
BACKEND_OPTIONS: dict[str, str] = {
    "ray": "tiderl.system.ray_options:RayOptions",
    "agent": "tiderl.serve.agent_options:AgentOptions",
}


def is_import_path(name: str) -> bool:
    """True for "module:attribute" strings (a user's own function or class)."""
    module, sep, attr = name.partition(":")
    parts = module.split(".") + attr.split(".")
    return bool(sep) and all(p.isidentifier() for p in parts)


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
    if name not in table and not is_import_path(name):
        raise ValueError(f"{what}: {name!r} is neither one of {', '.join(map(repr, table))} nor a 'module:attribute' "
                         "import path")
    return load_object(table.get(name, name), what)


def components(table: dict[str, str], options: dict[str, str], key: str, builds: str) -> Components:
    """The components `key` (`rollout.engine`) chooses among, for the options that follow it: a
    built-in's from `options` (without importing its code), a user's class's `Options` (which must
    have the classmethod `builds`, how tiderl constructs it). Former keys: each options dataclass's
    `former_keys`."""

    def options_of(name: str) -> type | None:
        if name in table:
            return load_object(options[name], f"{key} options") if name in options else None
        try:
            cls = resolve(table, name, key)
        except ValueError as exc:
            raise ConfigError(f"{exc}. Fix: use one of {', '.join(table)}, or your own 'module:Class' "
                              "(docs/extending.md).", key) from None
        except (ImportError, AttributeError) as exc:
            raise ConfigError(f"{key}: {exc}", key) from None
        if not callable(getattr(cls, builds, None)):
            raise ConfigError(f"{key}: {name} has no classmethod {builds}, which tiderl builds it with. Fix: "
                              f"add it (docs/extending.md).", key)
        declared = getattr(cls, "Options", None)
        if declared is not None and not (isinstance(declared, type) and dataclasses.is_dataclass(declared)):
            raise ConfigError(f"{key}: {name}'s Options is {declared!r}, not a dataclass. Fix: declare its options "
                              "as a @dataclass with tiderl.options.opt fields (docs/extending.md).", key)
        return declared

    def former_keys(name: str) -> dict[str, str]:
        return getattr(options_of(name), "former_keys", {})

    return Components(key.rpartition(".")[2], lambda: table, options_of, former_keys)


# `rollout.options` follows `rollout.engine`, `system.options` `system.backend` (tiderl.config).
ENGINE_COMPONENTS = components(ENGINES, ENGINE_OPTIONS, "rollout.engine", "from_config")
BACKEND_COMPONENTS = components(BACKENDS, BACKEND_OPTIONS, "system.backend", "from_run")
