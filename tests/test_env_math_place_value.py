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
        demonstrations(setup, load_config(CONFIG, ["env.options.calculator=true"]), random.Random(0))


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
        "env.options.num_train_tasks=300", "data.eval_size=16", "model.tiny.vocab_size=400",
        "model.tiny.hidden_size=64", "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1",
        "model.warmstart.num_traces=200", "model.warmstart.steps=20", "model.warmstart.batch_size=16",
        "rollout.batch_size=8", "train.steps=2", "algo.critic_warmup_steps=1", "log.progress=false",
        f"model.cache_dir={tmp_path / 'cache'}", f"run_dir={tmp_path / 'run'}"])
    with pytest.warns(RuntimeWarning, match="hit its cap"):  # 20 steps do not teach the copy
        run = build_run(cfg)
    model_dir = Path(run.model_path)
    assert model_dir.name.startswith("math-tiny-place_value-")
    report = json.loads((model_dir / "tiderl_build.json").read_text())
    assert report["demonstrations"] == 200 and 0.0 < report["demonstration_success"] < 1.0
    assert set(report["confusion_rates"]) == {k.name for k in PLACE_VALUE_KINDS}
    assert report["sft_loss_last"] < report["sft_loss_first"]
    assert report["sft_steps"] == 20 and report["copy_check"]["passed"] is False
    history, _ = train(run)
    assert len(history) == 2 and run.step == 2
    assert all(0.0 <= h["success"] <= 1.0 for h in history)
    result = evaluate(run.engine, run.tokenizer, run.make_env, run.setup.eval_tasks, cfg.env, cfg.rollout,
                      greedy=True)
    assert result["n"] == 16 and 0.0 <= result["success"] <= 1.0


# The warm start's copy check (model.warmstart.copy_check_*): the config trains until the model
# copies, rather than for a fixed number of steps.

def test_copy_check_asks_about_numbers_the_demonstrations_never_show():
    from tiderl.envs.math.setup import copy_check, copy_check_numbers

    cfg = load_config(CONFIG)
    assert cfg.model.warmstart.copy_check_threshold > 0  # the config uses the rule
    setup = load_setup(cfg)
    kept_out = copy_check_numbers(setup, cfg.seed)
    train_numbers = {t.meta["number"] for t in setup.train_tasks}
    assert kept_out < train_numbers and len(kept_out) == len(train_numbers) // 8
    tasks, scripts, copied = copy_check(setup, cfg)
    assert len(tasks) == cfg.model.warmstart.copy_check_size
    assert {t.meta["number"] for t in tasks} <= kept_out  # training questions, never held-out ones
    assert {t.prompt for t in tasks} <= {t.prompt for t in setup.train_tasks}
    demonstrated, _, _ = demonstrations(setup, cfg, random.Random(0))
    assert not {t.meta["number"] for t in demonstrated} & kept_out
    # With the rule off, the demonstrations are drawn from every training question, as before it.
    off = load_config(CONFIG, ["model.warmstart.copy_check_threshold=0"])
    assert {t.meta["number"] for t in demonstrations(setup, off, random.Random(0))[0]} & kept_out
    # The judge: the right and the confused answer are copies, a digit copied wrong is not.
    task = next(t for t in tasks if t.meta["kind"] == "times_ten")
    n = str(task.meta["number"])
    wrong_digit = str((int(n[1]) + 1) % 10)
    assert copied(task, f"Final Answer: {n}0") and copied(task, f"Final Answer: {n}00")
    assert not copied(task, f"Final Answer: {n[0]}{wrong_digit}{n[2]}0")
    assert not copied(task, "no answer") and scripts[0] == [f"Final Answer: {tasks[0].answer}"]
    with pytest.raises(ValueError, match="data.source=place_value"):
        copy_check(load_setup(load_config("configs/math_digits_sao_tiny.yaml")), cfg)


def test_copy_check_settings_are_validated():
    from tiderl.config import ConfigError

    for override, field in (("model.warmstart.copy_check_threshold=1.5", "copy_check_threshold"),
                            ("model.warmstart.copy_check_every=0", "copy_check_every"),
                            ("model.warmstart.copy_check_size=2", "copy_check_size")):
        with pytest.raises(ConfigError, match=f"model.warmstart.{field}"):
            load_config(CONFIG, [override])


def test_supervised_warm_start_stops_at_the_first_passing_check():
    import torch

    from tiderl.embedded.tiny import init_tiny_model, tiny_qwen2_config
    from tiderl.models.warmstart import supervised_finetune
    from tiderl.types import Trajectory

    model = init_tiny_model(tiny_qwen2_config(16, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                                              max_position_embeddings=16), 0)
    traces = [Trajectory(tokens=[3, 4, 5, 6], loss_mask=[0, 0, 1, 1], behavior_logprobs=[0.0] * 4,
                         policy_version=[0] * 4) for _ in range(4)]
    checked = []
    threads = torch.get_num_threads()

    def check(step):  # passes on its second call
        checked.append(step)
        return len(checked) == 2

    losses = supervised_finetune(model, traces, 0, 100, 2, 1e-3, 0, log=lambda _: None,
                                 check=check, check_every=3)
    assert checked == [3, 6] and len(losses) == 6
    assert torch.get_num_threads() == threads  # the warm start's one thread is given back
    # A check that never passes: every check_every steps, and the cap's model too.
    checked.clear()
    losses = supervised_finetune(model, traces, 0, 7, 2, 1e-3, 0, log=lambda _: None,
                                 check=lambda step: checked.append(step) and False, check_every=3)
    assert checked == [3, 6, 7] and len(losses) == 7 and torch.isfinite(torch.tensor(losses)).all()


def test_warm_start_that_hits_its_cap_warns_and_says_so_in_the_build_report(tmp_path):
    """A real (toy) build under a threshold no 4-step model reaches: the check runs on the
    model's greedy answers every 2 steps and at the cap, the build warns, and the report records
    every check and that none passed."""
    import json

    from tiderl.embedded.build import ensure_embedded_model

    cfg = load_config(CONFIG, [
        "env.options.num_train_tasks=200", "data.eval_size=8", "model.tiny.vocab_size=400",
        "model.tiny.hidden_size=32", "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1",
        "model.warmstart.num_traces=32", "model.warmstart.steps=5", "model.warmstart.batch_size=8",
        "model.warmstart.copy_check_every=2", "model.warmstart.copy_check_size=16",
        "model.warmstart.copy_check_threshold=1.0", f"model.cache_dir={tmp_path}"])
    with pytest.warns(RuntimeWarning, match="hit its cap of model.warmstart.steps=5 steps before the copy check"):
        path = ensure_embedded_model(cfg, load_setup(cfg), log=lambda _: None)
    report = json.loads((path / "tiderl_build.json").read_text())
    check = report["copy_check"]
    assert report["sft_steps"] == 5 and check["passed"] is False and check["questions"] == 16
    assert [h["step"] for h in check["history"]] == [2, 4, 5]
    assert all(0.0 <= rate < 1.0 for h in check["history"] for rate in h["per_kind"].values())


def test_place_value_report_sorts_answers_into_right_confused_and_neither():
    from tiderl.envs.math.place_value_report import main, outcome

    task = place_value_tasks(0, 40, 8)[1][0]
    assert outcome(task, f"Final Answer: {task.answer}") == "right"
    confused = calculate(task.meta["confusion"])
    assert outcome(task, f"Final Answer: {confused}") == ("right" if confused == task.answer else "confused")
    assert outcome(task, "Final Answer: 12345") == "neither" and outcome(task, "no answer") == "neither"
    with pytest.raises(SystemExit):  # --before names one run's model, so it takes one run dir
        main(["runs/a", "runs/b", "--before", "some/model"])
