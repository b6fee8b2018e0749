"""LoRA against full fine-tuning: trainer memory (weights, gradients, AdamW state), weight-sync
bytes and seconds per step, for a Qwen2 model built from a config with random weights; and the
same for the critic (`model.critic_lora=lora` against a fully trained critic).

Both policies run one real `train_step` (GRPO preset, no critic) on the same 8 synthetic
trajectories; memory is counted from the tensors the trainer holds after the step (parameters,
their gradients, the optimizer's state), the sync size from what `policy_state` sends to the
engines. Both critics run one critic-only SAO `train_step` (value regression; SAO's frozen
attention for the full critic, adapters on the attention projections plus the value head for
the LoRA critic) on the same trajectories.

    .venv/bin/python benchmarks/lora_memory.py            # ~0.1B parameters (hidden 768, 12 layers)
    .venv/bin/python benchmarks/lora_memory.py --quick    # the tiny test shape

Last line: full vs LoRA training-state MiB of the policy and of the critic, sync MiB, and the
ratios full / LoRA.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from tiderl.config import AlgoConfig, preset_defaults  # noqa: E402
from tiderl.embedded.tiny import init_tiny_model, tiny_qwen2_config  # noqa: E402
from tiderl.train.critic import ValueModel, freeze_matching  # noqa: E402
from tiderl.train.learner import Learner  # noqa: E402
from tiderl.train.lora import apply_critic_lora, apply_lora, policy_state  # noqa: E402
from tiderl.train.step import train_step  # noqa: E402
from tiderl.types import NO_VERSION, Trajectory  # noqa: E402

SHAPES = {
    "tiny": dict(vocab_size=512, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1),
    "100m": dict(vocab_size=32000, hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=4,
                 intermediate_size=2048),
}
MIB = 2**20


def batch(vocab: int, n: int = 8, length: int = 96) -> list[Trajectory]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        mask = [0] * 16 + [1] * (length - 16)
        out.append(Trajectory(tokens=torch.randint(3, vocab, (length,), generator=g).tolist(), loss_mask=mask,
                              behavior_logprobs=[-3.0 if m else 0.0 for m in mask],
                              policy_version=[0 if m else NO_VERSION for m in mask], reward=float(i % 2),
                              group_id=f"q{i // 4}"))
    return out


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def measure(shape: str, lora_r: int) -> dict[str, float]:
    config = tiny_qwen2_config(**SHAPES[shape], max_position_embeddings=256)
    model = init_tiny_model(config, seed=0)
    if lora_r:
        model = apply_lora(model, r=lora_r, alpha=2.0 * lora_r,
                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    learner = Learner(model, lr=1e-4)
    cfg = AlgoConfig(**{**preset_defaults("grpo"), "group_size": 4, "kl_coef": 0.0})
    t0 = time.perf_counter()
    train_step(batch(config.vocab_size), learner, None, None, cfg, pad_id=0, micro_batch_tokens=4096, train_actor=True)
    step_s = time.perf_counter() - t0
    params = list(model.parameters())
    state = [v for s in learner.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    sync = policy_state(model)
    out = {
        "weights": nbytes(params) / MIB,
        "grads": nbytes(p.grad for p in params if p.grad is not None) / MIB,
        "optimizer": nbytes(state) / MIB,
        "sync": nbytes(sync.values()) / MIB,
        "trainable": sum(p.numel() for p in params if p.requires_grad),
        "step_s": step_s,
    }
    out["training_state"] = out["weights"] + out["grads"] + out["optimizer"]
    name = f"LoRA r={lora_r}" if lora_r else "full"
    print(f"{shape} {name}: {out['trainable'] / 1e6:.2f}M trainable, weights {out['weights']:.1f} MiB, grads "
          f"{out['grads']:.1f} MiB, AdamW state {out['optimizer']:.1f} MiB, sync {out['sync']:.2f} MiB, "
          f"step {step_s:.2f}s", flush=True)
    return out


def measure_critic(shape: str, lora_r: int) -> dict[str, float]:
    """One critic step (SAO, actor frozen): the critic's training state, full or LoRA."""
    config = tiny_qwen2_config(**SHAPES[shape], max_position_embeddings=256)
    critic = ValueModel.from_policy(init_tiny_model(config, seed=0))
    freeze_matching(critic, r"self_attn\.")  # SAO's critic: attention frozen
    if lora_r:
        apply_critic_lora(critic, r=lora_r, alpha=2.0 * lora_r, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    learner = Learner(critic, lr=1e-4)
    actor = Learner(init_tiny_model(config, seed=0), lr=1e-4)  # not trained here (critic warm-up step)
    cfg = AlgoConfig(**{**preset_defaults("sao"), "group_size": 4, "critic_updates": 1})
    t0 = time.perf_counter()
    train_step(batch(config.vocab_size), actor, learner, None, cfg, pad_id=0, micro_batch_tokens=4096,
               train_actor=False)
    step_s = time.perf_counter() - t0
    params = list(critic.parameters())
    state = [v for s in learner.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    out = {
        "weights": nbytes(params) / MIB,
        "grads": nbytes(p.grad for p in params if p.grad is not None) / MIB,
        "optimizer": nbytes(state) / MIB,
        "trainable": sum(p.numel() for p in params if p.requires_grad),
        "step_s": step_s,
    }
    out["training_state"] = out["weights"] + out["grads"] + out["optimizer"]
    name = f"LoRA r={lora_r}" if lora_r else "full (attention frozen)"
    print(f"{shape} critic {name}: {out['trainable'] / 1e6:.2f}M trainable, weights {out['weights']:.1f} MiB, grads "
          f"{out['grads']:.1f} MiB, AdamW state {out['optimizer']:.1f} MiB, step {step_s:.2f}s", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the tiny test shape")
    parser.add_argument("--r", type=int, default=16, help="LoRA rank")
    args = parser.parse_args()
    torch.manual_seed(0)
    shape = "tiny" if args.quick else "100m"
    full, lora = measure(shape, 0), measure(shape, args.r)
    critic_full, critic_lora = measure_critic(shape, 0), measure_critic(shape, args.r)
    print(f"{shape}: policy training state full {full['training_state']:.1f} MiB vs LoRA {lora['training_state']:.1f} "
          f"MiB (ratio {full['training_state'] / lora['training_state']:.2f}); critic full "
          f"{critic_full['training_state']:.1f} MiB vs LoRA {critic_lora['training_state']:.1f} MiB (ratio "
          f"{critic_full['training_state'] / critic_lora['training_state']:.2f}); sync full {full['sync']:.2f} MiB vs "
          f"LoRA {lora['sync']:.2f} MiB (ratio {full['sync'] / lora['sync']:.1f})")


if __name__ == "__main__":
    main()
