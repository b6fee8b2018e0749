"""Fuzzing an environment with random and malformed agent outputs.

    python -m tiderl.envs.fuzz kg --outputs 1000 --seed 0     # prints the counts, exits 1 on a failure
    report = fuzz_environment(fuzz_config("kg"), outputs=1000)

No model output may crash training: whatever a policy writes, the environment answers with an
observation (or ends the episode), and that observation renders through the chat template and
the tokenizer. `agent_outputs` makes a seeded list of outputs a policy could write, most of them
malformed: broken, nested and huge JSON in `<tool_call>` tags, fenced JSON, unknown tools,
wrong argument types, huge integers, lone surrogates and control characters, empty and
enormous outputs, final-answer variants, repeated calls, and calls of the environment's real
tools (from `tool_schemas()`) with garbage arguments or with words of its tasks.

`fuzz_environment` builds the environment from its setup (`env.name`), plays the outputs as
episodes of a few turns (reset, then each output parsed as the agent loop parses it and given
to `step`, `finish` when no output ended the episode) and renders every answer's tokens as the
agent loop does (`ChatFormat.answer_ids`). Each call runs under a time limit, so a hang is
counted rather than waited for. The `FuzzReport` counts exceptions, hangs and contract
violations (an answer that is not a `StepResult` of text or `Observation` observations and a
finite reward, or text a tokenizer cannot encode; an `Observation`'s text is rendered, its
images checked to be PIL images) and keeps the first few offending outputs.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tiderl.agent.chat import CONTINUE_MESSAGE, ChatFormat, chat_format
from tiderl.agent.tool_parser import parse_hermes_tool_calls
from tiderl.envs.protocol import Observation, StepResult, Task, message_text
from tiderl.envs.setup import load_setup

if TYPE_CHECKING:
    from tiderl.config import RunConfig

__all__ = ["agent_outputs", "fuzz_config", "fuzz_environment", "FuzzReport"]

# ----------------------------------------------------------------------------- the outputs

# Values a model may put where an argument belongs: wrong types, huge numbers, odd text.
_GARBAGE_VALUES: list[Any] = [
    None, True, False, 0, -1, 1.5, float("1e308"), 10**300, 10**400, -(10**400), [], {}, [1, [2, [3]]],
    {"variable": "#0"}, "", " ", "#", "#-1", "#0", "#1", "#00000000000000000001", "#" + "9" * 5000,
    "#" + "0" * 5000 + "1", "#0.5", "#１", "#٣", "[", "]", "[]", "None", "null", "NaN", "Infinity",
    "1" + "0" * 5000, "9" * 4000 + "-01-01", "2001-05-03T10:00:00Z", "\u0000", "\x1b[31mred",
    "line\nbreak", "tab\there", "\u202eevil", "\ufeff", "\uffff", "\U0010ffff", "💥", "a" * 100_000,
    "<tool_call>", "</tool_call>", "<|im_end|>", "<|im_start|>assistant", "{{ raise }}", "{% for %}",
    "' OR 1=1 --", "\" ; DROP TABLE x; --", "\\", "\\u", "%s%s%n", "../../etc/passwd",
]

# Numbers past what a float holds, at its edges, and the non-finite ones JSON decoding accepts.
_GARBAGE_NUMBERS: list[Any] = [10**400, -(10**400), 10**300, 2**63, 2**1024, 1e308, -1e308, 5e-324, -0.0,
                               float("inf"), float("-inf"), float("nan"), 0, 1.5]

# JSON-escaped values a model writes as text (lone surrogates, control characters): they only
# become odd code points once the tool call's JSON is decoded.
_ESCAPED_VALUES = [r"\ud83d", r"\udc00", r"\ud83d\ude00", r"\ud800\ud800", r"\u0000", r"\u001f",
                   r"\u007f", r"\ufffe", r"\ud83dx", r"x\udfff"]

_FINAL_ANSWERS = [
    "Final Answer: #0", "FINAL ANSWER: #0", "final answer: #0", "Final answer:#1", "Final Answer: # 0",
    "Final Answer #0", "Final Answer: #-1", "Final Answer: #", "Final Answer:", "Final Answer: Paris",
    "**Final Answer:** #0", "Final Answer: #0.5", "Final Answer: #１", "Final Answer: #" + "9" * 5000,
    "Final Answer: #" + "0" * 5000, "Final Answer: #999999999999", "Final Answer: #0 Final Answer: #1",
    "final_answer: #0", "Final Answer: [#0]", "Final Answer: {\"answer\": \"#0\"}", "The final answer is #0.",
    "Final Answer: #\ud83d", "Final Answer: #0\u0000", "Final\nAnswer:\n#0", "FINAL ANSWER: " + "#0" * 1000,
]


def _call(name: Any, arguments: Any) -> str:
    """A well-formed tool-call block (whatever the name and arguments hold)."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def _tool_names(tool_schemas: list[dict[str, Any]]) -> list[str]:
    names = []
    for schema in tool_schemas:
        fn = schema.get("function") if isinstance(schema, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            names.append(fn["name"])
    return names or ["tool"]


def _parameters(tool_schemas: list[dict[str, Any]], name: str) -> list[str]:
    """The argument names of tool `name` in its schema (properties, required first)."""
    for schema in tool_schemas:
        fn = schema.get("function") if isinstance(schema, dict) else None
        if isinstance(fn, dict) and fn.get("name") == name:
            params = fn.get("parameters") or {}
            names = list(params.get("required") or []) + list(params.get("properties") or {})
            return list(dict.fromkeys(n for n in names if isinstance(n, str)))
    return []


def _parameter_type(tool_schemas: list[dict[str, Any]], name: str, parameter: str) -> str:
    """The JSON type a tool's schema declares for one argument ("" when none)."""
    for schema in tool_schemas:
        fn = schema.get("function") if isinstance(schema, dict) else None
        if isinstance(fn, dict) and fn.get("name") == name:
            spec = ((fn.get("parameters") or {}).get("properties") or {}).get(parameter)
            return str(spec.get("type", "")) if isinstance(spec, dict) else ""
    return ""


class _Generator:
    """The families of outputs; each method returns one output text."""

    def __init__(self, rng: random.Random, tool_schemas: list[dict[str, Any]], words: list[str],
                 seeds: list[str]) -> None:
        self.rng = rng
        self.schemas = tool_schemas
        self.tools = _tool_names(tool_schemas)
        self.words = words or ["x"]
        self.seeds = seeds or [_call(self.tools[0], {})]

    # -- building blocks
    def word(self) -> str:
        return self.rng.choice(self.words)

    def variable(self) -> str:
        return f"#{self.rng.choice([0, 0, 1, 2, 3, 7, 50])}"

    def plausible(self) -> str:
        return self.variable() if self.rng.random() < 0.4 else self.word()

    def garbage(self) -> Any:
        """A garbage value, sometimes inside a list (where a tool takes a list of values)."""
        value = self.rng.choice(_GARBAGE_VALUES)
        return [value, self.rng.choice(_GARBAGE_VALUES)] if self.rng.random() < 0.25 else value

    def real_arguments(self, name: str, value: Callable[[], Any]) -> dict[str, Any]:
        return {p: value() for p in _parameters(self.schemas, name)}

    # -- families
    def real_tool_plausible_arguments(self) -> str:
        """A real tool with words of the tasks and small variables (reaches the tools' logic)."""
        name = self.rng.choice(self.tools)
        return _call(name, self.real_arguments(name, self.plausible))

    def real_tool_garbage_arguments(self) -> str:
        name = self.rng.choice(self.tools)
        args = self.real_arguments(name, lambda: self.garbage() if self.rng.random() < 0.7 else self.plausible())
        for parameter in args:
            if _parameter_type(self.schemas, name, parameter) == "array" and self.rng.random() < 0.7:
                # The declared type, holding garbage: huge and odd numbers, nested values.
                args[parameter] = [self.rng.choice(_GARBAGE_NUMBERS if self.rng.random() < 0.5 else _GARBAGE_VALUES)
                                   for _ in range(self.rng.randint(1, 3))]
        roll = self.rng.random()
        if roll < 0.15 and args:
            args.pop(self.rng.choice(list(args)))  # a missing argument
        elif roll < 0.3:
            args[self.rng.choice(["extra", "", "variable ", "\u0000", "x" * 500])] = self.garbage()
        return _call(name, args)

    def wrong_argument_shape(self) -> str:
        name = self.rng.choice(self.tools)
        args = self.rng.choice([[], "#0", 5, None, True, [self.plausible()], '{"variable": "#0"}', "{not json",
                                json.dumps(self.real_arguments(name, self.plausible)), ""])
        return _call(name, args)

    def unknown_tool(self) -> str:
        name = self.rng.choice(["no_such_tool", "", " ", self.tools[0].upper(), self.tools[0] + " ",
                                "a" * 10_000, "\u0000", "💥", "get relations", "__import__", "<tool_call>"])
        return _call(name, {"variable": self.plausible()})

    def bad_name_type(self) -> str:
        return _call(self.garbage() if self.rng.random() < 0.5 else self.rng.choice([1, None, [], {}]),
                     {"variable": "#0"})

    def escaped_code_points(self) -> str:
        """Lone surrogates and control characters as JSON escapes, in the name or an argument."""
        escape = self.rng.choice(_ESCAPED_VALUES)
        name = self.rng.choice(self.tools)
        params = _parameters(self.schemas, name) or ["variable"]
        if self.rng.random() < 0.3:
            return f'<tool_call>{{"name": "{name}{escape}", "arguments": {{}}}}</tool_call>'
        body = ", ".join(f'"{p}": "{self.word()}{escape}"' for p in params)
        if self.rng.random() < 0.3:
            body = f'"{escape}": "#0"'  # the escape in an argument's name
        return f'<tool_call>{{"name": "{name}", "arguments": {{{body}}}}}</tool_call>'

    def raw_odd_characters(self) -> str:
        """Control characters, lone surrogates and BOMs in the text itself (an engine's decoder
        never makes lone surrogates, but a custom one or a script might)."""
        chars = "\u0000\u0001\u0007\b\t\n\v\f\r\u001b\u007f\u0085\u00a0\u200b\u2028\u2029\u202e\ufeff\ufffd\uffff"
        noise = "".join(self.rng.choice(chars) for _ in range(self.rng.randint(1, 40)))
        if self.rng.random() < 0.3:
            noise += self.rng.choice(["\ud83d", "\udc00"])
        name = self.rng.choice(self.tools)
        return self.rng.choice([noise, f"{noise}{_call(name, self.real_arguments(name, self.plausible))}",
                                _call(name, self.real_arguments(name, lambda: noise))])

    def huge_integers(self) -> str:
        name = self.rng.choice(self.tools)
        digits = "9" * self.rng.choice([20, 400, 4300, 5000, 20_000])
        return self.rng.choice([
            f'<tool_call>{{"name": "{name}", "arguments": {{"variable": {digits}}}}}</tool_call>',
            f'<tool_call>{{"name": "{name}", "arguments": {{"variable": "#{digits}"}}}}</tool_call>',
            f'<tool_call>{{"name": "{name}", "arguments": {{"variable": 1e999}}}}</tool_call>',
            f'<tool_call>{{"name": "{name}", "arguments": {{"variable": -{digits}.5e-{digits}}}}}</tool_call>',
            f"Final Answer: #{digits}",
        ])

    def broken_json(self) -> str:
        good = json.dumps({"name": self.rng.choice(self.tools), "arguments": {"variable": self.plausible()}})
        cut = self.rng.randint(0, len(good))
        body = self.rng.choice([
            good[:cut], good[cut:], good.replace('"', "'"), good + ",", good[:-1] + ",}", "{" + good,
            good.replace(":", "", 1), "{}", "[]", "null", "42", '"just a string"', "{,}", "{\"name\"}",
            good.replace("}", "", 1), "\u0000" + good, good + good, "NaN", "{\"name\": NaN}",
        ])
        return f"<tool_call>{body}</tool_call>"

    def nested_json(self) -> str:
        depth = self.rng.choice([10, 100, 1000, 5000, 100_000])
        inner = self.rng.choice(["[" * depth + "]" * depth, "{\"a\":" * depth + "1" + "}" * depth,
                                 "[" * depth])
        name = self.rng.choice(self.tools)
        where = self.rng.random()
        if where < 0.4:
            return f'<tool_call>{{"name": "{name}", "arguments": {{"variable": {inner}}}}}</tool_call>'
        if where < 0.7:
            return f'<tool_call>{{"name": "{name}", "arguments": {inner}}}</tool_call>'
        return f"<tool_call>{inner}</tool_call>"

    def huge_json(self) -> str:
        name = self.rng.choice(self.tools)
        roll = self.rng.random()
        if roll < 0.4:
            return _call(name, {"variable": self.word() * self.rng.choice([1000, 20_000])})
        if roll < 0.7:
            return _call(name, {f"k{i}": i for i in range(self.rng.choice([100, 5000]))})
        return _call(name, {"variable": [self.plausible()] * self.rng.choice([100, 10_000])})

    def fenced_json(self) -> str:
        call = json.dumps({"name": self.rng.choice(self.tools), "arguments": {"variable": self.plausible()}})
        return self.rng.choice([
            f"```json\n{call}\n```", f"<tool_call>\n```json\n{call}\n```\n</tool_call>", f"```\n{call}\n```",
            f"<tool_call>```{call}```</tool_call>", f"Action: {call}", call,
        ])

    def tags(self) -> str:
        """Unbalanced, repeated and nested tags."""
        call = json.dumps({"name": self.rng.choice(self.tools), "arguments": {"variable": self.plausible()}})
        n = self.rng.choice([2, 50, 500])
        return self.rng.choice([
            "<tool_call>" * n, "</tool_call>" * n, f"<tool_call>{call}", f"{call}</tool_call>",
            f"<tool_call><tool_call>{call}</tool_call></tool_call>", f"<tool_call>{call}</tool_call>" * n,
            "<tool_call></tool_call>", "<TOOL_CALL>" + call + "</TOOL_CALL>", "<tool_call >" + call + "</tool_call>",
            ("<tool_call>" + call) * n,
        ])

    def empty(self) -> str:
        return self.rng.choice(["", " ", "\n", "\n\n\n", "\t", "<|im_end|>", "\u200b"])

    def enormous(self) -> str:
        size = self.rng.choice([10_000, 100_000, 300_000])
        unit = self.rng.choice(["a", "ab ", "\n", "#0 ", "Final ", "{", "💥", self.word() + " "])
        return (unit * (size // len(unit) + 1))[:size]

    def final_answer(self) -> str:
        text = self.rng.choice(_FINAL_ANSWERS)
        if self.rng.random() < 0.3:
            text = f"{self.real_tool_plausible_arguments()}\n{text}"
        return text

    def repeated_calls(self) -> str:
        call = self.rng.choice([self.real_tool_plausible_arguments(), self.rng.choice(self.seeds)])
        return "\n".join([call] * self.rng.choice([2, 20, 100]))

    def mutated_seed(self) -> str:
        """A correct turn (the oracle's) with a few characters deleted, doubled or replaced."""
        text = list(self.rng.choice(self.seeds))
        for _ in range(self.rng.randint(1, 6)):
            if not text:
                break
            i = self.rng.randrange(len(text))
            op = self.rng.random()
            if op < 0.35:
                del text[i]
            elif op < 0.6:
                text.insert(i, text[i])
            else:
                text[i] = self.rng.choice(['"', "{", "}", "\\", ":", ",", "#", "\u0000", "9", " ", "\\u"])
        return "".join(text)

    def seed(self) -> str:
        """A correct turn as it is (keeps episodes going deep enough to reach later states)."""
        return self.rng.choice(self.seeds)

    def prose(self) -> str:
        return " ".join(self.word() for _ in range(self.rng.randint(1, 30)))

    def mixture(self) -> str:
        parts = [self.rng.choice(self.families)() for _ in range(self.rng.randint(2, 4))]
        return self.rng.choice(["\n", " ", ""]).join(parts)

    @property
    def families(self) -> list[Callable[[], str]]:
        return [self.real_tool_plausible_arguments, self.real_tool_garbage_arguments, self.wrong_argument_shape,
                self.unknown_tool, self.bad_name_type, self.escaped_code_points, self.raw_odd_characters,
                self.huge_integers, self.broken_json, self.nested_json, self.huge_json, self.fenced_json,
                self.tags, self.empty, self.enormous, self.final_answer, self.repeated_calls,
                self.mutated_seed, self.seed, self.prose]


def agent_outputs(count: int, seed: int, tool_schemas: list[dict[str, Any]], words: Sequence[str] = (),
                  seeds: Sequence[str] = ()) -> list[str]:
    """`count` agent outputs, the same for the same arguments (see the module docstring).

    tool_schemas: the environment's tools (their names and argument names are used).
    words: text of the environment's tasks (entity names, relations) for plausible arguments.
    seeds: correct turns (e.g. the oracle's) that are replayed and mutated.
    Every family of outputs appears about equally often; one in ten is a mixture of several.
    """
    rng = random.Random(seed)
    gen = _Generator(rng, tool_schemas, list(words), list(seeds))
    families = gen.families
    outputs = []
    for i in range(count):
        make = gen.mixture if i % 10 == 9 else families[i % len(families)]
        outputs.append(make())
    return outputs


def _task_words(tasks: list[Task], limit: int = 200) -> list[str]:
    """Short strings of the tasks: bracketed names and words of the prompts, and the string
    values of their meta (topic entities, relation paths)."""
    words: list[str] = []

    def visit(value: Any, depth: int = 0) -> None:
        if isinstance(value, str) and 0 < len(value) <= 80:
            words.append(value)
        elif isinstance(value, (list, tuple)) and depth < 3:
            for v in value[:20]:
                visit(v, depth + 1)
        elif isinstance(value, dict) and depth < 3:
            for k, v in list(value.items())[:20]:
                visit(k, depth + 1)
                visit(v, depth + 1)

    for task in tasks:
        words += re.findall(r"\[([^\]]{1,80})\]", task.prompt)
        words += re.findall(r"\w+", task.prompt)[:10]
        visit(task.meta)
    return list(dict.fromkeys(words))[:limit]


# ----------------------------------------------------------------------------- the driver

@dataclass
class FuzzReport:
    """What `fuzz_environment` found.

    outputs / episodes / steps: outputs played, episodes started, `step` calls made;
    answers: episodes a step ended (`done`), finished: episodes ended by `finish`;
    exceptions: calls that raised (parse, reset, step, finish or rendering), by phase in
        `by_phase`; hangs: calls that did not return within the time limit;
    violations: answers that break the contract without raising (not a StepResult, an
        observation that is not text or not valid UTF-8, a non-finite reward);
    by_phase: the exceptions and hangs by the call that raised (reset, step, render, finish)
        plus the violations (contract);
    examples: the first offending outputs, each as "phase: what happened: output".
    """

    env_name: str
    outputs: int = 0
    episodes: int = 0
    steps: int = 0
    answers: int = 0
    finished: int = 0
    exceptions: int = 0
    hangs: int = 0
    violations: int = 0
    by_phase: dict[str, int] = field(default_factory=dict)
    examples: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exceptions == 0 and self.hangs == 0 and self.violations == 0

    def counts(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("env_name", "outputs", "episodes", "steps", "answers", "finished",
                                              "exceptions", "hangs", "violations", "by_phase")} | {
            "seconds": round(self.seconds, 2)}

    def text(self) -> str:
        lines = [f"fuzz {self.env_name}: {self.outputs} outputs, {self.episodes} episodes, {self.steps} steps, "
                 f"{self.answers} answers, {self.finished} finished; {self.exceptions} exceptions "
                 f"{self.by_phase or ''}, {self.hangs} hangs, {self.violations} violations in {self.seconds:.1f} s"]
        lines += [f"  {e}" for e in self.examples]
        return "\n".join(lines)


class _Hang(Exception):
    """A call did not return within the time limit."""


def _timed(fn: Callable[[], Any], timeout_s: float) -> Any:
    """fn() in a daemon thread; its result, its exception re-raised, or _Hang after timeout_s
    (the thread is left running: Python cannot stop it, and the environment is dropped)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True, name="tiderl-fuzz")
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise _Hang(f"no answer within {timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def _short(text: str, limit: int = 160) -> str:
    shown = ascii(text)
    return shown if len(shown) <= limit else f"{shown[:limit]}... ({len(text)} characters)"


def _result_problem(result: Any) -> str:
    """Why `result` breaks the StepResult contract ("" when it does not)."""
    if not isinstance(result, StepResult):
        return f"returned {type(result).__name__}, not a StepResult"
    if not isinstance(result.observations, list):
        return f"observations is a {type(result.observations).__name__}, not a list"
    for obs in result.observations:
        if isinstance(obs, Observation):
            from tiderl.envs.check import message_problem

            problem = message_problem(obs)
            if problem:
                return f"an observation is {problem}"
            obs = obs.text
        if not isinstance(obs, str):
            return f"an observation is a {type(obs).__name__}, not text or an Observation"
        try:
            obs.encode("utf-8")
        except UnicodeEncodeError as exc:
            return f"an observation is not valid text ({exc.reason} at {exc.start}): {_short(obs)}"
    try:
        finite = math.isfinite(float(result.reward))
    except (TypeError, ValueError):
        finite = False
    if not finite:
        return f"reward {result.reward!r} is not a finite number"
    return ""


def fuzz_environment(cfg: "RunConfig", outputs: int = 1000, seed: int = 0, tokenizer: Any = None,
                     turns_per_episode: int = 4, step_timeout_s: float = 5.0, max_examples: int = 5) -> FuzzReport:
    """Play `outputs` fuzzed agent outputs (`agent_outputs`) against the environment `cfg.env.name`.

    Episodes of `turns_per_episode` outputs: a fresh environment (`make_env()`), `reset` with a
    task drawn from the setup's tasks, each output parsed as the agent loop parses a turn
    (`parse_hermes_tool_calls`) and given to `step`, whose answer is rendered to tokens as the
    loop renders it (`ChatFormat.answer_ids`, with `tokenizer`, default: a small one trained on
    the environment's own text); `finish("max_turns")` when no step ended the episode. Each of
    these calls has `step_timeout_s`; an episode stops at its first exception or hang (its
    remaining outputs are skipped, and counted only in `outputs`).
    """
    start = time.perf_counter()
    report = FuzzReport(env_name=cfg.env.name)
    setup = load_setup(cfg)
    tasks = list(setup.train_tasks[:50]) + list(setup.eval_tasks[:50])
    if not tasks:
        raise ValueError(f"env.name={cfg.env.name}: its setup has no tasks to fuzz with")
    probe = setup.make_env()
    schemas = probe.tool_schemas()
    seeds: list[str] = []
    if setup.oracle is not None:
        for task in tasks[:5]:
            try:
                seeds += setup.oracle(task)
            except Exception:  # noqa: BLE001 - an oracle that cannot solve a task gives no seeds
                continue
    texts = agent_outputs(outputs, seed, schemas, _task_words(tasks), seeds)
    if tokenizer is None:
        tokenizer = _tokenizer([probe.system_prompt(), json.dumps(schemas), *(t.prompt for t in tasks), *seeds])
    fmt = chat_format(tokenizer, schemas)
    rng = random.Random(seed + 1)

    def offend(phase: str, what: str, text: str) -> None:
        report.by_phase[phase] = report.by_phase.get(phase, 0) + 1
        if len(report.examples) < max_examples:
            report.examples.append(f"{phase}: {what}: {_short(text)}")

    for episode in _chunks(texts, turns_per_episode):
        report.outputs += len(episode)
        report.episodes += 1
        phase, text = "reset", ""
        try:
            env = setup.make_env()
            task = rng.choice(tasks)
            _timed(lambda: _render_prompt(fmt, env, task), step_timeout_s)
            done = False
            for text in episode:
                report.steps += 1
                phase = "step"
                result = _timed(lambda: env.step(parse_hermes_tool_calls(text, strip=(fmt.end_of_turn,))),
                                step_timeout_s)
                problem = _result_problem(result)
                if problem:
                    report.violations += 1
                    offend("contract", problem, text)
                if not isinstance(result, StepResult):
                    break
                if result.done:
                    report.answers += 1
                    done = True
                    break
                phase = "render"
                _timed(lambda: fmt.answer_ids([message_text(o) for o in result.observations], CONTINUE_MESSAGE),
                       step_timeout_s)
            if not done:
                phase, text = "finish", "(finish after the episode's outputs)"
                result = _timed(lambda: env.finish("max_turns"), step_timeout_s)
                report.finished += 1
                problem = _result_problem(result)
                if problem:
                    report.violations += 1
                    offend("contract", problem, text)
        except _Hang as exc:
            report.hangs += 1
            offend(phase, f"hang, {exc}", text)
        except Exception as exc:  # noqa: BLE001 - what the fuzz is looking for
            report.exceptions += 1
            offend(phase, f"{type(exc).__name__}: {_short(str(exc), 200)}", text)
    report.seconds = time.perf_counter() - start
    return report


def fuzz_config(env_name: str, *overrides: str) -> "RunConfig":
    """The config of environment `env_name` with `overrides`; with no data.source among them, the
    environment reads its default source (the first it registers), so a name alone is enough."""
    from tiderl.config import load_config

    return load_config(None, [f"env.name={env_name}", *overrides])


def _chunks(items: list[str], size: int) -> Iterator[list[str]]:
    for i in range(0, len(items), max(1, size)):
        yield items[i:i + size]


def _render_prompt(fmt: ChatFormat, env: Any, task: Task) -> list[int]:
    """reset + the first prompt's tokens, as the agent loop starts an episode (the text of an
    `Observation`: the fuzz's tokenizer is text-only; its images are checked, not rendered)."""
    first = env.reset(task)
    if isinstance(first, Observation):
        from tiderl.envs.check import message_problem

        problem = message_problem(first)
        if problem:
            raise TypeError(f"reset returned {problem}")
    return fmt.prompt_ids([{"role": "system", "content": env.system_prompt()},
                           {"role": "user", "content": message_text(first)}])


def _tokenizer(texts: list[str]) -> Any:
    """A small byte-level tokenizer with tiderl's chat template (no download)."""
    from tiderl.embedded.tiny import train_tokenizer

    return train_tokenizer([t for t in texts if t] * 2, vocab_size=400)


def main(argv: list[str] | None = None) -> int:
    """`python -m tiderl.envs.fuzz ENV [overrides...]`: print the counts; exit 1 on a failure."""
    parser = argparse.ArgumentParser(prog="python -m tiderl.envs.fuzz", description=__doc__.split("\n\n")[0])
    parser.add_argument("env", help="env.name: a built-in environment (kg, db) or a user's module:Class")
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. data.data_dir=/data")
    parser.add_argument("--outputs", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds each call may take")
    args = parser.parse_args(argv)
    report = fuzz_environment(fuzz_config(args.env, *args.overrides), outputs=args.outputs, seed=args.seed,
                              step_timeout_s=args.timeout)
    print(report.text())
    print(json.dumps(report.counts()))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
