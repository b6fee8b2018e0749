"""The visual grid world (`env.name=visual_grid`): walk to the goal, seeing the grid only as an image.

World: an `n` x `n` grid of floor and wall cells, the agent (a blue disc) and the goal (a green
square). Each turn the agent sees the grid rendered as a small RGB image (`render`), calls
`move(direction)` with up, down, left or right, and gets the new image back. Walking into a wall
or off the grid leaves it where it was ("blocked"). Reaching the goal ends the episode with
reward 1; the agent loop's turn limit (`env.max_turns`) ends it through `finish` with reward 0.

The text never says where anything is: the agent has to read the image. `text_state=True`
(`env.options.text_state`) also writes the state as text (a character map and the positions),
for text-only baselines and for checking that the task is learnable at all; with `images=False`
as well (`env.options.images=false`) every message is plain text, for text-only models.

Tasks are drawn by a seeded generator (`generate_tasks`): random walls, a start and a goal with
a shortest path of `min_path`..`max_path` moves (BFS, `shortest_moves`). A task's id is the hash
of its layout, and the split is a function of that hash (`is_held_out`), so held-out layouts are
never trained on, whatever the seed. The oracle (`oracle_turns`) walks a shortest path, one
`move` a turn, so it solves every task whose shortest path fits in `env.max_turns`.
"""

from __future__ import annotations

import copy
import hashlib
import json
import random
from collections import deque
from typing import Any

from tiderl.envs.protocol import Action, Observation, StepResult, Task
from tiderl.options import ConfigError

DIRECTIONS: dict[str, tuple[int, int]] = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}

# Colours (RGB) of the rendering; tests read them back from the pixels.
FLOOR, GRID_LINE, WALL = (245, 245, 245), (200, 200, 200), (60, 60, 60)
AGENT, GOAL = (30, 90, 220), (40, 170, 60)

SYSTEM_PROMPT = (
    "You are the blue disc in a grid world shown as an image. Dark cells are walls; the green square "
    "is the goal. Reach the goal by calling move with a direction: up, down, left or right. Each move "
    "shows you the grid again."
)
TASK_PROMPT = "Reach the green goal square. The image shows the grid."

MOVE_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "move",
        "description": "Move one cell in a direction; walls and the edge of the grid block the move.",
        "parameters": {
            "type": "object",
            "properties": {"direction": {"type": "string", "enum": list(DIRECTIONS),
                                         "description": "up, down, left or right"}},
            "required": ["direction"],
        },
    },
}

_NO_ACTION = "No tool call. Call move with a direction (up, down, left or right), e.g. " \
             '<tool_call>{"name": "move", "arguments": {"direction": "up"}}</tool_call>.'

Cell = tuple[int, int]


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """One Hermes-format tool call, as the agent loop's parser reads it."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


# ----------------------------------------------------------------------------- the world

def _neighbours(cell: Cell, size: int, walls: frozenset[Cell]) -> list[tuple[str, Cell]]:
    out = []
    for name, (dr, dc) in DIRECTIONS.items():
        nxt = (cell[0] + dr, cell[1] + dc)
        if 0 <= nxt[0] < size and 0 <= nxt[1] < size and nxt not in walls:
            out.append((name, nxt))
    return out


def shortest_moves(size: int, walls: frozenset[Cell], start: Cell, goal: Cell) -> list[str] | None:
    """The directions of a shortest path from `start` to `goal` (BFS, ties broken in the order
    up, down, left, right), or None when the goal cannot be reached."""
    previous: dict[Cell, tuple[Cell, str] | None] = {start: None}
    queue = deque([start])
    while queue:
        cell = queue.popleft()
        if cell == goal:
            path: list[str] = []
            while previous[cell] is not None:
                cell, step = previous[cell]  # type: ignore[misc]
                path.append(step)
            return path[::-1]
        for name, nxt in _neighbours(cell, size, walls):
            if nxt not in previous:
                previous[nxt] = (cell, name)
                queue.append(nxt)
    return None


def layout_of(task: Task) -> tuple[int, frozenset[Cell], Cell, Cell]:
    """(size, walls, start, goal) of a grid task."""
    meta = task.meta
    return (int(meta["size"]), frozenset(tuple(w) for w in meta["walls"]),  # type: ignore[misc]
            tuple(meta["start"]), tuple(meta["goal"]))  # type: ignore[return-value]


def layout_key(size: int, walls: frozenset[Cell], start: Cell, goal: Cell) -> str:
    """The hash of a layout: the task id's suffix and what decides its split."""
    text = json.dumps([size, sorted(walls), list(start), list(goal)])
    return hashlib.sha256(text.encode()).hexdigest()


def is_held_out(key: str, every: int = 5) -> bool:
    """Whether a layout (by `layout_key`) is held out: one in `every`, by its hash alone."""
    return int(key[:8], 16) % every == 0


def fixed_goal_cell(size: int) -> Cell:
    """The goal of every task with `fixed_goal`: row 1, column size - 2 (all four moves are needed
    to reach it from somewhere)."""
    return (1, size - 2)


def generate_tasks(seed: int, size: int, count: int, held_out: bool, min_path: int, max_path: int,
                   wall_fraction: float, fixed_goal: bool = False) -> list[Task]:
    """`count` distinct tasks of the held-out (or training) split, drawn with `seed`. Each has
    random walls (about `wall_fraction` of the cells), and a start and goal whose shortest path
    is `min_path`..`max_path` moves; with `fixed_goal` the goal is always `fixed_goal_cell(size)`.
    ValueError when the draws cannot find enough of them."""
    rng = random.Random(f"visual_grid-{seed}-{size}-{held_out}")
    cells = [(r, c) for r in range(size) for c in range(size)]
    tasks: list[Task] = []
    seen: set[str] = set()
    for _ in range(200 * count + 1000):
        if len(tasks) == count:
            break
        if fixed_goal:
            goal = fixed_goal_cell(size)
            walls = frozenset(rng.sample([c for c in cells if c != goal], round(wall_fraction * len(cells))))
            start = rng.choice([cell for cell in cells if cell not in walls and cell != goal])
        else:
            walls = frozenset(rng.sample(cells, round(wall_fraction * len(cells))))
            free = [cell for cell in cells if cell not in walls]
            start, goal = rng.sample(free, 2)
        path = shortest_moves(size, walls, start, goal)
        if path is None or not min_path <= len(path) <= max_path:
            continue
        key = layout_key(size, walls, start, goal)
        if key in seen or is_held_out(key) != held_out:
            continue
        seen.add(key)
        tasks.append(Task(f"grid{size}-{key[:12]}", TASK_PROMPT, len(path),
                          {"size": size, "walls": sorted(list(w) for w in walls), "start": list(start),
                           "goal": list(goal), "shortest": len(path)}))
    if len(tasks) < count:
        raise ConfigError(f"env.options: only {len(tasks)} of {count} grid tasks with a {min_path}..{max_path}-move "
                          f"path found on a {size}x{size} grid{' with a fixed goal' if fixed_goal else ''}. Fix: "
                          "lower env.options.wall_fraction or env.options.num_train_tasks (or data.eval_size), or "
                          "widen min_path/max_path")
    return tasks


def render(size: int, walls: frozenset[Cell], agent: Cell, goal: Cell, cell_px: int = 16) -> Any:
    """The grid as an RGB PIL image of `size * cell_px` pixels a side, the same pixels for the same
    state: floor cells light with thin grid lines, walls dark, the goal a green square filling its
    cell but a 2-pixel margin, the agent a blue disc (drawn over the goal when it stands on it)."""
    from PIL import Image, ImageDraw

    side = size * cell_px
    image = Image.new("RGB", (side, side), FLOOR)
    draw = ImageDraw.Draw(image)
    for i in range(size + 1):
        edge = min(i * cell_px, side - 1)
        draw.line([(edge, 0), (edge, side - 1)], fill=GRID_LINE)
        draw.line([(0, edge), (side - 1, edge)], fill=GRID_LINE)

    def box(cell: Cell, margin: int) -> list[int]:
        top, left = cell[0] * cell_px, cell[1] * cell_px
        return [left + margin, top + margin, left + cell_px - 1 - margin, top + cell_px - 1 - margin]

    for wall in sorted(walls):
        draw.rectangle(box(wall, 0), fill=WALL)
    draw.rectangle(box(goal, 2), fill=GOAL)
    draw.ellipse(box(agent, max(2, cell_px // 6)), fill=AGENT)
    return image


def text_map(size: int, walls: frozenset[Cell], agent: Cell, goal: Cell) -> str:
    """The state as text (`text_state`): a character map (A agent, G goal, # wall, . floor) and
    the positions, rows and columns counted from 0 at the top left."""
    rows = ["".join("A" if (r, c) == agent else "G" if (r, c) == goal else "#" if (r, c) in walls else "."
                    for c in range(size)) for r in range(size)]
    return ("Map (A you, G goal, # wall):\n" + "\n".join(rows) +
            f"\nYou are at row {agent[0]}, column {agent[1]}; the goal is at row {goal[0]}, column {goal[1]}.")


# ----------------------------------------------------------------------------- the episode

class GridEnv:
    """One grid episode at a time (the `Env` protocol; module docstring).

    cell_px: pixels per cell side of the rendered image.
    text_state: also describe the state in text (`text_map`).
    images: show the grid as an image (False: plain text messages, for text-only models).
    max_calls_per_turn: moves one turn may make (each answered with an image); the rest are
        not run and one error observation says so.
    """

    def __init__(self, cell_px: int = 16, text_state: bool = False, max_calls_per_turn: int = 4,
                 system_prompt: str | None = None, images: bool = True) -> None:
        if cell_px < 4 or max_calls_per_turn < 1:
            raise ValueError(f"cell_px must be >= 4 and max_calls_per_turn >= 1, got {cell_px}, {max_calls_per_turn}")
        self.cell_px, self.text_state, self.max_calls_per_turn = cell_px, text_state, max_calls_per_turn
        self.images = images
        self._system_prompt = system_prompt or SYSTEM_PROMPT
        self._layout: tuple[int, frozenset[Cell], Cell, Cell] | None = None
        self.agent: Cell = (0, 0)
        self._moves = self._calls = self._errors = 0
        self._ended = False

    def system_prompt(self) -> str:
        return self._system_prompt

    def tool_schemas(self) -> list[dict[str, Any]]:
        """[move] in OpenAI function format (a copy: callers may edit it)."""
        return [copy.deepcopy(MOVE_TOOL)]

    def reset(self, task: Task) -> Observation | str:
        """Start on `task`; returns the first user message: the rendered grid and the instruction."""
        self._layout = layout_of(task)
        self.agent = self._layout[2]
        self._moves = self._calls = self._errors = 0
        self._ended = False
        return self._observation(task.prompt)

    def step(self, action: Action) -> StepResult:
        """Answer parse errors (text), then run the `move` calls in order, each answered with the
        new image; the move that reaches the goal ends and scores the episode. At most
        `max_calls_per_turn` of them (malformed ones first) are answered one by one."""
        self._require_episode()
        errors = action.parse_errors[: self.max_calls_per_turn]
        observations: list[str | Observation] = [self._error(str(e)) for e in errors]
        calls = action.tool_calls[: self.max_calls_per_turn - len(errors)]
        for call in calls:
            observations.append(self._move(call.name, call.arguments))
            if self._ended:
                return self._final(1.0)
        unrun = len(action.parse_errors) + len(action.tool_calls) - len(errors) - len(calls)
        if unrun:
            self._calls += unrun
            self._errors += unrun
            observations.append(f"Error: {unrun} more tool calls were not run: at most {self.max_calls_per_turn} "
                                "moves a turn.")
        if not observations:
            observations.append(_NO_ACTION)
        return StepResult(observations, info=self._counters())

    def finish(self, reason: str) -> StepResult:
        """End without reaching the goal (turn or token limit): reward 0."""
        self._require_episode()
        result = self._final(0.0)
        result.info["finish_reason"] = str(reason)
        return result

    # -- internals -------------------------------------------------------------------------

    def _require_episode(self) -> tuple[int, frozenset[Cell], Cell, Cell]:
        if self._layout is None:
            raise RuntimeError("GridEnv.step/finish called before reset(task): start an episode first")
        if self._ended:
            raise RuntimeError("GridEnv.step/finish called after the episode ended: call reset(task) first")
        return self._layout

    def _observation(self, text: str) -> Observation | str:
        size, walls, _, goal = self._require_episode()
        if self.text_state:
            text = f"{text}\n{text_map(size, walls, self.agent, goal)}"
        if not self.images:
            return text
        return Observation(text, [render(size, walls, self.agent, goal, self.cell_px)])

    def _error(self, message: str) -> str:
        self._calls += 1
        self._errors += 1
        return f"Error: {message}"[:500].encode("utf-8", "replace").decode("utf-8")

    def _move(self, name: Any, arguments: Any) -> str | Observation:
        if name != "move":
            return self._error(f"unknown tool {str(name)[:40]!r}; the only tool is move(direction)")
        direction = arguments.get("direction") if isinstance(arguments, dict) else None
        extra = sorted(str(k)[:40] for k in arguments if k != "direction") if isinstance(arguments, dict) else []
        if not isinstance(direction, str) or direction.strip().lower() not in DIRECTIONS or extra:
            return self._error('move takes one argument, direction: "up", "down", "left" or "right", e.g. '
                               '{"direction": "up"}')
        size, walls, _, goal = self._require_episode()
        dr, dc = DIRECTIONS[direction.strip().lower()]
        nxt = (self.agent[0] + dr, self.agent[1] + dc)
        self._calls += 1
        self._moves += 1
        if not (0 <= nxt[0] < size and 0 <= nxt[1] < size) or nxt in walls:
            return self._observation("Blocked: you did not move.")
        self.agent = nxt
        if nxt == goal:
            self._ended = True
            return "Reached the goal."
        return self._observation("Moved.")

    def _counters(self) -> dict[str, Any]:
        return {"tool_calls": self._calls, "tool_errors": self._errors, "moves": self._moves}

    def _final(self, reward: float) -> StepResult:
        assert self._layout is not None
        size, walls, start, goal = self._layout
        shortest = shortest_moves(size, walls, start, goal)
        info = self._counters() | {"success": reward, "reward_parts": {"outcome": reward},
                                   "shortest": len(shortest or [])}
        self._ended = True
        return StepResult([], reward=reward, done=True, info=info)


def oracle_turns(task: Task) -> list[str]:
    """A shortest path as assistant turns, one `move` call a turn."""
    size, walls, start, goal = layout_of(task)
    return [tool_call_text("move", {"direction": d}) for d in shortest_moves(size, walls, start, goal) or []]


def noisy_turns(task: Task, rate: float, rng: random.Random, max_turns: int) -> list[str]:
    """A demonstration that errs: with probability `rate`, one of its turns (drawn at random) is a
    move off the shortest path, after which it walks the shortest path from where it stands; at
    most `max_turns` turns, so some erring demonstrations run out of turns before the goal."""
    size, walls, agent, goal = layout_of(task)
    planned = len(shortest_moves(size, walls, agent, goal) or [])
    wrong_at = rng.randrange(planned) if planned and rng.random() < rate else -1
    turns: list[str] = []
    while agent != goal and len(turns) < max_turns:
        best = (shortest_moves(size, walls, agent, goal) or ["up"])[0]
        direction = rng.choice([d for d in DIRECTIONS if d != best]) if len(turns) == wrong_at else best
        turns.append(tool_call_text("move", {"direction": direction}))
        dr, dc = DIRECTIONS[direction]
        nxt = (agent[0] + dr, agent[1] + dc)
        if 0 <= nxt[0] < size and 0 <= nxt[1] < size and nxt not in walls:
            agent = nxt
    return turns


def confusion_table(size: int, share: float, seed: int) -> dict[tuple[Cell, str], str]:
    """Systematic mistakes for the warm start's demonstrations: about `share` of the (cell, right
    move) pairs of an `size` x `size` grid, each with its one fixed wrong move (another direction
    that stays on the grid), drawn with `seed`. A demonstration standing on such a cell whose
    shortest path starts with that move takes the wrong one instead, at a rate
    (`confused_turns`). Above rate 0.5 the wrong move is the demonstrations' majority there, so the
    warm-started policy makes it under greedy decoding too: a mistake RL can fix, which uniform
    noise (`noisy_turns`) never leaves (the right move stays the argmax everywhere)."""
    rng = random.Random(f"visual_grid-confusions-{seed}-{size}")
    table: dict[tuple[Cell, str], str] = {}
    for cell in [(r, c) for r in range(size) for c in range(size)]:
        for best in DIRECTIONS:
            confused = rng.random() < share
            others = [d for d, (dr, dc) in DIRECTIONS.items()
                      if d != best and 0 <= cell[0] + dr < size and 0 <= cell[1] + dc < size]
            wrong = rng.choice(others)  # drawn either way, so `share` does not move the other pairs' draws
            if confused:
                table[(cell, best)] = wrong
    return table


def confused_turns(task: Task, table: dict[tuple[Cell, str], str], rate: float, rng: random.Random,
                   max_turns: int) -> list[str]:
    """A demonstration with systematic mistakes: each turn walks the shortest path from where it
    stands, except that on a (cell, right move) pair of `table` it takes the table's wrong move
    with probability `rate`; at most `max_turns` turns."""
    size, walls, agent, goal = layout_of(task)
    turns: list[str] = []
    while agent != goal and len(turns) < max_turns:
        best = (shortest_moves(size, walls, agent, goal) or ["up"])[0]
        wrong = table.get((agent, best))
        direction = wrong if wrong is not None and rng.random() < rate else best
        turns.append(tool_call_text("move", {"direction": direction}))
        dr, dc = DIRECTIONS[direction]
        nxt = (agent[0] + dr, agent[1] + dc)
        if 0 <= nxt[0] < size and 0 <= nxt[1] < size and nxt not in walls:
            agent = nxt
    return turns
