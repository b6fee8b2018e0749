"""The visual environments as `env.name` finds them (`tiderl.envs.registration`): `visual_grid`
and `visual_table`, their options and warm starts. Imports nothing heavy (no Pillow, no SQL)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tiderl.envs.registration import BuiltinEnvironment
from tiderl.options import need, opt

# Both generate their tasks; there is no other source.
GRID_SOURCES = ("generated_grids",)
TABLE_SOURCES = ("generated_charts",)


@dataclass
class GridOptions:
    """The visual grid's options (`env.options.*` with env.name=visual_grid)."""

    size: int = opt(5, "Cells per side of the grid (4..8).")
    cell_px: int = opt(16, "Pixels per cell side of the image (the image is size * cell_px pixels a side).")
    wall_fraction: float = opt(0.2, "Share of the cells that are walls.")
    min_path: int = opt(2, "Fewest moves of a task's shortest path.")
    max_path: int = opt(0, "Most moves of a task's shortest path (0 = env.max_turns: the oracle, one move a turn, "
                        "solves every task).")
    text_state: bool = opt(False, "Also describe the state in text (a character map and the positions): for "
                           "text-only baselines; false = the image alone shows where things are.")
    images: bool = opt(True, "Show the grid as an image; false = text only (with text_state=true), for text-only "
                       "models.")
    max_calls_per_turn: int = opt(4, "Moves one turn may make (each answered with an image).")
    num_train_tasks: int = opt(2000, "Training tasks generated.")
    fixed_goal: bool = opt(False, "Put the goal of every task at row 1, column size-2 (still shown only in the "
                           "picture): the right move then depends on where the agent is, not on two positions, "
                           "which the tiny vision-language model learns (docs/multimodal.md, the visual demo).")
    confused_share: float = opt(0.0, "Warm start only (model.path=tiny): 0 = each demonstration makes one random "
                                "wrong move at rate model.warmstart.relation_noise; above 0 = its mistakes are "
                                "systematic: on this share of the (cell, right move) pairs it takes one fixed wrong "
                                "move at that rate, so above 0.5 the warm-started policy makes it greedily too "
                                "(docs/env_visual.md, Warm starts).")

    def check(self, cfg: Any) -> None:
        need(4 <= self.size <= 8, "size", f"{self.size} is outside 4..8", "use 5")
        need(4 <= self.cell_px <= 64, "cell_px", f"{self.cell_px} is outside 4..64", "use 16")
        need(0 <= self.wall_fraction <= 0.4, "wall_fraction", f"{self.wall_fraction} is outside [0, 0.4]", "use 0.2")
        longest = self.max_path or cfg.env.max_turns
        need(1 <= self.min_path <= longest, "min_path", f"{self.min_path} is outside 1..{longest} (max_path, or "
             "env.max_turns when max_path is 0)", "use 2, or raise env.max_turns")
        need(self.max_path >= 0, "max_path", "must be >= 0", "use 0 (env.max_turns)")
        need(self.max_calls_per_turn >= 1, "max_calls_per_turn", "must be >= 1", "use 4")
        need(self.num_train_tasks >= 1, "num_train_tasks", "must be >= 1", "use 2000")
        need(0 <= self.confused_share <= 1, "confused_share", f"{self.confused_share} is outside [0, 1]", "use 0 or 0.3")
        _need_something_shown(self)


def _need_something_shown(options: Any) -> None:
    need(options.images or options.text_state, "images", "is false and so is text_state: the agent would see "
         "nothing of the state", "set env.options.text_state=true for a text-only run, or keep images=true")


@dataclass
class TableOptions:
    """The visual table's options (`env.options.*` with env.name=visual_table)."""

    text_state: bool = opt(False, "Also name the highlighted city in the text: for text-only baselines; false = "
                           "only the chart shows which city is asked about.")
    images: bool = opt(True, "Show the chart; false = text only (with text_state=true), for text-only models.")
    num_train_tasks: int = opt(2000, "Training tasks generated.")

    def check(self, cfg: Any) -> None:
        need(self.num_train_tasks >= 1, "num_train_tasks", "must be >= 1", "use 2000")
        _need_something_shown(self)


GRID = BuiltinEnvironment(
    setup_path="tiderl.envs.visual.setup:grid_setup",
    Options=GridOptions,
    sources=GRID_SOURCES,
    warm_start_path="tiderl.envs.visual.setup:GRID_WARM_START",
)

TABLE = BuiltinEnvironment(
    setup_path="tiderl.envs.visual.setup:table_setup",
    Options=TableOptions,
    sources=TABLE_SOURCES,
    warm_start_path="tiderl.envs.visual.setup:TABLE_WARM_START",
)
