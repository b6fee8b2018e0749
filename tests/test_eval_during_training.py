"""Held-out evaluation during training (`eval.every`, `eval.before`, `eval.n`, `train.keep_best`): what it logs,
that it evaluates the weights of the step just taken, that it leaves training as it was, that a
resumed run logs the same, and which configs are refused.

Runs train a tiny untrained model on `tests/resume_env.py:LengthReward` (rewarded by answer
length; an episode succeeds when its answer's length is 6 mod 7, so held-out success moves as
the weights do), a few steps each.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tiderl.config import ConfigError, load_config
from tiderl.evaluate import evaluate_modes, held_out_metrics
from tiderl.recipe import train
from tiderl.rollout.weights import weights_checksum
from tiderl.run import HeldOut, build_run
from tiderl.train.checkpoint import MARKER
from tiderl.train.lora import policy_state

from support import TIMED, length_reward_overrides, parity_model_dir

EVAL_N = 12


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return parity_model_dir(tmp_path_factory.mktemp("length"))


overrides = length_reward_overrides  # a tiny synchronous, reproducible SAO run (tests/support.py)


def rows(run_dir):
    return [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def training_part(row):
    """A metrics row without wall-clock figures and without the evaluation's own keys."""
    return {k: v for k, v in row.items() if not k.startswith(TIMED + ("eval/",))}


def exact(row):
    return {k: v for k, v in row.items() if not k.startswith(TIMED)}


@pytest.mark.slow
def test_eval_every_logs_the_published_weights_and_leaves_training_as_it_was(model, tmp_path):
    """eval.every=2 over 5 steps: rows 2, 4 and 5 (the last) carry eval/* for both modes, the
    others none; each equals an evaluation of that step's checkpoint done afterwards from scratch;
    every training metric and the final weights equal those of the same run without evaluations,
    bit for bit; TensorBoard has the eval scalars."""
    plain = build_run(load_config(None, overrides(model, tmp_path / "plain", "train.steps=5")))
    train(plain)
    cfg = load_config(None, overrides(model, tmp_path / "eval", "train.steps=5", "eval.every=2", f"eval.n={EVAL_N}",
                                      "train.checkpoint_every=1", "log.tensorboard=true"))
    evaluated = build_run(cfg)
    train(evaluated)
    a, b = rows(tmp_path / "plain"), rows(tmp_path / "eval")
    assert [training_part(x) for x in a] == [training_part(y) for y in b]
    for k, v in plain.actor.model.state_dict().items():
        assert v.equal(evaluated.actor.model.state_dict()[k]), k
    assert [r["step"] for r in b if "eval/success" in r] == [2, 4, 5]
    for r in b:
        if "eval/success" in r:
            assert r["eval/success"] == r["eval/greedy/success"] and r["eval/success_se"] == r["eval/greedy/success_se"]
            assert {"eval/sampled/success", "eval/sampled/success_se", "time/eval_s"} <= set(r)
    # The same numbers from each step's checkpoint, evaluated afterwards in a fresh run (its engine
    # synced to the checkpoint's actor), on the same first EVAL_N held-out tasks.
    seen = []
    for r in (r for r in b if "eval/success" in r):
        step = r["step"]
        checkpoint = tmp_path / "eval" / "checkpoints" / f"step_{step}"
        again = build_run(load_config(None, overrides(model, tmp_path / f"again{step}", "train.steps=5",
                                                      f"train.resume={checkpoint}")))
        results = evaluate_modes(again.cfg, again.engine, again.tokenizer, again.make_env,
                                 again.setup.eval_tasks[:EVAL_N])
        assert {k: r[k] for k in r if k.startswith("eval/")} == held_out_metrics(results), step
        assert results["greedy"]["n"] == EVAL_N
        seen.append((r["eval/greedy/success"], r["eval/sampled/success"]))
    assert len(set(seen)) > 1, f"the evaluations cannot tell the steps' weights apart: {seen}"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(tmp_path / "eval" / "tensorboard"))
    tb.Reload()
    assert [e.step for e in tb.Scalars("eval/success")] == [2, 4, 5]
    assert [e.value for e in tb.Scalars("eval/sampled/success_se")] == pytest.approx(
        [r["eval/sampled/success_se"] for r in b if "eval/success" in r])


@pytest.mark.slow
def test_keep_best_and_an_exact_resume_with_evaluations(model, tmp_path):
    """eval.every=1 with train.keep_best: checkpoints/best is the first step with the highest
    eval/success; resumed from step 2, steps 3-4 log the same rows, evaluations included, and
    the best checkpoint is replaced only by a better step."""
    more = ("train.steps=4", "eval.every=1", f"eval.n={EVAL_N}", "train.checkpoint_every=2", "train.keep_best=true",
            "eval.sampled=false")
    a = build_run(load_config(None, overrides(model, tmp_path / "a", *more)))
    train(a)
    ra = rows(tmp_path / "a")
    scores = [r["eval/success"] for r in ra]
    best = json.loads((tmp_path / "a" / "checkpoints" / "best" / MARKER).read_text())
    assert best["eval/success"] == max(scores) and best["step"] == 1 + scores.index(max(scores))
    assert "eval/sampled/success" not in ra[0]
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    b = build_run(load_config(None, overrides(model, tmp_path / "b", *more,
                                              f"train.resume={tmp_path / 'b' / 'checkpoints' / 'step_2'}")))
    train(b)
    rb = rows(tmp_path / "b")
    assert [exact(x) for x in ra] == [exact(y) for y in rb]
    # The resumed run knew the best so far: it saved no equal or worse step over it.
    assert json.loads((tmp_path / "b" / "checkpoints" / "best" / MARKER).read_text())["step"] == best["step"]


@pytest.mark.slow
def test_eval_during_asynchronous_training(model, tmp_path):
    """max_staleness=1: the evaluations run beside in-flight episodes on the same engine, on
    the weights the step published."""
    run = build_run(load_config(None, [o for o in overrides(model, tmp_path, "train.steps=3", "eval.every=3",
                                                            "eval.n=6", "system.max_staleness=1")
                                       if o != "train.reproducible=true"]))
    history, _ = train(run)
    last = rows(tmp_path)[-1]
    assert last["step"] == 3 and 0 <= last["eval/success"] <= 1 and "eval/sampled/success" in last
    results = evaluate_modes(run.cfg, run.engine, run.tokenizer, run.make_env, run.setup.eval_tasks[:6])
    assert held_out_metrics(results)["eval/greedy/success"] == last["eval/greedy/success"]


@pytest.mark.slow
def test_a_lagging_engine_gets_the_trainers_weights_before_it_evaluates(model, tmp_path):
    """Where rollouts run elsewhere (system.backend=ray), the driver's engine lags the trainer:
    HeldOut hands it the trainer's weights first, so it evaluates the step's weights."""
    run = build_run(load_config(None, overrides(model, tmp_path, "train.steps=2", "eval.every=1", f"eval.n={EVAL_N}")))
    train(run)

    def now() -> dict[str, float]:
        return held_out_metrics(evaluate_modes(run.cfg, run.engine, run.tokenizer, run.make_env,
                                               run.setup.eval_tasks[:EVAL_N]))

    published = now()
    assert published == {k: v for k, v in rows(tmp_path)[-1].items() if k.startswith("eval/")}
    # A trainer step the engine has not seen: the actor moves to version 3, the engine stays at 2.
    noise = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in run.actor.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=noise))
    run.step = 3
    evaluated = {k: v for k, v in HeldOut(run)(3).items() if k.startswith("eval/")}
    assert run.engine.version == 3 and run.engine.state_checksum() == weights_checksum(policy_state(run.actor.model))
    assert evaluated == now() and evaluated != published, (evaluated, published)


@pytest.mark.slow
def test_eval_before_logs_the_starting_weights_at_step_0_and_leaves_training_as_it_was(model, tmp_path):
    """eval.before=true: a row for step 0 holds eval/* of the untrained weights (equal to evaluating
    a freshly built run), training's rows equal those of a run without it, and a resumed run does
    not evaluate its starting point again."""
    plain = build_run(load_config(None, overrides(model, tmp_path / "plain", "train.steps=2")))
    train(plain)
    more = ("train.steps=2", "eval.before=true", f"eval.n={EVAL_N}", "train.checkpoint_every=1")
    run = build_run(load_config(None, overrides(model, tmp_path / "before", *more)))
    train(run)
    fresh = build_run(load_config(None, overrides(model, tmp_path / "fresh", "train.steps=2")))
    expected = held_out_metrics(evaluate_modes(fresh.cfg, fresh.engine, fresh.tokenizer, fresh.make_env,
                                               fresh.setup.eval_tasks[:EVAL_N]))
    logged = rows(tmp_path / "before")
    assert [r["step"] for r in logged] == [0, 1, 2]
    assert {k: v for k, v in logged[0].items() if k.startswith("eval/")} == expected
    assert set(logged[0]) == {"step", "time/eval_s", *expected}
    # Samples, rewards, values and losses are equal bit for bit; the engine's own log-probs after an
    # evaluation at step 0 are not (step 2's dis/ratio_mean 1 + 4.0e-8 against 1 + 4.5e-8: the
    # engine decoded differently shaped batches first; not traced further), so dis/* is compared
    # to 1e-6.
    for x, y in zip(rows(tmp_path / "plain"), logged[1:]):
        x, y = training_part(x), training_part(y)
        assert {k: v for k, v in x.items() if not k.startswith("dis/")} == {k: v for k, v in y.items() if not k.startswith("dis/")}
        assert {k: v for k, v in y.items() if k.startswith("dis/")} == pytest.approx(
            {k: v for k, v in x.items() if k.startswith("dis/")}, rel=1e-6, abs=1e-9)
    resumed = build_run(load_config(None, overrides(model, tmp_path / "before", *more, "train.steps=3",
                                                    f"train.resume={tmp_path / 'before' / 'checkpoints' / 'step_2'}")))
    train(resumed)
    assert [r["step"] for r in rows(tmp_path / "before")] == [0, 1, 2, 3]


@pytest.mark.parametrize("more, field", [
    (["train.keep_best=true"], "train.keep_best"),
    (["eval.n=5"], "eval.n"),
    (["eval.every=2", "eval.greedy=false", "eval.sampled=false"], "eval.every"),
    (["eval.every=-1"], "eval.every/eval.n"),
    (["eval.before=true", "eval.greedy=false", "eval.sampled=false"], "eval.before"),
])
def test_eval_settings_that_would_do_nothing_are_refused(more, field):
    with pytest.raises(ConfigError) as error:
        load_config(None, more)
    assert error.value.field == field and "Fix:" in str(error.value)


def test_held_out_metrics_names_each_mode_and_the_first_as_eval_success():
    results = {"sampled": {"success": 0.25, "stderr": 0.1, "pass_at_k": 0.5}, "greedy": {"success": 0.5, "stderr": 0.2}}
    assert held_out_metrics(results) == {
        "eval/success": 0.25, "eval/success_se": 0.1, "eval/sampled/success": 0.25, "eval/sampled/success_se": 0.1,
        "eval/sampled/pass_at_k": 0.5, "eval/greedy/success": 0.5, "eval/greedy/success_se": 0.2}
