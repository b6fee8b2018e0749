"""Parse tool calls out of a model turn, in the forms model families write them.

- "hermes" (Hermes / Qwen chat templates): a block
  `<tool_call>{"name": "...", "arguments": {...}}</tool_call>` anywhere in the turn text.
- "json" (what Qwen2.5-Coder, Llama-style and many fine-tuned models write): a fenced block
  ```json {"name": ..., "arguments": {...}} ``` (language tag `json`, `tool_call` or none), or
  a bare JSON object with a "name" key in the text; either may also be a JSON list of calls.
  "parameters" is accepted for "arguments" (Llama 3's spelling).
- "auto": every form above; text inside `<tool_call>` tags is read as Hermes, the rest as JSON.

Models (tiny ones especially) get this wrong in many ways; every mistake becomes one readable
message in `Action.parse_errors`, which the environment answers with an error observation so
the agent can learn to fix it. Nothing here raises.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

from tiderl.envs.protocol import Action, ToolCall

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"

# The forms `parse_tool_calls` reads (config: model.tool_call_format).
TOOL_CALL_FORMATS = ("auto", "hermes", "json")

# Shown in error messages so the agent (and the person reading the logs) sees the fix.
_EXPECTED = f'expected {OPEN_TAG}{{"name": <tool name>, "arguments": {{...}}}}{CLOSE_TAG}'
_EXPECTED_JSON = 'expected ```json {"name": <tool name>, "arguments": {...}}```'


def parse_hermes_tool_calls(text: str, strip: Iterable[str] = ()) -> Action:
    """`parse_tool_calls(text, "hermes", strip)`: every well-formed `<tool_call>` block in order
    (`arguments` always a dict: a JSON-encoded string of an object is decoded, missing or null
    arguments mean `{}`), and one parse error per malformed block, numbered by the block's
    position among all blocks ("tool call 2: ..."): invalid JSON (with line and column), a value
    that is not an object, a missing/empty/non-string `name`, arguments that are not an object, a
    block opened again before it was closed, a block never closed. `strip`: strings removed from
    `text` first (the end-of-turn token); `Action.text` is the turn without them. Text outside
    the blocks is left to the environment; never raises, whatever the input.
    """
    return parse_tool_calls(text, "hermes", strip)


def _parse_call_body(body: str) -> tuple[ToolCall | None, str]:
    """Decode the JSON between the tags; returns (call, "") or (None, reason)."""
    value, error = _decode(body)
    if error:
        return None, f"{error}; {_EXPECTED}"
    return _call_from_value(value, _EXPECTED)


def _call_from_value(value: Any, expected: str) -> tuple[ToolCall | None, str]:
    """A decoded JSON value as one call; returns (call, "") or (None, reason)."""
    if not isinstance(value, dict):
        return None, f"the call must be a JSON object, got {_json_type(value)}; {expected}"
    name = value.get("name")
    if not isinstance(name, str) or not name.strip():
        got = "no 'name'" if "name" not in value else f"'name' = {_short(name)}"
        return None, f"the call needs a non-empty string 'name', got {got}; {expected}"
    # Llama-style calls spell the arguments "parameters".
    arguments = value.get("arguments") if "arguments" in value else value.get("parameters")
    if arguments is None:
        return ToolCall(name=name, arguments={}), ""
    if isinstance(arguments, str):
        # Some models (and the OpenAI wire format) send arguments as a JSON-encoded string.
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError):
            return None, f"'arguments' of {name!r} is a string that is not valid JSON; {expected}"
    if not isinstance(arguments, dict):
        return None, f"'arguments' of {name!r} must be a JSON object, got {_json_type(arguments)}; {expected}"
    return ToolCall(name=name, arguments=arguments), ""


def _json_type(value: Any) -> str:
    """The JSON name of a decoded value's type, for error messages."""
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


def _short(value: Any, limit: int = 40) -> str:
    """A value's JSON text cut to `limit` characters, for error messages."""
    shown = json.dumps(value)
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."


# -- every format -------------------------------------------------------------------------------

# One call attempt found in the text: where it starts (to number attempts in reading order),
# and the call or the reason it is malformed.
_Attempt = tuple[int, "ToolCall | None", str]

# A fenced block: ``` + an optional language tag on the same line, the body, then ```.
_FENCE = re.compile(r"```[ \t]*([A-Za-z_][\w-]*)?[ \t]*\n?(.*?)(```|\Z)", re.DOTALL)
# Fence tags whose body is read as tool calls (other tags, e.g. ```sql, are code, not calls).
_CALL_FENCE_TAGS = ("", "json", "tool_call", "tool_calls", "jsonc")
# Where a bare call starts: an object whose first key is "name", or a list of such objects.
_BARE_START = re.compile(r'(\[\s*)?\{\s*"name"\s*:')


# The attribute that carries a tokenizer's configured format to every episode runner (the
# tokenizer travels to each of them, including Ray workers, where a module table would not).
_FORMAT_ATTRIBUTE = "tiderl_tool_call_format"


def set_tool_call_format(tokenizer: Any, fmt: str) -> None:
    """Make episodes played with `tokenizer` read tool calls in format `fmt`."""
    if fmt not in TOOL_CALL_FORMATS:
        raise ValueError(f"model.tool_call_format: {fmt!r} is not one of {', '.join(TOOL_CALL_FORMATS)}")
    setattr(tokenizer, _FORMAT_ATTRIBUTE, fmt)


def tool_call_format_of(tokenizer: Any) -> str:
    """The format set with `set_tool_call_format`, else "auto"."""
    return getattr(tokenizer, _FORMAT_ATTRIBUTE, "auto")


def parse_tool_calls(text: str, fmt: str = "auto", strip: Iterable[str] = ()) -> Action:
    """Split one model turn into its well-formed tool calls and one error per malformed call,
    reading the forms of `fmt` (one of `TOOL_CALL_FORMATS`; see the module docstring).

    `strip`: strings removed from `text` first (the end-of-turn token); `Action.text` is the
    turn without them. "hermes" reads only the tag blocks (`parse_hermes_tool_calls`). Otherwise:
    - calls come in reading order; a JSON list of calls gives one call per element;
    - errors are numbered by the attempt's position among all attempts ("tool call 2: ..."):
      a `json`-tagged (or untagged) fenced block whose body starts like JSON but does not
      decode, is never closed, or is not a call; a bare `{"name": ...` that does not decode;
      plus everything the Hermes parser reports for tag blocks (in "auto");
    - JSON that is not a call (an object without "name" outside a fence, code in a ```sql
      fence, prose) is left to the environment as text;
    - an unknown `fmt` is one parse error, not an exception; never raises, whatever the input.
    """
    for token in strip:
        if token:
            text = text.replace(token, "")
    if fmt not in TOOL_CALL_FORMATS:
        return Action(text=text, parse_errors=[
            f"tiderl cannot read tool calls in format {fmt!r}; use one of {', '.join(TOOL_CALL_FORMATS)}"])
    attempts: list[_Attempt] = []
    covered: list[tuple[int, int]] = []
    if fmt != "json":
        attempts += _tag_attempts(text, covered, unwrap=fmt == "auto")
    if fmt != "hermes":
        attempts += _fenced_attempts(text, covered)
        attempts += _bare_attempts(text, covered)
    attempts.sort(key=lambda a: a[0])
    calls = [call for _, call, _ in attempts if call is not None]
    errors = [f"tool call {i}: {error}" for i, (_, call, error) in enumerate(attempts, 1) if call is None]
    return Action(text=text, tool_calls=calls, parse_errors=errors)


def _inside(position: int, covered: list[tuple[int, int]]) -> bool:
    return any(start <= position < end for start, end in covered)


def _tag_attempts(text: str, covered: list[tuple[int, int]], unwrap: bool) -> list[_Attempt]:
    """The `<tool_call>` blocks as attempts (Hermes rules); marks their spans as covered. With
    `unwrap` ("auto"), a body is stripped and a fenced one (```json {...}```) read as its content."""
    out: list[_Attempt] = []
    position = text.find(OPEN_TAG)
    while position != -1:
        body_start = position + len(OPEN_TAG)
        close = text.find(CLOSE_TAG, body_start)
        reopen = text.find(OPEN_TAG, body_start)
        if close == -1 and reopen == -1:
            out.append((position, None, f"{OPEN_TAG} is never closed with {CLOSE_TAG}; {_EXPECTED}"))
            covered.append((position, len(text)))
            break
        if reopen != -1 and (close == -1 or reopen < close):
            # The model started a second call before finishing this one: report this block and
            # parse the next one on its own, so one slip does not hide a good call.
            out.append((position, None, f"{OPEN_TAG} opened again before {CLOSE_TAG}; {_EXPECTED}"))
            covered.append((position, reopen))
            position = reopen
            continue
        body = text[body_start:close]
        if unwrap:
            body = body.strip()
            fenced = _FENCE.fullmatch(body)
            if fenced and fenced.group(3):
                body = fenced.group(2)
        call, error = _parse_call_body(body)
        out.append((position, call, error))
        covered.append((position, close + len(CLOSE_TAG)))
        position = text.find(OPEN_TAG, close + len(CLOSE_TAG))
    return out


def _values_as_attempts(position: int, value: Any, expected: str) -> list[_Attempt]:
    """A decoded value as attempts: a list gives one per element (an empty list, one error)."""
    if isinstance(value, list):
        if not value:
            return [(position, None, f"an empty list of calls; {expected}")]
        if not all(isinstance(v, dict) for v in value):
            kinds = ", ".join(_json_type(v) for v in value[:4])
            return [(position, None, f"a list of calls must hold only JSON objects, got {kinds}; {expected}")]
        return [(position, *_call_from_value(v, expected)) for v in value]
    return [(position, *_call_from_value(value, expected))]


def _decode(body: str) -> tuple[Any, str]:
    """json.loads with the failure as a message (value, "") or (None, reason)."""
    try:
        return json.loads(body), ""
    except json.JSONDecodeError as exc:
        return None, f"invalid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
    except (ValueError, RecursionError) as exc:
        return None, f"invalid JSON ({type(exc).__name__})"


def _fenced_attempts(text: str, covered: list[tuple[int, int]]) -> list[_Attempt]:
    """Fenced blocks tagged json (or untagged) whose body starts with { or [, as attempts."""
    out: list[_Attempt] = []
    for match in _FENCE.finditer(text):
        start = match.start()
        if _inside(start, covered):
            continue
        tag, body, closing = (match.group(1) or "").lower(), match.group(2).strip(), match.group(3)
        covered.append((start, match.end()))  # no bare JSON search inside a fence
        if tag not in _CALL_FENCE_TAGS or not body.startswith(("{", "[")):
            continue  # code, not a call
        if not closing:
            out.append((start, None, f"the ```{tag} block is never closed with ```; {_EXPECTED_JSON}"))
            continue
        value, error = _decode(body)
        if error:
            out.append((start, None, f"{error}; {_EXPECTED_JSON}"))
            continue
        out += _values_as_attempts(start, value, _EXPECTED_JSON)
    return out


def _bare_attempts(text: str, covered: list[tuple[int, int]]) -> list[_Attempt]:
    """Bare `{"name": ...}` objects (or lists of them) outside fences and tags, as attempts."""
    out: list[_Attempt] = []
    decoder = json.JSONDecoder()
    search_from = 0
    while True:
        match = _BARE_START.search(text, search_from)
        if match is None:
            return out
        start = match.start()
        if _inside(start, covered):
            search_from = start + 1
            continue
        try:
            value, end = decoder.raw_decode(text, start)
        except json.JSONDecodeError as exc:
            if match.group(1):
                # "[ {"name": ..." need not be a list of calls: try the object on its own.
                search_from = start + len(match.group(1))
                continue
            out.append((start, None, f"invalid JSON ({exc.msg}; column {exc.pos - start + 1} of the call); "
                                     f"{_EXPECTED_JSON}"))
            search_from = start + 1
            # A broken object swallows nothing: the next "name" object is tried on its own.
            continue
        except (ValueError, RecursionError) as exc:
            out.append((start, None, f"invalid JSON ({type(exc).__name__}); {_EXPECTED_JSON}"))
            search_from = start + 1
            continue
        out += _values_as_attempts(start, value, _EXPECTED_JSON)
        search_from = end
