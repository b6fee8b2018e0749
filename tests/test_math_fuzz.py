"""Fuzz the math environment with 1,200 random and malformed agent outputs: broken tool-call
JSON, huge numbers, enormous and nested LaTeX, unbalanced `\\boxed{`, lone surrogates, empty
turns. Each goes through the agent loop's tool-call parser, then reset/step/finish, single- and
multi-turn. Promise: no exception, no hang (every step is bounded by the verifier's timeout),
valid text observations, finite rewards whose parts sum to them."""

import json
import math
import random
import time

import pytest

from tiderl.agent.tool_parser import parse_hermes_tool_calls
from tiderl.envs.math.env import MathEnv
from tiderl.envs.math.verify import AnswerVerifier
from tiderl.envs.protocol import Task

CASES = 1200
TIMEOUT_S = 1.0

TASKS = [
    Task("a", "What is 347 plus 589?", "936", {"expression": "347 + 589"}),
    Task("b", "Convert (0, 3) to polar coordinates.", "\\left( 3, \\frac{\\pi}{2} \\right)"),
    Task("c", "Who?", "\\text{Evelyn}"),
    Task("d", "Surrogate \ud800 question", "-2 + 7i"),
]

EXPRESSIONS = [
    "347 + 589", "9" * 5000, "10**10**10", "1/0", "((((", "2 ** -1", "__import__('os')", "1e999",
    "\ud800", "", "[" * 300, "(1)" * 80, "sum(range(10**9))", "'a' * 10**9", "0.1 ** 200",
    "12 × 3", "lambda: 0", "import os", "\x00", "7 // 0", "-" * 199 + "1",
]

LATEX = [
    "\\boxed{936}", "\\boxed{", "}", "\\boxed{\\frac{1}{2}}", "\\boxed{" * 300, "}" * 300,
    "\\frac{" * 200, "^{", "\\boxed{2^{2^{2^{2^{2^{2}}}}}}", "\\boxed{" + "1" * 5000 + "}",
    "\\boxed{\\{1, 2\\}}", "$$", "\\left(", "\\sqrt{", "\\boxed{\ud800}", "\\fbox{7}",
    "\\boxed{" + "(" * 400 + "}", "\\boxed{x^" + "{x^" * 100 + "}", "\\boxed{\\text{Evelyn}}",
    "\\boxed{(3, \\pi/2)}", "\\boxed{-2+7i}", "\\boxed{1,600}",
]

TEXT = [
    "", " ", "Final Answer: 936", "Final Answer:", "#### 18", "####", "The answer is 5.", "\n" * 50,
    "\ud800\udfff", "\udc00", "<|im_end|>", "\x00\x01", "🙂" * 100, "a" * 20000, "Final Answer: " + "9" * 3000,
]


def tool_call(rng: random.Random) -> str:
    """A tool call that is well-formed or broken in one of many ways."""
    expression = rng.choice(EXPRESSIONS)
    body = rng.choice([
        json.dumps({"name": "calculator", "arguments": {"expression": expression}}),
        json.dumps({"name": "calculator", "arguments": json.dumps({"expression": expression})}),
        json.dumps({"name": "calculator", "arguments": {"expression": rng.choice([12, 1e308, None, [1], {"a": 1}, True])}}),
        json.dumps({"name": "calculator", "arguments": {"expr": expression}}),
        json.dumps({"name": rng.choice(["search", "", "\ud800", "calculator "]), "arguments": {}}),
        json.dumps({"arguments": {"expression": expression}}),
        json.dumps([1, 2, 3]), "{not json", '{"name": "calculator", "arguments": {"expression": "1 + ',
        "null", '{"name": "calculator", "arguments": "not an object"}', "", "{" * 200,
    ])
    opening = rng.choice(["<tool_call>", "<tool_call>\n", "<tool_call><tool_call>"])
    closing = rng.choice(["</tool_call>", "\n</tool_call>", ""])
    return opening + body + closing


def agent_output(rng: random.Random) -> str:
    parts = [rng.choice([tool_call, lambda r: r.choice(LATEX), lambda r: r.choice(TEXT),
                         lambda r: r.choice(EXPRESSIONS)])(rng) for _ in range(rng.randint(0, 5))]
    return rng.choice(["", " ", "\n"]).join(parts)


def check_result(result, done_expected=None):
    assert isinstance(result.observations, list)
    for observation in result.observations:
        assert isinstance(observation, str)
        observation.encode("utf-8")  # valid text: no lone surrogates
    assert math.isfinite(result.reward)
    if result.done:
        assert result.info["success"] in (0.0, 1.0)
        assert sum(result.info["reward_parts"].values()) == pytest.approx(result.reward)
        json.dumps(result.info, ensure_ascii=False).encode("utf-8")


@pytest.mark.slow
@pytest.mark.timeout(300)  # the hang guard: the fuzz takes seconds
def test_fuzzed_agent_outputs_never_raise_or_hang():
    rng = random.Random(12)
    verifier = AnswerVerifier(timeout_s=TIMEOUT_S)
    outcomes = {"done": 0, "finished": 0, "tool_observations": 0, "errors": 0}
    slowest, t0 = 0.0, time.perf_counter()
    try:
        for case in range(CASES):
            tools = case % 2 == 0
            env = MathEnv(verifier, tools=tools, format_penalty=rng.choice([0.0, 0.1]))
            first = env.reset(rng.choice(TASKS))
            first.encode("utf-8")
            result = None
            for _ in range(3):
                action = parse_hermes_tool_calls(agent_output(rng), strip=("<|im_end|>",))
                started = time.perf_counter()
                result = env.step(action)
                slowest = max(slowest, time.perf_counter() - started)
                check_result(result)
                outcomes["tool_observations"] += len(result.observations)
                outcomes["errors"] += sum(o.startswith("Error:") for o in result.observations)
                if result.done:
                    outcomes["done"] += 1
                    break
            if not result.done:
                result = env.finish(rng.choice(["max_turns", "max_tokens"]))
                assert result.done
                check_result(result)
                outcomes["finished"] += 1
            with pytest.raises(RuntimeError, match="reset"):
                env.step(parse_hermes_tool_calls("\\boxed{1}"))
    finally:
        verifier.close()
    elapsed = time.perf_counter() - t0
    print(f"{CASES} episodes in {elapsed:.1f}s, slowest step {slowest:.2f}s, {outcomes}, "
          f"verifier timeouts {verifier.timeouts}")
    assert outcomes["done"] + outcomes["finished"] == CASES
    assert outcomes["errors"] > 100 and outcomes["finished"] > 10  # the fuzz reached the tool paths
    # No hang: every step returned (a step that waited without end would fail by the timeout above).
