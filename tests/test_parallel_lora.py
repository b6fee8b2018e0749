"""LoRA on data-parallel ranks: 2 gloo ranks (DDP and FSDP2) take the same `train_step` as one
process on the same batch, for a LoRA policy and a LoRA critic (`model.critic_lora=lora`): the
adapters (and the value head) get the same gradients and the same update, the frozen base stays
as it was, and what a rank publishes is the adapters alone."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")

from support import CLIP, LR, PARALLEL_MODEL_CFG, nine_trajectories, parallel_cases, seed_adapters, snapshot  # noqa: E402
from tiderl.embedded.tiny import init_tiny_model  # noqa: E402
from tiderl.lab.ranks import spawn_ranks  # noqa: E402
from tiderl.train.learner import Learner  # noqa: E402
from tiderl.train.step import train_step  # noqa: E402

TARGETS = ["q_proj", "v_proj", "up_proj"]


def build_lora(make_learner):
    """(actor, critic) of SAO with adapters on both (the critic's attention frozen as SAO's, its
    head trained fully), each wrapped by `make_learner(model, lr)`."""
    from tiderl.train.critic import ValueModel, freeze_matching
    from tiderl.train.lora import apply_critic_lora, apply_lora

    cfg, _ = parallel_cases()["sao"]
    policy = apply_lora(init_tiny_model(PARALLEL_MODEL_CFG, seed=0), 4, 8.0, TARGETS)
    seed_adapters(policy, 1)
    value_model = ValueModel.from_policy(init_tiny_model(PARALLEL_MODEL_CFG, seed=0))
    with torch.no_grad():
        value_model.head.weight.copy_(torch.randn(value_model.head.weight.shape,
                                                  generator=torch.Generator().manual_seed(7)) * 0.1)
    freeze_matching(value_model, cfg.critic_freeze_pattern)
    apply_critic_lora(value_model, 4, 8.0, TARGETS)
    seed_adapters(value_model, 2)
    return make_learner(policy, LR), make_learner(value_model, LR)


def one_step(make_learner) -> dict[str, object]:
    cfg, micro_tokens = parallel_cases()["sao"]
    actor, critic = build_lora(make_learner)
    metrics = train_step(nine_trajectories(), actor, critic, None, cfg, pad_id=0, micro_batch_tokens=micro_tokens,
                         train_actor=True)
    return {"metrics": metrics, "actor": snapshot(actor), "critic": snapshot(critic), "learner": actor}


def rank_main(rank: int, world_size: int, out_path: str) -> None:
    """One rank: the LoRA step under DDP and FSDP2, and what each publishes; rank 0 saves it."""
    from tiderl.train.parallel import ParallelLearner, published_state

    results = {}
    for mode in ("ddp", "fsdp2"):
        got = one_step(lambda m, lr: ParallelLearner(m, mode, lr=lr, grad_clip=CLIP))
        learner = got.pop("learner")
        got["published"] = published_state(learner.model, mode)
        got["optimizer_entries"] = len(learner.optimizer.state)
        # FSDP2 shards every parameter, the frozen base too (gathered for each forward, never
        # reduced: it has no gradient); DDP keeps whole replicas.
        frozen = [p for p in learner.model.parameters() if not p.requires_grad]
        got["frozen_sharded"] = bool(frozen) and all(type(p).__name__ == "DTensor" for p in frozen)
        results[mode] = got
    if rank == 0:
        torch.save(results, out_path)


@pytest.fixture(scope="module")
def lora_results(tmp_path_factory):
    path = tmp_path_factory.mktemp("parallel_lora") / "rank0.pt"
    spawn_ranks(rank_main, 2, str(path), timeout_s=300)
    return torch.load(path, weights_only=False)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_two_lora_ranks_equal_one_lora_process(lora_results, mode):
    single = one_step(lambda m, lr: Learner(m, lr=lr, grad_clip=CLIP))
    single.pop("learner")
    got = lora_results[mode]
    assert single["metrics"]["micro_batches"] >= 3  # a real split across the ranks
    for part in ("actor", "critic"):
        want_all = single[part]
        assert got[part].keys() == want_all.keys(), part
        grads = {k for k in want_all if k.startswith("grad/")}
        # Only adapters (and the critic's head) have gradients: the base is frozen on every rank.
        assert grads and all(".lora_" in k or k.startswith("grad/head.") for k in grads), sorted(grads)
        assert any(".lora_A." in k and want_all[k].abs().max() > 0 for k in grads)
        for name, want in want_all.items():
            torch.testing.assert_close(got[part][name], want, atol=1e-6, rtol=1e-5, msg=f"{mode} {part} {name}")
    for key, want in single["metrics"].items():
        assert got["metrics"][key] == pytest.approx(want, rel=1e-5, abs=1e-6), key
    # What a rank publishes to the engines: exactly the trained adapters, nothing of the base.
    published = got["published"]
    adapters = {k[len("param/"):] for k in single["actor"] if k.startswith("param/") and ".lora_" in k}
    assert set(published) == adapters
    for name, value in published.items():
        torch.testing.assert_close(value, single["actor"][f"param/{name}"], atol=1e-6, rtol=1e-5)
    assert got["optimizer_entries"] == len(adapters)  # AdamW state for the adapters alone
    assert got["frozen_sharded"] == (mode == "fsdp2")


# -- end to end on Ray: LoRA + FSDP2 ranks + staleness 2, checkpoint, export, resume ----------

SMALL = [
    "env.options.num_films=40", "env.options.num_people=40", "data.eval_size=16",
    "model.tiny.vocab_size=512", "model.tiny.hidden_size=64", "model.tiny.num_layers=2",
    "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1",
    "model.warmstart.num_traces=40", "model.warmstart.steps=2", "model.warmstart.batch_size=16",
    "rollout.batch_size=4", "algo.critic_warmup_steps=0", "algo.entropy_coef=0.01", "log.progress=false",
    "log.tensorboard=false", "system.wait_timeout_s=300", "train.micro_batch_tokens=1024", "env.max_turns=2",
    "rollout.max_new_tokens=16", "system.backend=ray", "train.parallel=fsdp2", "train.world_size=2",
    "model.lora.r=4", "model.critic_lora=lora", "system.max_staleness=2", "train.checkpoint_every=1",
]


@pytest.mark.slow
def test_lora_on_fsdp2_ray_ranks_with_staleness_trains_checkpoints_exports_and_resumes(cache, tmp_path):
    """`tiderl train` with LoRA (policy and critic) on 2 FSDP2 ranks, staleness 2, on Ray: the
    rollout workers get the adapters alone (checksums checked at every sync), the ledger
    balances, the sharded checkpoint exports merged weights with the trained policy's logits,
    and `train.resume=auto` goes on from it (with the local backend: ranks on Ray, episodes here)."""
    ray = pytest.importorskip("ray")
    from tiderl.config import load_config
    from tiderl.recipe import train
    from tiderl.rollout.lora import LoraTorchEngine
    from tiderl.rollout.weights import weights_checksum
    from tiderl.run import build_run
    from tiderl.train.checkpoint import export_actor
    from tiderl.train.lora import adapter_state

    def config(*more):
        return load_config("configs/kg_sao_tiny.yaml", SMALL + [f"model.cache_dir={cache}",
                                                                f"run_dir={tmp_path / 'run'}", *more])

    ray.init(address="local", num_cpus=2, include_dashboard=False)  # our own cluster, not a running one
    try:
        run = build_run(config("train.steps=2"))
        assert isinstance(run.engine, LoraTorchEngine)
        base_before = {k: v.clone() for k, v in run.actor.model.state_dict().items() if ".lora_" not in k}
        adapters_before = {k: v.clone() for k, v in adapter_state(run.actor.model).items()}
        history, summary = train(run)
        assert [h["policy_version"] for h in history] == [1, 2]
        ledger = summary["ledger"]
        assert ledger["started"] == sum(v for k, v in ledger.items() if k != "started"), ledger
        assert ledger["trained"] == 2 * 4 and ledger["failed"] == 0, ledger
        stats = summary["backend"]["worker_stats"]
        assert stats and {s["version"] for s in stats} == {2}
        # The driver's mirror got the ranks' adapters; its base is untouched.
        after = run.actor.model.state_dict()
        assert all(torch.equal(after[k], v) for k, v in base_before.items())
        assert any(not torch.equal(after[k], v) for k, v in adapters_before.items())
        assert run.engine.state_checksum() == weights_checksum(adapter_state(run.actor.model))

        final = tmp_path / "run" / "checkpoints" / "final"
        assert (final / "sharded").is_dir() and (final / "actor_config" / "adapter_config.json").is_file()
        exported = export_actor(final, tmp_path / "exported")
        from transformers import AutoModelForCausalLM

        plain = AutoModelForCausalLM.from_pretrained(exported).eval()
        assert not any("lora" in k for k in plain.state_dict())
        ids = torch.tensor([[5, 9, 13, 21, 34, 40, 7, 3]])
        with torch.no_grad():
            want = run.actor.model(input_ids=ids).logits
            torch.testing.assert_close(plain(input_ids=ids).logits, want, atol=1e-5, rtol=0)

        # Resumed with the local backend: the same ranks, the episodes in this process.
        resumed = build_run(config("train.steps=3", "train.resume=auto", "system.backend=local"))
        assert resumed.step == 2
        for k, v in adapter_state(run.actor.model).items():
            assert torch.equal(adapter_state(resumed.actor.model)[k], v), k
        history, summary = train(resumed)
        assert [h["policy_version"] for h in history] == [3]
        assert summary["ledger"]["failed"] == 0
        assert isinstance(resumed.engine, LoraTorchEngine) and resumed.engine.version == 3
        assert resumed.engine.state_checksum() == weights_checksum(adapter_state(resumed.actor.model))
        assert any(not torch.equal(adapter_state(resumed.actor.model)[k], v)
                   for k, v in adapter_state(run.actor.model).items())  # step 3 moved the adapters
    finally:
        ray.shutdown()
