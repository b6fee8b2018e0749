"""The `place_value` family (tiderl/envs/math/data.py), the tiny model's learning task on math:
the held-out split shares no number with training; every answer is made of the question's own
digits; the oracle scores 1 and the confused variant 0 under the verifier; the warm-start
demonstrations use each kind's confused variant at its intended rate; and the toy end-to-end
path (build, SAO steps, greedy held-out evaluation) runs. The learning figure itself (held-out
success before and after SAO) is printed by `tiderl demo --config configs/math_place_sao_tiny.yaml`
(docs/env_math.md, "Learning"), not asserted here."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from tiderl.config import load_config
from tiderl.envs.math.calculator import calculate
from tiderl.envs.math.data import PLACE_VALUE_KINDS, held_out_number, place_value_tasks
from tiderl.envs.math.setup import demonstrations, spread_confusion_rates
from tiderl.envs.setup import load_setup

CONFIG = "configs/math_place_sao_tiny.yaml"


def test_held_out_split_shares_no_number_with_training():
    train, held_out = place_value_tasks(0, 4000, 400)
    assert len(train) == 4000 and len(held_out) == 400
    train_numbers = {t.meta["number"] for t in train}
    held_numbers = {t.meta["number"] for t in held_out}
    assert not train_numbers & held_numbers
    assert not {t.prompt for t in train} & {t.prompt for t in held_out}
    assert all(held_out_number(n, 0) for n in held_numbers)
    assert not any(held_out_number(n, 0) for n in train_numbers)
    assert len({t.task_id for t in train + held_out}) == 4400
    # All eight kinds are held out, in roughly equal shares.
    kinds = Counter(t.meta["kind"] for t in held_out)
    assert set(kinds) == {k.name for k in PLACE_VALUE_KINDS} and min(kinds.values()) >= 25
    for t in train[:500] + held_out:
        n = str(t.meta["number"])
        assert n in t.prompt and t.answer == calculate(t.meta["expression"])
        # Each question ends with n; the answer (and the confused one) is a prefix of n's
        # digits with zeros appended.
        assert t.prompt.endswith(f" {n}?")
        for answer in (t.answer, calculate(t.meta["confusion"])):
            assert any(answer == n[:j] + "0" * m for j in (1, 2, 3) for m in (0, 1, 2, 3)), (t.prompt, answer)
    # Deterministic for a seed, another split for another seed; too many asked is an error.
    assert [t.prompt for t in place_value_tasks(0, 4000, 400)[1]] == [t.prompt for t in held_out]
    assert {t.meta["number"] for t in place_value_tasks(1, 4000, 400)[1]} != held_numbers
    with pytest.raises(ValueError, match="fewer than asked"):
        place_value_tasks(0, 7200, 10)


def test_oracle_scores_one_and_the_confused_variant_zero_under_the_verifier():
    from tiderl.agent.tool_parser import parse_hermes_tool_calls

    cfg = load_config(CONFIG, ["data.eval_size=24"])
    setup = load_setup(cfg)
    assert setup.name == "place_value" and len(setup.eval_tasks) == 24
    checked = 0
    for task in setup.eval_tasks:
        env = setup.make_env()
        env.reset(task)
        turns = setup.oracle(task)
        assert len(turns) == 1  # single turn, no calculator
        assert env.step(parse_hermes_tool_calls(turns[0])).info["success"] == 1.0
        confused = calculate(task.meta["confusion"])
        if confused != task.answer:  # e.g. the tens and hundreds digits of 335 coincide
            env.reset(task)
            assert env.step(parse_hermes_tool_calls(f"\\boxed{{{confused}}}")).info["success"] == 0.0
            checked += 1
    assert checked >= 18


def test_demonstrations_confuse_each_kind_at_its_intended_rate():
    cfg = load_config(CONFIG)
    setup = load_setup(cfg)
    rates = spread_confusion_rates(0.5, 0, PLACE_VALUE_KINDS)
    assert sorted(round(r, 3) for r in rates.values()) == [round(0.25 + i / 14, 3) for i in range(8)]
    assert spread_confusion_rates(0.5, 1, PLACE_VALUE_KINDS) != rates  # another kind order
    tasks, scripts, entries = demonstrations(setup, cfg, random.Random(0))
    assert len(tasks) == 3000 and entries["confusion_rates"] == {k: round(r, 3) for k, r in rates.items()}
    train_prompts = {t.prompt for t in setup.train_tasks}
    used, confused = Counter(), Counter()
    for task, script in zip(tasks, scripts):
        assert task.prompt in train_prompts and len(script) == 1 and script[0].startswith("Final Answer: ")
        right, wrong = task.answer, calculate(task.meta["confusion"])
        if right == wrong:
            continue
        answer = script[0][len("Final Answer: "):]
        assert answer in (right, wrong)
        used[task.meta["kind"]] += 1
        confused[task.meta["kind"]] += answer == wrong
    for kind, rate in rates.items():
        assert abs(confused[kind] / used[kind] - rate) < 0.1, (kind, confused[kind] / used[kind], rate)
    with pytest.raises(ValueError, match="place_value without it"):
        demonstrations(setup, load_config(CONFIG, ["env.math_tools=true"]), random.Random(0))


@pytest.mark.slow
def test_place_value_tiny_model_builds_trains_and_evaluates(tmp_path):
    """The demo's path at toy size: build the embedded model (a short warm start), 2 SAO steps,
    a greedy evaluation on held-out questions. Only that it runs: the figure is the demo's."""
    import json
    from pathlib import Path

    from tiderl.evaluate import evaluate
    from tiderl.recipe import train
    from tiderl.run import build_run

    cfg = load_config(CONFIG, [
        "data.num_train_tasks=300", "data.eval_size=16", "model.tiny.vocab_size=400",
        "model.tiny.hidden_size=64", "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1",
        "model.warmstart.num_traces=200", "model.warmstart.steps=20", "model.warmstart.batch_size=16",
        "rollout.batch_size=8", "train.steps=2", "algo.critic_warmup_steps=1", "log.progress=false",
        f"model.cache_dir={tmp_path / 'cache'}", f"run_dir={tmp_path / 'run'}"])
    run = build_run(cfg)
    model_dir = Path(run.model_path)
    assert model_dir.name.startswith("math-tiny-place_value-")
    report = json.loads((model_dir / "tiderl_build.json").read_text())
    assert report["demonstrations"] == 200 and 0.0 < report["demonstration_success"] < 1.0
    assert set(report["confusion_rates"]) == {k.name for k in PLACE_VALUE_KINDS}
    assert report["sft_loss_last"] < report["sft_loss_first"]
    history, _ = train(run)
    assert len(history) == 2 and run.step == 2
    assert all(0.0 <= h["success"] <= 1.0 for h in history)
    result = evaluate(run.engine, run.tokenizer, run.make_env, run.setup.eval_tasks, cfg.env, cfg.rollout,
                      greedy=True)
    assert result["n"] == 16 and 0.0 <= result["success"] <= 1.0
