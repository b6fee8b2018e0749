"""Sharded checkpoints (torch.distributed.checkpoint): 2 gloo ranks (DDP and FSDP2) train a step,
save, and either go on or restart from the checkpoint with fresh learners; the restarted run's
next step equals the uninterrupted one. One process reads the same shards (resharding 2 -> 1),
and the checkpoint layout (marker, atomic rename, `latest_checkpoint`) holds for sharded state."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from support import CLIP, build, nine_trajectories, parallel_cases, snapshot
from tiderl.lab.ranks import spawn_ranks
from tiderl.train.checkpoint import (
    SHARDED,
    latest_checkpoint,
    load_checkpoint,
    load_sharded,
    load_sharded_weights,
    save_checkpoint,
    save_sharded,
)
from tiderl.train.learner import Learner
from tiderl.train.step import train_step

CFG, MICRO = parallel_cases()["sao"]  # actor and critic (frozen attention), two critic updates


def tiny_tokenizer():
    from tiderl.embedded.tiny import train_tokenizer

    return train_tokenizer(["a tiny corpus for a tokenizer"] * 3, vocab_size=300)


def batch_b():
    """A second batch: the same episodes with other rewards (so step 2 differs from step 1)."""
    return [dataclasses.replace(t, reward=1.0 - t.reward) for t in nine_trajectories()]


def step(actor, critic, ref, batch):
    return train_step(batch, actor, critic, ref, CFG, pad_id=0, micro_batch_tokens=MICRO, train_actor=True)


def both(actor, critic):
    return {"actor": snapshot(actor), "critic": snapshot(critic)}


def rank_main(rank: int, world_size: int, out_dir: str) -> None:
    from tiderl.train.parallel import ParallelLearner

    results = {}
    for mode in ("ddp", "fsdp2"):
        def make(m, lr, mode=mode):
            return ParallelLearner(m, mode, lr=lr, grad_clip=CLIP)

        actor, critic, ref = build(CFG, make)
        step(actor, critic, ref, nine_trajectories())
        torch.manual_seed(1234 + rank)  # each rank's RNG goes into the checkpoint and comes back
        save_sharded(f"{out_dir}/{mode}", actor, critic)
        results[(mode, "saved")] = both(actor, critic)
        rng_saved = torch.get_rng_state()
        metrics = step(actor, critic, ref, batch_b())
        results[(mode, "uninterrupted")] = (both(actor, critic), metrics)

        torch.manual_seed(99)
        actor, critic, ref = build(CFG, make)  # a fresh start: the initial weights, no optimizer state
        results[(mode, "fresh")] = both(actor, critic)
        load_sharded(f"{out_dir}/{mode}", actor, critic)
        results[(mode, "rng_restored")] = torch.equal(torch.get_rng_state(), rng_saved)
        metrics = step(actor, critic, ref, batch_b())
        results[(mode, "resumed")] = (both(actor, critic), metrics)
    if rank == 0:
        torch.save(results, f"{out_dir}/rank0.pt")


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded")
    spawn_ranks(rank_main, 2, str(out), timeout_s=240)
    return out, torch.load(out / "rank0.pt", weights_only=False)


def assert_same(got, want, what):
    for part in ("actor", "critic"):
        params = [k for k in want[part] if k.startswith("param/")]
        assert params
        for name in params:
            torch.testing.assert_close(got[part][name], want[part][name], atol=1e-6, rtol=1e-5, msg=f"{what} {name}")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_two_ranks_resume_like_the_uninterrupted_run(sharded_runs, mode):
    out, results = sharded_runs
    (want, want_metrics), (got, got_metrics) = results[(mode, "uninterrupted")], results[(mode, "resumed")]
    assert_same(got, want, mode)
    for key in ("policy/loss", "policy/grad_norm", "value/loss"):
        assert got_metrics[key] == pytest.approx(want_metrics[key], rel=1e-5, abs=1e-6), key
    assert results[(mode, "rng_restored")]
    # The fresh learners really were elsewhere: without the checkpoint the step would differ.
    fresh = results[(mode, "fresh")]["actor"]
    assert any(not torch.equal(fresh[k], want["actor"][k]) for k in fresh if k.startswith("param/"))
    # Each rank wrote its own shard file (DDP's replicated tensors once) and its RNG state.
    files = {p.name for p in (out / mode).iterdir()}
    assert {".metadata", "rng_rank0.pt", "rng_rank1.pt"} <= files
    assert sum(name.endswith(".distcp") for name in files) == 2


@pytest.mark.slow
def test_one_process_reads_the_two_ranks_shards(sharded_runs):
    """DCP reshards: the FSDP2 ranks' checkpoint loads into plain learners (train.parallel=none)."""
    out, results = sharded_runs
    actor, critic, ref = build(CFG, lambda m, lr: Learner(m, lr=lr, grad_clip=CLIP))
    load_sharded(out / "fsdp2", actor, critic)
    metrics = step(actor, critic, ref, batch_b())
    want, want_metrics = results[("fsdp2", "uninterrupted")]
    assert_same(both(actor, critic), want, "one process")
    assert metrics["policy/loss"] == pytest.approx(want_metrics["policy/loss"], rel=1e-5, abs=1e-6)


@pytest.mark.slow
def test_sharded_checkpoint_layout_saves_atomically_and_loads(tmp_path):
    """`save_checkpoint(shards=...)`: sharded/ + actor_config/ + trainer_state.pt + the marker,
    renamed into place; `load_checkpoint` restores the whole state in one process, or the
    weights alone with `ranks_load` (the ranks read sharded/ themselves)."""
    actor, critic, ref = build(CFG, lambda m, lr: Learner(m, lr=lr, grad_clip=CLIP))
    step(actor, critic, ref, nine_trajectories())
    tokenizer = tiny_tokenizer()

    def shards(path):
        save_sharded(path, actor, critic)
        return {"parallel": "test", "world_size": 1}

    root = tmp_path / "checkpoints"
    ckpt = save_checkpoint(root / "step_1", 1, actor, critic, tokenizer, state={"extra": 7}, shards=shards)
    assert latest_checkpoint(root) == ckpt
    assert {p.name for p in ckpt.iterdir()} == {SHARDED, "actor_config", "trainer_state.pt",
                                                "tiderl_checkpoint.json"}
    assert json.loads((ckpt / "tiderl_checkpoint.json").read_text())["sharded"] == {"parallel": "test", "world_size": 1}
    want_metrics = step(actor, critic, ref, batch_b())
    want = both(actor, critic)

    fresh_actor, fresh_critic, _ = build(CFG, lambda m, lr: Learner(m, lr=lr, grad_clip=CLIP))
    state = load_checkpoint(ckpt, fresh_actor, fresh_critic)
    assert (state["step"], state["extra"]) == (1, 7)
    assert step(fresh_actor, fresh_critic, ref, batch_b())["policy/loss"] == pytest.approx(want_metrics["policy/loss"], rel=1e-5)
    assert_same(both(fresh_actor, fresh_critic), want, "load_checkpoint")

    mirror_actor, mirror_critic, _ = build(CFG, lambda m, lr: Learner(m, lr=lr, grad_clip=CLIP))
    state = load_checkpoint(ckpt, mirror_actor, mirror_critic, ranks_load=True)
    assert state["sharded"] == str(ckpt / SHARDED)
    assert not mirror_actor.optimizer.state  # the optimizer states stay for the ranks
    weights_only = build(CFG, lambda m, lr: Learner(m, lr=lr))[0].model
    load_sharded_weights(ckpt / SHARDED, weights_only, "actor")
    for a, b in zip(weights_only.state_dict().values(), mirror_actor.model.state_dict().values()):
        assert torch.equal(a, b)


def test_single_process_checkpoint_is_refused_for_ranks(tmp_path):
    actor, critic, _ = build(CFG, lambda m, lr: Learner(m, lr=lr))
    ckpt = save_checkpoint(tmp_path / "step_0", 0, actor, critic, tiny_tokenizer())
    with pytest.raises(ValueError, match="train.parallel=none"):
        load_checkpoint(ckpt, actor, critic, ranks_load=True)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_export_consolidates_the_ranks_shards_into_a_plain_model_dir(sharded_runs, tmp_path, mode):
    """`tiderl export` of a checkpoint whose sharded/ the two ranks wrote: a directory that
    `AutoModelForCausalLM.from_pretrained` loads, with the trained model's logits."""
    import shutil

    from transformers import AutoModelForCausalLM

    from tiderl.cli import main as cli

    out, results = sharded_runs
    actor, critic, _ = build(CFG, lambda m, lr: Learner(m, lr=lr))

    def ranks_shards(path):  # the ranks' DCP directory, as RayParallelTrainer.save_sharded leaves it
        shutil.copytree(out / mode, path)
        return {"parallel": mode, "world_size": 2}

    ckpt = save_checkpoint(tmp_path / "step_1", 1, actor, critic, tiny_tokenizer(), shards=ranks_shards)
    assert cli(["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "hf")]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()

    trained = build(CFG, lambda m, lr: Learner(m, lr=lr))[0].model.eval()
    saved = results[(mode, "saved")]["actor"]
    trained.load_state_dict({k[len("param/"):]: v for k, v in saved.items() if k.startswith("param/")}, strict=False)
    ids = torch.tensor([[5, 9, 3, 17, 42, 8], [1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        want, got = trained(ids).logits, exported(ids).logits
    assert not torch.equal(want, build(CFG, lambda m, lr: Learner(m, lr=lr))[0].model.eval()(ids).logits)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    # Export never overwrites, and names what it needs.
    assert cli(["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "hf")]) == 2
    assert cli(["export", "--checkpoint", str(tmp_path), "--out", str(tmp_path / "hf2")]) == 2
