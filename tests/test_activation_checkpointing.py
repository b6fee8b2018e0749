"""`train.activation_checkpointing`: the decoder layers of the policy and the critic run their
forward again in the backward pass, and the update is the one without it."""

from __future__ import annotations

import copy

import pytest
import torch

from tiderl.config import AlgoConfig, preset_defaults
from tiderl.embedded.tiny import init_tiny_model, tiny_qwen2_config
from tiderl.train.critic import ValueModel
from tiderl.train.learner import Learner
from tiderl.train.memory import enable_activation_checkpointing
from tiderl.train.step import train_step

from support import nine_trajectories  # noqa: E402  (9 trajectories of the same tiny shape)

MODEL_CFG = tiny_qwen2_config(50, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                              max_position_embeddings=64)


def sao_step(checkpointing: bool, lora: bool = False, copied: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """Weights of policy and critic after one SAO step (actor and critic trained), and how many
    times the MLP of each model's first decoder layer ran forward. `copied`: train deep copies
    of the checkpointed models (as a Ray trainer rank receives them)."""
    torch.manual_seed(0)
    policy = init_tiny_model(MODEL_CFG, seed=0)
    critic = ValueModel.from_policy(policy)
    with torch.no_grad():
        critic.head.weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
    if lora:
        from tiderl.train.lora import apply_lora

        policy = apply_lora(policy, r=4, alpha=8.0, target_modules=["q_proj", "v_proj", "up_proj"])
        with torch.no_grad():  # B starts at 0: give the adapters a gradient on A too
            for name, p in policy.named_parameters():
                if ".lora_B." in name:
                    p.normal_(0, 0.05, generator=torch.Generator().manual_seed(2))
    if checkpointing:
        enable_activation_checkpointing(policy)
        enable_activation_checkpointing(critic)
        if copied:
            policy, critic = copy.deepcopy(policy), copy.deepcopy(critic)
    calls = {"policy": 0, "critic": 0}

    class CountedActivation(torch.nn.Module):
        """The MLP's activation, counting its calls (module hooks do not fire in a recompute)."""

        def __init__(self, act: torch.nn.Module, key: str):
            super().__init__()
            self.act, self.key = act, key

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            calls[self.key] += 1
            return self.act(x)

    first_mlp = [m for n, m in policy.named_modules() if n.endswith("layers.0.mlp")][0]
    first_mlp.act_fn = CountedActivation(first_mlp.act_fn, "policy")
    critic_mlp = critic.backbone.layers[0].mlp
    critic_mlp.act_fn = CountedActivation(critic_mlp.act_fn, "critic")
    cfg = AlgoConfig(**{**preset_defaults("sao"), "critic_updates": 1, "entropy_coef": 0.0})
    actor, critic_learner = Learner(policy, lr=1e-2), Learner(critic, lr=1e-2)
    train_step(nine_trajectories(), actor, critic_learner, None, cfg, pad_id=0, micro_batch_tokens=64, train_actor=True)
    weights = {f"policy.{k}": v.detach().clone() for k, v in policy.state_dict().items()}
    weights.update({f"critic.{k}": v.detach().clone() for k, v in critic.state_dict().items()})
    return weights, calls


@pytest.mark.parametrize("lora,copied", [(False, False), (True, False), (False, True)],
                         ids=["full", "lora", "deep-copied"])
@pytest.mark.slow
def test_checkpointing_recomputes_layers_and_leaves_the_update_unchanged(lora, copied):
    if lora:
        pytest.importorskip("peft")
    plain, plain_calls = sao_step(False, lora)
    checkpointed, ckpt_calls = sao_step(True, lora, copied)
    # Each training micro-batch runs the layer once more in its backward; no-grad passes
    # (old log-probs, values for GAE) do not.
    assert ckpt_calls["policy"] > plain_calls["policy"] and ckpt_calls["critic"] > plain_calls["critic"]


    for k, v in plain.items():
        torch.testing.assert_close(checkpointed[k], v, atol=1e-6, rtol=1e-5, msg=k)


def test_the_step_moves_the_weights_so_the_comparison_means_something():
    before = {f"policy.{k}": v.clone() for k, v in init_tiny_model(MODEL_CFG, seed=0).state_dict().items()}
    after, _ = sao_step(True)
    assert any(not torch.equal(after[k], v) for k, v in before.items())


def test_a_model_without_checkpointable_layers_names_the_option():
    with pytest.raises(ValueError, match="train.activation_checkpointing=false"):
        enable_activation_checkpointing(torch.nn.Linear(3, 3))


@pytest.mark.slow
def test_config_turns_it_on_for_the_actor_and_the_critic_not_the_engine(cache, tmp_path):
    from tiderl.config import load_config
    from tiderl.run import build_run

    cfg = load_config("configs/kg_sao_tiny.yaml", [
        "env.options.num_films=40", "env.options.num_people=40", "data.eval_size=16", "model.tiny.vocab_size=512",
        "model.tiny.hidden_size=64", "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1",
        "model.warmstart.num_traces=40", "model.warmstart.steps=2", "model.warmstart.batch_size=16",
        "log.progress=false", "log.tensorboard=false", "train.activation_checkpointing=true",
        f"model.cache_dir={cache}", f"run_dir={tmp_path / 'run'}"])
    run = build_run(cfg)
    assert checkpointing(run.actor.model) and checkpointing(run.critic.model.backbone)
    assert not checkpointing(run.engine.model)
    assert checkpointing(copy.deepcopy(run.actor.model))  # survives the copies a Ray bundle makes


def checkpointing(model: torch.nn.Module) -> bool:
    """Whether any decoder layer of `model` is set to recompute its activations."""
    return any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
