"""The visual table task (`env.name=visual_table`): a question about a bar chart, answered with SQL.

Each task has a small table `stats(city, year, value)` (3-5 cities, 3-4 years, integer values)
and a bar chart of one year's values rendered from it (`render_chart`): one bar per city, in
alphabetical order, labelled with the city's name, one of them highlighted in red. The question
is about the highlighted city ("What was the highlighted city's value in 2021?"), so the agent
needs the image (which city) and the database (the value the chart does not show: another
year, a total over years, the year of its best value). The chart prints no numbers.

The episode is the SQL environment's (`tiderl.envs.db.env.DBEnv`, reused whole: read-only
sessions, row and time limits, errors as `Error:` observations, `commit_final_answer` scoring
with `answers_match`); this module only adds the chart to the first message. `text_state=True`
(`env.options.text_state`) also names the highlighted city in the text, for text-only baselines
(`images=False` drops the chart: a text-only model's run).

Tasks are drawn by a seeded generator (`generate_tasks`); a task's id is the hash of its table
and question, and the split is a function of that hash (as in `tiderl.envs.visual.grid`). The
oracle (`oracle_turns`) runs the task's gold SQL, then commits the answer.
"""

from __future__ import annotations

import hashlib
import json
import random
from typing import Any

from tiderl.envs.db.backend import TableSpec
from tiderl.envs.db.env import DBEnv
from tiderl.envs.protocol import Action, Observation, StepResult, Task
from tiderl.envs.visual.grid import is_held_out, tool_call_text

TABLE = "stats"
CITIES = ("Ash", "Bay", "Cor", "Dun", "Elk", "Fen", "Gal", "Hay", "Ivy", "Jun", "Kew", "Lux")
FIRST_YEAR = 2018

# Chart colours (RGB); tests read them back from the pixels.
BACKGROUND, BAR, HIGHLIGHT, INK = (255, 255, 255), (150, 150, 150), (220, 40, 40), (0, 0, 0)
CHART_WIDTH, CHART_HEIGHT, LABEL_HEIGHT, TITLE_HEIGHT = 112, 84, 14, 12

SYSTEM_PROMPT = (
    "The image is a bar chart of one year of the table stats(city, year, value): one bar per city, "
    "in alphabetical order, labelled with the city's name; the highlighted (red) bar is the city the "
    "question asks about. Query the table with execute_sql (one SELECT per call) and finish with "
    "commit_final_answer and the answer as a list, e.g. [42]."
)

# kind -> (question template, gold SQL template); {city}, {year}, {shown} are filled in.
QUESTIONS: dict[str, tuple[str, str]] = {
    "value": ("The chart shows {shown}. What was the value of the highlighted city in {year}?",
              "SELECT value FROM stats WHERE city = '{city}' AND year = {year}"),
    "total": ("The chart shows {shown}. What is the highlighted city's total value over all years in the table?",
              "SELECT SUM(value) FROM stats WHERE city = '{city}'"),
    "best_year": ("The chart shows {shown}. In which year did the highlighted city have its highest value?",
                  "SELECT year FROM stats WHERE city = '{city}' ORDER BY value DESC LIMIT 1"),
}


def _answer(kind: str, rows: list[tuple[str, int, int]], city: str, year: int) -> int:
    mine = [(y, v) for c, y, v in rows if c == city]
    if kind == "value":
        return next(v for y, v in mine if y == year)
    if kind == "total":
        return sum(v for _, v in mine)
    return max(mine, key=lambda yv: yv[1])[0]


def generate_tasks(seed: int, count: int, held_out: bool) -> list[Task]:
    """`count` distinct tasks of the held-out (or training) split, drawn with `seed`. A best-year
    question is drawn only where the city's highest value is unique (the answer is one year)."""
    rng = random.Random(f"visual_table-{seed}-{held_out}")
    tasks: list[Task] = []
    seen: set[str] = set()
    for _ in range(50 * count + 1000):
        if len(tasks) == count:
            break
        cities = sorted(rng.sample(CITIES, rng.randint(3, 5)))
        first = FIRST_YEAR + rng.randint(0, 2)
        years = list(range(first, first + rng.randint(3, 4)))
        rows = [(c, y, rng.randint(10, 99)) for c in cities for y in years]
        city, shown, kind = rng.choice(cities), rng.choice(years), rng.choice(list(QUESTIONS))
        year = rng.choice([y for y in years if y != shown])
        values = [v for c, _, v in rows if c == city]
        if kind == "best_year" and values.count(max(values)) > 1:
            continue
        question, sql = (t.format(city=city, year=year, shown=shown) for t in QUESTIONS[kind])
        table = TableSpec(TABLE, (("city", "TEXT"), ("year", "INTEGER"), ("value", "INTEGER")), tuple(rows))
        key = hashlib.sha256(json.dumps([table.to_dict(), question, city]).encode()).hexdigest()
        if key in seen or is_held_out(key) != held_out:
            continue
        seen.add(key)
        tasks.append(Task(f"table-{key[:12]}", question, {"values": [_answer(kind, rows, city, year)]},
                          {"tables": [table.to_dict()], "answer_type": kind, "gold_sql": sql,
                           "chart": {"year": shown, "highlight": city}}))
    if len(tasks) < count:
        raise ValueError(f"only {len(tasks)} of {count} visual_table tasks could be drawn. Fix: ask for fewer tasks")
    return tasks


def render_chart(task: Task) -> Any:
    """The task's chart as an RGB PIL image (`CHART_WIDTH` x `CHART_HEIGHT`), the same pixels for
    the same task: the year as a title, one bar per city (height proportional to its value that
    year, 0..100), alphabetical, the highlighted city's bar red and the others grey, each labelled
    with the city's name in PIL's built-in font."""
    from PIL import Image, ImageDraw, ImageFont

    chart = task.meta["chart"]
    rows = TableSpec.from_dict(task.meta["tables"][0]).rows
    bars = sorted((c, v) for c, y, v in rows if y == chart["year"])
    image = Image.new("RGB", (CHART_WIDTH, CHART_HEIGHT), BACKGROUND)
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=10) if _sized_default_font() else ImageFont.load_default()
    draw.text((2, 0), str(chart["year"]), fill=INK, font=font)
    slot = CHART_WIDTH // len(bars)
    base = CHART_HEIGHT - LABEL_HEIGHT
    room = base - TITLE_HEIGHT
    for i, (city, value) in enumerate(bars):
        left = i * slot + 3
        top = base - round(room * value / 100)
        draw.rectangle([left, top, left + slot - 7, base - 1], fill=HIGHLIGHT if city == chart["highlight"] else BAR)
        draw.text((i * slot + 2, base + 1), city, fill=INK, font=font)
    return image


def _sized_default_font() -> bool:
    """Whether this Pillow's built-in font takes a size (10.1 and later)."""
    from PIL import ImageFont

    try:
        ImageFont.load_default(size=10)
    except TypeError:
        return False
    return True


def bar_box(task: Task, city: str) -> tuple[int, int, int, int]:
    """(left, top, right, bottom) of `city`'s bar in `render_chart`'s image (for tests)."""
    chart = task.meta["chart"]
    rows = TableSpec.from_dict(task.meta["tables"][0]).rows
    bars = sorted((c, v) for c, y, v in rows if y == chart["year"])
    slot, base = CHART_WIDTH // len(bars), CHART_HEIGHT - LABEL_HEIGHT
    i = [c for c, _ in bars].index(city)
    return i * slot + 3, base - round((base - TITLE_HEIGHT) * bars[i][1] / 100), i * slot + slot - 4, base - 1


class VisualTableEnv:
    """One visual table episode at a time: `DBEnv`'s episode, with the chart in the first message.

    db: the `DBEnv` that runs the tools and scores (module docstring).
    text_state: also name the highlighted city in the text.
    images: show the chart (False: the first message is plain text, for text-only models).
    """

    def __init__(self, db: DBEnv, text_state: bool = False, system_prompt: str | None = None,
                 images: bool = True) -> None:
        self.db, self.text_state, self.images = db, text_state, images
        self._system_prompt = system_prompt or SYSTEM_PROMPT

    def system_prompt(self) -> str:
        return self._system_prompt

    def tool_schemas(self) -> list[dict[str, Any]]:
        """The SQL environment's four tools."""
        return self.db.tool_schemas()

    def reset(self, task: Task) -> Observation | str:
        """Start on `task`: the chart, then the question."""
        text = self.db.reset(task)
        if self.text_state:
            text = f"{text}\n(The highlighted bar is {task.meta['chart']['highlight']}.)"
        return Observation(text, [render_chart(task)]) if self.images else text

    def step(self, action: Action) -> StepResult:
        return self.db.step(action)

    def finish(self, reason: str) -> StepResult:
        return self.db.finish(reason)


def oracle_turns(task: Task) -> list[str]:
    """The gold SQL through execute_sql, then the answer through commit_final_answer."""
    return [tool_call_text("execute_sql", {"query": task.meta["gold_sql"]}),
            tool_call_text("commit_final_answer", {"answers": list(task.answer["values"])})]


def confused_turns(task: Task, rate: float, rng: random.Random) -> list[str]:
    """A demonstration that errs like a misread chart: with probability `rate` it asks about the
    city whose bar stands next to the highlighted one (and commits that city's answer), else it is
    `oracle_turns`."""
    chart = task.meta["chart"]
    rows = [tuple(r) for r in task.meta["tables"][0]["rows"]]
    cities = sorted({r[0] for r in rows})
    if rng.random() >= rate:
        return oracle_turns(task)
    at = cities.index(chart["highlight"])
    city = cities[at + 1] if at + 1 < len(cities) else cities[at - 1]
    kind, sql = task.meta["answer_type"], task.meta["gold_sql"].replace(f"'{chart['highlight']}'", f"'{city}'")
    year = int(sql.rsplit("year = ", 1)[1]) if kind == "value" else 0
    return [tool_call_text("execute_sql", {"query": sql}),
            tool_call_text("commit_final_answer", {"answers": [_answer(kind, rows, city, year)]})]
