"""Task setups and evaluation summaries."""

import math

import pytest

from tiderl.config import load_config
from tiderl.config import ConfigError
from tiderl.envs.setup import data_root, load_setup
from tiderl.evaluate import markdown_table, summarize
from tiderl.types import Trajectory


def test_embedded_setup_is_held_out_by_topic_and_mixes_hops():
    cfg = load_config(None, ["data.eval_size=120"])
    setup = load_setup(cfg)
    train_topics = {t.meta["topic"] for t in setup.train_tasks}
    eval_topics = {t.meta["topic"] for t in setup.eval_tasks}
    assert len(setup.eval_tasks) == 120
    assert not train_topics & eval_topics
    assert {t.meta["hops"] for t in setup.eval_tasks} == {1, 2}
    # Deterministic for the seed.
    again = load_setup(cfg)
    assert [t.task_id for t in again.eval_tasks] == [t.task_id for t in setup.eval_tasks]


def test_env_factory_uses_the_configured_system_prompt():
    cfg = load_config(None, ["env.system_prompt=Be brief."])
    make_env = load_setup(cfg).make_env
    assert make_env().system_prompt() == "Be brief."
    assert make_env() is not make_env()  # one fresh environment per episode


def test_metaqa_setup_needs_its_data(tmp_path):
    cfg = load_config(None, ["data.source=metaqa", f"data.data_dir={tmp_path}"])
    with pytest.raises(FileNotFoundError, match="data.data_dir"):
        load_setup(cfg)


def test_metaqa_setup_trains_on_generated_questions_only():
    cfg = load_config(None, ["data.source=metaqa", "data.eval_size=40", "env.options.num_train_tasks=200"])
    if not (data_root(cfg.data.data_dir) / "metaqa" / "kb.txt").is_file():
        pytest.skip(f"MetaQA not found under {data_root(cfg.data.data_dir)} (set TIDERL_DATA_DIR)")
    setup = load_setup(cfg)
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
    table = markdown_table([("x", s)])
    assert "0.750" in table and "0.217" in table


def test_env_factory_passes_the_observation_limits_to_the_kg_env():
    cfg = load_config(None, ["env.max_items=7", "env.max_observation_chars=300", "env.options.max_listed=3"])
    env = load_setup(cfg).make_env()
    assert (env.limits.max_items, env.limits.max_chars, env.max_listed) == (7, 300, 3)
    # The in-memory graph has no endpoint to go to.
    with pytest.raises(ConfigError, match="env.options.sparql_endpoint: set, but data.source=embedded keeps its graph"):
        load_config(None, ["env.options.sparql_endpoint=http://localhost:1/sparql"])


def _dbbench_root():
    root = data_root()
    if not (root / "agentbench_dbbench" / "dev.jsonl").is_file():
        pytest.skip(f"agentbench_dbbench/ not found under {root} (set TIDERL_DATA_DIR)")
    return root


def test_agentbench_db_setup_trains_on_the_other_split():
    _dbbench_root()
    from tiderl.envs.db.env import DBEnv

    cfg = load_config(None, ["env.name=db", "data.source=agentbench_db", "env.max_items=5",
                             "env.options.timeout_s=0.5", "env.max_observation_chars=900", "env.system_prompt=SQL."])
    setup = load_setup(cfg)
    assert (setup.name, setup.split, setup.store, setup.eval_chunk_size) == ("agentbench_db", "dev", None, 0)
    assert len(setup.eval_tasks) == 60 and len(setup.train_tasks) == 300
    assert all(t.task_id.startswith("dbbench-dev-") for t in setup.eval_tasks)
    assert all(t.task_id.startswith("dbbench-standard-") for t in setup.train_tasks)
    make_env = setup.make_env
    env, other = make_env(), make_env()
    assert isinstance(env, DBEnv) and env is not other
    assert env.backend is other.backend  # one backend (task databases, gold hashes) per setup
    assert (env.limits.max_rows, env.limits.timeout_s, env.limits.max_observation_chars) == (5, 0.5, 900)
    assert env.system_prompt() == "SQL."
    # The KG environment cannot run DB tasks.
    with pytest.raises(ConfigError, match="data.source"):
        load_config(None, ["env.name=kg", "data.source=agentbench_db"])

    standard = load_setup(load_config(None, ["env.name=db", "data.source=agentbench_db",
                                                "data.split=standard", "data.eval_size=50"]))
    assert len(standard.eval_tasks) == 50 and len(standard.train_tasks) == 60
    assert all(t.task_id.startswith("dbbench-standard-") for t in standard.eval_tasks)
    with pytest.raises(ValueError, match="data.split"):
        load_setup(load_config(None, ["env.name=db", "data.source=agentbench_db", "data.split=std"]))


def test_agentbench_setups_need_their_data(tmp_path):
    cfg = load_config(None, ["env.name=db", "data.source=agentbench_db", f"data.data_dir={tmp_path}"])
    with pytest.raises(FileNotFoundError, match="data.data_dir"):
        load_setup(cfg)
    cfg = load_config(None, ["data.source=agentbench_kg", "env.options.sparql_endpoint=http://x/sparql",
                             f"data.data_dir={tmp_path}"])
    with pytest.raises(FileNotFoundError, match="data.data_dir"):
        load_setup(cfg)


def test_agentbench_kg_setup_queries_the_configured_endpoint():
    root = data_root()
    if not (root / "agentbench_kg" / "dev.json").is_file():
        pytest.skip(f"agentbench_kg/ not found under {root} (set TIDERL_DATA_DIR)")
    from tiderl.envs.kg.sparql import SparqlBackend

    cfg = load_config(None, ["data.source=agentbench_kg", "env.options.sparql_endpoint=http://127.0.0.1:9/sparql"])
    setup = load_setup(cfg)
    assert (setup.name, setup.split, len(setup.eval_tasks)) == ("agentbench_kg", "dev", 20)
    # kg_rl_all repeats some dev questions: they are not trained on.
    assert not {t.meta["qid"] for t in setup.eval_tasks} & {t.meta["qid"] for t in setup.train_tasks}
    assert 1100 < len(setup.train_tasks) < 1214
    make_env = setup.make_env
    env = make_env()
    assert isinstance(env.store, SparqlBackend) and env.store is make_env().store
    assert env.store.client.endpoint == "http://127.0.0.1:9/sparql"
    assert load_setup(load_config(None, ["data.source=agentbench_kg", "env.options.sparql_endpoint=u",
                                            "data.split=test"])).split == "std"


def test_metaqa_setup_evaluates_three_hops_and_trains_on_template_hops():
    cfg = load_config(None, ["data.source=metaqa", "env.options.hops=[1,2,3]", "data.eval_size=30",
                             "env.options.num_train_tasks=50"])
    if not (data_root(cfg.data.data_dir) / "metaqa" / "kb.txt").is_file():
        pytest.skip(f"MetaQA not found under {data_root(cfg.data.data_dir)} (set TIDERL_DATA_DIR)")
    setup = load_setup(cfg)
    assert [t.meta["hops"] for t in setup.eval_tasks] == [1] * 10 + [2] * 10 + [3] * 10
    assert {t.meta["hops"] for t in setup.train_tasks} == {1, 2}  # no 3-hop templates
    only3 = load_setup(load_config(None, ["data.source=metaqa", "env.options.hops=[3]", "data.eval_size=5"]))
    assert len(only3.eval_tasks) == 5 and only3.train_tasks == []
