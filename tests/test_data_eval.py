"""Task setups and evaluation summaries."""

import math

import pytest

from tiderl.config import load_config
from tiderl.data import data_root, env_factory, load_kg_setup
from tiderl.evaluate import format_table, summarize
from tiderl.types import Trajectory


def test_embedded_setup_is_held_out_by_topic_and_mixes_hops():
    cfg = load_config(None, ["data.eval_size=120"])
    setup = load_kg_setup(cfg.data)
    train_topics = {t.meta["topic"] for t in setup.train_tasks}
    eval_topics = {t.meta["topic"] for t in setup.eval_tasks}
    assert len(setup.eval_tasks) == 120
    assert not train_topics & eval_topics
    assert {t.meta["hops"] for t in setup.eval_tasks} == {1, 2}
    # Deterministic for the seed.
    again = load_kg_setup(cfg.data)
    assert [t.task_id for t in again.eval_tasks] == [t.task_id for t in setup.eval_tasks]


def test_env_factory_uses_the_configured_system_prompt():
    cfg = load_config(None, ["env.system_prompt=Be brief."])
    setup = load_kg_setup(cfg.data)
    make_env = env_factory(cfg.env, setup)
    assert make_env().system_prompt() == "Be brief."
    assert make_env() is not make_env()  # one fresh environment per episode


def test_metaqa_setup_needs_its_data(tmp_path):
    cfg = load_config(None, ["data.source=metaqa", f"data.data_dir={tmp_path}"])
    with pytest.raises(FileNotFoundError, match="data.data_dir"):
        load_kg_setup(cfg.data)


def test_metaqa_setup_trains_on_generated_questions_only():
    cfg = load_config(None, ["data.source=metaqa", "data.eval_size=40", "data.num_train_tasks=200"])
    if not (data_root(cfg.data) / "metaqa" / "kb.txt").is_file():
        pytest.skip(f"MetaQA not found under {data_root(cfg.data)} (set TIDERL_DATA_DIR)")
    setup = load_kg_setup(cfg.data)
    assert len(setup.eval_tasks) == 40
    assert all(t.task_id.startswith("metaqa-") for t in setup.eval_tasks)
    assert {t.meta["hops"] for t in setup.eval_tasks} == {1, 2}
    assert all(not t.task_id.startswith("metaqa-") for t in setup.train_tasks)
    eval_questions = {t.prompt for t in setup.eval_tasks}
    assert not eval_questions & {t.prompt for t in setup.train_tasks}
    assert not {t.meta["topic"] for t in setup.eval_tasks} & {t.meta["topic"] for t in setup.train_tasks}


def _traj(success, turns=2, reason="answer"):
    return Trajectory(tokens=[1, 2, 3], loss_mask=[0, 1, 1], behavior_logprobs=[0, -1, -1],
                      policy_version=[-1, 0, 0], reward=float(success), num_turns=turns,
                      stop_reason=reason, env_info={"success": success, "f1": 0.5 * success})


def test_summary_success_and_standard_error():
    # 3 of 4 solved: p = 0.75, se = sqrt(0.75 * 0.25 / 4) = sqrt(0.046875) = 0.2165.
    s = summarize([_traj(1), _traj(1), _traj(1), _traj(0, reason="max_turns")])
    assert s["n"] == 4 and s["success"] == 0.75
    assert math.isclose(s["stderr"], math.sqrt(0.75 * 0.25 / 4))
    assert math.isclose(s["f1"], 0.375)
    assert s["stop_reasons"] == {"answer": 3, "max_turns": 1}
    assert s["action_tokens"] == 2
    table = format_table([("x", s)])
    assert "0.750" in table and "0.217" in table
