"""The math environment's setup (`env.name=math`), one per `data.source`:

| source | train tasks | eval tasks |
| --- | --- | --- |
| `arithmetic` | `env.options.num_train_tasks` generated questions | `data.eval_size` other generated questions |
| `digit_arithmetic` | `env.options.num_train_tasks` of its 540 questions | `data.eval_size` other questions (single turn, no calculator) |
| `small_arithmetic` | `env.options.num_train_tasks` generated questions | `data.eval_size` generated questions over number pairs no training question uses |
| `place_value` | `env.options.num_train_tasks` questions about three-digit numbers | `data.eval_size` questions about other numbers (single turn, no calculator) |
| `gsm8k`, `math500`, `aime24`, `aime25`, `amc23` | none (the files are test sets) | a fixed-seed sample of at most `data.eval_size` |

The environment is configured by its options (`tiderl.envs.math.registration.MathOptions`:
`env.options.calculator` (multi-turn), `format_penalty`, `verify_timeout_s`), `env.system_prompt`
and `env.max_observation_chars`. One `AnswerVerifier` (math-verify worker processes) is shared by
every environment of a setup.

The oracle answers every task with its reference answer, `\\boxed{<gold>}`; with the
calculator on, an arithmetic task's oracle first calls the calculator with the task's
expression. `WARM_START` gives the embedded tiny model's warm start on the generated sources
(`demonstrations`, and `copy_check` for place_value).
"""

from __future__ import annotations

import json
import random
from typing import TYPE_CHECKING, Any

from tiderl.envs.math.calculator import CalculatorError, calculate
from tiderl.envs.math.data import (
    ARITHMETIC_KINDS,
    BENCHMARK_FILES,
    DIGIT_ARITHMETIC_KINDS,
    PLACE_VALUE_KINDS,
    SMALL_ARITHMETIC_KINDS,
    Kind,
    arithmetic_tasks,
    digit_arithmetic_tasks,
    file_tasks,
    load_benchmark,
    place_value_tasks,
    small_arithmetic_tasks,
)
from tiderl.envs.math.env import MathEnv
from tiderl.envs.math.registration import SOURCES as MATH_SOURCES
from tiderl.envs.math.verify import AnswerVerifier
from tiderl.envs.protocol import Task
from tiderl.envs.registration import WarmStart
from tiderl.envs.setup import Setup, data_root, file_split, files_name, sample_tasks

if TYPE_CHECKING:
    from tiderl.config import RunConfig

# The generated sources the embedded tiny model can be built for, with their kinds of question.
GENERATED_KINDS: dict[str, tuple[Kind, ...]] = {"arithmetic": ARITHMETIC_KINDS,
                                                "small_arithmetic": SMALL_ARITHMETIC_KINDS,
                                                "digit_arithmetic": DIGIT_ARITHMETIC_KINDS,
                                                "place_value": PLACE_VALUE_KINDS}
# The generated sources whose tiny model answers in one turn, without the calculator.
SINGLE_TURN_SOURCES = ("digit_arithmetic", "place_value")


def setup(cfg: "RunConfig") -> Setup:
    """The tasks of `data.source` (or of `data.train_files` / `data.eval_files`, in place of the
    source's) and a factory of `MathEnv`s (module docstring)."""
    data, options = cfg.data, cfg.env.options
    train_files, eval_files = file_split(data)
    if train_files and eval_files:  # the source's own tasks are not needed
        train, held_out = [], []
    elif data.source == "arithmetic":
        train, held_out = arithmetic_tasks(data.seed, options.num_train_tasks, data.eval_size)
    elif data.source == "digit_arithmetic":
        train, held_out = digit_arithmetic_tasks(data.seed, options.num_train_tasks, data.eval_size)
    elif data.source == "small_arithmetic":
        train, held_out = small_arithmetic_tasks(data.seed, options.num_train_tasks, data.eval_size)
    elif data.source == "place_value":
        train, held_out = place_value_tasks(data.seed, options.num_train_tasks, data.eval_size)
    elif data.source in BENCHMARK_FILES:
        root = data_root(data.data_dir)
        try:
            tasks = load_benchmark(root, data.source)
        except FileNotFoundError as exc:
            raise FileNotFoundError(
                f"{exc}. Fix: set data.data_dir to the folder that holds {BENCHMARK_FILES[data.source]}, "
                "or the TIDERL_DATA_DIR environment variable.") from None
        train, held_out = [], sample_tasks(tasks, data.eval_size, data.seed)
    else:
        raise ValueError(f"data.source={data.source!r} is not a math source. Fix: use one of "
                         f"{', '.join(MATH_SOURCES)} with env.name=math.")
    if train_files:
        train = file_tasks(train_files, data.fields)
    if eval_files:
        held_out = sample_tasks(file_tasks(eval_files, data.fields), data.eval_size, data.seed)
    name = files_name(train_files, eval_files, data.source)  # no warm start for files
    out = Setup(train, held_out, _no_env, name)
    env = cfg.env
    out.make_env = _MathFactory(out, options.calculator, options.format_penalty, options.verify_timeout_s,
                                env.system_prompt or None, env.max_observation_chars, options.answer_fallback)
    tools = options.calculator
    out.oracle = lambda task: oracle_turns(task, tools)
    return out


def _no_env() -> MathEnv:
    raise RuntimeError("the setup's environment factory was not set")


class _MathFactory:
    """`make_env` of a math setup: a `MathEnv` on the setup's shared verifier (built on first
    use, in the process that plays the episodes)."""

    def __init__(self, setup: Setup, tools: bool, format_penalty: float, timeout_s: float,
                 system_prompt: str | None, max_observation_chars: int, answer_fallback: str) -> None:
        self.setup, self.tools, self.format_penalty, self.timeout_s = setup, tools, format_penalty, timeout_s
        self.system_prompt, self.max_observation_chars = system_prompt, max_observation_chars
        self.answer_fallback = answer_fallback

    def __call__(self) -> MathEnv:
        verifier = self.setup.backend(("math-verify", self.timeout_s), lambda: AnswerVerifier(self.timeout_s))
        return MathEnv(verifier, tools=self.tools, format_penalty=self.format_penalty,
                       system_prompt=self.system_prompt, max_observation_chars=self.max_observation_chars,
                       answer_fallback=self.answer_fallback)


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """One Hermes-format tool call, as the agent loop's parser reads it."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def oracle_turns(task: Task, tools: bool) -> list[str]:
    """The reference answer as assistant turns: `\\boxed{<gold>}`, after a calculator call with
    the task's expression when the calculator is on and the task has one (arithmetic)."""
    turns = []
    if tools and "expression" in task.meta:
        turns.append(tool_call_text("calculator", {"expression": task.meta["expression"]}))
    turns.append(f"The answer is \\boxed{{{task.answer}}}.")
    return turns


def confusion_rates(noise: float, seed: int, kinds: tuple[Kind, ...] = ARITHMETIC_KINDS) -> dict[str, float]:
    """Per arithmetic kind, the rate at which demonstrations use the confused calculation:
    uniform in [noise - 0.3, noise + 0.3], clipped to [0, 0.9], so some kinds are mostly right
    in the demonstrations and some mostly wrong (a systematic error RL can fix)."""
    rng = random.Random(f"confusions-{seed}")
    return {k.name: min(max(noise + rng.uniform(-0.3, 0.3), 0.0), 0.9) for k in kinds}


def spread_confusion_rates(noise: float, seed: int, kinds: tuple[Kind, ...]) -> dict[str, float]:
    """Per kind, the rate at which demonstrations use the confused calculation: the rates are
    evenly spaced over [noise - 0.25, noise + 0.25] (clipped to [0, 0.9]) and dealt to the
    kinds in a `seed`-shuffled order. Unlike `confusion_rates`' independent draws, every seed
    gets the same set of rates, so about half the kinds are mostly right in the demonstrations
    and half mostly wrong, none hopelessly (at noise 0.5: 0.25 to 0.75)."""
    count = len(kinds)
    rates = [min(max(noise - 0.25 + 0.5 * i / max(count - 1, 1), 0.0), 0.9) for i in range(count)]
    random.Random(f"spread-confusions-{seed}").shuffle(rates)
    return {k.name: rate for k, rate in zip(kinds, rates)}


def demonstrations(setup: Setup, cfg: "RunConfig", rng: random.Random) -> tuple[list[Task], list[list[str]], dict[str, Any]]:
    """Warm-start scripts for the embedded tiny model on a generated source: `model.warmstart.num_traces`
    training tasks, each solved with the task's expression, or its confusion at the kind's rate
    (`confusion_rates`, or `spread_confusion_rates` for place_value, with
    `model.warmstart.relation_noise` as the mean): a calculator call and `\\boxed{<its result>}`
    (arithmetic, small_arithmetic), `\\boxed{<the result>}` alone (digit_arithmetic) or
    `Final Answer: <the result>` alone (place_value). Returns (tasks, scripts, build-report entries)."""
    if setup.name not in GENERATED_KINDS or (setup.name not in SINGLE_TURN_SOURCES) != cfg.env.options.calculator:
        raise ValueError("the embedded tiny model is built for data.source=arithmetic or small_arithmetic with the "
                         "calculator (env.options.calculator=true), or digit_arithmetic or place_value without it. "
                         "Fix: set one of those, or pass a real model (model.path=DIR; tiderl eval --model DIR) for "
                         "the math benchmarks")
    draw_rates = spread_confusion_rates if setup.name == "place_value" else confusion_rates
    rates = draw_rates(cfg.model.warmstart.relation_noise, cfg.seed, GENERATED_KINDS[setup.name])
    pool = setup.train_tasks
    if cfg.model.warmstart.copy_check_threshold > 0:  # the copy check's numbers are not demonstrated
        kept_out = copy_check_numbers(setup, cfg.seed)
        pool = [t for t in pool if t.meta["number"] not in kept_out]
    tasks = [rng.choice(pool) for _ in range(cfg.model.warmstart.num_traces)]
    scripts = []
    for task in tasks:
        confused = rng.random() < rates[task.meta["kind"]]
        expression = task.meta["confusion" if confused else "expression"]
        try:
            result = calculate(expression)
        except CalculatorError:
            result = "0"
        if cfg.env.options.calculator:
            scripts.append([tool_call_text("calculator", {"expression": expression}), f"\\boxed{{{result}}}"])
        elif setup.name == "place_value":
            # `Final Answer: ` ends in the same lone-space token that comes before the number in
            # every place_value question, so the answer's first digit has an anchor to copy from
            # (the token after that lone space in the question); after `\\boxed{` it had none, and
            # the model learned the answer's shape but wrote the same digits for every number.
            scripts.append([f"Final Answer: {result}"])
        else:  # single turn: the (possibly confused) result, boxed
            scripts.append([f"\\boxed{{{result}}}"])
    return tasks, scripts, {"confusion_rates": {k: round(r, 3) for k, r in rates.items()}}


def copy_check_numbers(setup: Setup, seed: int) -> set[int]:
    """A `seed`-drawn eighth of the numbers of a place_value setup's training questions: the
    warm start's copy check asks about them and its demonstrations never do, so passing the
    check means copying digits of numbers the supervised model never saw (as the held-out
    questions need), measured without touching the held-out split."""
    numbers = sorted({t.meta["number"] for t in setup.train_tasks})
    return set(random.Random(f"copy-check-{seed}").sample(numbers, max(1, len(numbers) // 8)))


def copy_check(setup: Setup, cfg: "RunConfig") -> tuple[list[Task], list[list[str]], Any]:
    """The warm start's copy check (`model.warmstart.copy_check_threshold`, place_value only):
    up to `model.warmstart.copy_check_size` training questions about `copy_check_numbers`, their
    reference scripts (which give the prompts the RL layout), and `copied(task, text) -> bool`:
    whether a model turn's answer is a copied variant, the right answer or the confused one
    (which of the two is the demonstrations' business; a digit copied wrong is neither)."""
    if setup.name != "place_value":
        raise ValueError(f"model.warmstart.copy_check_threshold is defined for data.source=place_value, not "
                         f"{setup.name!r}. Fix: set model.warmstart.copy_check_threshold=0.")
    from tiderl.envs.math.extract import extract_answer

    kept_out = copy_check_numbers(setup, cfg.seed)
    tasks = [t for t in setup.train_tasks if t.meta["number"] in kept_out]
    tasks = random.Random(f"copy-check-tasks-{cfg.seed}").sample(
        tasks, min(len(tasks), cfg.model.warmstart.copy_check_size))

    def copied(task: Task, text: str) -> bool:
        return extract_answer(text).answer in (task.answer, calculate(task.meta["confusion"]))

    return tasks, [[f"Final Answer: {t.answer}"] for t in tasks], copied


# The embedded tiny model's warm start (tiderl/models/embedded.py). The generated families still
# change: their generator's and demonstrations' source text keys the cached model.
# The reward's format penalty, the answer fallback and the verifier's time limit do not change the
# demonstrations' texts.
WARM_START = WarmStart(demonstrations=demonstrations, copy_check=copy_check,
                       key_modules=("tiderl.envs.math.data", "tiderl.envs.math.setup"),
                       unkeyed_options=("format_penalty", "answer_fallback", "verify_timeout_s"))
