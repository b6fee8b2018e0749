"""How many copies of a LoRA run's base weights the trainer's process holds: the policy, a LoRA
critic and the HTTP engine's probe reference, built by the calls `build_run` and the HTTP engine
make, with the base copied into each (`copies`, the baseline: what every run did before) and
shared with the policy (`shared`, what a run with `model.lora.r > 0` and `train.parallel=none` does
now: docs/scale.md, "One copy of the base weights").

The model is a Qwen2 built from a config with random weights (memory does not depend on the
values), by default Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads, 2 KV heads, MLP 4864,
vocabulary 151,936, tied embeddings) in float32, LoRA r = 16 on every linear layer of policy and
critic. Each mode runs in a process of its own, so its resident memory is its own.

Printed per mode: the bytes of the distinct weight storages the three models hold (exact) and the
process's resident memory after building them (`VmRSS`) beside that of the policy alone. Last
line: both modes and the ratio copies / shared.

    .venv/bin/python benchmarks/lora_base_copies.py            # the 0.5B shape, about 1 minute, 7 GiB
    .venv/bin/python benchmarks/lora_base_copies.py --quick    # a tiny shape (the smoke test)
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {
    "0.5b": dict(vocab_size=151936, hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2,
                 intermediate_size=4864),
    "tiny": dict(vocab_size=512, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1),
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GIB = 2**30


def resident_gib() -> float:
    status = Path("/proc/self/status").read_text().splitlines()
    return int(next(line for line in status if line.startswith("VmRSS")).split()[1]) * 1024 / GIB


def measure(shape: str, shared: bool) -> dict[str, float]:
    """Build policy, LoRA critic and HTTP probe reference in this process; their held bytes and RSS."""
    from tiderl.embedded.tiny import init_tiny_model, tiny_qwen2_config
    from tiderl.rollout.lora import unmerged_plain
    from tiderl.train.critic import ValueModel
    from tiderl.train.lora import apply_critic_lora, apply_lora

    policy = init_tiny_model(tiny_qwen2_config(**SHAPES[shape]), seed=0)
    gc.collect()
    alone = resident_gib()
    critic = apply_critic_lora(ValueModel.from_policy(policy, share_weights=shared), 16, 32.0, TARGETS)
    policy = apply_lora(policy, 16, 32.0, TARGETS)
    reference, _, _ = unmerged_plain(policy, share_frozen=shared)
    gc.collect()
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                for model in (policy, critic, reference) for p in model.parameters()}
    return {"held_gib": sum(storages.values()) / GIB, "rss_gib": resident_gib(), "policy_rss_gib": alone}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="0.5b", choices=tuple(SHAPES))
    parser.add_argument("--quick", action="store_true", help="the tiny shape")
    parser.add_argument("--mode", choices=("copies", "shared"), help=argparse.SUPPRESS)  # one mode, this process
    args = parser.parse_args()
    shape = "tiny" if args.quick else args.shape
    if args.mode:
        print(json.dumps(measure(shape, args.mode == "shared")))
        return 0
    figures = {}
    for mode in ("copies", "shared"):
        out = subprocess.run([sys.executable, __file__, "--shape", shape, "--mode", mode], check=True,
                             capture_output=True, text=True).stdout
        figures[mode] = json.loads(out.strip().splitlines()[-1])
        f = figures[mode]
        print(f"{mode:>6}: weights held {f['held_gib']:.3f} GiB; resident {f['rss_gib']:.2f} GiB "
              f"(the policy alone {f['policy_rss_gib']:.2f} GiB)")
    c, s = figures["copies"], figures["shared"]
    print(f"{shape}: policy + LoRA critic + HTTP probe reference hold {c['held_gib']:.3f} GiB of weights with copies "
          f"vs {s['held_gib']:.3f} GiB shared (ratio {c['held_gib'] / s['held_gib']:.2f}); resident "
          f"{c['rss_gib']:.2f} vs {s['rss_gib']:.2f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
