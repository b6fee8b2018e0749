"""The environment contract.

An environment runs one episode at a time: `reset(task)` returns the first user message,
`step(action)` executes the model's turn. The agent loop owns the tokens; the environment
only ever sees text and parsed tool calls, and answers with text, or with an `Observation`
(text with images) where the task is visual.

A malformed tool call never reaches the environment as an exception: the agent loop puts the
parse error in `Action.parse_errors`, and the environment answers it with an error observation
so the agent can recover.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class Task:
    """One unit of work: a question (or instruction) and what a correct episode achieves.

    task_id: unique and stable across runs (used for splits, logs and retries).
    prompt: the first user message.
    answer: the gold answer, in whatever form the environment scores.
    meta: anything else the environment needs (topic entity, hops, relation path, ...).
    """

    task_id: str
    prompt: str
    answer: Any
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class ToolCall:
    """A parsed tool call: the tool's name and its JSON arguments."""

    name: str
    arguments: dict[str, Any]


@dataclass
class Action:
    """One model turn as the environment sees it.

    text: the decoded text of the turn (without the end-of-turn token).
    tool_calls: the well-formed tool calls found in `text`, in order.
    parse_errors: one message per malformed tool call (bad JSON, missing name, ...).
    cut: the turn did not end on its own: it reached the token limit (its end-of-turn token was
        forced), so its text may stop mid-sentence or mid-number. An environment that reads an
        answer from free text should not read one from a cut turn's unfinished end.
    """

    text: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    parse_errors: list[str] = field(default_factory=list)
    cut: bool = False


@dataclass
class Observation:
    """A message that shows images: the images (PIL images, shown before the text, in order) and
    the text. `reset` may return one as the first user message, and `step` may answer with them
    among its observations; a text-only environment returns plain strings."""

    text: str
    images: list[Any] = field(default_factory=list)


def message_text(message: "str | Observation") -> str:
    """The text of a message, whether it is plain text or an `Observation`."""
    return message.text if isinstance(message, Observation) else message


@dataclass
class StepResult:
    """What the environment answers to one action.

    observations: tool responses, one message each (text, or an `Observation` with images),
        appended to the conversation with role "tool" (empty when the episode is done or the turn
        had no tool call).
    reward: the scalar reward; only meaningful when `done` (outcome rewards) but any step may
        carry shaping.
    done: the episode ended (final answer, or the environment gave up).
    info: metrics for logging; on the final step it holds "success" (0/1), "reward_parts"
        (dict of named reward parts summing to the reward) and environment scores such as "f1".
    """

    observations: list[str | Observation]
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


class Env(Protocol):
    """One episode at a time. Create one instance per concurrent episode."""

    def system_prompt(self) -> str:
        """The system message that explains the task and the tools."""
        ...

    def tool_schemas(self) -> list[dict[str, Any]]:
        """The tools in OpenAI function format, passed to the chat template."""
        ...

    def reset(self, task: Task) -> str | Observation:
        """Start an episode; returns the first user message (an `Observation` to show images)."""
        ...

    def step(self, action: Action) -> StepResult:
        """Execute one model turn."""
        ...

    def finish(self, reason: str) -> StepResult:
        """End the episode without an answer (turn or token limit); scores what there is."""
        ...
