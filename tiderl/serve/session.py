"""Recorded sessions: every request of an external agent as exact token ids (docs/serve.md, "What
a session records").

A session's requests are kept in *segments*, each one growing token sequence in the layout of
`play_episode`. A request whose messages start with a segment's recorded conversation (compared
by `wire.message_key`) extends that segment: the earlier turns keep the ids the engine sampled,
only the new messages are rendered (`continuation_ids`). Anything else starts a new segment whose
`reason` says why. When the session ends (`finish`, with the reward), each segment becomes one
`Trajectory`, the record the trainer takes from `play_episode`; a segment's images (the images
of its messages, in token order) become the trajectory's `images`.
"""

from __future__ import annotations

import json
import math
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tiderl.agent.chat import ChatFormat, TemplateError
from tiderl.serve.images import describe, has_images, image_prompt_ids
from tiderl.serve.wire import RequestError, message_key
from tiderl.types import TokenRecord, Trajectory


def continuation_ids(fmt: ChatFormat, messages: list[dict[str, Any]]) -> list[int]:
    """`ChatFormat.continuation_ids` of `messages` (`images.image_prompt_ids` when some hold
    images), or RequestError (400) when the template renders the earlier turns differently once
    they follow."""
    try:
        return image_prompt_ids(fmt, messages, True) if has_images(messages) else fmt.continuation_ids(messages)
    except TemplateError:
        raise RequestError("the model's chat template renders earlier turns differently when these messages "
                           "follow, so they cannot be appended to the recorded tokens", "messages") from None


@dataclass
class Segment(TokenRecord):
    """One growing token sequence of a session (see the module docstring)."""

    reason: str
    tools_key: str
    messages: list[dict[str, Any]] = field(default_factory=list)
    turns: int = 0
    last_cut: bool = False
    images: list[Any] = field(default_factory=list)

    def matches(self, messages: list[dict[str, Any]], tools_key: str) -> bool:
        """Whether a request with `messages` and tools continues this segment's conversation."""
        n = len(self.messages)
        return tools_key == self.tools_key and 0 < n < len(messages) and self.first_difference(messages) == n

    def first_difference(self, messages: list[dict[str, Any]]) -> int:
        """The index of the first message of `messages` that differs from the recorded ones."""
        for i, (a, b) in enumerate(zip(self.messages, messages)):
            if message_key(a) != message_key(b):
                return i
        return min(len(self.messages), len(messages))


@dataclass
class Turn:
    """What one request adds, before it is committed: the full prompt ids (what the engine
    sees) and its images in token order, how many ids were already recorded, and the segment it
    continues (None: new)."""

    prompt: list[int]
    reused: int
    segment: Segment | None
    reason: str
    tools_key: str
    images: list[Any] = field(default_factory=list)


@dataclass
class Session:
    """An agent's attempt at one task: its segments, a record per request, and the reward."""

    session_id: str
    task_id: str = ""
    group_id: str = ""
    meta: dict[str, Any] = field(default_factory=dict)
    segments: list[Segment] = field(default_factory=list)
    requests: list[dict[str, Any]] = field(default_factory=list)
    reward: float | None = None
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.reward is not None

    def plan(self, fmt: ChatFormat, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> Turn:
        """The prompt ids of a request: an extension of the longest segment whose conversation
        its messages start with, else the whole conversation rendered as a new segment."""
        tools_key = json.dumps(tools, sort_keys=True)
        candidates = [s for s in self.segments if s.matches(messages, tools_key)]
        if candidates:
            segment = max(candidates, key=lambda s: len(s.messages))
            new = messages[len(segment.messages):]
            return Turn(segment.tokens + continuation_ids(fmt, new), len(segment.tokens), segment, "", tools_key,
                        segment.images + _images(new))
        turn = session_free_turn(fmt, messages)
        turn.reason, turn.tools_key = self._why_new(messages, tools_key), tools_key
        return turn

    def _why_new(self, messages: list[dict[str, Any]], tools_key: str) -> str:
        if not self.segments:
            return "first request"
        last = self.segments[-1]
        if last.tools_key != tools_key:
            return "the tools differ from the recorded ones"
        i = last.first_difference(messages)
        if i < len(last.messages):
            return (f"history edited: message {i} ({messages[i]['role'] if i < len(messages) else 'missing'}) is not "
                    f"the recorded {last.messages[i]['role']} message, so the recorded tokens cannot be reused")
        return "the request repeats the recorded conversation without adding a message"

    def commit(self, turn: Turn, messages: list[dict[str, Any]], sampled: list[int], logprobs: list[float],
               versions: list[int], end_of_turn: int, reply: dict[str, Any], record: dict[str, Any]) -> Segment:
        """Append one answered request: the forced prompt tokens not yet recorded, the sampled
        ids (loss_mask 1), a forced end-of-turn when the turn lacks one; `reply` (the assistant
        message as recorded) closes the segment's conversation. A segment extended by another
        request meanwhile is not touched: this turn forks into a new segment."""
        segment = turn.segment
        reason = turn.reason
        if segment is not None and len(segment.tokens) != turn.reused:
            segment, reason = None, "forked: another request of this session extended the same conversation first"
        if segment is None:
            segment = Segment(reason=reason, tools_key=turn.tools_key)
            self.segments.append(segment)
            reused = 0
        else:
            reused = turn.reused
        segment.append_forced(turn.prompt[reused:])
        segment.append_sampled(sampled, logprobs, versions)
        segment.last_cut = not sampled or sampled[-1] != end_of_turn
        if segment.last_cut:
            segment.append_forced([end_of_turn])
        segment.messages = [*messages, reply]
        segment.images = list(turn.images)
        segment.turns += 1
        self.requests.append({**record, "segment": self.segments.index(segment), "reused_prompt_tokens": reused,
                              "new_segment_reason": reason if reused == 0 else ""})
        return segment

    def trajectories(self) -> list[Trajectory]:
        """One Trajectory per segment, each with the session's reward (a finished session);
        stop_reason is the reward info's "stop_reason" when given (e.g. "max_tokens" for an agent
        that ran out of context), else "length" when the last turn was cut, else "answer"."""
        if self.reward is None:
            raise ValueError(f"session {self.session_id!r} has no reward yet: POST /sessions/<id>/reward first")
        task_id = self.task_id or self.session_id
        out = []
        for i, s in enumerate(self.segments):
            out.append(Trajectory(
                tokens=list(s.tokens), loss_mask=list(s.loss_mask), behavior_logprobs=list(s.behavior_logprobs),
                policy_version=list(s.policy_version), reward=self.reward,
                reward_parts={"outcome": self.reward}, task_id=task_id, group_id=self.group_id or task_id,
                env_info={**self.info, "turns": s.turns, "session": self.session_id, "segment": i,
                          "segment_reason": s.reason},
                num_turns=s.turns, stop_reason=str(self.info.get("stop_reason") or ("length" if s.last_cut else "answer")),
                images=list(s.images),
            ))
        return out

    def to_dict(self) -> dict[str, Any]:
        """The whole record as JSON-ready data (GET /sessions/<id>)."""
        return {
            "session_id": self.session_id, "task_id": self.task_id, "group_id": self.group_id, "meta": self.meta,
            "finished": self.finished, "reward": self.reward, "info": self.info, "requests": self.requests,
            "segments": [{"reason": s.reason, "turns": s.turns, "messages": [_jsonable(m) for m in s.messages],
                          "images": [describe(i) for i in s.images], "tokens": s.tokens,
                          "loss_mask": s.loss_mask, "behavior_logprobs": s.behavior_logprobs,
                          "policy_version": s.policy_version} for s in self.segments],
        }


def session_free_turn(fmt: ChatFormat, messages: list[dict[str, Any]]) -> Turn:
    """The Turn of a request outside any session (nothing recorded, nothing reused)."""
    prompt = image_prompt_ids(fmt, messages, False) if has_images(messages) else fmt.prompt_ids(messages)
    return Turn(prompt, 0, None, "", "", _images(messages))


def _images(messages: list[dict[str, Any]]) -> list[Any]:
    return [image for m in messages for image in m.get("images") or ()]


def _jsonable(message: dict[str, Any]) -> dict[str, Any]:
    """A recorded message as JSON: its images described (`images.describe`), not their pixels."""
    return {**message, "images": [describe(i) for i in message["images"]]} if message.get("images") else message


class SessionStore:
    """The sessions of one server. Safe to use from the server's loop and a trainer's thread.

    `on_finish(session)` is called when a session gets its reward (e.g. to write its
    trajectories to a file).
    """

    def __init__(self, on_finish: Callable[[Session], None] | None = None):
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        self.on_finish = on_finish

    def create(self, session_id: str | None = None, task_id: str = "", group_id: str = "",
               meta: dict[str, Any] | None = None) -> Session:
        session_id = session_id or uuid.uuid4().hex
        if not isinstance(session_id, str) or not session_id or "/" in session_id:
            raise RequestError(f"session id {session_id!r} must be a non-empty string without '/'", "session_id")
        with self._lock:
            if session_id in self._sessions:
                raise RequestError(f"session {session_id!r} exists already; pick another id", "session_id", 409)
            session = self._sessions[session_id] = Session(session_id, task_id, group_id, dict(meta or {}))
        return session

    def get(self, session_id: str, open_only: bool = False) -> Session:
        """The session, or RequestError 404 (unknown) / 409 (finished, when `open_only`)."""
        with self._lock:
            session = self._sessions.get(session_id)
        if session is None:
            raise RequestError(f"no session {session_id!r}: create it first with POST /sessions", None, 404,
                               "session_not_found")
        if open_only and session.finished:
            raise RequestError(f"session {session_id!r} has ended (its reward is in); start a new session", None, 409,
                               "session_finished")
        return session

    def finish(self, session_id: str, reward: Any, info: Any = None) -> Session:
        """End a session with its reward (a finite number) and optional info."""
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise RequestError(f"'reward' must be a finite number, got {reward!r}", "reward")
        if info is not None and not isinstance(info, dict):
            raise RequestError("'info' must be an object", "info")
        session = self.get(session_id, open_only=True)
        with self._lock:
            session.reward, session.info = float(reward), dict(info or {})
        if self.on_finish is not None:
            self.on_finish(session)
        return session

    def delete(self, session_id: str) -> None:
        """Forget a session (finished or not)."""
        self.get(session_id)  # RequestError 404 when unknown
        with self._lock:
            self._sessions.pop(session_id, None)
