"""Parse tool calls out of a model turn (Hermes / Qwen format).

A tool call is a block `<tool_call>{"name": "...", "arguments": {...}}</tool_call>` anywhere in
the turn text. Models (tiny ones especially) get this wrong in many ways; every mistake becomes
one readable message in `Action.parse_errors`, which the environment answers with an error
observation so the agent can learn to fix it. Nothing here raises.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from tiderl.envs.protocol import Action, ToolCall

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"

# Shown in error messages so the agent (and the person reading the logs) sees the fix.
_EXPECTED = f'expected {OPEN_TAG}{{"name": <tool name>, "arguments": {{...}}}}{CLOSE_TAG}'


def parse_hermes_tool_calls(text: str, strip: Iterable[str] = ()) -> Action:
    """Split one model turn into its well-formed tool calls and one error per malformed call.

    `strip`: strings removed from `text` before anything else (the end-of-turn token, e.g.
    `("<|im_end|>",)`); the returned `Action.text` is the turn without them.

    Promises:
    - `tool_calls` holds every well-formed `<tool_call>` block in order of appearance, with
      `arguments` always a dict (a JSON-encoded string of an object is decoded; missing or
      null arguments mean `{}`, a tool without parameters);
    - `parse_errors` holds one message per malformed block, numbered by the block's position
      among all blocks ("tool call 2: ..."): invalid JSON (with line and column), a value that
      is not an object, a missing/empty/non-string `name`, arguments that are not an object,
      a block opened again before it was closed, a block never closed;
    - text outside the blocks (reasoning, a final answer) is left to the environment;
    - never raises, whatever the input.
    """
    for token in strip:
        if token:
            text = text.replace(token, "")
    calls: list[ToolCall] = []
    errors: list[str] = []
    position = text.find(OPEN_TAG)
    number = 0
    while position != -1:
        number += 1
        body_start = position + len(OPEN_TAG)
        close = text.find(CLOSE_TAG, body_start)
        reopen = text.find(OPEN_TAG, body_start)
        if close == -1 and reopen == -1:
            errors.append(f"tool call {number}: {OPEN_TAG} is never closed with {CLOSE_TAG}; {_EXPECTED}")
            break
        if reopen != -1 and (close == -1 or reopen < close):
            # The model started a second call before finishing this one: report this block and
            # parse the next one on its own, so one slip does not hide a good call.
            errors.append(f"tool call {number}: {OPEN_TAG} opened again before {CLOSE_TAG}; {_EXPECTED}")
            position = reopen
            continue
        call, error = _parse_call_body(text[body_start:close])
        if call is not None:
            calls.append(call)
        else:
            errors.append(f"tool call {number}: {error}")
        position = text.find(OPEN_TAG, close + len(CLOSE_TAG))
    return Action(text=text, tool_calls=calls, parse_errors=errors)


def _parse_call_body(body: str) -> tuple[ToolCall | None, str]:
    """Decode the JSON between the tags; returns (call, "") or (None, reason)."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError as exc:
        return None, f"invalid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}); {_EXPECTED}"
    except (ValueError, RecursionError) as exc:  # e.g. absurdly deep nesting
        return None, f"invalid JSON ({type(exc).__name__}); {_EXPECTED}"
    if not isinstance(value, dict):
        return None, f"the call must be a JSON object, got {_json_type(value)}; {_EXPECTED}"
    name = value.get("name")
    if not isinstance(name, str) or not name.strip():
        got = "no 'name'" if "name" not in value else f"'name' = {_short(name)}"
        return None, f"the call needs a non-empty string 'name', got {got}; {_EXPECTED}"
    arguments = value.get("arguments")
    if arguments is None:
        return ToolCall(name=name, arguments={}), ""
    if isinstance(arguments, str):
        # Some models (and the OpenAI wire format) send arguments as a JSON-encoded string.
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError):
            return None, f"'arguments' of {name!r} is a string that is not valid JSON; {_EXPECTED}"
    if not isinstance(arguments, dict):
        return None, f"'arguments' of {name!r} must be a JSON object, got {_json_type(arguments)}; {_EXPECTED}"
    return ToolCall(name=name, arguments=arguments), ""


def _json_type(value: Any) -> str:
    """The JSON name of a decoded value's type, for error messages."""
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


def _short(value: Any, limit: int = 40) -> str:
    """A value's JSON text cut to `limit` characters, for error messages."""
    shown = json.dumps(value)
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."
