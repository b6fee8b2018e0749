"""Generated one-line functions (`data.source: funcs`): the code environment's task for the
embedded tiny model.

Each task asks for a named function of one argument that applies one operation with a constant,
in words, with one test shown (MBPP's prompt form, `tiderl.envs.code.data.mbpp_task`):

    Complete "def kavo(x):" so that it returns x times 7.
    Your code should pass this test:
    assert kavo(3) == 21

and is solved by submitting `def kavo(x):\\n    return x * 7`; hidden asserts check six arguments
in the sandbox, as MBPP's tests do. Eight kinds, one per operation, in four confusable pairs (plus
and minus, times and power, floor division and remainder, larger and smaller), each with its own
constant 2-9 per task. The prompt quotes the code's first line as the submission's JSON string
starts it (`"def kavo(x):`), so the name follows the same tokens in both (the shop database's
lesson, docs/env_db.md: the tiny model copies what follows the same anchor; with `def kavo(x):`
unquoted in the prompt, its greedy policy copied the name in under half the tasks). Held-out tasks are the rows no training task of that kind
has (every fifth); each kind's rows are the names shifted by the kind's index, so every held-out
name is a training name of other kinds (the tokenizer and the warm start know it) while a held-out
task's (name, kind, constant) was never trained on.

The warm start (`WARM_START`) submits the reference with a systematic mistake: each kind's
partner operation at its own rate spread around `model.warmstart.relation_noise`, so the policy
is right for some kinds and wrong for others: what RL can fix. Its copy check
(`model.warmstart.copy_check_threshold`) asks training tasks the demonstrations never show
(`copy_check_tasks`) and counts a submission of the kind's or the partner's function as copied.
"""

from __future__ import annotations

import json
import random
from typing import TYPE_CHECKING, Any

from tiderl.envs.code.data import mbpp_task
from tiderl.envs.protocol import Task
from tiderl.envs.registration import WarmStart

if TYPE_CHECKING:
    from tiderl.config import RunConfig
    from tiderl.envs.setup import Setup

ROWS = 200  # names per kind
HELD_OUT_EVERY = 5
ARGUMENTS = (-4, 0, 1, 3, 6, 11)  # the hidden tests' arguments: below and above every constant
SHOWN_ARGUMENT = 3
SYLLABLES = ["ka", "ra", "vo", "le", "mi", "so", "ta", "ne", "du", "pe", "lo", "ri", "sa", "bo", "fi", "gu"]

# kind -> (the operation in words, as Python, the partner kind a demonstration confuses it with)
KINDS: dict[str, tuple[str, str, str]] = {
    "plus": ("x plus {k}", "x + {k}", "minus"),
    "minus": ("x minus {k}", "x - {k}", "plus"),
    "times": ("x times {k}", "x * {k}", "power"),
    "power": ("x to the power {k}", "x ** {k}", "times"),
    "floordiv": ("x divided by {k}, rounded down", "x // {k}", "remainder"),
    "remainder": ("the remainder of x divided by {k}", "x % {k}", "floordiv"),
    "larger": ("the larger of x and {k}", "max(x, {k})", "smaller"),
    "smaller": ("the smaller of x and {k}", "min(x, {k})", "larger"),
}


def function_code(name: str, kind: str, k: int) -> str:
    """The one-line function `name` of operation `kind` with constant `k`."""
    return f"def {name}(x):\n    return {KINDS[kind][1].format(k=k)}"


def _value(kind: str, k: int, x: int) -> int:
    scope: dict[str, Any] = {}
    exec(function_code("f", kind, k), scope)  # noqa: S102 - our own one-line source
    return scope["f"](x)


def funcs_task(name: str, kind: str, k: int, task_id: str) -> Task:
    """The task asking for `function_code(name, kind, k)` (module docstring)."""
    words = KINDS[kind][0].format(k=k)
    # The shown argument's assert first: mbpp_task shows the first and hides them all.
    asserts = [f"assert {name}({x}) == {_value(kind, k, x)}" for x in dict.fromkeys((SHOWN_ARGUMENT, *ARGUMENTS))]
    task = mbpp_task(f'Complete "def {name}(x):" so that it returns {words}.', asserts, [],
                     function_code(name, kind, k), task_id)
    task.meta.update(source="funcs", kind=kind, constant=k)
    return task


def funcs_tasks(seed: int) -> tuple[list[Task], list[Task]]:
    """(training, held-out) tasks drawn from `seed` (the same for the same seed)."""
    rng = random.Random(f"funcs-{seed}")
    names = sorted({a + b for a in SYLLABLES for b in SYLLABLES})
    rng.shuffle(names)
    names = names[:ROWS]
    train, held_out = [], []
    for shift, kind in enumerate(KINDS):
        for row in range(ROWS):
            task = funcs_task(names[(row + shift) % ROWS], kind, rng.randint(2, 9), f"funcs/{kind}-{row:03d}")
            (held_out if row % HELD_OUT_EVERY == 0 else train).append(task)
    return train, held_out


def confusion_rates(noise: float, seed: int) -> dict[str, float]:
    """Per kind, the rate at which demonstrations submit the partner operation. In each pair one
    kind (drawn with `seed`) is confused: its rates are evenly spaced over [noise + 0.05, noise +
    0.25] (clipped to 0.9) and dealt to the pairs in a `seed`-shuffled order, so its greedy choice is
    the partner's operation; the other kind gets noise / 5, mostly right.

    Why not one spread over all eight kinds: a pair whose two rates sum to 1 gives both kinds the
    same chance of each operation, so the demonstrations never show that the words decide; the
    warm-started model then ignores them, and RL on one kind moves the other the opposite way (GRPO
    on `larger` alone took its right operation 0.23 -> 0.60 and `smaller`'s 0.73 -> 0.24; the
    benchmark on that design moved no held-out choice, docs/env_code.md)."""
    rng = random.Random(f"funcs-confusions-{seed}")
    pairs = sorted({tuple(sorted((kind, KINDS[kind][2]))) for kind in KINDS})
    high = [min(noise + 0.05 + 0.2 * i / (len(pairs) - 1), 0.9) for i in range(len(pairs))]
    rng.shuffle(high)
    rates: dict[str, float] = {}
    for (first, second), rate in zip(pairs, high):
        confused, right = (first, second) if rng.random() < 0.5 else (second, first)
        rates[confused], rates[right] = rate, noise / 5
    return dict(sorted(rates.items()))


def demonstrations(setup: "Setup", cfg: "RunConfig", rng: random.Random) -> tuple[list[Task], list[list[str]], dict[str, Any]]:
    """`model.warmstart.num_traces` training tasks drawn with `rng`, each with one turn submitting
    its function, or the partner operation's at the kind's rate (`confusion_rates`)."""
    from tiderl.envs.code.env import tool_call_text

    if setup.name != "funcs":
        raise ValueError(f"the embedded tiny model of the code environment is built on data.source=funcs, not "
                         f"data.source={setup.name}. Fix: set data.source=funcs, or pass a real model "
                         "(model.path=DIR; tiderl eval --model DIR)")
    rates = confusion_rates(cfg.model.warmstart.relation_noise, cfg.seed)
    kept_out = {t.task_id for t in copy_check_tasks(setup, cfg.seed)}
    shown_tasks = [t for t in setup.train_tasks if t.task_id not in kept_out]
    tasks = [rng.choice(shown_tasks) for _ in range(cfg.model.warmstart.num_traces)]
    scripts = []
    for task in tasks:
        kind, name = task.meta["kind"], task.meta["entry_points"][0]
        shown = KINDS[kind][2] if rng.random() < rates[kind] else kind
        scripts.append([tool_call_text("submit", {"code": function_code(name, shown, task.meta["constant"])})])
    return tasks, scripts, {"confusion_rates": {k: round(r, 3) for k, r in rates.items()}}


def copy_check_tasks(setup: "Setup", seed: int) -> list[Task]:
    """A `seed`-drawn eighth of the training tasks: the copy check asks them, the demonstrations
    never show them (so passing it means copying names and constants into code for tasks the
    supervised model never saw, as the held-out tasks need, without touching the held-out split)."""
    tasks = sorted(setup.train_tasks, key=lambda t: t.task_id)
    return random.Random(f"funcs-copy-check-{seed}").sample(tasks, max(1, len(tasks) // 8))


def copy_check(setup: "Setup", cfg: "RunConfig") -> tuple[list[Task], list[list[str]], Any]:
    """The warm start's copy check: up to `model.warmstart.copy_check_size` of `copy_check_tasks`
    (meta["kind"] set), their reference turns (which give the prompts the RL layout), and
    `copied(task, text)`: whether a turn submits the kind's function or its partner's, name and
    constant copied (which of the two is the demonstrations' business)."""
    from tiderl.envs.code.env import tool_call_text

    tasks = copy_check_tasks(setup, cfg.seed)
    size = min(len(tasks), cfg.model.warmstart.copy_check_size)
    tasks = random.Random(f"funcs-copy-check-size-{cfg.seed}").sample(tasks, size)

    def copied(task: Task, text: str) -> bool:
        name, kind, k = task.meta["entry_points"][0], task.meta["kind"], task.meta["constant"]
        return any(json.dumps(function_code(name, shown, k)) in text for shown in (kind, KINDS[kind][2]))

    return tasks, [[tool_call_text("submit", {"code": t.meta["reference"]})] for t in tasks], copied


# The sandbox's limits cannot change what the model learns.
WARM_START = WarmStart(demonstrations=demonstrations, copy_check=copy_check, key_modules=("tiderl.envs.code.funcs",),
                       unkeyed_options=("sandbox_cpu_s", "sandbox_wall_s", "sandbox_memory_mb", "sandbox_concurrency"))
