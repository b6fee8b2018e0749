"""The math environment: answer a problem, optionally with a calculator tool.

Episode:

- single-turn (`tools=False`, `env.options.calculator=false`): the first model turn is the answer turn;
  the episode ends there.
- multi-turn (`tools=True`): the agent may call `calculator` (one observation per call, an
  `Error: ...` observation for a malformed call or a bad expression); the first turn without
  any tool call (and without a malformed one) is the answer turn and ends the episode. The turn
  and token limits end it through `finish` when no such turn comes.

Reward (on the answer turn): outcome = 1 when math-verify finds the extracted answer
(`extract.extract_answer`: last `\\boxed{}`, else `Final Answer:`, else `####`) equal to the
gold answer, else 0 (no answer, a wrong answer, an answer that could not be checked in time).
Format: when `format_penalty` > 0, an episode whose answer is not in a `\\boxed{}` (or that has
no answer, or ends at a limit) loses `format_penalty`. reward = outcome - format penalty;
`info["reward_parts"]` is {"outcome", "format"} and `info["success"]` the outcome.

`step` or `finish` after the episode ended (or before `reset`) raises `RuntimeError`: call
`reset(task)` first. Nothing else raises: every failure inside a tool is an `Error:`
observation, and every observation is valid text (lone surrogates replaced).
"""

from __future__ import annotations

import copy
from typing import Any

from tiderl.envs.math.calculator import ALLOWED, Bounds, CalculatorError, calculate
from tiderl.envs.math.extract import FALLBACKS, extract_answer
from tiderl.envs.math.text import clean_text
from tiderl.envs.math.verify import AnswerVerifier
from tiderl.envs.protocol import Action, StepResult, Task

SINGLE_TURN_PROMPT = "Solve the problem. Put the final answer in \\boxed{}."
TOOL_PROMPT = ("Solve the problem. You may call the calculator tool. "
               "Put the final answer in \\boxed{}.")

CALCULATOR_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": f"Evaluate an arithmetic expression exactly ({ALLOWED}).",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. (347 + 589) * 2"}},
            "required": ["expression"],
        },
    },
}

# How much of the answer the final info keeps (for logs).
_INFO_ANSWER_CHARS = 200


class MathEnv:
    """One math episode at a time (the `Env` protocol).

    verifier: the shared `AnswerVerifier` (math-verify in bounded worker processes).
    tools: offer the calculator (multi-turn); False = single-turn.
    format_penalty: subtracted from the reward when the answer is not boxed (0 = off).
    system_prompt: overrides the default prompt of the chosen mode.
    answer_fallback: "last_number" reads the last number of an answer without a marker
        (`extract.extract_answer`), never of a cut one (`Action.cut`); "none" scores such an answer 0.
    max_observation_chars: longest observation; longer ones are cut with a note.
    bounds: the calculator's size bounds.
    """

    def __init__(self, verifier: AnswerVerifier, tools: bool = False, format_penalty: float = 0.0,
                 system_prompt: str | None = None, max_observation_chars: int = 4000,
                 bounds: Bounds = Bounds(), answer_fallback: str = "none") -> None:
        if format_penalty < 0:
            raise ValueError(f"format_penalty must be >= 0, got {format_penalty}")
        if answer_fallback not in FALLBACKS:
            raise ValueError(f"answer_fallback must be one of {FALLBACKS}, got {answer_fallback!r}")
        self.answer_fallback = answer_fallback
        self.verifier, self.tools, self.format_penalty = verifier, tools, format_penalty
        self.max_observation_chars, self.bounds = max_observation_chars, bounds
        self._system_prompt = system_prompt or (TOOL_PROMPT if tools else SINGLE_TURN_PROMPT)
        self._task: Task | None = None
        self._calls = self._errors = 0

    def system_prompt(self) -> str:
        return self._system_prompt

    def tool_schemas(self) -> list[dict[str, Any]]:
        """[calculator] in multi-turn mode, else [] (a copy: callers may edit it)."""
        return [copy.deepcopy(CALCULATOR_TOOL)] if self.tools else []

    def reset(self, task: Task) -> str:
        """Start an episode on `task`; returns the problem text."""
        self._task = task
        self._calls = self._errors = 0
        return clean_text(str(task.prompt))

    def step(self, action: Action) -> StepResult:
        """Run the turn's tool calls (multi-turn), or score it as the answer turn."""
        self._require_episode()
        if self.tools and (action.tool_calls or action.parse_errors):
            observations = [self._error(str(e)) for e in action.parse_errors]
            observations += [self._call(call) for call in action.tool_calls]
            return StepResult(observations, info=self._counters())
        return self._score(str(action.text), cut=bool(getattr(action, "cut", False)))

    def finish(self, reason: str) -> StepResult:
        """End without an answer turn (turn or token limit): outcome 0, minus the format penalty."""
        self._require_episode()
        return self._end(0.0, boxed=False, info={"finish_reason": str(reason), "answer_source": "none"})

    # -- internals -------------------------------------------------------------------------

    def _require_episode(self) -> Task:
        if self._task is None:
            raise RuntimeError("MathEnv.step/finish called without an episode in progress (the episode "
                               "already ended, or never started): call reset(task) first")
        return self._task

    def _counters(self) -> dict[str, Any]:
        return {"tool_calls": self._calls, "tool_errors": self._errors}

    def _error(self, message: str) -> str:
        self._calls += 1
        self._errors += 1
        return clean_text(f"Error: {message}", self.max_observation_chars)

    def _call(self, call: Any) -> str:
        """One calculator call as an observation; every failure is an `Error:` observation."""
        try:
            name, arguments = getattr(call, "name", None), getattr(call, "arguments", None)
            if name != "calculator":
                return self._error(f"unknown tool {clean_text(str(name), 80)!r}; the only tool is calculator")
            if not isinstance(arguments, dict) or "expression" not in arguments:
                return self._error('calculator needs {"expression": "..."}, e.g. {"expression": "12 * (3 + 4)"}')
            extra = sorted(str(k) for k in arguments if k != "expression")
            if extra:
                return self._error(f"calculator takes only 'expression', not {clean_text(', '.join(extra), 200)}")
            expression = arguments["expression"]
            if isinstance(expression, (int, float)) and not isinstance(expression, bool):
                expression = repr(expression)
            if not isinstance(expression, str):
                return self._error("the expression must be text, e.g. \"12 * (3 + 4)\"")
            value = calculate(expression, self.bounds)
        except CalculatorError as exc:
            return self._error(str(exc))
        except Exception as exc:  # noqa: BLE001 - a tool failure is an observation, never a crash
            return self._error(f"the calculator failed ({type(exc).__name__})")
        self._calls += 1
        return clean_text(value, self.max_observation_chars)

    def _score(self, text: str, cut: bool = False) -> StepResult:
        task = self._require_episode()
        extracted = extract_answer(text, self.answer_fallback, cut=cut)
        info: dict[str, Any] = {"answer_source": extracted.source, "answer_cut": cut}
        outcome = 0.0
        if extracted.answer is None:
            info["answer_error"] = "no final answer (expected \\boxed{...})"
        else:
            info["answer"] = clean_text(extracted.answer, _INFO_ANSWER_CHARS)
            try:
                verdict = self.verifier.verify(str(task.answer), extracted.answer)
            except Exception as exc:  # noqa: BLE001 - a verifier failure scores 0, never crashes
                info["verify_error"] = f"the verifier failed ({type(exc).__name__})"
            else:
                outcome = float(verdict.correct)
                if verdict.error:
                    info["verify_error"] = clean_text(verdict.error, _INFO_ANSWER_CHARS)
        return self._end(outcome, extracted.boxed, info)

    def _end(self, outcome: float, boxed: bool, info: dict[str, Any]) -> StepResult:
        penalty = 0.0 if boxed else self.format_penalty
        parts = {"outcome": outcome, "format": -penalty}
        info = self._counters() | info | {"success": outcome, "reward_parts": parts}
        self._task = None
        return StepResult([], reward=outcome - penalty, done=True, info=info)
