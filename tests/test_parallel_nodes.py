"""Placement over two Ray "nodes" on this machine (two raylets with custom resources): the
trainer ranks land one per node as `train.rank_resources` and `train.placement=spread` ask, form
one gloo group across them, and one DDP step equals the single-process step."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from tiderl.config import load_config  # noqa: E402
from tiderl.system.ray_trainer import RayParallelTrainer  # noqa: E402
from tiderl.train.learner import Learner  # noqa: E402
from tiderl.train.step import train_step  # noqa: E402

from support import CLIP, build, nine_trajectories, snapshot  # noqa: E402

LR = 1e-3


@pytest.fixture(scope="module")
def two_nodes():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"trainer_slot": 1},
                                                            "include_dashboard": False})
    cluster.add_node(num_cpus=1, resources={"trainer_slot": 1})
    ray.init(address=cluster.address)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.mark.slow
def test_ranks_spread_over_two_nodes_and_train_like_one_process(two_nodes):
    cfg = load_config(None, [
        "system.backend=ray", "train.parallel=ddp", "train.world_size=2", "train.placement=spread",
        "train.rank_resources={trainer_slot: 1}", "train.steps=1", "train.grad_clip=0.5",
        "rollout.max_new_tokens=8", "env.max_total_tokens=32", "train.micro_batch_tokens=40",
        "algo.critic_updates=2", f"algo.actor_lr={LR}", f"algo.critic_lr={LR}", "algo.critic_warmup_steps=0",
        "system.wait_timeout_s=120"])
    assert cfg.train.rank_resources == {"trainer_slot": 1.0}
    actor, critic, ref = build(cfg.algo, lambda m, lr: Learner(m, lr=lr, grad_clip=CLIP))
    run = SimpleNamespace(cfg=cfg, actor=actor, critic=critic, ref=ref, step=0,
                          tokenizer=SimpleNamespace(pad_token_id=0))
    trainer = RayParallelTrainer(run, preparations=[])
    try:
        metrics = trainer.train(nine_trajectories())  # one blocking step from version run.step = 0
        nodes = {info["node_id"] for info in trainer.info}
        assert len(nodes) == 2, trainer.info  # one rank per node
        assert trainer.published is not None and trainer.published.version == 1
        trainer.close()  # pulls the trained actor and critic into the driver's models
    finally:
        trainer.close()

    single_actor, single_critic, _ = build(cfg.algo, lambda m, lr: Learner(m, lr=lr, grad_clip=CLIP))
    single = train_step(nine_trajectories(), single_actor, single_critic, ref, cfg.algo, pad_id=0,
                        micro_batch_tokens=40, train_actor=True)
    assert metrics["micro_batches"] == single["micro_batches"] >= 3
    for learner, want in ((run.actor, single_actor), (run.critic, single_critic)):
        got, ref_params = snapshot(learner), snapshot(want)
        for name, value in ref_params.items():
            if name.startswith("param/"):
                torch.testing.assert_close(got[name], value, atol=1e-6, rtol=1e-5, msg=name)
    fresh_actor, fresh_critic, _ = build(cfg.algo, lambda m, lr: Learner(m, lr=lr))
    for learner, fresh in ((run.actor, fresh_actor), (run.critic, fresh_critic)):
        before, after = snapshot(fresh), snapshot(learner)
        assert any(not torch.equal(before[n], after[n]) for n in before if n.startswith("param/"))


@pytest.mark.slow
def test_sharded_checkpoint_across_two_nodes_resumes_like_the_uninterrupted_run(two_nodes, tmp_path):
    """Ranks on two nodes write one sharded checkpoint (each its shards, into a directory both
    reach: the same disk here); new ranks started from it take the next step exactly as the
    ranks that went on without stopping."""
    import dataclasses

    from tiderl.embedded.tiny import train_tokenizer
    from tiderl.train.checkpoint import load_checkpoint, save_checkpoint

    cfg = load_config(None, [
        "system.backend=ray", "train.parallel=ddp", "train.world_size=2", "train.placement=spread",
        "train.rank_resources={trainer_slot: 1}", "train.steps=2", "train.grad_clip=0.5",
        "rollout.max_new_tokens=8", "env.max_total_tokens=32", "train.micro_batch_tokens=40",
        "algo.critic_updates=2", f"algo.actor_lr={LR}", f"algo.critic_lr={LR}", "algo.critic_warmup_steps=0",
        "system.wait_timeout_s=120"])
    tokenizer = train_tokenizer(["a tiny corpus for a tokenizer"] * 3, vocab_size=300)
    tokenizer.pad_token_id = 0  # the trajectories' padding id
    second = [dataclasses.replace(t, reward=1.0 - t.reward) for t in nine_trajectories()]

    actor, critic, ref = build(cfg.algo, lambda m, lr: Learner(m, lr=lr, grad_clip=CLIP))
    run = SimpleNamespace(cfg=cfg, actor=actor, critic=critic, ref=ref, step=0, tokenizer=tokenizer)
    trainer = RayParallelTrainer(run, preparations=[])
    try:
        trainer.train(nine_trajectories())
        assert len({info["node_id"] for info in trainer.info}) == 2
        trainer.pull_actor()
        trainer._pull_critic()
        ckpt = save_checkpoint(tmp_path / "step_1", 1, run.actor, run.critic, tokenizer, shards=trainer.save_sharded)
        run.step = 1
        trainer.train(second)
        trainer.close()
    finally:
        trainer.close()
    uninterrupted = {"actor": snapshot(run.actor), "critic": snapshot(run.critic)}

    fresh_actor, fresh_critic, _ = build(cfg.algo, lambda m, lr: Learner(m, lr=lr, grad_clip=CLIP))
    state = load_checkpoint(ckpt, fresh_actor, fresh_critic, ranks_load=True)
    resumed_run = SimpleNamespace(cfg=cfg, actor=fresh_actor, critic=fresh_critic, ref=ref, step=1,
                                  tokenizer=tokenizer, resume_state=state)
    resumed = RayParallelTrainer(resumed_run, preparations=[])
    try:
        resumed.train(second)
        resumed.close()
    finally:
        resumed.close()
    for part, learner in (("actor", fresh_actor), ("critic", fresh_critic)):
        got = snapshot(learner)
        for name, want in uninterrupted[part].items():
            if name.startswith("param/"):
                torch.testing.assert_close(got[name], want, atol=1e-6, rtol=1e-5, msg=f"{part} {name}")
