"""Environments on the Ray backend (issue 30): a drifting knowledge graph reaches the rollout
workers (each moves its copy of the world to the weight version it loads, and answers as the
driver's world does), and every built-in environment that needs no downloaded data plays its
oracle episodes inside a Ray rollout worker with the rewards of the same episodes played here.
One local Ray session (2 CPUs) serves the module; each test starts one worker."""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3

import pytest
import torch

ray = pytest.importorskip("ray")

from tiderl.agent.loop import ScriptedEngine, play_episode  # noqa: E402
from tiderl.config import load_config  # noqa: E402
from tiderl.embedded.tiny import init_tiny_model, tiny_qwen2_config  # noqa: E402
from tiderl.envs.setup import data_root, load_setup  # noqa: E402
from tiderl.rollout.base import sampling_params  # noqa: E402
from tiderl.rollout.client import BatchingEngine  # noqa: E402
from tiderl.system import ray_backend as rb  # noqa: E402

TIMEOUT_S = 400  # a worker imports torch and transformers when it starts: minutes on a loaded machine
COMMON = ["system.backend=ray", "system.options.workers=1", f"system.wait_timeout_s={TIMEOUT_S}",
          "env.max_total_tokens=8192", "train.micro_batch_tokens=8192", "rollout.max_new_tokens=1024",
          "data.eval_size=2", "model.tiny.max_positions=8192"]
EPISODES = 3  # oracle episodes per environment


def tiny_policy(tokenizer) -> torch.nn.Module:
    """A random 1-layer policy over `tokenizer` (what it samples does not matter here)."""
    return init_tiny_model(tiny_qwen2_config(len(tokenizer), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                             max_position_embeddings=8192), seed=0)


# ------------------------------------------------------------------ drift


class ProbeWorker(rb.RolloutWorker):
    """A RolloutWorker that also reports how its own copy of the setup asks tasks now."""

    def __init__(self, serial, bundle, *args, **kwargs):
        super().__init__(serial, bundle, *args, **kwargs)
        self.setup = bundle.setup  # the copy whose world `on_step` moves (its make_env shares it)

    async def asked(self, tasks):
        return [asked(self.setup, task) for task in tasks]


def asked(setup, task):
    """(phase, relation path (KG), gold answer) of `task` in the world a new episode of `setup` plays."""
    env = setup.make_env()
    env.reset(task)
    return env.episode_phase, list(env._task.meta.get("path", [])), json.dumps(env._task.answer, sort_keys=True)


def _drifting(name, tmp_path):
    """The config of a drifting KG (relations renamed) or database (rows changed), a change a step."""
    if name == "kg":
        return load_config("configs/kg_sao_tiny.yaml", COMMON + [
            "env.options.num_films=40", "env.options.num_people=40", "env.options.drift.every_steps=1",
            "env.options.drift.kind=relations", "env.options.drift.fraction=0.5", "rollout.max_new_tokens=8",
            "env.max_turns=1"])
    path, overrides = _db(tmp_path)
    return load_config(path, overrides + COMMON + ["env.options.drift.every_steps=1", "env.options.drift.fraction=0.5",
                                                   "rollout.max_new_tokens=8", "env.max_turns=1"])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["kg", "db"])
def test_a_drifting_world_follows_the_weight_version_in_the_ray_workers(ray_cluster, tokenizer, tmp_path, name):
    cfg = _drifting(name, tmp_path)
    local = load_setup(cfg)  # the driver's world, moved as the recipe moves it
    tasks = local.train_tasks[:12]
    model = tiny_policy(tokenizer)

    async def scenario():
        rollout = rb.RayRollout(cfg, model, tokenizer, load_setup(cfg), worker_cls=ProbeWorker)
        await rollout.start()
        seen = {}
        try:
            worker = next(iter(rollout._workers.values())).handle
            for version in (0, 1, 2):
                if version:
                    await rollout.update_weights(model.state_dict(), version)
                remote = await rb._await_ref(worker.asked.remote(tasks), TIMEOUT_S, "asking")
                episode = await rollout.run_episode(tasks[0], "g")
                seen[version] = (remote, episode)
        finally:
            await rollout.close()
        return seen

    seen = asyncio.run(scenario())
    for version, (remote, episode) in seen.items():
        local.on_step(version)
        here = [asked(local, t) for t in tasks]
        assert remote == here, version  # the same world, task by task, as the driver's
        assert {phase for phase, _, _ in remote} == {version}
        assert episode.env_info["drift_phase"] == version  # a real episode played in that world
    # The world did change: relation names (and so paths) or the rows (and so answers) moved.
    assert [r[1:] for r in seen[0][0]] != [r[1:] for r in seen[2][0]]


# ------------------------------------------------------------------ every environment


class OracleWorker(rb.RolloutWorker):
    """A RolloutWorker whose episodes play the setup's oracle turns (its engine still holds and
    checksums the policy): the environment's tools all run inside the Ray worker."""

    def __init__(self, serial, bundle, *args, **kwargs):
        super().__init__(serial, bundle, *args, **kwargs)
        setup = bundle.setup
        self.scripted = ScriptedEngine(bundle.tokenizer, {t.prompt: setup.oracle(t) for t in setup.train_tasks})

    def _ensure_client(self):
        if self._client is None:
            self._client = BatchingEngine(self.scripted, self.max_batch_size)
            self._client.start()
        return self._client


# Each environment's case: (config file or None, overrides), written for a test's tmp_path.


def _kg(tmp_path):
    return "configs/kg_sao_tiny.yaml", ["env.options.num_films=40", "env.options.num_people=40"]


def _math(tmp_path):
    return "configs/math_small_sao_tiny.yaml", ["env.options.num_train_tasks=20"]


def _db(tmp_path):
    path = tmp_path / "shop.sqlite"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE item (id INTEGER, name TEXT, price REAL)")
    conn.executemany("INSERT INTO item VALUES (?, ?, ?)", [(1, "pen", 1.5), (2, "ink", 4.0), (3, "pad", 2.5)])
    conn.commit()
    conn.close()
    questions = [("How many items are there?", "SELECT count(*) FROM item"),
                 ("Names of items under 3, by name.", "SELECT name FROM item WHERE price < 3 ORDER BY name"),
                 ("The most expensive item.", "SELECT name FROM item ORDER BY price DESC LIMIT 1"),
                 ("Total price.", "SELECT sum(price) FROM item"),
                 ("Items named pen.", "SELECT id FROM item WHERE name = 'pen'"),
                 ("Cheapest price.", "SELECT min(price) FROM item")]
    qfile = tmp_path / "questions.jsonl"
    qfile.write_text("".join(json.dumps({"id": f"q{i}", "question": q, "sql": s}) + "\n"
                             for i, (q, s) in enumerate(questions)))
    return None, ["env.name=db", "data.source=db_file", f"env.options.db_path={path}", f"env.options.questions={qfile}"]


def _repo(tmp_path):
    for i in range(4):
        folder = tmp_path / "tasks" / f"add-{i}"
        files = {
            "task.md": f"add() is off by one; fix it ({i}).",
            "repo/calc/__init__.py": "from calc.core import add\n",
            "repo/calc/core.py": "def add(a, b):\n    return a + b + 1\n",
            "repo/tests/test_add.py": "from calc import add\n\ndef test_add():\n    assert add(1, 2) == 3\n",
            "hidden_tests/test_more.py": f"from calc import add\n\ndef test_more():\n    assert add({i}, 5) == {i + 5}\n",
            "solution/calc/core.py": "def add(a, b):\n    return a + b\n",
        }
        for name, text in files.items():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_text(text)
    return None, ["env.name=repo", "data.source=folder", f"env.options.task_dir={tmp_path / 'tasks'}"]


def _code(tmp_path):
    if not (data_root() / "mbpp").is_dir():
        pytest.skip(f"env.name=code reads MBPP from the data root ({data_root()}): set TIDERL_DATA_DIR to the "
                    "folder that holds mbpp/ to run this case")
    return None, ["env.name=code", "data.source=mbpp"]


ENVIRONMENTS = {"kg": _kg, "math": _math, "db": _db, "repo": _repo, "code": _code}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ENVIRONMENTS))
def test_each_builtin_environment_plays_its_oracle_on_a_ray_worker(ray_cluster, tokenizer, tmp_path, name):
    path, overrides = ENVIRONMENTS[name](tmp_path)
    cfg = load_config(path, overrides + COMMON)
    setup = load_setup(cfg)
    tasks = setup.train_tasks[:EPISODES]
    assert tasks, f"{name}: no training tasks"

    async def here():
        client = BatchingEngine(ScriptedEngine(tokenizer, {t.prompt: setup.oracle(t) for t in setup.train_tasks}))
        client.start()
        try:
            params = sampling_params(cfg.rollout, tokenizer.eos_token_id, greedy=False)
            return [await play_episode(client, tokenizer, setup.make_env, t, params, cfg.env.max_turns,
                                       cfg.env.max_total_tokens) for t in tasks]
        finally:
            await client.close()

    async def on_ray():
        rollout = rb.RayRollout(cfg, tiny_policy(tokenizer), tokenizer, load_setup(cfg), worker_cls=OracleWorker)
        await rollout.start()
        try:
            played = await asyncio.gather(*(rollout.run_episode(t, t.task_id) for t in tasks))
        finally:
            await rollout.close()
        return played, rollout.worker_stats

    local = asyncio.run(here())
    remote, stats = asyncio.run(on_ray())
    assert stats and stats[0]["episodes"] == len(tasks)  # played in the worker
    assert stats[0]["pid"] != os.getpid()
    for want, got in zip(local, remote):
        assert got.task_id == want.task_id and got.stop_reason == want.stop_reason, (got.env_info, want.env_info)
        assert got.reward == want.reward and got.tokens == want.tokens
        assert "error" not in got.env_info, got.env_info
    assert any(t.reward > 0 for t in remote), [(t.reward, t.stop_reason, t.env_info) for t in remote]
