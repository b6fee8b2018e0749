"""The data-parallel trainer as Ray actors, end to end: `system.backend=ray train.parallel=fsdp2
train.world_size=2` trains SAO on CPU with the tiny model; the rollout workers receive rank 0's
weights straight from the object store and their checksums match rank 0's; config errors."""

from __future__ import annotations

import json
import time

import pytest
import torch

ray = pytest.importorskip("ray")

from tiderl.config import ConfigError, load_config  # noqa: E402
from tiderl.recipe import train  # noqa: E402
from tiderl.rollout.weights import weights_checksum  # noqa: E402
from tiderl.run import build_run  # noqa: E402

SMALL = [
    "env.options.num_films=40", "env.options.num_people=40", "data.eval_size=16",
    "model.tiny.vocab_size=512", "model.tiny.hidden_size=64", "model.tiny.num_layers=2",
    "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1",
    "model.warmstart.num_traces=40", "model.warmstart.steps=2", "model.warmstart.batch_size=16",
    "rollout.batch_size=8", "algo.critic_warmup_steps=1", "log.progress=false", "log.tensorboard=false",
    "system.wait_timeout_s=300", "train.micro_batch_tokens=1024",
]


def small_config(cache, run_dir, *more):
    return load_config("configs/kg_sao_tiny.yaml", SMALL + [f"model.cache_dir={cache}", f"run_dir={run_dir}", *more])


@pytest.fixture(scope="module")
def cluster():
    ray.init(address="local", num_cpus=2, include_dashboard=False)  # our own cluster, not a running one
    yield
    ray.shutdown()


@pytest.mark.slow
def test_fsdp2_ranks_as_ray_actors_train_end_to_end(cluster, cache, tmp_path):
    cfg = small_config(cache, tmp_path / "run", "train.steps=2", "system.backend=ray",
                       "train.parallel=fsdp2", "train.world_size=2",
                       # Every reward of the tiny model may be 0: the entropy bonus makes sure the actor moves.
                       "algo.entropy_coef=0.01", "env.max_turns=2", "rollout.max_new_tokens=24")
    run = build_run(cfg)
    before = {k: v.clone() for k, v in run.actor.model.state_dict().items()}

    t0 = time.monotonic()
    history, summary = train(run)
    print(f"train: {time.monotonic() - t0:.1f}s", [round(h.get("system/train_s", 0), 2) for h in history])  # the scheduler checks every sync: workers' checksum == rank 0's

    assert [h["policy_version"] for h in history] == [1, 2]
    assert all(h["micro_batches"] >= 1 and h["time/publish_s"] > 0 for h in history)
    assert summary["ledger"]["trained"] == 2 * cfg.rollout.batch_size
    stats = summary["backend"]["worker_stats"]
    assert stats and all(s["version"] == 2 for s in stats)
    # The driver's mirror holds what the ranks trained (step 2 trains the actor too), and its own
    # engine was synced to it for evaluation.
    after = run.actor.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert run.engine.version == 2
    assert run.engine.state_checksum() == weights_checksum(after)
    # The rollout workers hold exactly those weights too.
    assert {s["version"] for s in stats} == {2}
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2]


@pytest.mark.slow
def test_sharded_checkpoints_on_ray_ranks_resume(cluster, cache, tmp_path, caplog):
    """DDP ranks write step_1 and final as sharded checkpoints (DCP); train.resume=auto gives the
    driver step_1's weights and the ranks its shards (optimizer state included), and the run goes
    on to step 2."""
    from tiderl.run import save_run_checkpoint
    from tiderl.train.checkpoint import SHARDED, latest_checkpoint, load_sharded_weights

    run_dir = tmp_path / "run"
    common = ("system.backend=ray", "train.parallel=ddp", "train.world_size=2", "algo.entropy_coef=0.01",
              "algo.critic_warmup_steps=0", "env.max_turns=2", "rollout.max_new_tokens=16",
              "train.checkpoint_every=1")
    run = build_run(small_config(cache, run_dir, "train.steps=1", *common))
    train(run)
    with pytest.raises(RuntimeError, match="trainer ranks.*not running"):
        save_run_checkpoint(run, run_dir / "checkpoints" / "late")  # no ranks: no optimizer states to save
    root = run_dir / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["final", "step_1"]
    for name in ("step_1", "final"):
        marker = json.loads((root / name / "tiderl_checkpoint.json").read_text())
        assert marker["sharded"] == {"parallel": "ddp", "world_size": 2} and marker["step"] == 1
        assert not (root / name / "actor").exists() and (root / name / "actor_config" / "config.json").is_file()
    step1 = {k: v.clone() for k, v in run.actor.model.state_dict().items()}  # the driver's mirror after step 1
    saved = run.actor.model.__class__(run.actor.model.config)
    load_sharded_weights(root / "step_1" / SHARDED, saved, "actor")
    assert all(torch.equal(saved.state_dict()[k], v) for k, v in step1.items())

    assert latest_checkpoint(root) == root / "step_1"
    resumed = build_run(small_config(cache, run_dir, "train.steps=2", "train.resume=auto", *common))
    assert resumed.step == 1
    assert all(torch.equal(resumed.actor.model.state_dict()[k], v) for k, v in step1.items())
    assert resumed.resume_state["sharded"] == str(root / "step_1" / SHARDED)
    with caplog.at_level("INFO", logger="tiderl.system.ray_trainer"):
        history, _ = train(resumed)
    loaded = [r.getMessage() for r in caplog.records if "loaded the sharded checkpoint" in r.getMessage()]
    assert len(loaded) == 1 and "step_1" in loaded[0], loaded
    entries = [int(n) for n in loaded[0].rsplit("[", 1)[1].rstrip("])").split(",")]
    assert len(entries) == 2 and all(n > 0 for n in entries)  # AdamW state came back on both ranks
    assert [h["policy_version"] for h in history] == [2]
    assert json.loads((root / "final" / "tiderl_checkpoint.json").read_text())["step"] == 2


def test_parallel_config_errors(tmp_path):
    base = ["system.backend=ray"]
    with pytest.raises(ConfigError, match="train.parallel.*system.backend=ray or local"):
        load_config(None, ["train.parallel=ddp", "train.world_size=2", "system.backend=agent",
                           "system.options.agent=mypkg.agents:solve"])
    assert load_config(None, ["train.parallel=ddp", "train.world_size=2"]).system.backend == "local"
    with pytest.raises(ConfigError, match="train.world_size.*one rank is one process"):
        load_config(None, base + ["train.parallel=fsdp2", "train.world_size=1"])
    with pytest.raises(ConfigError, match="train.world_size.*train.parallel=none"):
        load_config(None, base + ["train.world_size=4"])
    with pytest.raises(ConfigError, match="train.parallel"):
        load_config(None, base + ["train.parallel=zero3"])
    with pytest.raises(ConfigError, match="train.autocast.*model.dtype=float32"):
        load_config(None, ["train.autocast=bfloat16", "model.dtype=bfloat16"])
    cfg = load_config(None, base + ["train.parallel=fsdp2", "train.world_size=2"])
    assert (cfg.train.parallel, cfg.train.world_size) == ("fsdp2", 2)
