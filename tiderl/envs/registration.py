"""What `env.name` names: an environment as the config, the command line and the embedded model
see it, before any of its code runs.

An environment is one object (a class or a module-level object) with:

- `setup(cfg) -> Setup` (required; `tiderl.envs.setup`): its tasks and a factory of episodes;
- `Options` (optional): a dataclass of its options, declared with `tiderl.options.opt`; the
  config holds them as `cfg.env.options` (YAML and overrides: `env.options.<field>`), validated
  by the dataclass, listed by `tiderl config`. It may define `check(self, cfg)`, raising with
  `tiderl.options.need` for values its types cannot rule out;
- `sources` (optional): the `data.source` values it reads, the first being the default (a
  run that names the environment and no source reads the first);
- `warm_start` (optional): a `WarmStart`, how the embedded tiny model (`model.path=tiny`) is
  warm-started on it;
- `eval_flags` (optional): `EvalFlag`s, shortcuts of `tiderl eval` for its options;
- `task_files` (optional, default true for a user's): whether it reads `data.train_files`,
  `data.eval_files` and `data.fields` (a built-in that does not has them refused);
  `task_fields` (optional): the roles `data.fields` may map (a user's: any).

A built-in is a `BuiltinEnvironment` in its own package's `registration.py`, named by
`tiderl.registry.ENVIRONMENTS`: torch-free and quick to import, so loading a config imports
neither torch nor the environment's own modules; `setup` and `warm_start` are import paths,
loaded on first use.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tiderl.options import Components, ConfigError, need
from tiderl.registry import ENVIRONMENTS, load_object, resolve


@dataclass(frozen=True)
class WarmStart:
    """How the embedded tiny model is warm-started on an environment (`tiderl/embedded/build.py`).

    demonstrations(setup, cfg, rng) -> (tasks, scripts, report entries): training tasks and the
        assistant turns that (imperfectly, on purpose) solve them, drawn with `rng`; the
        tokenizer is trained on the texts of their episodes. Raises ValueError naming the fix
        when this configuration of the environment has no tiny model (say, a data source with
        no training tasks).
    copy_check(setup, cfg) -> (tasks, scripts, copied(task, text) -> bool): the optional
        stopping rule of `model.warmstart.copy_check_threshold` (the tasks carry meta["kind"]).
    key_modules: modules whose source text is part of the cached model's key (for task
        generators that still change: a changed one must not reuse a model built on the old).
    unkeyed_options: the environment's options that cannot change the built model (every other
        option is part of its key), so runs that differ only in them share one cached model.
    """

    demonstrations: Callable[..., tuple[list[Any], list[list[str]], dict[str, Any]]]
    copy_check: Callable[..., tuple[list[Any], list[list[str]], Callable[[Any, str], bool]]] | None = None
    key_modules: tuple[str, ...] = ()
    unkeyed_options: tuple[str, ...] = ()


@dataclass(frozen=True)
class EvalFlag:
    """A `tiderl eval` shortcut for an environment's settings: `flag VALUE` stands for
    `overrides`, each with `{}` replaced by VALUE (dotted overrides on the command line win)."""

    flag: str
    overrides: tuple[str, ...]
    help: str


@dataclass(frozen=True)
class BuiltinEnvironment:
    """A built-in environment (module docstring): its setup and warm start as import paths.

    former_keys: run-level keys that became its options, old dotted key -> option name, so a
    config that still sets one is told where it went (`tiderl.options.reject_former_keys`).
    """

    setup_path: str
    Options: type | None = None
    sources: tuple[str, ...] = ()
    warm_start_path: str = ""
    eval_flags: tuple[EvalFlag, ...] = ()
    former_keys: dict[str, str] = dataclasses.field(default_factory=dict)
    task_files: bool = False
    task_fields: tuple[str, ...] = ("question", "answer", "id")

    def setup(self, cfg: Any) -> Any:
        """The environment's `Setup` for `cfg` (imports the environment's code)."""
        return load_object(self.setup_path, "env.name setup")(cfg)

    @property
    def warm_start(self) -> WarmStart | None:
        """Its warm start (imports the module that holds it), None when it has none."""
        return load_object(self.warm_start_path, "warm start") if self.warm_start_path else None


def environment(name: str) -> Any:
    """The environment `env.name` names: a built-in's registration or a user's object."""
    try:
        return resolve(ENVIRONMENTS, name, "env.name")
    except ValueError as exc:
        raise ConfigError(f"{exc}. Fix: use one of {', '.join(ENVIRONMENTS)}, or your own 'module:Object' "
                          "(docs/extending.md).", "env.name") from None
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"env.name: {exc}", "env.name") from None


def options_class(name: str) -> type | None:
    """The options dataclass of environment `name` (None when it declares none)."""
    options = getattr(environment(name), "Options", None)
    if options is not None and not (isinstance(options, type) and dataclasses.is_dataclass(options)):
        raise ConfigError(f"env.name: {name}'s Options is {options!r}, not a dataclass. Fix: declare its options "
                          "as a @dataclass with tiderl.options.opt fields (docs/extending.md).", "env.name")
    return options


def sources(name: str) -> tuple[str, ...]:
    """The data sources environment `name` reads, the default first (() = it reads any)."""
    return tuple(getattr(environment(name), "sources", None) or ())


def reads_task_files(name: str) -> bool:
    """Whether environment `name` reads `data.train_files` / `data.eval_files` (module docstring)."""
    return bool(getattr(environment(name), "task_files", True))


def task_fields(name: str) -> tuple[str, ...] | None:
    """The roles `data.fields` may map for environment `name` (None = any)."""
    return getattr(environment(name), "task_fields", None)


def builtin(name: str) -> BuiltinEnvironment:
    """The registration of built-in environment `name`."""
    return load_object(ENVIRONMENTS[name], "env.name")


# `env.options` follows `env.name` (tiderl.config.EnvConfig).
ENVIRONMENT_OPTIONS = Components(chooser="name", names=lambda: ENVIRONMENTS, options_of=options_class,
                                 former_keys=lambda name: builtin(name).former_keys)


def check_drift(drift: Any, cfg: Any, what: str) -> None:
    """The rules every environment's `drift` options share (`every_steps`, `fraction`, and any
    further field, which matters only with drift on): each field named in errors as
    `drift.<field>`; `what` says what drifts, for the backend rule."""
    need(drift.every_steps >= 0, "drift.every_steps", "must be >= 0", "use 0 (off) or e.g. 20")
    need(0 < drift.fraction <= 1, "drift.fraction", f"{drift.fraction} is outside (0, 1]", "use e.g. 0.2")
    need(drift.every_steps == 0 or cfg.system.backend in ("local", "ray"), "drift.every_steps",
         f"{what} moves with the weight version in the training process (system.backend=local) or in each Ray "
         f"rollout worker (ray), and system.backend={cfg.system.backend}'s external agent plays in a world of its own",
         "use system.backend=local or ray, or env.options.drift.every_steps=0")
    off = type(drift)()
    for field in dataclasses.fields(drift):
        key = field.name
        need(key == "every_steps" or drift.every_steps > 0 or getattr(drift, key) == getattr(off, key),
             f"drift.{key}", f"set to {getattr(drift, key)!r}, but drift.every_steps=0 turns drift off, so it would "
             "be ignored", f"remove env.options.drift.{key}, or set env.options.drift.every_steps > 0")

