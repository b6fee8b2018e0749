"""The generated shop database (`data.source=shop`, tiderl/envs/db/shop.py): held-out questions are
about rows no training question mentions, the oracle solves every question, the warm start's
demonstrations are wrong by kind at their rates, and a drifting shop changes values (never the
names a question asks about) with gold answers that follow the phase."""

from __future__ import annotations

import random
import re

import pytest

from tiderl.config import ConfigError, load_config
from tiderl.envs.db.oracle import oracle_ceiling, replay_turns
from tiderl.envs.db.shop import KINDS, confusion_rates, demonstrations, shop_files
from tiderl.envs.setup import load_setup

ARGS = ["env.name=db", "data.source=shop", "data.eval_size=80", "model.path=tiny"]
ROW = re.compile(r"FROM (\w+) WHERE name = '([^']+)'")


@pytest.fixture(scope="module")
def shop():
    cfg = load_config(None, ARGS)
    return cfg, load_setup(cfg)


def test_held_out_questions_are_about_rows_no_training_question_mentions(shop):
    _, setup = shop
    assert setup.name == "shop" and len(setup.eval_tasks) == 80 and len(setup.train_tasks) > 1000
    train_rows = {ROW.search(t.meta["gold_sql"]).groups() for t in setup.train_tasks}
    eval_rows = {ROW.search(t.meta["gold_sql"]).groups() for t in setup.eval_tasks}
    assert eval_rows and not train_rows & eval_rows
    # ... while every held-out row's name is a training row's name in the other table (the tokenizer
    # and the warm start see each name).
    assert {name for _, name in eval_rows} <= {name for _, name in train_rows}
    assert {t.meta["answer_type"] for t in setup.train_tasks} == set(KINDS)
    assert all(t.answer["rows"] and len(t.answer["rows"]) == 1 for t in setup.eval_tasks)  # one cell each
    # Every process finds the same files (written once per content).
    assert shop_files(0) == shop_files(0) and shop_files(0) != shop_files(1)


def test_the_oracle_solves_every_question(shop):
    _, setup = shop
    report = oracle_ceiling(setup.eval_tasks, setup.make_env)
    assert report["success"] == 1.0, report["failed"][:5]


def test_demonstrations_ask_the_partner_column_at_each_kinds_rate(shop):
    cfg, setup = shop
    rates = confusion_rates(0.5, cfg.seed)
    assert min(rates.values()) == pytest.approx(0.2) and max(rates.values()) == pytest.approx(0.8)
    tasks, scripts, report = demonstrations(setup, cfg, random.Random(0))
    assert len(tasks) == cfg.model.warmstart.num_traces and report["confusion_rates"] == {
        k: round(r, 3) for k, r in rates.items()}
    wrong: dict[str, list[int]] = {k: [0, 0] for k in KINDS}
    for task, script in list(zip(tasks, scripts))[:800]:
        result = replay_turns(setup.make_env(), task, script)
        wrong[task.meta["answer_type"]][0] += result.reward == 0.0
        wrong[task.meta["answer_type"]][1] += 1
        column = KINDS[task.meta["answer_type"]][1]
        assert f"SELECT {column} " in script[0] or f"SELECT {KINDS[task.meta['answer_type']][3]} " in script[0]
    for kind, (failed, n) in wrong.items():
        # A confused demonstration fails unless the two columns hold the same value (only price and stock
        # can, rarely), so the failure rate is the kind's rate.
        assert abs(failed / n - rates[kind]) < 4 * (rates[kind] * (1 - rates[kind]) / n) ** 0.5 + 0.02, kind


def test_a_drifting_shop_changes_values_and_the_gold_answers_follow(shop):
    setup = load_setup(load_config(None, ARGS + ["env.options.drift.every_steps=2",
                                                 "env.options.drift.fraction=0.3"]))
    world = setup.make_env.world
    assert "0 of" not in world.describe(1) and "customers rows changed" in world.describe(1)
    tasks = setup.eval_tasks
    before = [setup.oracle(t) for t in tasks]
    setup.on_step(2)
    now = [replay_turns(setup.make_env(), t, setup.oracle(t)) for t in tasks]
    assert all(r.reward == 1.0 and r.info["drift_phase"] == 1 for r in now)
    stale = [replay_turns(setup.make_env(), t, turns).reward for t, turns in zip(tasks, before)]
    assert 0 < stale.count(0.0) < len(tasks)  # some answers moved, most did not
    # A factory pinned to phase 0 still plays the original database.
    pinned = setup.make_env.at_phase(0)
    assert all(replay_turns(pinned(), t, turns).reward == 1.0 for t, turns in zip(tasks, before))


def test_drift_needs_a_database_file_or_the_shop():
    load_config(None, ARGS + ["env.options.drift.every_steps=2"])
    with pytest.raises(ConfigError, match="drift.every_steps.*data.source=shop"):
        load_config(None, ["env.name=db", "env.options.drift.every_steps=2"])
