"""The visual environments' setups and warm starts (`env.name=visual_grid`, `visual_table`).

Both generate their tasks (`data.source=generated_grids` / `generated_charts`, the only sources): `env.options.num_train_tasks` training tasks
and `data.eval_size` held-out ones, drawn with `data.seed` from disjoint splits (a task's split
is a function of its layout's hash: `grid.is_held_out`). The options are
`tiderl.envs.visual.registration.GridOptions` / `TableOptions`.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

from tiderl.envs.protocol import Task
from tiderl.envs.registration import WarmStart
from tiderl.envs.setup import Setup
from tiderl.envs.visual import grid, table
from tiderl.envs.visual.registration import GRID_SOURCES, TABLE_SOURCES

if TYPE_CHECKING:
    from tiderl.config import RunConfig


def _check_source(cfg: "RunConfig", source: str) -> None:
    if cfg.data.source not in ("", source):
        raise ValueError(f"data.source={cfg.data.source!r}: env.name={cfg.env.name} generates its tasks. Fix: use "
                         f"data.source={source} (or leave it out).")


def max_path(cfg: "RunConfig") -> int:
    """The longest shortest path of a grid task: `env.options.max_path`, else `env.max_turns`."""
    return cfg.env.options.max_path or cfg.env.max_turns


def grid_setup(cfg: "RunConfig") -> Setup:
    """Grid tasks (module docstring) and a factory of `GridEnv`s; the oracle walks a shortest path."""
    _check_source(cfg, GRID_SOURCES[0])
    options, data = cfg.env.options, cfg.data
    shape = dict(size=options.size, min_path=options.min_path, max_path=max_path(cfg),
                 wall_fraction=options.wall_fraction, fixed_goal=options.fixed_goal)
    train = grid.generate_tasks(data.seed, count=options.num_train_tasks, held_out=False, **shape)
    held_out = grid.generate_tasks(data.seed, count=data.eval_size, held_out=True, **shape)
    factory = _GridFactory(options.cell_px, options.text_state, options.max_calls_per_turn,
                           cfg.env.system_prompt or None, options.images)
    return Setup(train, held_out, factory, GRID_SOURCES[0], oracle=grid.oracle_turns)


class _GridFactory:
    """`make_env` of a grid setup (a class, so a Setup pickles for the Ray backend)."""

    def __init__(self, cell_px: int, text_state: bool, max_calls_per_turn: int, system_prompt: str | None,
                 images: bool) -> None:
        self.cell_px, self.text_state, self.images = cell_px, text_state, images
        self.max_calls_per_turn, self.system_prompt = max_calls_per_turn, system_prompt

    def __call__(self) -> grid.GridEnv:
        return grid.GridEnv(self.cell_px, self.text_state, self.max_calls_per_turn, self.system_prompt, self.images)


def table_setup(cfg: "RunConfig") -> Setup:
    """Chart-and-SQL tasks (module docstring) and a factory of `VisualTableEnv`s over the setup's
    SQLite backend, with the DB environment's limits: `Limits(max_rows=env.max_items,
    max_observation_chars=env.max_observation_chars)` (statements stop after 2 s)."""
    from tiderl.envs.db.tools import Limits

    _check_source(cfg, TABLE_SOURCES[0])
    options, data, env = cfg.env.options, cfg.data, cfg.env
    train = table.generate_tasks(data.seed, options.num_train_tasks, held_out=False)
    held_out = table.generate_tasks(data.seed, data.eval_size, held_out=True)
    out = Setup(train, held_out, _no_env, TABLE_SOURCES[0], oracle=table.oracle_turns)
    limits = Limits(max_rows=env.max_items, max_observation_chars=env.max_observation_chars)
    out.make_env = _TableFactory(out, "sqlite", limits, options.text_state, env.system_prompt or None,
                                 options.images)
    return out


def _no_env() -> Any:
    raise RuntimeError("the setup's environment factory was not set")


class _TableFactory:
    """`make_env` of a visual table setup: a `VisualTableEnv` on the setup's backend (built on
    first use, in the process that plays the episodes)."""

    def __init__(self, setup: Setup, backend: str, limits: Any, text_state: bool, system_prompt: str | None,
                 images: bool) -> None:
        self.setup, self.backend, self.limits = setup, backend, limits
        self.text_state, self.system_prompt, self.images = text_state, system_prompt, images

    def __call__(self) -> table.VisualTableEnv:
        from tiderl.envs.db.env import DBEnv
        from tiderl.envs.db.setup import db_backend

        db = DBEnv(db_backend(self.setup, self.backend), limits=self.limits)
        return table.VisualTableEnv(db, self.text_state, self.system_prompt, self.images)


def grid_demonstrations(setup: Setup, cfg: "RunConfig", rng: random.Random) -> tuple[list[Task], list[list[str]], dict[str, Any]]:
    """`model.warmstart.num_traces` training tasks drawn with `rng`, each with a demonstration
    within `env.max_turns` turns. With `env.options.confused_share` 0, at rate
    `model.warmstart.relation_noise` it makes one move off the shortest path (`grid.noisy_turns`);
    above 0, its mistakes are systematic: on that share of the (cell, right move) pairs it takes
    one fixed wrong move at rate `relation_noise` (`grid.confusion_table`, drawn with `seed`;
    `grid.confused_turns`)."""
    ws, share = cfg.model.warmstart, cfg.env.options.confused_share
    tasks = [rng.choice(setup.train_tasks) for _ in range(ws.num_traces)]
    if share <= 0:
        scripts = [grid.noisy_turns(t, ws.relation_noise, rng, cfg.env.max_turns) for t in tasks]
        return tasks, scripts, {"wrong_move_rate": ws.relation_noise}
    table = grid.confusion_table(cfg.env.options.size, share, cfg.seed)
    scripts = [grid.confused_turns(t, table, ws.relation_noise, rng, cfg.env.max_turns) for t in tasks]
    confusions = {f"{r},{c} {best}": wrong for ((r, c), best), wrong in sorted(table.items())}
    return tasks, scripts, {"wrong_move_rate": ws.relation_noise, "confusions": confusions}


def table_demonstrations(setup: Setup, cfg: "RunConfig", rng: random.Random) -> tuple[list[Task], list[list[str]], dict[str, Any]]:
    """`model.warmstart.num_traces` training tasks drawn with `rng`, each with a demonstration
    that, at rate `model.warmstart.relation_noise`, asks about the bar next to the highlighted one
    (`table.confused_turns`)."""
    ws = cfg.model.warmstart
    tasks = [rng.choice(setup.train_tasks) for _ in range(ws.num_traces)]
    scripts = [table.confused_turns(t, ws.relation_noise, rng) for t in tasks]
    return tasks, scripts, {"misread_rate": ws.relation_noise}


# The generators and the tiny VLM's recipe still change: their source text keys a cached model (every
# option stays keyed: each changes the tasks or what the model sees).
GRID_WARM_START = WarmStart(demonstrations=grid_demonstrations,
                            key_modules=("tiderl.envs.visual.grid", "tiderl.envs.visual.setup",
                                         "tiderl.embedded.tiny_vlm"))
TABLE_WARM_START = WarmStart(demonstrations=table_demonstrations,
                             key_modules=("tiderl.envs.visual.table", "tiderl.envs.visual.setup",
                                          "tiderl.embedded.tiny_vlm"))
