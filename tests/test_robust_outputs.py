"""No model output can crash training: valid text everywhere, a guard around every KG tool,
bounded integer parsing, final-answer spelling, and one rule for `step` after an episode ended.
Each test here fails on the code before these fixes."""

from __future__ import annotations

import json

import pytest

from support import SCHEMA, small_graph, small_store
from tiderl.agent.chat import chat_format
from tiderl.agent.loop import ScriptedEngine, play_episodes
from tiderl.agent.text import shown, valid_text
from tiderl.agent.tool_parser import parse_hermes_tool_calls
from tiderl.config import load_config
from tiderl.embedded.tiny import train_tokenizer
from tiderl.envs.check import check_environment
from tiderl.envs.kg.backend import numeric_value
from tiderl.envs.kg.env import KGEnv
from tiderl.envs.kg.sparql import SparqlError
from tiderl.envs.protocol import Action, StepResult, Task, ToolCall
from tiderl.rollout.base import SamplingParams

# The backslash is typed out: the model writes the JSON escape of a lone surrogate.
SURROGATE_CALL = '<tool_call>{"name": "get_relations", "arguments": {"variable": "\\ud83d"}}</tool_call>'
SURROGATE_TOOL = '<tool_call>{"name": "no_such\\udc00", "arguments": {}}</tool_call>'


def task() -> Task:
    return Task("t1", "which films did [D1] direct?", ["F1", "F2"], {"topic": "D1", "path": ["directed_by_inv"]})


def is_valid(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@pytest.fixture(scope="module")
def tok():
    env = KGEnv(small_store())
    corpus = [env.system_prompt(), json.dumps(env.tool_schemas()), task().prompt, SURROGATE_CALL, "Error: entity"]
    return train_tokenizer(corpus * 4, vocab_size=400)


# -- valid text ---------------------------------------------------------------------------------

def test_valid_text_replaces_lone_surrogates_and_keeps_the_rest():
    assert valid_text("a\ud83db") == "a\ufffdb"
    assert valid_text("\udc00") == "\ufffd"
    assert valid_text("\ud83d\ude00") == "\U0001f600"  # a pair as two code points is the character
    plain = "ok \u0000 \x1b 💥"
    assert valid_text(plain) is plain
    assert shown("x" * 10_000, 50).endswith("(10000 characters)") and len(shown("x" * 10_000, 50)) < 80
    assert shown("\ud83d") == "\ufffd"
    assert shown(10**5000) == "<a int>"  # past Python's digit limit an int has no repr


def test_chat_rendering_survives_a_lone_surrogate(tok):
    fmt = chat_format(tok, KGEnv(small_store()).tool_schemas())
    ids = fmt.answer_ids(["Error: entity '\ud83d' not found."])
    assert "\ufffd" in tok.decode(ids)
    with pytest.raises(TypeError, match="observation is a int"):
        fmt.answer_ids([7])  # type: ignore[list-item]


# -- the KG environment -------------------------------------------------------------------------

@pytest.mark.parametrize("output", [SURROGATE_CALL, SURROGATE_TOOL])
def test_kg_observations_echo_arguments_as_valid_text(output):
    env = KGEnv(small_store())
    env.reset(task())
    step = env.step(parse_hermes_tool_calls(output))
    assert step.observations[0].startswith("Error:") and all(is_valid(o) for o in step.observations)


def test_kg_echo_of_an_enormous_argument_is_short():
    env = KGEnv(small_store())
    env.reset(task())
    step = env.step(Action("", [ToolCall("get_relations", {"variable": "Z" * 1_000_000})]))
    assert step.observations[0].startswith("Error: entity 'ZZZ") and len(step.observations[0]) < 300


def test_kg_huge_variable_numbers_are_errors_not_crashes():
    env = KGEnv(small_store())
    env.reset(task())
    step = env.step(Action("", [ToolCall("count", {"variable": "#" + "9" * 5000})]))
    assert step.observations[0].startswith("Error: variable #999") and "does not exist" in step.observations[0]
    final = env.step(Action("Final Answer: #" + "9" * 5000))
    assert final.done and final.reward == 0.0 and "names no variable" in final.info["answer_error"]
    assert len(final.info["answer_error"]) < 300
    # Leading zeros do not make a number long.
    env.reset(task())
    env.step(Action("", [ToolCall("get_neighbors", {"variable": "D1", "relation": "directed_by_inv"})]))
    assert env.step(Action("Final Answer: #" + "0" * 5000)).reward == 1.0


def test_numeric_value_of_a_date_with_a_huge_year_is_no_value():
    assert numeric_value("9" * 5000 + "-01-01") is None
    assert numeric_value("1" + "0" * 400 + "-01") is None
    assert numeric_value("2001-05-03") == pytest.approx(2001 + (4 * 31 + 2) / 372)


class ExplodingStore:
    """A store whose relation lookup raises something no tool expects."""

    def __init__(self, exc: Exception) -> None:
        self.inner, self.exc = small_store(), exc

    def relations_of(self, entities):
        raise self.exc

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_any_exception_inside_a_kg_tool_is_an_error_observation():
    env = KGEnv(ExplodingStore(KeyError("surprise")))
    env.reset(task())
    step = env.step(Action("", [ToolCall("get_relations", {"variable": "D1"})]))
    assert step.observations == ["Error: get_relations failed on these arguments (KeyError: 'surprise'). "
                                 "Check the arguments and try again."]
    assert step.info["tool_errors"] == 1
    # A failing backend is not the agent's fault: it still ends the episode (and the task is retried).
    env = KGEnv(ExplodingStore(SparqlError("endpoint down")))
    env.reset(task())
    with pytest.raises(SparqlError):
        env.step(Action("", [ToolCall("get_relations", {"variable": "D1"})]))


@pytest.mark.parametrize("text", ["FINAL ANSWER: #0", "final answer: #0", "Final answer:#0"])
def test_kg_final_answer_in_any_case(text):
    env = KGEnv(small_store())
    env.reset(task())
    env.step(Action("", [ToolCall("get_neighbors", {"variable": "D1", "relation": "directed_by_inv"})]))
    step = env.step(Action(text))
    assert step.done and step.reward == 1.0


@pytest.mark.parametrize("text", ["FINAL ANSWER #0", "Final Answer: Paris", "final answer: [#0]"])
def test_kg_final_answer_in_the_wrong_form_says_the_form(text):
    env = KGEnv(small_store())
    env.reset(task())
    step = env.step(Action(text))
    assert not step.done and step.observations == [
        "Error: the final answer must be a variable, written as Final Answer: #k (e.g. Final Answer: #0). "
        "Build the answer set with the tools first."]


@pytest.mark.parametrize("end", ["answer", "finish"])
def test_kg_step_after_the_episode_ended_raises_until_reset(end):
    env = KGEnv(small_store())
    env.reset(task())
    env.step(Action("", [ToolCall("get_neighbors", {"variable": "D1", "relation": "directed_by_inv"})]))
    assert (env.step(Action("Final Answer: #0")) if end == "answer" else env.finish("max_turns")).done
    with pytest.raises(RuntimeError, match=r"episode ended.*reset\(task\)"):
        env.step(Action("Final Answer: #0"))
    env.reset(task())
    assert not env.step(Action("thinking")).done


def test_contract_check_catches_a_built_in_environment_that_steps_after_the_end(monkeypatch):
    original = KGEnv.step

    def rescoring_step(self, action):
        self._ended = False  # the old behaviour: a step after the end scores again
        return original(self, action)

    monkeypatch.setattr(KGEnv, "step", rescoring_step)
    report = check_environment(load_config(None, ["env.name=kg"]))
    failed = [name for name, passed, _ in report.checks if not passed]
    assert failed == ["step after the episode ended (finish) raises RuntimeError",
                      "step after the episode ended (an answer) raises RuntimeError"], report.text()


def test_contract_check_of_kg_passes_with_the_new_rule():
    report = check_environment(load_config(None, ["env.name=kg"]))
    assert report.ok, report.text()
    assert sum("step after the episode ended" in name for name, _, _ in report.checks) == 2


# -- the agent loop -----------------------------------------------------------------------------

class OddEnv:
    """Answers turn 1 with a raw lone surrogate (an environment that does not clean its text),
    or with an observation that is not text (task.meta["bad"]), then ends on any turn; with
    task.meta["bad_tools"] its tool schemas cannot be rendered."""

    def __init__(self) -> None:
        self.task: Task | None = None
        self.turns = 0

    def system_prompt(self) -> str:
        return "Say anything."

    def tool_schemas(self) -> list:
        assert self.task is not None
        return [{"not json": {1, 2}}] if self.task.meta.get("bad_tools") else []

    def reset(self, task: Task) -> str:
        self.task = task
        return task.prompt

    def step(self, action: Action) -> StepResult:
        assert self.task is not None
        self.turns += 1
        if self.turns == 1:
            return StepResult([7] if self.task.meta.get("bad") else ["odd \ud83d text"])  # type: ignore[list-item]
        return StepResult([], reward=1.0, done=True, info={"success": 1.0})

    def finish(self, reason: str) -> StepResult:
        return StepResult([], done=True, info={"success": 0.0})


def test_one_bad_answer_ends_only_its_episode(tok):
    tasks = [Task("good", "question good", None), Task("bad", "question bad", None, {"bad": True}),
             Task("tools", "question tools", None, {"bad_tools": True})]
    engine = ScriptedEngine(tok, {"question good": ["a", "b"], "question bad": ["a", "b"]})
    good, bad, tools = play_episodes(engine, tok, OddEnv, tasks, SamplingParams(max_new_tokens=16), max_turns=3,
                              max_total_tokens=400, threads=1)
    # The raw surrogate was rendered as U+FFFD and the episode went on to its answer.
    assert good.stop_reason == "answer" and good.reward == 1.0
    assert "odd \ufffd text" in tok.decode(good.tokens)
    # An observation that is not text ends that episode as an error, named; the batch lives on.
    assert bad.stop_reason == "error" and "observation is a int" in bad.env_info["error"]
    assert bad.env_info["error_in"] == "rendering the environment's answer"
    assert tools.stop_reason == "error" and tools.env_info["error_in"] == "rendering the prompt"


def test_kg_episode_with_a_surrogate_argument_plays_on(tok):
    env = KGEnv(small_store())
    turns = [SURROGATE_CALL, SURROGATE_TOOL,
             '<tool_call>{"name": "get_neighbors", "arguments": {"variable": "D1", "relation": "directed_by_inv"}}'
             "</tool_call>", "FINAL ANSWER: #0"]
    engine = ScriptedEngine(tok, {task().prompt: turns})
    (trajectory,) = play_episodes(engine, tok, lambda: KGEnv(env.store), [task()], SamplingParams(max_new_tokens=64),
                                  max_turns=6, max_total_tokens=2000, threads=1)
    assert trajectory.stop_reason == "answer" and trajectory.reward == 1.0 and trajectory.num_turns == 4


def test_kg_answers_at_most_max_calls_per_turn():
    env = KGEnv(small_store(), max_calls_per_turn=3)
    env.reset(task())
    step = env.step(parse_hermes_tool_calls("<tool_call>" * 5000))
    assert len(step.observations) == 4 and step.observations[-1] == (
        "Error: this turn has 5000 tool calls; only the first 3 were answered and 4997 were not run. "
        "Make fewer calls per turn.")
    assert (step.info["tool_calls"], step.info["tool_errors"]) == (5000, 5000)
    calls = [ToolCall("count", {"variable": "D1"})] * 10
    step = env.step(Action("", calls, parse_errors=["bad"]))
    assert step.observations == ["Error: bad", "Count: 1", "Count: 1", step.observations[-1]]
    assert (step.info["tool_calls"], step.info["tool_errors"]) == (5011, 5009)
    assert env.toolbox.num_calls == 2


def test_kg_on_sparql_reads_a_surrogate_argument_as_an_unknown_entity():
    # The SPARQL backend builds IRIs from arguments (UTF-8 percent-encoding): a lone surrogate
    # raised UnicodeEncodeError there. Arguments are valid text before any backend sees them.
    pytest.importorskip("pyoxigraph", reason="pyoxigraph is the in-process SPARQL store")
    from tiderl.envs.kg.rdf import to_ntriples
    from tiderl.envs.kg.sparql import OxigraphClient, SparqlBackend

    env = KGEnv(SparqlBackend(OxigraphClient.from_rdf(to_ntriples(small_graph(), SCHEMA), "nt"), SCHEMA))
    env.reset(task())
    step = env.step(parse_hermes_tool_calls(SURROGATE_CALL.replace("\\ud83d", "D1\\udc00")))
    assert step.observations == ["Error: entity 'D1\ufffd' not found. Use an exact entity name from the question "
                                 "or a variable like #0."]
