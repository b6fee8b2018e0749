"""The OpenAI chat-completions wire format: reading requests, writing responses and stream chunks.

Pure functions over plain dicts (no web framework, no engine): `read_request` turns a request
body into a `ChatRequest` (image parts decoded: `images.decode_data_url`) or raises
`RequestError` naming the field and the fix; `assistant_reply` turns a sampled turn into the
assistant message the client gets (parsed tool calls as OpenAI `tool_calls`, anything malformed
as plain content); `completion_body` and `stream_chunks` write the response.
"""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from tiderl.agent.tool_parser import OPEN_TAG, parse_tool_calls
from tiderl.serve.images import MAX_IMAGES, decode_data_url, image_key

ROLES = ("system", "user", "assistant", "tool")
# OpenAI's newer name for the system role; templates know only "system".
_ROLE_ALIASES = {"developer": "system"}


class RequestError(ValueError):
    """A request tiderl cannot serve: `status` is the HTTP status, `param` the field at fault."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def body(self) -> dict[str, Any]:
        """The OpenAI error body: {"error": {"message", "type", "param", "code"}}."""
        kind = {404: "not_found_error", 409: "conflict_error"}.get(self.status, "invalid_request_error")
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}


@dataclass
class ChatRequest:
    """One chat-completions request, checked and normalised.

    messages: each {"role", "content": str} plus, for an assistant turn that called tools,
        "tool_calls" with arguments as dicts (what chat templates render), for a tool
        message its "tool_call_id"/"name" when given, and for a user or tool message with
        image parts "images" (RGB PIL images, in order; shown before the text) and "image_keys".
    tools: the OpenAI tool list (None when absent or empty); parse_tools: False for
        tool_choice "none" (calls come back as content).
    temperature/top_p/max_tokens: None where the request does not set them.
    """

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    parse_tools: bool = True
    stream: bool = False
    include_usage: bool = False
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: bool = False


def _number(body: dict[str, Any], key: str, low: float, high: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not low <= value <= high:
        raise RequestError(f"'{key}' must be a number in [{low}, {high}], got {value!r}", key)
    return float(value)


def read_request(body: Any) -> ChatRequest:
    """Check and normalise a chat-completions body; RequestError (400) names what is wrong."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list of {role, content} objects", "messages")
    normal = [_read_message(m, i) for i, m in enumerate(messages)]
    count = sum(len(m.get("images", ())) for m in normal)
    if count > MAX_IMAGES:
        raise RequestError(f"the messages hold {count} images; at most {MAX_IMAGES} are accepted in one request: "
                           "drop older images from the conversation", "messages")
    if normal[-1]["role"] == "assistant":
        raise RequestError("the last message is an assistant message; tiderl does not continue a partial "
                           "assistant turn: end with a user, tool or system message", f"messages[{len(normal) - 1}]")
    n = body.get("n", 1)
    if n != 1:
        raise RequestError(f"'n' must be 1 (one completion per request), got {n!r}", "n")
    tools = _read_tools(body.get("tools"))
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise RequestError(f"tool_choice {choice!r} is not supported: tiderl samples freely and parses what the "
                           "model writes, so only 'auto' (the default) and 'none' can be honoured", "tool_choice")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise RequestError(f"'max_tokens' must be a positive integer, got {max_tokens!r}", "max_tokens")
    stop = body.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise RequestError("'stop' must be a string or a list of non-empty strings", "stop")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise RequestError("'stream_options' must be an object", "stream_options")
    return ChatRequest(
        messages=normal, tools=tools, parse_tools=choice != "none" and tools is not None,
        stream=bool(body.get("stream", False)), include_usage=bool(stream_options.get("include_usage")),
        temperature=_number(body, "temperature", 0.0, 2.0), top_p=_number(body, "top_p", 1e-6, 1.0),
        max_tokens=max_tokens, stop=list(stop), logprobs=bool(body.get("logprobs", False)),
    )


def _content_of(content: Any, where: str, role: str) -> tuple[str, list[Any]]:
    """A message's content as (text, images): a string, null, or a list of {"type": "text"} and
    (user and tool messages) {"type": "image_url", "image_url": {"url": "data:image/...;base64,..."}}
    parts; the texts joined, the images decoded in order."""
    if content is None:
        return "", []
    if isinstance(content, str):
        return content, []
    if not isinstance(content, list):
        raise RequestError(f"{where}.content must be a string, null or a list of content parts", f"{where}.content")
    texts, images = [], []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "image_url" and role in ("user", "tool"):
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            try:
                images.append(decode_data_url(url))
            except ValueError as exc:
                raise RequestError(f"{at}: {exc}", at) from None
        elif kind == "image_url":
            raise RequestError(f"{at} is an image part in a message of role {role}; images are accepted in user and "
                               "tool messages", at)
        else:
            raise RequestError(f"{at} is not a text part ({{'type': 'text', 'text': ...}}) or an image part "
                               "({'type': 'image_url', 'image_url': {'url': 'data:image/png;base64,...'}})", at)
    return "".join(texts), images


def _read_message(message: Any, i: int) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise RequestError(f"{where} must be an object with 'role' and 'content'", where)
    role = _ROLE_ALIASES.get(message.get("role"), message.get("role"))
    if role not in ROLES:
        raise RequestError(f"{where}.role is {message.get('role')!r}; use one of {', '.join(ROLES)}", f"{where}.role")
    text, images = _content_of(message.get("content"), where, role)
    out: dict[str, Any] = {"role": role, "content": text}
    if images:
        out["images"], out["image_keys"] = images, [image_key(i) for i in images]
    if role == "assistant" and message.get("tool_calls"):
        out["tool_calls"] = [_read_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(message["tool_calls"])]
    if role == "tool":
        for key in ("tool_call_id", "name"):
            if isinstance(message.get(key), str):
                out[key] = message[key]
    return out


def _read_call(call: Any, where: str) -> dict[str, Any]:
    """An assistant message's tool call, arguments decoded to a dict (what templates render)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise RequestError(f"{where} must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}", where)
    arguments = function.get("arguments") or {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            raise RequestError(f"{where}.function.arguments is not valid JSON", f"{where}.function.arguments") from None
    if not isinstance(arguments, dict):
        raise RequestError(f"{where}.function.arguments must encode a JSON object", f"{where}.function.arguments")
    out = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def _read_tools(tools: Any) -> list[dict[str, Any]] | None:
    """The tool list with every function's `parameters` filled in (templates read its properties)."""
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise RequestError("'tools' must be a list of {'type': 'function', 'function': {...}}", "tools")
    out = []
    for j, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str) or not function["name"]:
            raise RequestError(f"tools[{j}] must be {{'type': 'function', 'function': {{'name': ..., "
                               "'parameters': {...}}}}", f"tools[{j}]")
        parameters = function.get("parameters") or {}
        if not isinstance(parameters, dict):
            raise RequestError(f"tools[{j}].function.parameters must be a JSON schema object",
                               f"tools[{j}].function.parameters")
        parameters = {"type": "object", "properties": {}, **parameters}
        out.append({"type": "function", "function": {**function, "parameters": parameters}})
    return out


def message_key(message: dict[str, Any]) -> tuple[Any, ...]:
    """What must be equal for a message of a new request to count as the recorded one: role,
    content and images (by `image_key`), and for an assistant turn its calls' names and decoded
    arguments (call ids and the arguments' JSON spacing are the client's business)."""
    calls = tuple((c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True))
                  for c in message.get("tool_calls") or ())
    return (message["role"], message.get("content") or "", calls, tuple(message.get("image_keys") or ()))


# Where a call starts, for the content shown beside parsed calls: a tag, a fence or a bare object.
_CALL_START = re.compile(re.escape(OPEN_TAG) + r'|```|(\[\s*)?\{\s*"name"\s*:')


@dataclass
class Reply:
    """The assistant message made of one sampled turn."""

    content: str | None
    tool_calls: list[dict[str, Any]]
    finish_reason: str
    parse_errors: list[str]

    def message(self) -> dict[str, Any]:
        """The OpenAI assistant message."""
        out: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        return out

    def recorded(self) -> dict[str, Any]:
        """The message as `read_request` would normalise it when the client sends it back."""
        out: dict[str, Any] = {"role": "assistant", "content": self.content or ""}
        if self.tool_calls:
            out["tool_calls"] = [{"type": "function", "id": c["id"], "function": {
                "name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}}
                for c in self.tool_calls]
        return out


def assistant_reply(text: str, fmt: str, parse_tools: bool, cut: bool, stop: list[str] = ()) -> Reply:
    """The assistant message for a sampled turn's text (end-of-turn token already removed).

    With tools (and tool_choice not "none"), the turn is parsed in tool-call format `fmt`
    (`parse_tool_calls`): well-formed calls become `tool_calls` (finish_reason "tool_calls") and
    the content is the text before the first call (None when empty). A turn with any malformed
    call comes back whole as plain content (finish_reason "stop"; the parse errors are recorded,
    not raised): the agent reads what the model wrote. `cut`: the turn hit its token limit
    (finish_reason "length"). A stop string ends the content before it, as OpenAI does.
    """
    for s in stop:
        at = text.find(s)
        if at >= 0:
            text = text[:at]
    finish = "length" if cut else "stop"
    if not parse_tools:
        return Reply(text, [], finish, [])
    action = parse_tool_calls(text, fmt)
    if action.parse_errors or not action.tool_calls:
        return Reply(text, [], finish, list(action.parse_errors))
    start = _CALL_START.search(text)
    content = text[: start.start()].strip() if start else text.strip()
    calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
              "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in action.tool_calls]
    return Reply(content or None, calls, "tool_calls", [])


def completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def completion_body(cid: str, model: str, reply: Reply, prompt_tokens: int, completion_tokens: int,
                    logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    """A `chat.completion` response object with one choice."""
    return {
        "id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": reply.message(), "finish_reason": reply.finish_reason,
                     "logprobs": {"content": logprobs} if logprobs is not None else None}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }


def stream_chunks(body: dict[str, Any], pieces: list[str], include_usage: bool) -> list[dict[str, Any]]:
    """The `chat.completion.chunk` objects of a finished completion `body`: the role, the content
    in `pieces` (one per sampled token, joined they are the content), each tool call (name and
    arguments), then the finish reason, then (when asked) usage with no choices."""
    choice = body["choices"][0]
    message = choice["message"]

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {"id": body["id"], "object": "chat.completion.chunk", "created": body["created"],
                "model": body["model"], "choices": [{"index": 0, "delta": delta, "finish_reason": finish,
                                                     "logprobs": None}]}

    out = [chunk({"role": "assistant", "content": ""})]
    out += [chunk({"content": p}) for p in pieces if p]
    for i, call in enumerate(message.get("tool_calls") or []):
        out.append(chunk({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                          "function": {"name": call["function"]["name"],
                                                       "arguments": call["function"]["arguments"]}}]}))
    out.append(chunk({}, choice["finish_reason"]))
    if include_usage:
        out.append({**chunk({}), "choices": [], "usage": body["usage"]})
    return out


def content_pieces(content: str | None, token_texts: list[str]) -> list[str]:
    """`content` cut where the sampled tokens' texts end (so a stream shows it token by token);
    whatever the token texts do not cover comes as one last piece."""
    if not content:
        return []
    pieces, at = [], 0
    for t in token_texts:
        if not t or not content.startswith(t, at):
            break
        pieces.append(t)
        at += len(t)
    if at < len(content):
        pieces.append(content[at:])
    return pieces
