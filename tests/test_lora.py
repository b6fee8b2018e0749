"""LoRA through peft: only the adapters train (through the real `train_step`), only they sync,
and after a step and a sync the engine samples from exactly the policy the trainer scores (its
adapters unmerged, so that a bf16 base does not round small updates away)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")

from tiderl.config import AlgoConfig, ConfigError, load_config, preset_defaults  # noqa: E402
from tiderl.embedded.tiny import init_tiny_model, tiny_qwen2_config, train_tokenizer  # noqa: E402
from tiderl.rollout.base import SamplingParams  # noqa: E402
from tiderl.rollout.lora import LoraTorchEngine  # noqa: E402
from tiderl.rollout.weights import weights_checksum  # noqa: E402
from tiderl.train.critic import ValueModel  # noqa: E402
from tiderl.train.learner import Learner  # noqa: E402
from tiderl.train.lora import adapter_state, apply_lora, merged_copy, policy_state  # noqa: E402
from tiderl.train.step import train_step  # noqa: E402

from support import nine_trajectories  # noqa: E402  (9 trajectories of the same tiny shape)

MODEL_CFG = tiny_qwen2_config(50, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                              max_position_embeddings=64)
TARGETS = ["q_proj", "v_proj", "o_proj", "up_proj"]


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits


def test_only_adapters_train_and_sync_and_the_engine_matches_the_merged_model():
    base = init_tiny_model(MODEL_CFG, seed=0)
    critic = Learner(ValueModel.from_policy(base), lr=1e-3)  # the critic stays a full model
    policy = apply_lora(base, r=4, alpha=8.0, target_modules=TARGETS)
    frozen_before = {k: v.clone() for k, v in policy.state_dict().items() if "lora_" not in k}
    adapters_before = {k: v.clone() for k, v in adapter_state(policy).items()}
    actor = Learner(policy, lr=1e-2)
    assert {n for n, p in policy.named_parameters() if p.requires_grad} == set(adapters_before)

    tokenizer = train_tokenizer(["tool call answer"] * 4, vocab_size=300)
    engine = LoraTorchEngine(policy, tokenizer)
    ids = torch.tensor([[5, 9, 13, 21, 34, 40, 7, 3]])
    torch.testing.assert_close(logits(engine.model, ids), logits(policy, ids), atol=1e-6, rtol=0)

    cfg = AlgoConfig(**{**preset_defaults("sao"), "entropy_coef": 0.01})
    train_step(nine_trajectories(), actor, critic, None, cfg, pad_id=0, micro_batch_tokens=64, train_actor=True)

    after = policy.state_dict()
    assert all(torch.equal(after[k], v) for k, v in frozen_before.items())  # base weights untouched
    assert all(not torch.equal(after[k], v) for k, v in adapters_before.items() if ".lora_B." in k)
    sent = policy_state(policy)
    assert set(sent) == set(adapters_before)
    engine.update_weights(sent, version=1)
    assert engine.version == 1 and engine.state_checksum() == weights_checksum(sent)
    merged = merged_copy(policy)
    torch.testing.assert_close(logits(engine.model, ids), logits(merged, ids), atol=1e-6, rtol=0)
    torch.testing.assert_close(logits(engine.model, ids), logits(policy, ids), atol=1e-5, rtol=0)
    # The sync carries the adapters only: a small fraction of the model's bytes.
    sync_bytes = sum(v.numel() * v.element_size() for v in sent.values())
    full_bytes = sum(v.numel() * v.element_size() for v in merged.state_dict().values())
    assert sync_bytes < 0.2 * full_bytes

    with pytest.raises(ValueError, match="LoRA adapters"):
        engine.update_weights(merged.state_dict(), version=2)
    with pytest.raises(ValueError, match="versions must not decrease"):
        engine.update_weights(sent, version=0)


def test_apply_lora_names_unknown_target_modules():
    with pytest.raises(ValueError, match="model.lora.target_modules.*qkv"):
        apply_lora(init_tiny_model(MODEL_CFG, seed=0), r=4, alpha=8.0, target_modules=["qkv"])


def test_lora_config_fields():
    cfg = load_config(None, ["model.lora.r=8", "model.lora.target_modules=[q_proj, v_proj]"])
    assert (cfg.model.lora.r, cfg.model.lora.target_modules) == (8, ["q_proj", "v_proj"])
    with pytest.raises(ConfigError, match="model.lora.r.*>= 0"):
        load_config(None, ["model.lora.r=-1"])
    with pytest.raises(ConfigError, match="model.lora.alpha.*model.lora.r=0"):
        load_config(None, ["model.lora.alpha=32"])
    with pytest.raises(ConfigError, match="model.lora.target_modules.*empty"):
        load_config(None, ["model.lora.r=8", "model.lora.target_modules=[]"])
    # LoRA on data-parallel ranks (tests/test_parallel_lora.py) and with the HTTP engine (merged
    # weights, tests/test_lora_http.py); an engine of its own has no adapter path.
    assert load_config(None, ["model.lora.r=8", "system.backend=ray", "train.parallel=fsdp2",
                              "train.world_size=2"]).model.lora.r == 8
    assert load_config(None, ["model.lora.r=8", "rollout.engine=http"]).model.lora.r == 8
    own = "tiderl.rollout.torch_engine:TorchEngine"  # named as a class: no LoRA path of its own
    with pytest.raises(ConfigError, match=f"model.lora.r.*rollout.engine={own}.*Fix: use rollout.engine=torch or http"):
        load_config(None, ["model.lora.r=8", f"rollout.engine={own}"])


@pytest.mark.slow
def test_a_lora_run_trains_and_syncs_adapters(cache, tmp_path):
    from tiderl.recipe import train
    from tiderl.run import build_run

    cfg = load_config("configs/kg_sao_tiny.yaml", [
        "env.options.num_films=40", "env.options.num_people=40", "data.eval_size=16", "model.tiny.vocab_size=512",
        "model.tiny.hidden_size=64", "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1",
        "model.warmstart.num_traces=40", "model.warmstart.steps=2", "model.warmstart.batch_size=16",
        "rollout.batch_size=4", "env.max_turns=2", "rollout.max_new_tokens=24", "algo.critic_warmup_steps=0",
        "algo.entropy_coef=0.01", "log.progress=false", "log.tensorboard=false", "train.steps=1",
        "model.lora.r=4", "model.critic_lora=lora", f"model.cache_dir={cache}",
        f"run_dir={tmp_path / 'run'}"])
    run = build_run(cfg)
    assert isinstance(run.engine, LoraTorchEngine)
    critic_before = {k: v.clone() for k, v in run.critic.model.state_dict().items()}
    assert any(".lora_" in k for k in critic_before)  # the critic carries adapters too
    before = {k: v.clone() for k, v in adapter_state(run.actor.model).items()}
    history, _ = train(run)  # the scheduler checks the engine's adapter checksum against the trainer's
    assert len(history) == 1 and run.engine.version == 1
    assert any(not torch.equal(v, adapter_state(run.actor.model)[k]) for k, v in before.items())
    assert run.engine.state_checksum() == weights_checksum(adapter_state(run.actor.model))
    # The tiny model's rewards may all be 0 (no value gradient): the LoRA critic's learning is
    # checked in test_a_lora_critic_trains_its_adapters_and_head_and_checkpoints; here, that the
    # run trains exactly its adapters and head, and leaves its base weights alone.
    assert {n for n, p in run.critic.model.named_parameters() if p.requires_grad} == {
        k for k in critic_before if ".lora_" in k or k.startswith("head.")}
    critic_after = run.critic.model.state_dict()
    assert all(torch.equal(v, critic_after[k]) for k, v in critic_before.items() if ".lora_" not in k and "head" not in k)


def test_a_lora_checkpoint_resumes_and_exports_merged_weights(tmp_path):
    """A LoRA policy's checkpoint holds its adapters: `load_checkpoint` puts them (and AdamW's
    state) back into a fresh LoRA policy, and `tiderl export` writes the merged model as a plain
    Hugging Face directory with the trained policy's logits."""
    from transformers import AutoModelForCausalLM

    from tiderl.cli import main as cli
    from tiderl.models.loading import load_model, save_model_dir
    from tiderl.train.checkpoint import load_checkpoint, save_checkpoint

    tokenizer = train_tokenizer(["tool call answer"] * 4, vocab_size=300)
    base_dir = save_model_dir(init_tiny_model(MODEL_CFG, seed=0), tokenizer, tmp_path / "base")
    policy = apply_lora(load_model(base_dir), r=4, alpha=8.0, target_modules=TARGETS)
    actor = Learner(policy, lr=1e-2)
    cfg = AlgoConfig(**{**preset_defaults("grpo"), "entropy_coef": 0.01, "kl_coef": 0.0, "group_size": 3})
    train_step(nine_trajectories(), actor, None, None, cfg, pad_id=0, micro_batch_tokens=64, train_actor=True)
    ckpt = save_checkpoint(tmp_path / "ckpt" / "step_1", 1, actor, None, tokenizer)
    assert (ckpt / "actor" / "adapter_config.json").is_file()

    fresh = Learner(apply_lora(load_model(base_dir), r=4, alpha=8.0, target_modules=TARGETS), lr=1e-2)
    assert load_checkpoint(ckpt, fresh, None)["step"] == 1
    for k, v in adapter_state(policy).items():
        assert torch.equal(adapter_state(fresh.model)[k], v), k
    assert len(fresh.optimizer.state) == len(actor.optimizer.state) > 0
    with pytest.raises(ValueError, match="model.lora"):
        load_checkpoint(ckpt, Learner(load_model(base_dir), lr=1e-2), None)  # adapters, but no LoRA policy

    assert cli(["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "merged")]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert not any("lora" in k for k in exported.state_dict())
    ids = torch.tensor([[5, 9, 13, 21, 34, 40, 7, 3]])
    torch.testing.assert_close(logits(exported, ids), logits(policy, ids), atol=1e-5, rtol=0)
    assert not torch.allclose(logits(exported, ids), logits(load_model(base_dir), ids), atol=1e-4)
    # The base model the adapters name is gone: export says what to pass.
    import shutil

    shutil.move(base_dir, tmp_path / "moved")
    assert cli(["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "m2")]) == 2
    assert cli(["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "m2"),
                "--base-model", str(tmp_path / "moved")]) == 0


def test_a_lora_critic_trains_its_adapters_and_head_and_checkpoints(tmp_path):
    """`model.critic_lora=lora`: adapters on the critic's backbone (base frozen) and a fully
    trained value head; its value loss falls over critic steps; a checkpoint restores it, and
    its critic/ directory stays a plain value model (merged backbone) with the same values."""
    from tiderl.train.checkpoint import load_checkpoint, save_checkpoint
    from tiderl.train.critic import freeze_matching
    from tiderl.train.lora import apply_critic_lora

    def lora_critic():
        critic = ValueModel.from_policy(init_tiny_model(MODEL_CFG, seed=0))
        freeze_matching(critic, r"self_attn\.")  # as SAO's critic (before the adapters, on base names)
        return apply_critic_lora(critic, r=4, alpha=8.0, target_modules=TARGETS)

    critic_model = lora_critic()
    trainable = {n for n, p in critic_model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n or n.startswith("head.") for n in trainable)
    assert {"head.weight", "head.bias"} <= trainable
    frozen_before = {k: v.clone() for k, v in critic_model.state_dict().items() if ".lora_" not in k and "head" not in k}
    critic = Learner(critic_model, lr=1e-2)
    actor = Learner(init_tiny_model(MODEL_CFG, seed=0), lr=1e-3)
    cfg = AlgoConfig(**{**preset_defaults("sao"), "group_size": 3, "critic_updates": 1})
    losses = [train_step(nine_trajectories(), actor, critic, None, cfg, pad_id=0, micro_batch_tokens=64,
                         train_actor=False)["value/loss"] for _ in range(8)]
    assert losses[-1] < 0.5 * losses[0], losses
    after = critic_model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in frozen_before.items())  # base weights untouched

    tokenizer = train_tokenizer(["tool call answer"] * 4, vocab_size=300)
    ckpt = save_checkpoint(tmp_path / "step_8", 8, actor, critic, tokenizer)
    fresh = Learner(lora_critic(), lr=1e-2)
    load_checkpoint(ckpt, Learner(init_tiny_model(MODEL_CFG, seed=0), lr=1e-3), fresh)
    ids = torch.tensor([[5, 9, 13, 21, 34, 40, 7, 3]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        want = critic_model(ids, mask)
        torch.testing.assert_close(fresh.model(ids, mask), want, atol=1e-6, rtol=0)
        torch.testing.assert_close(ValueModel.load(ckpt / "critic")(ids, mask), want, atol=1e-5, rtol=0)
    assert len(fresh.optimizer.state) == len(critic.optimizer.state) > 0
    full = Learner(ValueModel.from_policy(init_tiny_model(MODEL_CFG, seed=0)), lr=1e-2)
    with pytest.raises(ValueError, match="model.critic_lora=lora"):
        load_checkpoint(ckpt, Learner(init_tiny_model(MODEL_CFG, seed=0), lr=1e-3), full)
    with pytest.raises(ConfigError, match="model.critic_lora.*model.lora.r"):
        load_config(None, ["model.critic_lora=lora"])
    assert load_config(None, ["model.critic_lora=lora", "model.lora.r=4"]).model.critic_lora == "lora"


def test_a_lora_critic_over_a_model_directory_saves_its_adapters_not_the_merged_weights(tmp_path):
    """A LoRA critic whose base is a model directory (every real model's) writes peft's adapter
    folder in critic/backbone, not a merged copy of the base (for a 0.5B model 68 MB, not 1.9 GB);
    `ValueModel.load` merges them over the base again, with the values the critic had, and says
    what to do when the base is gone."""
    from tiderl.models.loading import load_model
    from tiderl.train.lora import apply_critic_lora

    init_tiny_model(MODEL_CFG, seed=0).save_pretrained(tmp_path / "base")
    critic_model = apply_critic_lora(ValueModel.from_policy(load_model(str(tmp_path / "base"))), r=4, alpha=8.0,
                                     target_modules=TARGETS)
    critic = Learner(critic_model, lr=1e-2)
    cfg = AlgoConfig(**{**preset_defaults("sao"), "group_size": 3, "critic_updates": 1})
    for _ in range(2):  # adapters that moved away from zero
        train_step(nine_trajectories(), Learner(init_tiny_model(MODEL_CFG, seed=0), lr=1e-3), critic, None, cfg,
                   pad_id=0, micro_batch_tokens=64, train_actor=False)
    assert any(float(v.abs().sum()) > 0 for k, v in adapter_state(critic_model).items() if "lora_B" in k)
    critic_model.save(tmp_path / "critic")
    saved = {p.name for p in (tmp_path / "critic" / "backbone").iterdir()}
    assert "adapter_config.json" in saved and "model.safetensors" not in saved, saved
    ids, mask = torch.tensor([[5, 9, 13, 21, 34, 40, 7, 3]]), torch.ones(1, 8, dtype=torch.long)
    with torch.no_grad():
        torch.testing.assert_close(ValueModel.load(tmp_path / "critic")(ids, mask), critic_model(ids, mask),
                                   atol=1e-5, rtol=0)
    (tmp_path / "base").rename(tmp_path / "moved")
    with pytest.raises(FileNotFoundError, match="put the base model back"):
        ValueModel.load(tmp_path / "critic")


ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _bf16_policy_with_small_adapters(targets=ALL_LINEAR, scale=3e-3):
    """A bf16 LoRA policy whose adapters are set to random values that change each weight by
    about its bf16 rounding step or less (as early LoRA updates do), and those adapters."""
    base = init_tiny_model(tiny_qwen2_config(50, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                                             max_position_embeddings=128), seed=0)
    with torch.no_grad():
        base.model.norm.weight.mul_(8.0)  # peaked next-token distributions
    policy = apply_lora(base.to(torch.bfloat16), r=4, alpha=8.0, target_modules=targets)
    g = torch.Generator().manual_seed(1)
    adapters = {k: torch.randn(v.shape, generator=g) * scale for k, v in policy_state(policy).items()}
    policy.load_state_dict(adapters, strict=False)
    return policy, adapters


def test_a_bf16_engine_scores_exactly_as_the_trainer_where_a_merge_would_not():
    policy, adapters = _bf16_policy_with_small_adapters()
    tokenizer = train_tokenizer(["tool call answer"] * 4, vocab_size=300)
    engine = LoraTorchEngine(policy, tokenizer)
    engine.update_weights(adapters, version=1)
    ids = torch.tensor([[5, 9, 13, 21, 34, 40, 7, 3, 11, 12, 13, 14]])
    trainer = logits(policy, ids)  # peft's forward: what the trainer scores
    with policy.disable_adapter():
        before = logits(policy, ids)
    assert (trainer - before).abs().max() > 0.05  # the update changes the policy
    # The engine adds the adapters' term before rounding, as peft does: identical logits.
    assert torch.equal(logits(engine.model, ids), trainer)
    # A bf16 merge rounds most of the update away: its logits are as far from the trainer's as
    # the base model's are.
    merged = logits(merged_copy(policy), ids)
    assert (merged - trainer).abs().max() > 0.25 * (before - trainer).abs().max()
    assert all(p.dtype == torch.bfloat16 for p in engine.model.parameters())  # the base stays bf16
    assert engine.state_checksum() == weights_checksum(adapters)


@pytest.mark.parametrize("targets", [ALL_LINEAR, ["q_proj", "v_proj", "up_proj"]])
def test_the_fast_decode_step_adds_the_adapters_as_the_model_forward_does(targets):
    """Sampling with the stacked q/k/v and gate/up terms of the fast decode step gives the very
    tokens and log-probs of decoding with the model's own forward (each layer's hook)."""
    policy, adapters = _bf16_policy_with_small_adapters(targets)
    tokenizer = train_tokenizer(["tool call answer"] * 4, vocab_size=300)
    prompts = [[5, 9, 13, 21], [7, 3], [11, 12, 13, 14, 15, 16]]
    params = SamplingParams(temperature=1.0, max_new_tokens=24)
    runs = []
    for fast in (True, False):
        engine = LoraTorchEngine(policy, tokenizer, seed=3)
        engine.update_weights(adapters, version=1)
        assert (engine._fast is not None) is True
        if not fast:
            engine._fast = None
        runs.append(engine.generate(prompts, params))
        # A second sync is read by the same path (the layers' buffers are views of the stacks).
        engine.update_weights({k: v * 2 for k, v in adapters.items()}, version=2)
        runs.append(engine.generate(prompts, params))
    for with_fast, with_forward in zip(runs[:2], runs[2:]):
        for a, b in zip(with_fast, with_forward):
            assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


def test_an_fp32_engine_samples_with_the_trainers_log_probs():
    policy, adapters = _bf16_policy_with_small_adapters(scale=3e-2)
    policy = policy.float()
    tokenizer = train_tokenizer(["tool call answer"] * 4, vocab_size=300)
    engine = LoraTorchEngine(policy, tokenizer)
    engine.update_weights(adapters, version=1)
    prompt = [5, 9, 13, 21]
    completion = engine.generate([prompt], SamplingParams(temperature=1.0, max_new_tokens=24))[0]
    sequence = torch.tensor([prompt + completion.token_ids])
    with torch.no_grad():
        scored = torch.log_softmax(policy(input_ids=sequence).logits[0, len(prompt) - 1: -1].float(), -1)
    recomputed = scored.gather(-1, torch.tensor(completion.token_ids)[:, None]).squeeze(-1)
    torch.testing.assert_close(torch.tensor(completion.logprobs), recomputed, atol=1e-4, rtol=0)


def test_the_lora_engine_refuses_adapters_on_layers_other_than_linear():
    base = init_tiny_model(MODEL_CFG, seed=0)
    policy = apply_lora(base, r=4, alpha=8.0, target_modules=["q_proj", "embed_tokens"])
    with pytest.raises(ValueError, match="linear layers only.*embed_tokens.*model.lora.target_modules"):
        LoraTorchEngine(policy, train_tokenizer(["tool call answer"] * 4, vocab_size=300))


def test_a_lora_checkpoint_evaluates_unmerged_on_its_base_model(tmp_path):
    """`load_policy` (what `tiderl eval --model` and `tiderl serve` call) loads a LoRA run's actor/
    as its bf16 base with fp32 adapters beside it, and the engine built from it (handed over, not
    copied) scores exactly as the trainer did. A plain model directory loads as before."""
    from tiderl.models.loading import load_model, load_policy, save_model_dir
    from tiderl.rollout import make_engine

    tokenizer = train_tokenizer(["tool call answer"] * 4, vocab_size=300)
    # The base as a run has it: a model directory, loaded in bf16 (a model cast with .to() would
    # also round its rotary frequencies, which loading does not).
    plain, adapters = _bf16_policy_with_small_adapters()
    base_dir = save_model_dir(plain.unload(), tokenizer, tmp_path / "base")
    policy = apply_lora(load_model(base_dir, "bfloat16"), r=4, alpha=8.0, target_modules=ALL_LINEAR)
    policy.load_state_dict(adapters, strict=False)
    actor_dir = save_model_dir(policy, tokenizer, tmp_path / "ckpt" / "actor")  # as save_checkpoint writes it

    loaded = load_policy(actor_dir, "bfloat16")
    assert {p.dtype for n, p in loaded.named_parameters() if ".lora_" in n} == {torch.float32}
    ids = torch.tensor([[5, 9, 13, 21, 34, 40, 7, 3, 11, 12, 13, 14]])
    trainer = logits(policy, ids)
    assert torch.equal(logits(loaded, ids), trainer)
    engine = make_engine(load_config(None, []), loaded, tokenizer, seed=0, copy_model=False)
    assert isinstance(engine, LoraTorchEngine) and engine.model is not None
    assert torch.equal(logits(engine.model, ids), trainer)
    with policy.disable_adapter():
        assert (logits(policy, ids) - trainer).abs().max() > 0.05  # the adapters matter
    # A plain model directory loads as before; a missing base model names the fix.
    assert not hasattr(load_policy(base_dir, "bfloat16"), "peft_config")
    assert torch.equal(logits(load_policy(base_dir, "bfloat16"), ids), logits(load_model(base_dir, "bfloat16"), ids))
    import shutil

    shutil.move(base_dir, tmp_path / "moved")
    with pytest.raises(FileNotFoundError, match="tiderl export --base-model"):
        load_policy(actor_dir, "bfloat16")
    moved = load_policy(actor_dir, "bfloat16", base_model=tmp_path / "moved")
    assert torch.equal(logits(moved, ids), trainer)
