"""The knowledge-graph question-answering environment (AgentBench-style KG tools).

An episode: the agent reads a question, calls the seven KG tools (see `tools.py`), and ends
with `Final Answer: #k`, naming a variable. Only a variable is accepted as the final answer,
not entity names written out: the tools build the answer set, the text only points at it.
The words are matched in any case (`FINAL ANSWER: #0` is an answer); "final answer:" not
followed by a variable, or "final answer #k" without the colon, gets an error observation that
shows the form.

After the episode ends (an answer, or `finish`), `step` raises RuntimeError until the next
`reset(task)`: a caller bug (the agent loop never does it), not a second chance to score.

Reward (`outcome`): 1.0 iff the predicted set equals the gold set (`task.answer`, a list or
set of entity names), else 0.0. Precision, recall and F1 are logged as scores. When
`task.meta["exclude_topic"]` is true the topic entity (`task.meta["topic"]`) is removed from
the predicted set first, and the toolbox hides it from every `get_neighbors` result: MetaQA's
multi-hop gold answers exclude the topic entity, at intermediate hops too (3-hop gold sets are
reproducible with the tools only under that convention).

Other task conventions the env honours: `task.meta["entities"]` (name -> id, AgentBench's map
from the names in the question to Freebase mids) lets the agent use those names as tool
arguments; `task.meta["count_creates_variable"]` makes count store its number as a variable, so
counting questions (gold answer `["3"]`) can be answered with `Final Answer: #k`.

The final StepResult (an answer, or `finish`) carries `info["knowledge_units"]`: the sorted
`entity:<id>` / `entity_relation:<id>|<relation>` strings of what successful tool calls explored
(see `tools.knowledge_units`), for a curiosity reward.
"""

from __future__ import annotations

import copy
import re
from typing import Any

from tiderl.agent.text import shown
from tiderl.envs.kg.backend import KGBackend
from tiderl.envs.kg.tools import KGToolbox, ObservationLimits
from tiderl.envs.protocol import Action, StepResult, Task

DEFAULT_SYSTEM_PROMPT = (
    "Answer the question by calling the tools on the knowledge graph. "
    "When a variable holds the answer, reply with Final Answer: #k."
)

# Case-insensitive, so FINAL ANSWER: #0 and final answer: #0 count as Final Answer: #0. An
# attempt at one (the words then a colon or a #) that does not parse gets _BAD_FINAL_ANSWER.
_FINAL_ANSWER = re.compile(r"final\s*answer\s*:\s*#\s*(\d+)", re.IGNORECASE)
_FINAL_ANSWER_WORDS = re.compile(r"final\s*answer\s*[:#]", re.IGNORECASE)

_NO_ACTION = (
    "No tool call and no final answer. Call a tool as <tool_call>{...}</tool_call> "
    "or reply with Final Answer: #k."
)
_BAD_FINAL_ANSWER = (
    "Error: the final answer must be a variable, written as Final Answer: #k (e.g. Final Answer: #0). "
    "Build the answer set with the tools first."
)


def _function(name: str, description: str, arguments: dict[str, str]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {a: {"type": "string", "description": d} for a, d in arguments.items()},
                "required": list(arguments),
            },
        },
    }


_VARIABLE_ARG = "a variable like #0 or an exact entity name"

TOOL_SCHEMAS: list[dict[str, Any]] = [
    _function("get_relations", "List the relations of an entity or of the entities in a variable.",
              {"variable": _VARIABLE_ARG}),
    _function("get_neighbors", "Follow a relation; the entities reached become a new variable.",
              {"variable": _VARIABLE_ARG, "relation": "a relation from get_relations"}),
    _function("intersection", "The entities in both inputs, as a new variable.",
              {"variable1": _VARIABLE_ARG, "variable2": _VARIABLE_ARG}),
    _function("get_attributes", "List the numeric attributes (e.g. release_year) of the entities.",
              {"variable": _VARIABLE_ARG}),
    _function("argmax", "The entities with the largest value of an attribute, as a new variable.",
              {"variable": _VARIABLE_ARG, "attribute": "an attribute from get_attributes"}),
    _function("argmin", "The entities with the smallest value of an attribute, as a new variable.",
              {"variable": _VARIABLE_ARG, "attribute": "an attribute from get_attributes"}),
    _function("count", "The number of entities (creates no variable).", {"variable": _VARIABLE_ARG}),
]


def set_scores(predicted: set[str], gold: set[str]) -> tuple[float, float, float]:
    """(precision, recall, f1) of a predicted set against a gold set.

    An empty prediction has precision 0; two empty sets score 1 on all three.
    """
    if not predicted and not gold:
        return 1.0, 1.0, 1.0
    hits = len(predicted & gold)
    precision = hits / len(predicted) if predicted else 0.0
    recall = hits / len(gold) if gold else 0.0
    f1 = 2 * precision * recall / (precision + recall) if hits else 0.0
    return precision, recall, f1


class KGEnv:
    """One KG episode at a time (the `Env` protocol).

    store: the knowledge graph, any `KGBackend` (shared read-only between env instances).
    max_listed: list entity names in a new-variable observation when the set has at most this
        many members (0 = never).
    system_prompt: overrides `DEFAULT_SYSTEM_PROMPT`.
    limits: bounds on the lists observations show (default `ObservationLimits()`).
    max_calls_per_turn: the most tool calls (malformed ones included) one turn gets answered;
        the rest are not run and one more error observation says so. A degenerate turn of
        thousands of `<tool_call>` blocks would otherwise run them all and answer with an
        observation of hundreds of thousands of tokens. They all count in `tool_calls` and the
        unanswered ones in `tool_errors`.
    The current episode's `toolbox` is public so reward shaping can read `toolbox.touched`.
    """

    def __init__(self, store: KGBackend, max_listed: int = 0, system_prompt: str | None = None,
                 limits: ObservationLimits | None = None, max_calls_per_turn: int = 20) -> None:
        if max_calls_per_turn < 1:
            raise ValueError(f"max_calls_per_turn must be >= 1, got {max_calls_per_turn}")
        self.max_calls_per_turn = max_calls_per_turn
        self.store = store
        self.max_listed = max_listed
        self.limits = ObservationLimits() if limits is None else limits
        self._system_prompt = DEFAULT_SYSTEM_PROMPT if system_prompt is None else system_prompt
        self.toolbox: KGToolbox | None = None
        self._task: Task | None = None
        self._unrun_calls = 0
        self._ended = False

    def system_prompt(self) -> str:
        """The short instruction: use the tools, end with `Final Answer: #k`."""
        return self._system_prompt

    def tool_schemas(self) -> list[dict[str, Any]]:
        """The seven KG tools in OpenAI function format (a copy: callers may edit it)."""
        return copy.deepcopy(TOOL_SCHEMAS)

    def reset(self, task: Task) -> str:
        """Start an episode with fresh variables; returns the question."""
        hidden = [task.meta["topic"]] if task.meta.get("exclude_topic") else []
        self.toolbox = KGToolbox(
            self.store, max_listed=self.max_listed, hidden=hidden, limits=self.limits,
            entity_names=task.meta.get("entities"),
            count_creates_variable=bool(task.meta.get("count_creates_variable")),
        )
        self._task = task
        self._unrun_calls = 0
        self._ended = False
        return task.prompt

    def step(self, action: Action) -> StepResult:
        """Answer parse errors and tool calls (one observation each, in order); a
        `Final Answer: #k` in the text ends and scores the episode (after the turn's calls run).
        RuntimeError when the episode has ended (see the module docstring)."""
        toolbox = self._require_episode()
        if self._ended:
            raise RuntimeError("KGEnv.step called after the episode ended (a final answer or finish); "
                               "call reset(task) first to start a new episode")
        errors = action.parse_errors[: self.max_calls_per_turn]
        calls = action.tool_calls[: self.max_calls_per_turn - len(errors)]
        observations = [f"Error: {e}" for e in errors] + [toolbox.call(c.name, c.arguments) for c in calls]
        # Malformed calls and calls over the limit never reach the toolbox; they count as calls
        # and as errors (`_counters`).
        total = len(action.parse_errors) + len(action.tool_calls)
        self._unrun_calls += total - len(calls)
        if total > len(observations):
            observations.append(
                f"Error: this turn has {total} tool calls; only the first {self.max_calls_per_turn} were "
                f"answered and {total - len(observations)} were not run. Make fewer calls per turn.")

        final = _FINAL_ANSWER.search(action.text)
        if final is not None:
            self._ended = True
            return self._score(f"#{final.group(1)}")
        if _FINAL_ANSWER_WORDS.search(action.text):
            observations.append(_BAD_FINAL_ANSWER)
        if not observations:
            observations.append(_NO_ACTION)
        return StepResult(observations=observations, info=self._counters())

    def finish(self, reason: str) -> StepResult:
        """End without an answer (turn/token limit): reward 0, the same info keys as an answer."""
        toolbox = self._require_episode()
        self._ended = True
        info = self._counters() | {
            "success": 0.0, "f1": 0.0, "precision": 0.0, "recall": 0.0,
            "reward_parts": {"outcome": 0.0}, "answer_size": 0, "finish_reason": reason,
            "knowledge_units": toolbox.knowledge_units(),
        }
        return StepResult(observations=[], reward=0.0, done=True, info=info)

    def _require_episode(self) -> KGToolbox:
        if self.toolbox is None:
            raise RuntimeError("KGEnv.step/finish called before reset(task): start an episode first")
        return self.toolbox

    def _counters(self) -> dict[str, Any]:
        """Tool calls include malformed ones (parse errors) and ones over `max_calls_per_turn`,
        which also count as tool errors."""
        assert self.toolbox is not None
        return {
            "tool_calls": self.toolbox.num_calls + self._unrun_calls,
            "tool_errors": self.toolbox.num_errors + self._unrun_calls,
        }

    def _score(self, ref: str) -> StepResult:
        assert self.toolbox is not None and self._task is not None
        predicted = self.toolbox.resolve_answer(ref)
        if predicted is None:
            result = self.finish("answer_error")
            result.info["answer_error"] = (
                f"final answer {shown(ref)} names no variable (variables: {len(self.toolbox.variables)})"
            )
            return result
        meta = self._task.meta
        if meta.get("exclude_topic"):
            predicted.discard(meta["topic"])
        gold = set(self._task.answer)
        precision, recall, f1 = set_scores(predicted, gold)
        reward = 1.0 if predicted == gold else 0.0
        info = self._counters() | {
            "success": reward, "f1": f1, "precision": precision, "recall": recall,
            "reward_parts": {"outcome": reward}, "answer_size": len(predicted),
            "knowledge_units": self.toolbox.knowledge_units(),
        }
        return StepResult(observations=[], reward=reward, done=True, info=info)
