"""The generated task families for the tiny model (tiderl/envs/math/data.py): `small_arithmetic`'s
held-out split shares no question and no number pair with training, `digit_arithmetic`'s no
question; every task is solved by its oracle under the math environment's verifier; and (slow)
the warm-started tiny model solves some held-out `digit_arithmetic` tasks before any RL. The learning figure itself (held-out success before
and after SAO) is printed by `tiderl demo --config configs/math_digits_sao_tiny.yaml`
(docs/env_math.md), not asserted here."""

from __future__ import annotations

import pytest

from tiderl.config import load_config
from tiderl.envs.math.calculator import calculate
from tiderl.envs.math.data import (
    DIGIT_ARITHMETIC_KINDS,
    SMALL_ARITHMETIC_KINDS,
    digit_arithmetic_tasks,
    held_out_pair,
    small_arithmetic_tasks,
)
from tiderl.envs.setup import load_setup

CONFIG = "configs/math_small_sao_tiny.yaml"
DIGITS = "configs/math_digits_sao_tiny.yaml"


def test_held_out_split_is_disjoint_by_question_and_by_number_pair():
    train, held_out = small_arithmetic_tasks(0, 2000, 300)
    assert len(train) == 2000 and len(held_out) == 300
    assert not {t.prompt for t in train} & {t.prompt for t in held_out}
    train_pairs = {tuple(t.meta["pair"]) for t in train}
    held_pairs = {tuple(t.meta["pair"]) for t in held_out}
    assert not train_pairs & held_pairs
    assert all(held_out_pair(a, b, 0) for a, b in held_pairs)
    assert not any(held_out_pair(a, b, 0) for a, b in train_pairs)
    # Every number of a held-out question appears in its text; the kinds are all present.
    assert {t.meta["kind"] for t in held_out} == {k.name for k in SMALL_ARITHMETIC_KINDS}
    for t in held_out:
        a, b = t.meta["pair"]
        assert str(b) in t.prompt
        assert t.answer == calculate(t.meta["expression"]) != calculate(t.meta["confusion"])
        assert (t.answer == str(a)) == t.meta["kind"].startswith("eq_")  # equations solve for a
    # Deterministic for a seed, different for another.
    assert [t.prompt for t in small_arithmetic_tasks(0, 2000, 300)[1]] == [t.prompt for t in held_out]
    assert [t.prompt for t in small_arithmetic_tasks(1, 2000, 300)[1]] != [t.prompt for t in held_out]
    with pytest.raises(ValueError, match="fewer than asked"):
        small_arithmetic_tasks(0, 100000, 10)


def test_digit_split_is_disjoint_and_every_answer_is_one_digit():
    train, held_out = digit_arithmetic_tasks(0, 340, 200)
    assert len(train) == 340 and len(held_out) == 200
    assert not {t.prompt for t in train} & {t.prompt for t in held_out}
    assert len({t.task_id for t in train + held_out}) == 540
    for t in train + held_out:
        assert t.answer == calculate(t.meta["expression"]) and len(t.answer) == 1
        assert len(calculate(t.meta["confusion"])) == 1  # the confused answer is a digit too
    assert {t.meta["kind"] for t in held_out} == {k.name for k in DIGIT_ARITHMETIC_KINDS}
    assert [t.prompt for t in digit_arithmetic_tasks(0, 340, 200)[1]] == [t.prompt for t in held_out]
    assert len(digit_arithmetic_tasks(0, 4000, 200)[0]) == 340  # the rest, when fewer are left
    with pytest.raises(ValueError, match="540 distinct questions, data.eval_size=540"):
        digit_arithmetic_tasks(0, 10, 540)


def test_oracle_solves_held_out_tasks_under_the_verifier():
    """The environment's ceiling on this family: the oracle (a calculator call with the task's
    expression, then the boxed result) succeeds under math-verify; the confused calculation fails."""
    from tiderl.agent.tool_parser import parse_hermes_tool_calls
    from tiderl.envs.math.setup import tool_call_text

    cfg = load_config(CONFIG, ["data.eval_size=40"])
    setup = load_setup(cfg)
    assert setup.name == "small_arithmetic" and len(setup.eval_tasks) == 40
    for task in setup.eval_tasks:
        for expression, success in ((task.meta["expression"], 1.0), (task.meta["confusion"], 0.0)):
            env = setup.make_env()
            env.reset(task)
            observation = env.step(parse_hermes_tool_calls(tool_call_text("calculator", {"expression": expression})))
            assert not observation.done and observation.observations == [calculate(expression)]
            result = env.step(parse_hermes_tool_calls(f"\\boxed{{{observation.observations[0]}}}"))
            assert result.done and result.info["success"] == success, (task.prompt, expression)


@pytest.mark.slow
def test_warm_started_tiny_model_solves_some_held_out_tasks(tmp_path):
    """Builds the embedded tiny model of configs/math_digits_sao_tiny.yaml with a shorter warm
    start (600 demonstrations, 40 supervised steps; the config's takes minutes) and evaluates
    it greedily on 100 of its held-out questions: some succeed (the start RL needs) and not all
    (there is something to learn)."""
    from tiderl.evaluate import evaluate
    from tiderl.run import build_run

    cfg = load_config(DIGITS, ["log.progress=false", f"run_dir={tmp_path / 'run'}",
                               f"model.cache_dir={tmp_path / 'cache'}", "model.warmstart.num_traces=600",
                               "model.warmstart.steps=40"])
    run = build_run(cfg)
    held_out = run.setup.eval_tasks[:100]
    assert not {t.prompt for t in held_out} & {t.prompt for t in run.setup.train_tasks}
    result = evaluate(run.engine, run.tokenizer, run.make_env, held_out, cfg.env, cfg.rollout, greedy=True)
    assert result["n"] == 100
    assert 0.0 < result["success"] < 1.0
