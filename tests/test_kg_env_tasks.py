"""KGEnv scoring, synthetic task generation, the oracle, and the MetaQA loaders."""

from __future__ import annotations

import json
import random
import re

import pytest

from support import metaqa_dir, small_store
from tiderl.envs.kg.env import KGEnv
from tiderl.envs.kg.store import load_metaqa_kb
from tiderl.envs.kg.tasks import (
    build_movie_world,
    generate_metaqa_training_questions,
    generate_questions,
    load_metaqa_questions,
    oracle_relation_path,
    oracle_turns,
    qtype_to_path,
    split_by_entity,
)
from tiderl.envs.kg.tools import TOOL_ARGUMENTS
from tiderl.envs.protocol import Action, Task, ToolCall

INFO_KEYS = {"success", "f1", "precision", "recall", "reward_parts", "tool_calls", "tool_errors", "answer_size"}


def call(name: str, **arguments: str) -> ToolCall:
    return ToolCall(name=name, arguments=arguments)


def one_hop_task(answer: list[str]) -> Task:
    return Task("t1", "which films did [D1] direct?", answer, {"topic": "D1", "path": ["directed_by_inv"]})


# -- env -------------------------------------------------------------------------------------


def test_prompt_and_schemas():
    env = KGEnv(small_store())
    assert "Final Answer: #k" in env.system_prompt() and len(env.system_prompt()) < 200
    assert KGEnv(small_store(), system_prompt="custom").system_prompt() == "custom"
    schemas = env.tool_schemas()
    assert [s["function"]["name"] for s in schemas] == list(TOOL_ARGUMENTS)
    for s in schemas:
        params = s["function"]["parameters"]
        assert s["type"] == "function" and params["type"] == "object"
        assert tuple(params["properties"]) == TOOL_ARGUMENTS[s["function"]["name"]] == tuple(params["required"])
    assert env.reset(one_hop_task(["F1", "F2"])) == "which films did [D1] direct?"


def test_correct_final_answer_scores_one():
    env = KGEnv(small_store())
    env.reset(one_hop_task(["F1", "F2"]))
    step = env.step(Action("", [call("get_neighbors", variable="D1", relation="directed_by_inv")]))
    assert step.observations == ["Variable #0: 2 entities"] and not step.done
    # Spaces inside the marker are tolerated.
    step = env.step(Action("The films are in #0. Final Answer : # 0"))
    assert step.done and step.reward == 1.0 and step.observations == []
    assert INFO_KEYS <= set(step.info)
    assert step.info["success"] == 1.0 and step.info["f1"] == 1.0
    assert step.info["reward_parts"] == {"outcome": 1.0}
    assert (step.info["tool_calls"], step.info["tool_errors"], step.info["answer_size"]) == (1, 0, 2)


def test_partial_answer_gets_f1_but_no_reward():
    env = KGEnv(small_store())
    env.reset(one_hop_task(["F1", "F3"]))
    # Predicted #0 = {F1, F2}, gold {F1, F3}: 1 hit -> precision 1/2, recall 1/2, F1 1/2.
    step = env.step(Action("Final Answer: #0", [call("get_neighbors", variable="D1", relation="directed_by_inv")]))
    assert step.done and step.reward == 0.0 and step.info["success"] == 0.0
    assert (step.info["precision"], step.info["recall"], step.info["f1"]) == (0.5, 0.5, 0.5)


def test_exclude_topic_hides_the_topic_entity():
    # "Which films share a director with F1?": F1 -> D1 -> {F1, F2}; the topic is excluded -> {F2}.
    task = Task("t2", "q", ["F2"], {"topic": "F1", "path": ["directed_by", "directed_by_inv"], "exclude_topic": True})
    env = KGEnv(small_store())
    env.reset(task)
    env.step(Action("", [call("get_neighbors", variable="F1", relation="directed_by"),
                         call("get_neighbors", variable="#0", relation="directed_by_inv")]))
    assert env.toolbox.variables == [{"D1"}, {"F2"}]
    step = env.step(Action("Final Answer: #1"))
    assert step.reward == 1.0 and step.info["answer_size"] == 1
    # A set holding only the topic (built by intersection, which hides nothing) scores empty:
    # precision 0 (empty prediction), recall 0/1.
    env.reset(task)
    env.step(Action("", [call("intersection", variable1="F1", variable2="F1")]))
    step = env.step(Action("Final Answer: #0"))
    assert step.reward == 0.0 and step.info["answer_size"] == 0 and step.info["recall"] == 0.0
    # Without exclude_topic the same episode keeps F1: the answer {D1 films} = {F1, F2}.
    env.reset(Task("t3", "q", ["F1", "F2"], {"topic": "F1"}))
    env.step(Action("", [call("get_neighbors", variable="F1", relation="directed_by"),
                         call("get_neighbors", variable="#0", relation="directed_by_inv")]))
    assert env.step(Action("Final Answer: #1")).reward == 1.0


def test_parse_errors_and_bad_calls_become_observations():
    env = KGEnv(small_store())
    env.reset(one_hop_task(["F1", "F2"]))
    step = env.step(Action("<tool_call>{oops</tool_call>", [call("get_neighbors", variable="D9", relation="x")],
                           parse_errors=["tool call is not valid JSON"]))
    assert not step.done
    assert step.observations[0] == "Error: tool call is not valid JSON"
    assert step.observations[1].startswith("Error: entity 'D9' not found.")
    # 1 malformed + 1 well-formed call, both errors.
    assert (step.info["tool_calls"], step.info["tool_errors"]) == (2, 2)


def test_turn_without_call_or_answer_is_told_what_to_do():
    env = KGEnv(small_store())
    env.reset(one_hop_task(["F1"]))
    step = env.step(Action("I think about it."))
    assert not step.done and len(step.observations) == 1
    assert "Call a tool" in step.observations[0] and "Final Answer: #k" in step.observations[0]
    # An entity name is not a final answer: only a variable is.
    step = env.step(Action("Final Answer: F1"))
    assert not step.done and step.observations[0].startswith("Error: the final answer must be a variable")


def test_unknown_variable_in_final_answer_ends_with_zero():
    env = KGEnv(small_store())
    env.reset(one_hop_task(["F1", "F2"]))
    step = env.step(Action("Final Answer: #3"))
    assert step.done and step.reward == 0.0 and "#3" in step.info["answer_error"]
    assert INFO_KEYS <= set(step.info)


def test_finish_and_step_before_reset():
    env = KGEnv(small_store())
    with pytest.raises(RuntimeError, match="reset"):
        env.step(Action("Final Answer: #0"))
    env.reset(one_hop_task(["F1"]))
    env.step(Action("", [call("count", variable="D1")]))
    step = env.finish("max_turns")
    assert step.done and step.reward == 0.0 and INFO_KEYS <= set(step.info)
    assert step.info["success"] == 0.0 and step.info["tool_calls"] == 1 and step.info["finish_reason"] == "max_turns"


# -- synthetic world and questions -------------------------------------------------------------


def test_generate_questions_on_the_small_graph():
    templates = {
        ("directed_by_inv",): ["which films did {topic} direct?"],
        ("directed_by", "directed_by_inv"): ["which films share a director with {topic}?"],
    }
    tasks = generate_questions(small_store(), seed=0, templates=templates)
    # 1 hop: D1 -> {F1, F2}, D2 -> {F3}.  2 hops (topic excluded): F1 -> D1 -> {F2},
    # F2 -> D1 -> {F1}, F3 -> D2 -> {F3} minus F3 = {} (skipped).
    assert [(t.task_id, t.prompt, t.answer) for t in tasks] == [
        ("kgsyn-1-0", "which films did [D1] direct?", ["F1", "F2"]),
        ("kgsyn-1-1", "which films did [D2] direct?", ["F3"]),
        ("kgsyn-2-0", "which films share a director with [F1]?", ["F2"]),
        ("kgsyn-2-1", "which films share a director with [F2]?", ["F1"]),
    ]
    assert tasks[2].meta == {"topic": "F1", "path": ["directed_by", "directed_by_inv"], "hops": 2,
                             "template": "which films share a director with {topic}?", "exclude_topic": True}
    # The cap drops D1's 2-film answer; hops=(2,) keeps the 2-hop ids unchanged.
    assert [t.task_id for t in generate_questions(small_store(), 0, hops=(1,), templates=templates,
                                                  max_answers=1)] == ["kgsyn-1-0"]
    assert [t.task_id for t in generate_questions(small_store(), 0, hops=(2,), templates=templates)] == [
        "kgsyn-2-0", "kgsyn-2-1"]
    with pytest.raises(ValueError, match="no question templates for hops=\\[3\\]"):
        generate_questions(small_store(), 0, hops=(3,), templates=templates)


def test_movie_world_is_deterministic_and_uses_short_names():
    tasks_a = generate_questions(build_movie_world(seed=1), seed=1)
    tasks_b = generate_questions(build_movie_world(seed=1), seed=1)
    assert tasks_a == tasks_b
    assert generate_questions(build_movie_world(seed=2), seed=1) != tasks_a

    world = build_movie_world(seed=1)
    name = re.compile(r"film_\d{3}|p_\d{3}|g_\d|lang_\d|(19|20)\d\d")
    assert all(name.fullmatch(e) for e in world.entities())
    assert sum(e.startswith("film_") for e in world.entities()) == 150
    assert world.attribute_relations == {"release_year"}

    assert len({t.task_id for t in tasks_a}) == len(tasks_a) > 1000
    assert {t.meta["hops"] for t in tasks_a} == {1, 2}
    for t in tasks_a:
        assert 1 <= len(t.answer) <= 5 and t.answer == sorted(t.answer)
        assert f"[{t.meta['topic']}]" in t.prompt
        assert t.meta["exclude_topic"] == (t.meta["hops"] == 2)
        assert t.meta["topic"] not in t.answer or t.meta["hops"] == 1
    # Small answers dominate: most questions have at most 4 answers.
    assert sum(len(t.answer) <= 4 for t in tasks_a) > 0.9 * len(tasks_a)


def test_split_by_entity_holds_topics_out():
    tasks = generate_questions(build_movie_world(seed=0), seed=0)
    train, held = split_by_entity(tasks, eval_fraction=0.2, seed=3)
    train_topics = {t.meta["topic"] for t in train}
    held_topics = {t.meta["topic"] for t in held}
    assert not train_topics & held_topics
    assert len(train) + len(held) == len(tasks)
    all_topics = train_topics | held_topics
    assert len(held_topics) == round(0.2 * len(all_topics))
    assert split_by_entity(tasks, 0.2, seed=3) == (train, held)
    with pytest.raises(ValueError, match="eval_fraction"):
        split_by_entity(tasks, 1.5)


# -- oracle ----------------------------------------------------------------------------------


def parse_turn(text: str) -> Action:
    """What an agent loop would parse from one oracle turn (tool-call JSON between the tags)."""
    calls = [json.loads(body) for body in re.findall(r"<tool_call>\n(.*?)\n</tool_call>", text, re.S)]
    return Action(text, [ToolCall(c["name"], c["arguments"]) for c in calls])


def replay(env: KGEnv, task: Task, turns: list[str]):
    env.reset(task)
    steps = [env.step(parse_turn(t)) for t in turns]
    assert all(not s.done for s in steps[:-1]) and steps[-1].done
    assert all(not o.startswith("Error") for s in steps for o in s.observations)
    return steps[-1]


def test_oracle_turn_format():
    task = generate_questions(small_store(), 0, templates={
        ("directed_by", "directed_by_inv"): ["which films share a director with {topic}?"]})[0]
    assert oracle_relation_path(task) == ["directed_by", "directed_by_inv"]
    assert oracle_turns(task, random.Random(0)) == [
        '<tool_call>\n{"name": "get_neighbors", "arguments": {"variable": "F1", "relation": "directed_by"}}\n</tool_call>',
        '<tool_call>\n{"name": "get_neighbors", "arguments": {"variable": "#0", "relation": "directed_by_inv"}}\n'
        "</tool_call>",
        "Final Answer: #1",
    ]
    with pytest.raises(ValueError, match="needs the store"):
        oracle_turns(task, random.Random(0), relation_noise=0.5)


def test_noise_free_oracle_solves_every_generated_task():
    world = build_movie_world(seed=0)
    env = KGEnv(world)
    tasks = generate_questions(world, seed=0)
    rng = random.Random(0)
    for task in tasks:
        assert replay(env, task, oracle_turns(task, rng, 0.0, store=world)).reward == 1.0, task


def test_noisy_oracle_fails_sometimes_but_every_call_is_valid():
    world = build_movie_world(seed=0)
    env = KGEnv(world)
    tasks = generate_questions(world, seed=0)[::5]
    assert [sum(t.meta["hops"] == h for t in tasks) for h in (1, 2)] == [245, 365]
    rng = random.Random(0)
    # relation_noise=1: the first hop never uses the intended relation, unless the topic has
    # no other relation to choose from (a person who only directed keeps directed_by_inv).
    for task in tasks[:100]:
        first = json.loads(oracle_turns(task, rng, 1.0, store=world)[0].split("\n")[1])
        alternatives = set(world.relations(task.meta["topic"])) - {task.meta["path"][0]}
        assert (first["arguments"]["relation"] != task.meta["path"][0]) == bool(alternatives)
        assert first["arguments"]["relation"] in world.relations(task.meta["topic"])
    # relation_noise=0.3: a 1-hop task stays on its path with p 0.7, a 2-hop one with 0.7^2 = 0.49.
    # This sample has 245 1-hop and 365 2-hop tasks: (245 * 0.7 + 365 * 0.49) / 610 ~= 0.57 stay
    # on path; a wrong path only rarely reaches the gold set by chance.
    rewards = [replay(env, t, oracle_turns(t, rng, 0.3, store=world)).reward for t in tasks]
    rate = sum(rewards) / len(rewards)
    assert 0.4 < rate < 0.8, rate


# -- MetaQA ----------------------------------------------------------------------------------


def test_qtype_paths_and_missing_folder(tmp_path):
    assert qtype_to_path("actor_to_movie") == ["starred_actors_inv"]
    assert qtype_to_path("movie_to_director_to_movie_to_language") == [
        "directed_by", "directed_by_inv", "in_language"]
    assert qtype_to_path("tag_to_movie") == ["has_tags_inv"] and qtype_to_path("movie_to_tags") == ["has_tags"]
    assert qtype_to_path("movie_to_imdbrating") == ["has_imdb_rating"]
    with pytest.raises(ValueError, match="unknown MetaQA qtype step"):
        qtype_to_path("actor_to_director")
    with pytest.raises(FileNotFoundError, match="data.metaqa_dir"):
        load_metaqa_questions(tmp_path / "nowhere", hops=1)


@pytest.fixture(scope="module")
def metaqa():
    folder = metaqa_dir()
    return folder, load_metaqa_kb(folder / "kb.txt")


@pytest.mark.data
def test_metaqa_questions_parse(metaqa):
    folder, _ = metaqa
    # README: 9,947 / 14,872 / 14,274 test questions.
    assert [len(load_metaqa_questions(folder, h)) for h in (1, 2, 3)] == [9947, 14872, 14274]
    first = load_metaqa_questions(folder, 1)[0]
    assert first.task_id == "metaqa-1hop-test-0"
    assert first.prompt == "what does [Grégoire Colin] appear in" and first.answer == ["Before the Rain"]
    assert first.meta == {"topic": "Grégoire Colin", "path": ["starred_actors_inv"], "hops": 1,
                          "qtype": "actor_to_movie", "exclude_topic": False}
    sample = load_metaqa_questions(folder, 2, sample=50, seed=4)
    assert sample == load_metaqa_questions(folder, 2, sample=50, seed=4) and len(sample) == 50
    assert all(t.meta["exclude_topic"] for t in sample)


@pytest.mark.data
@pytest.mark.parametrize("hops", [2, 3])
def test_metaqa_qtype_paths_reproduce_gold_through_the_env(metaqa, hops):
    folder, store = metaqa
    env = KGEnv(store)
    tasks = load_metaqa_questions(folder, hops, sample=200, seed=0)
    rewards = [replay(env, t, oracle_turns(t, random.Random(0))).reward for t in tasks]
    # README: the qtype path reproduces 100% of 2-/3-hop gold sets (topic excluded at every hop).
    assert sum(rewards) >= 0.99 * len(tasks), sum(rewards)


@pytest.mark.data
def test_generated_metaqa_training_questions_are_held_out(metaqa):
    folder, store = metaqa
    evaluation = load_metaqa_questions(folder, 2, sample=300, seed=0)
    eval_topics = {t.meta["topic"] for t in evaluation}
    train = generate_metaqa_training_questions(store, seed=0, n=300, exclude_topics=eval_topics)
    assert train == generate_metaqa_training_questions(store, seed=0, n=300, exclude_topics=eval_topics)
    assert len(train) == 300 and {t.meta["hops"] for t in train} == {1, 2}
    assert not {t.meta["topic"] for t in train} & eval_topics
    metaqa_texts = {t.prompt for t in evaluation}
    assert not {t.prompt for t in train} & metaqa_texts
    env = KGEnv(store)
    for task in train[:100]:
        assert 1 <= len(task.answer) <= 5
        assert replay(env, task, oracle_turns(task, random.Random(0))).reward == 1.0, task
