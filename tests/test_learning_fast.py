"""Training learns, in CI: 40 SAO steps raise the embedded tiny model's greedy success on held-out
place-value questions (numbers no training question uses) by more than 3 standard errors
(configs/ci_learning_fast.yaml; docs/env_math.md, "The CI learning test").

The run is repeatable (`train.reproducible` on one trainer thread), so on a given CPU build the
test sees one outcome, not a draw: seed 7 gains 7.5 standard errors. Other seeds build other warm
starts and gain differently (the measured spread is in the docs); the seed stays fixed. What the
test guards is the whole path a user trains through — the warm start, the engine's behaviour
log-probs, the critic, GAE, the loss, the optimizer and the weight sync — of which a regression
anywhere shows as a gain that falls below the line.

The model is built into this test's own cache (pytest's cache folder, or a tmp folder when the
cache plugin is off): on a fresh clone the build (a copy-checked warm start, 200 supervised steps for
seed 7) is part of the test. The times are printed (`-s`), not asserted.
"""

from __future__ import annotations

import math
import time

import pytest

from tiderl.config import load_config
from tiderl.evaluate import evaluate
from tiderl.recipe import train
from tiderl.run import build_run

pytestmark = pytest.mark.slow

CONFIG = "configs/ci_learning_fast.yaml"
# The gain must exceed this many standard errors of the difference of the two success rates.
MIN_GAIN_SE = 3.0


@pytest.fixture
def cache_dir(request, tmp_path):
    cache = getattr(request.config, "cache", None)
    return cache.mkdir("tiderl_learning_fast") if cache is not None else tmp_path / "cache"


def test_forty_sao_steps_raise_held_out_place_value_success_by_more_than_3_standard_errors(cache_dir, tmp_path):
    t0 = time.perf_counter()
    cfg = load_config(CONFIG, [f"model.cache_dir={cache_dir}", f"run_dir={tmp_path / 'run'}"])
    run = build_run(cfg)
    built = time.perf_counter()
    held_out = run.setup.eval_tasks
    assert len(held_out) == cfg.data.eval_size
    assert not {t.meta["number"] for t in run.setup.train_tasks} & {t.meta["number"] for t in held_out}

    def greedy() -> dict:
        return evaluate(run.engine, run.tokenizer, run.make_env, held_out, cfg.env, cfg.rollout, greedy=True)

    before = greedy()
    # A gain measured from a floor (no success at all, standard error 0) would say little.
    assert 0.0 < before["success"] < 1.0, before
    t_train = time.perf_counter()
    history, _ = train(run)
    t_after = time.perf_counter()
    after = greedy()
    end = time.perf_counter()
    assert len(history) == cfg.train.steps

    se = math.sqrt(before["stderr"] ** 2 + after["stderr"] ** 2)
    gain = after["success"] - before["success"]
    print(f"\nheld-out greedy success (n={after['n']}): {before['success']:.3f} ± {before['stderr']:.3f} -> "
          f"{after['success']:.3f} ± {after['stderr']:.3f}, gain {gain:+.3f} = {gain / se:.1f} SE; "
          f"build {built - t0:.0f} s, eval {t_train - built + end - t_after:.0f} s, train {t_after - t_train:.0f} s, "
          f"total {end - t0:.0f} s")
    assert gain > MIN_GAIN_SE * se, (f"held-out success {before['success']:.3f} -> {after['success']:.3f}: a gain of "
                                     f"{gain:+.3f}, not above {MIN_GAIN_SE} standard errors ({MIN_GAIN_SE * se:.3f})")
