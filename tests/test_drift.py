"""The drifting world (tiderl/envs/drift.py): the schedule, the two kinds of change, the KG
environment that plays in the current world, the config rules, and (slow) the recipe moving the
world with the optimizer step."""

from __future__ import annotations

import random

import pytest

from tiderl.config import ConfigError, load_config
from tiderl.envs.drift import (
    DriftingWorld,
    DriftSchedule,
    World,
    current_name,
    forward_relations,
    rename_relations,
    rewire_facts,
)
from tiderl.envs.kg.tasks import build_movie_world, path_answer, tool_call_text
from tiderl.envs.protocol import Action, ToolCall
from tiderl.envs.setup import load_setup


def drift_setup(*overrides: str):
    return load_setup(load_config("configs/sao.yaml", ["env.options.drift.every_steps=10", *overrides]))


def play(env, task, turns: list[str]) -> dict:
    """Play scripted turns (tool calls parsed here, as the agent loop would) to the end."""
    from tiderl.agent.tool_parser import parse_hermes_tool_calls

    env.reset(task)
    for turn in turns:
        result = env.step(parse_hermes_tool_calls(turn))
        if result.done:
            return result.info
    raise AssertionError("the scripted turns did not end the episode")


def test_schedule_phases_and_errors():
    s = DriftSchedule(10, 0.3, "relations")
    assert [s.phase(t) for t in (0, 9, 10, 19, 20, 35)] == [0, 0, 1, 1, 2, 3]
    assert s.change_steps(30) == [10, 20, 30] and s.change_steps(29) == [10, 20]
    off = DriftSchedule(0, 0.3, "facts")
    assert not off.active and off.phase(1000) == 0 and off.change_steps(100) == []
    for bad, match in (((-1, 0.3, "facts"), "every_steps"), ((5, 0.0, "facts"), "fraction"),
                       ((5, 1.5, "facts"), "fraction"), ((5, 0.3, "rows"), "kind")):
        with pytest.raises(ValueError, match=match):
            DriftSchedule(*bad)


def test_renaming_is_a_derangement_of_the_chosen_relations():
    names = {r: r for r in ("a", "b", "c", "d", "e", "f")}
    for seed in range(20):
        out = rename_relations(names, 0.5, random.Random(seed))
        moved = [r for r in names if out[r] != names[r]]
        assert len(moved) == 3  # round(0.5 * 6), none keeps its name
        assert sorted(out.values()) == sorted(names.values())  # a permutation of the names
    assert len([r for r in names if rename_relations(names, 0.01, random.Random(0))[r] != r]) == 2
    assert current_name("b_inv", {"b": "c"}) == "c_inv" and current_name("b", {"b": "c"}) == "c"


def test_relation_drift_keeps_the_edges_and_moves_the_names():
    base = build_movie_world(0, num_films=40, num_people=40)
    world = DriftingWorld(base, DriftSchedule(5, 0.3, "relations", seed=3))
    w0, w1, w2 = world.world(0), world.world(1), world.world(2)
    assert w0.store is base and w1.store.num_triples == base.num_triples
    moved = [r for r in w1.names if w1.names[r] != r]
    assert len(moved) == 2
    for r in forward_relations(base):  # every original relation's edges, under its current name
        for topic in sorted(base.entities_with(r))[:5]:
            assert w2.store.neighbors(topic, w2.names[r]) == base.neighbors(topic, r)
            assert w2.store.neighbors(topic, w2.names[r] + "_inv") == set()  # the inverse stays _inv
    assert world.world(2) is w2  # phases are built once
    again = DriftingWorld(base, DriftSchedule(5, 0.3, "relations", seed=3))
    assert again.world(2).names == w2.names  # deterministic for a seed
    assert "release_year" not in w2.names.values() or w2.store.is_attribute(w2.names["release_year"])


def test_fact_drift_changes_the_asked_share_of_facts():
    base = build_movie_world(0)
    new = rewire_facts(base, 0.2, random.Random(0))
    old_facts, new_facts = set(base.triples()), set(new.triples())
    changed = len(old_facts - new_facts)
    movable = sum(1 for _, r, _ in base.triples() if r not in base.attribute_relations)
    assert 0.15 * movable <= changed <= 0.2 * movable
    assert all(r not in base.attribute_relations for _, r, _ in old_facts - new_facts)
    assert new.num_triples == base.num_triples


def test_drifting_env_plays_in_the_world_of_the_current_step():
    setup = drift_setup("env.options.drift.fraction=0.3")
    world = setup.make_env.world
    moved = [r for r, name in world.world(1).names.items() if name != r]
    task = next(t for t in setup.eval_tasks if t.meta["path"] == [moved[0]])
    old_turns = setup.oracle(task)
    assert play(setup.make_env(), task, old_turns)["success"] == 1.0

    setup.on_step(10)  # the recipe's hook: phase 1 from now on
    assert world.current().phase == 1
    env = setup.make_env()
    info = play(env, task, old_turns)  # the old relation name now reaches other entities
    assert info["success"] == 0.0 and info["drift_phase"] == 1
    new_turns = setup.oracle(task)
    assert new_turns != old_turns and world.world(1).names[moved[0]] in new_turns[0]
    assert play(setup.make_env(), task, new_turns)["success"] == 1.0
    # A factory pinned to a phase ignores the step (benchmarks measure both worlds at one step).
    assert play(setup.make_env.at_phase(0)(), task, old_turns)["success"] == 1.0


def test_fact_drift_re_answers_held_out_tasks():
    setup = drift_setup("env.options.drift.kind=facts", "env.options.drift.fraction=0.2")
    world = setup.make_env.world
    setup.on_step(10)
    changed = [t for t in setup.eval_tasks if world.current().answer(t).answer != t.answer]
    assert changed, "a fifth of the facts changed, so some gold answers must change"
    task = changed[0]
    gold_now = set(path_answer(world.current().store, task.meta["topic"], task.meta["path"]))
    assert set(world.current().answer(task).answer) == gold_now != set(task.answer)
    info = play(setup.make_env(), task, setup.oracle(task))  # the tools read the new facts
    assert info["success"] == 1.0
    env = setup.make_env()
    env.reset(task)
    hop = tool_call_text("get_neighbors", {"variable": task.meta["topic"], "relation": task.meta["path"][0]})
    assert env.step(Action(hop, [ToolCall("get_neighbors", {"variable": task.meta["topic"],
                                                            "relation": task.meta["path"][0]})])).observations


def test_world_answer_needs_a_path():
    from tiderl.envs.protocol import Task

    with pytest.raises(ValueError, match="meta\\['topic'\\] and meta\\['path'\\]"):
        World(0, build_movie_world(0, num_films=5, num_people=5)).answer(Task("x", "q", ["a"]))


def test_config_rules():
    cfg = load_config("configs/sao.yaml", ["env.options.drift.every_steps=20", "env.options.drift.kind=facts"])
    assert (cfg.env.options.drift.every_steps, cfg.env.options.drift.kind) == (20, "facts")
    with pytest.raises(ConfigError, match="env.options.drift: env.name=math has no such option; only env.name=kg and env.name=db read it"):
        load_config("configs/math_small_sao_tiny.yaml", ["env.options.drift.every_steps=5"])
    with pytest.raises(ConfigError, match="env.options.drift.kind.*every_steps=0 turns drift off"):
        load_config("configs/sao.yaml", ["env.options.drift.kind=facts"])
    with pytest.raises(ConfigError, match="env.options.drift.every_steps.*system.backend=local or ray"):
        load_config("configs/sao.yaml", ["env.options.drift.every_steps=5", "system.backend=agent",
                                         "system.options.agent=mypkg.agents:solve"])
    on_ray = load_config("configs/sao.yaml", ["env.options.drift.every_steps=5", "system.backend=ray"])
    assert on_ray.system.backend == "ray"  # each rollout worker moves its world (tests/test_ray_envs.py)
    with pytest.raises(ConfigError, match="env.options.drift.fraction"):
        load_config("configs/sao.yaml", ["env.options.drift.every_steps=5", "env.options.drift.fraction=0"])
    with pytest.raises(ConfigError, match="env.options.drift.kind"):
        load_config("configs/sao.yaml", ["env.options.drift.every_steps=5", "env.options.drift.kind=rows"])


@pytest.mark.slow
def test_recipe_moves_the_world_with_the_step(cache, tmp_path):
    """Synchronous SAO on a small world that changes every 2 steps: the world follows the step,
    and every episode trained at step v + 1 played in the world of step v."""
    from tiderl.recipe import train
    from tiderl.run import build_run

    small = ["env.options.num_films=40", "env.options.num_people=40", "data.eval_size=16", "model.tiny.vocab_size=512",
             "model.tiny.hidden_size=64", "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1",
             "model.warmstart.num_traces=200", "model.warmstart.steps=10", "model.warmstart.batch_size=16",
             "rollout.batch_size=8", "algo.critic_warmup_steps=1", "log.progress=false",
             "env.options.drift.every_steps=2", f"model.cache_dir={cache}", f"run_dir={tmp_path / 'run'}"]
    run = build_run(load_config("configs/kg_sao_tiny.yaml", small))
    world = run.setup.make_env.world
    seen: list[tuple[int, int, set[int]]] = []
    train(run, 5, observer=lambda v, m, batch: seen.append(
        (v, world.step, {t.env_info["drift_phase"] for t in batch})))
    assert [v for v, _, _ in seen] == [1, 2, 3, 4, 5]
    for version, step, phases in seen:
        assert step == version
        assert phases == {(version - 1) // 2}  # staleness 0: started after the hook of step v - 1
