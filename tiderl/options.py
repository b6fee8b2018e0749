"""Options: the typed, documented settings of the run and of each component, and how a mapping
(YAML plus dotted overrides) becomes them.

Every setting is a dataclass field declared with `opt(default, help)` beside the code that reads
it: the run-level sections in `tiderl/config.py`, a component's (environment, engine, backend) in
its own options dataclass, held in a `component_options` field that follows the component's
choice (`env.options` follows `env.name`). `build(cls, mapping, where)` rejects an unknown key
with a did-you-mean, a wrong type or value naming the field and the fix, and a component option
that only another component reads, naming it. An options dataclass may define `check(self, cfg)`
(run on the loaded config by `check_components`; its `need(ok, field, problem, fix)` names its
own fields and the dotted path is put in front: `env.options.timeout_s: must be > 0. Fix: use
2.0.`) and `unread(self, cfg) -> {field: why}` (`unread_keys`: fields that its values or the
run's choices leave unread, which the config rejects when set). No tiderl or torch import.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A config value or key is wrong. The message names the field and the fix; `field` is the
    dotted key the message starts with ('' when it names none)."""

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(message)
        self.field = field


class UnknownKeyError(ConfigError):
    """A key that the section or options at `where` do not declare."""

    def __init__(self, key: str, where: str, known: list[str]) -> None:
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.5)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        listed = ", ".join(sorted(known)) or "none"
        super().__init__(f"unknown config key '{dotted(where, key)}'.{hint} Known keys here: {listed}.",
                         dotted(where, key))
        self.key, self.where = key, where


def opt(default: Any, help: str, choices: tuple[Any, ...] | None = None) -> Any:
    """Declare an option with its default and documentation (and allowed values)."""
    meta = {"help": help, "choices": choices}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


def section(cls: type, help: str) -> Any:
    """Declare a nested section (a dataclass of options)."""
    return field(default_factory=cls, metadata={"help": help, "choices": None})


def need(ok: bool, field_name: str, problem: str, fix: str) -> None:
    """Raise `field_name: problem. Fix: fix.` unless `ok`."""
    if not ok:
        raise ConfigError(f"{field_name}: {problem}. Fix: {fix}.", field_name)


def dotted(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


# --------------------------------------------------------------------------------------------
# Components: options whose dataclass follows a choice


@dataclass
class NoOptions:
    """The options of a component that declares none."""


@dataclass(frozen=True)
class Components:
    """The components that one config key chooses among (e.g. the environments `env.name`
    names), so the options beside it can follow the choice.

    chooser: the sibling field that names the component ("name" in the `env` section).
    names: the built-in names (listed by `tiderl config`, and asked which of them read a key).
    options_of: a name -> the options dataclass that component declares (None: it declares
        none). It raises ConfigError for a name it cannot resolve.
    former_keys: a built-in name -> {former run-level dotted key: the option that took it over},
        so a config that still sets one is told where it went (`reject_former_keys`).
    """

    chooser: str
    names: Callable[[], Iterable[str]]
    options_of: Callable[[str], type | None]
    former_keys: Callable[[str], dict[str, str]] = lambda name: {}

    def options_class(self, name: str) -> type:
        """The options dataclass of component `name` (NoOptions when it declares none)."""
        return self.options_of(name) or NoOptions

    def readers(self, key: str) -> list[str]:
        """The built-in components whose options have a field `key`."""
        return [name for name in self.names()
                if key in {f.name for f in dataclasses.fields(self.options_class(name))}]

    def is_default_elsewhere(self, key: str, value: Any, path: str) -> bool:
        """Whether `value` is the default of option `key` of some built-in component that has it."""
        for name in self.readers(key):
            cls = self.options_class(name)
            f = next(g for g in dataclasses.fields(cls) if g.name == key)
            tp = typing.get_type_hints(cls)[key]
            try:
                built = build(tp, value or {}, path) if dataclasses.is_dataclass(tp) else coerce(value, tp, path)
            except ConfigError:
                continue
            if built == _default(f):
                return True
        return False


def component_options(components: Components, help: str) -> Any:
    """Declare the options of the component that the sibling field `components.chooser` names.
    The section's `__post_init__` calls `fill_component_defaults(self)`, so a section made
    in code gets its component's defaults."""
    return field(default=None, metadata={"help": help, "choices": None, "components": components})


def fill_component_defaults(obj: Any) -> None:
    """Set each component-options field of `obj` that is None to its component's defaults."""
    for f in dataclasses.fields(obj):
        components = f.metadata.get("components")
        if components is not None and getattr(obj, f.name) is None:
            setattr(obj, f.name, components.options_class(getattr(obj, components.chooser))())


def check_components(cfg: Any) -> None:
    """Run `check(cfg)` of every section and component options in `cfg` that defines one; an error
    naming one of its own fields gets its dotted path in front."""
    for path, node in _nodes(cfg, ""):
        check = getattr(node, "check", None)
        if check is None:
            continue
        try:
            check(cfg)
        except ConfigError as exc:
            own = {f.name for f in dataclasses.fields(node)}
            if not path or exc.field.split(".")[0] not in own:
                raise  # it names a key outside the options, in full
            raise ConfigError(f"{path}.{exc}", f"{path}.{exc.field}") from None


def unread_keys(cfg: Any) -> dict[str, str]:
    """Dotted key -> why nothing reads it, for each option that a section or component options
    of `cfg` leaves unread under the config's values (their `unread(cfg)`)."""
    out: dict[str, str] = {}
    for path, node in _nodes(cfg, ""):
        unread = getattr(node, "unread", None)
        if unread is not None:
            out.update({dotted(path, key): why for key, why in unread(cfg).items()})
    return out


def reject_former_keys(cfg: Any, written: Iterable[str]) -> None:
    """Raise ConfigError for a written dotted key (or one inside a section) that a built-in
    component's options took over (`Components.former_keys`), naming where it lives now. `cfg`:
    any instance of the config's class (only its component-options fields are looked at)."""
    for path, node in _nodes(cfg, ""):
        for f in (f for f in dataclasses.fields(node) if "components" in f.metadata):
            components, where = f.metadata["components"], dotted(path, f.name)
            moved: dict[str, list[tuple[str, str]]] = {}
            for name in components.names():
                for old, new in components.former_keys(name).items():
                    moved.setdefault(old, []).append((name, new))
            for key, old in ((k, o) for k in sorted(written) for o in moved if k == o or k.startswith(o + ".")):
                new = " or ".join(sorted({f"{where}.{option}" for _, option in moved[old]}))
                owners = ", ".join(f"{dotted(path, components.chooser)}={name}" for name, _ in moved[old])
                raise ConfigError(f"{old}: moved to {new} (the options of {owners}). Fix: write {new} instead.", old)


def _nodes(node: Any, where: str) -> Iterator[tuple[str, Any]]:
    """(dotted path, dataclass) for `node` and every dataclass under it."""
    yield where, node
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            yield from _nodes(value, dotted(where, f.name))


# --------------------------------------------------------------------------------------------
# Building options from a mapping


def build(cls: type, data: Any, where: str = "") -> Any:
    """The dataclass `cls` built from the nested mapping `data` (at dotted path `where`),
    checking keys, types and choices."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping of keys, got {data!r}.", where)
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in fields:
            if key in getattr(cls, "replaced_keys", {}):  # a key whose meaning changed: say how
                raise ConfigError(f"{dotted(where, key)} {cls.replaced_keys[key]}", dotted(where, key))
            raise UnknownKeyError(key, where, list(fields))
        if "components" in fields[key].metadata:
            continue  # built below, once the choice it follows is known
        path, tp = dotted(where, key), hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = build(tp, value or {}, path)
        else:
            kwargs[key] = _value(fields[key], tp, value, path)
    for f in fields.values():
        if "components" in f.metadata:
            kwargs[f.name] = _build_component_options(f, fields, kwargs, data.get(f.name) or {}, where)
    try:
        return cls(**kwargs)
    except ValueError as exc:  # a section that checks its own values (CuriosityConfig)
        raise ConfigError(str(exc)) from None


def _value(f: dataclasses.Field, tp: Any, value: Any, path: str) -> Any:
    """`value` as field `f`'s declared type, within its choices."""
    try:
        out = coerce(value, tp, path)
    except ConfigError as exc:
        raise ConfigError(f"{exc} Fix: set {path} like its default, {_default(f)!r}.", path) from None
    choices = f.metadata.get("choices")
    if choices and out not in choices:
        raise ConfigError(f"{path}: {out!r} is not one of {', '.join(map(repr, choices))}.", path)
    return out


def _default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def _build_component_options(f: dataclasses.Field, fields: dict[str, dataclasses.Field], built: dict[str, Any],
                             data: Any, where: str) -> Any:
    """Field `f`'s options, as the component named by its sibling chooser declares them
    (`fields`: the section's fields; `built`: the values built so far)."""
    components: Components = f.metadata["components"]
    chooser = dotted(where, components.chooser)
    name = built[components.chooser] if components.chooser in built else _default(fields[components.chooser])
    path, options_class = dotted(where, f.name), components.options_class(name)
    own = {g.name for g in dataclasses.fields(options_class)}
    # Another component's option at that component's default changes nothing and is dropped, as a
    # run-level key at its default is kept (a base config written for another component loads).
    data = {key: value for key, value in data.items()
            if key in own or not components.is_default_elsewhere(key, value, dotted(path, key))}
    try:
        return build(options_class, data, path)
    except UnknownKeyError as exc:
        readers = components.readers(exc.key) if exc.where == path else []
        if not readers and options_class is NoOptions:
            raise ConfigError(f"{exc.field}: {chooser}={name} declares no options, so it would be ignored. Fix: "
                              f"remove {exc.field}, or declare the option in its Options dataclass.", exc.field) from None
        if not readers:
            raise
        them = " and ".join(f"{chooser}={r}" for r in readers)
        raise ConfigError(
            f"{exc.field}: {chooser}={name} has no such option; only {them} {'reads' if len(readers) == 1 else 'read'} "
            f"it, so it would be ignored. Fix: remove {exc.field}, or set {chooser}={readers[0]}.", exc.field) from None


def coerce(value: Any, tp: Any, where: str) -> Any:
    """`value` converted to the declared type `tp`, or a ConfigError naming `where`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return coerce(value, args[0], where)
    if origin is dict:
        key_tp, value_tp = typing.get_args(tp)
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}. Fix: write e.g. {{a: 1.0}}.", where)
        return {coerce(k, key_tp, f"{where} key"): coerce(v, value_tp, f"{where}.{k}") for k, v in value.items()}
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if isinstance(value, str):
            value = [v for v in value.strip("[]").split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}. Fix: write e.g. [1, 2].", where)
        return [coerce(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{where}: expected true or false, got {value!r}.", where)
    if tp is int or tp is float:  # an int also from a number or string with an integral value (1e3, "4")
        if isinstance(value, int) and not isinstance(value, bool):
            return value if tp is int else float(value)
        try:
            number = None if isinstance(value, bool) else float(value)
        except (TypeError, ValueError):
            number = None
        if number is None or (tp is int and not number.is_integer()):
            kind = "an integer" if tp is int else "a number"
            raise ConfigError(f"{where}: expected {kind}, got {value!r}.", where)
        return int(number) if tp is int else number
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{where}: expected a string, got {value!r}.", where)
        return "" if value is None else str(value)
    raise ConfigError(f"{where}: unsupported field type {getattr(tp, '__name__', str(tp))}", where)


# --------------------------------------------------------------------------------------------
# The reference


def describe(cls: type, prefix: str = "", chosen: Any = None) -> list[tuple[str, str, Any]]:
    """(dotted key, help, default) for every leaf option of `cls`: the config reference.

    Component options are listed for every built-in component, each row's help starting with
    the choice it belongs to (`[env.name=NAME] ...`); with `chosen` (a loaded instance of `cls`),
    also for a chosen component that is not built in (a user's environment)."""
    rows: list[tuple[str, str, Any]] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        components = f.metadata.get("components")
        if components is not None:
            names = list(components.names())
            picked = getattr(chosen, components.chooser, None) if chosen is not None else None
            if picked is not None and picked not in names:
                names.append(picked)
            chooser = f"{prefix}{components.chooser}"
            for name in names:
                rows += [(k, f"[{chooser}={name}] {h}", d)
                         for k, h, d in describe(components.options_class(name), key + ".")]
        elif dataclasses.is_dataclass(hints[f.name]):
            rows += describe(hints[f.name], key + ".", getattr(chosen, f.name, None) if chosen is not None else None)
        else:
            rows.append((key, f.metadata.get("help", ""), _default(f)))
    return rows
