"""The agent loop reads tool calls in the tokenizer's configured format, and a turn without a
tool call gets the environment's nudge as a user turn, not as a tool response."""

from __future__ import annotations

import json
from typing import Any

import pytest

from support import user_message_ids
from tiderl.agent.chat import chat_format
from tiderl.agent.loop import ScriptedEngine, play_episodes
from tiderl.agent.tool_parser import set_tool_call_format
from tiderl.embedded.tiny import IM_END_ID, train_tokenizer
from tiderl.envs.protocol import Action, StepResult, Task
from tiderl.rollout.base import SamplingParams

TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Look up a key.",
    "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}}}]
SYSTEM = "Use lookup(key), then reply ANSWER: <value>."
NUDGE = "No tool call. Call lookup or reply ANSWER: <value>."
FENCED = '```json\n{"name": "lookup", "arguments": {"key": "up"}}\n```'


class NudgingEnv:
    """Answers lookups; nudges (one observation) on a turn with neither a call nor an answer,
    like tiderl's KG and DB environments."""

    def __init__(self) -> None:
        self.actions: list[Action] = []

    def system_prompt(self) -> str:
        return SYSTEM

    def tool_schemas(self) -> list[dict[str, Any]]:
        return TOOLS

    def reset(self, task: Task) -> str:
        return task.prompt

    def step(self, action: Action) -> StepResult:
        self.actions.append(action)
        observations = [f"error: {e}" for e in action.parse_errors]
        observations += ["Pete Docter" for c in action.tool_calls if c.name == "lookup"]
        if "ANSWER:" in action.text:
            return StepResult([], reward=1.0, done=True, info={"success": 1})
        return StepResult(observations or [NUDGE])

    def finish(self, reason: str) -> StepResult:
        return StepResult([], done=True, info={"success": 0})


@pytest.fixture(scope="module")
def tok():
    corpus = [SYSTEM, NUDGE, FENCED, "Who directed Up?", "Let me think.", "ANSWER: Pete Docter",
              "<tool_response>", "</tool_response>", json.dumps(TOOLS)]
    return train_tokenizer(corpus * 4, vocab_size=500)


def _play(tok, script: list[str], env: NudgingEnv):
    engine = ScriptedEngine(tok, {"Up": script})
    [traj] = play_episodes(engine, tok, lambda: env, [Task("t-up", "Who directed Up?", "Pete Docter")],
                           SamplingParams(max_new_tokens=64), max_turns=4, max_total_tokens=2000)
    return traj


def test_nudge_after_a_turn_without_tool_call_is_a_user_turn(tok):
    env = NudgingEnv()
    traj = _play(tok, ["Let me think.", "ANSWER: Pete Docter"], env)
    fmt = chat_format(tok, TOOLS)
    prompt = fmt.prompt_ids([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Who directed Up?"}])
    turn = tok.encode("Let me think.", add_special_tokens=False) + [IM_END_ID]
    nudge = user_message_ids(fmt, NUDGE)
    assert traj.tokens[: len(prompt) + len(turn) + len(nudge)] == prompt + turn + nudge
    assert "<tool_response>" not in tok.decode(traj.tokens)
    assert traj.stop_reason == "answer"


def test_errors_of_a_malformed_call_stay_tool_responses(tok):
    env = NudgingEnv()
    traj = _play(tok, ['```json\n{"name": "lookup", "arguments": }\n```', "ANSWER: Pete Docter"], env)
    assert len(env.actions[0].parse_errors) == 1
    assert f"<tool_response>\nerror: {env.actions[0].parse_errors[0]}\n</tool_response>" in tok.decode(traj.tokens)


@pytest.mark.parametrize("fmt, reaches_env", [("auto", True), ("json", True), ("hermes", False)])
def test_fenced_json_call_reaches_the_environment_in_the_configured_format(tok, fmt, reaches_env):
    set_tool_call_format(tok, fmt)
    try:
        env = NudgingEnv()
        traj = _play(tok, [FENCED, "ANSWER: Pete Docter"], env)
    finally:
        set_tool_call_format(tok, "auto")
    called = [c.name for c in env.actions[0].tool_calls]
    assert called == (["lookup"] if reaches_env else [])
    text = tok.decode(traj.tokens)
    assert ("<tool_response>\nPete Docter\n</tool_response>" in text) == reaches_env
