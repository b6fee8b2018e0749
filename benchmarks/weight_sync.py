"""Seconds per weight sync from data-parallel trainer ranks to a rollout engine, against model size.

Two FSDP2 ranks (`tiderl.system.ray_trainer.TrainerRank`, gloo on CPU, Ray actors) hold a Qwen2
model built from a config with random weights; one Ray actor holds a `TorchEngine`. One sync:

- `direct` (what `train.parallel` does): rank 0 gathers the full weights, checksums them and puts
  them in the object store; the engine actor loads them from there and returns its checksum;
- `via_driver` (the baseline: a trainer that hands weights over in the driver, as the Ray backend
  does without `train.parallel`): the same gather, then the driver fetches the weights, puts them
  in the object store again, and the engine loads them.

Both are verified (the engine's checksum must equal rank 0's). Sizes: `tiny` (the test model's
shape) and `100m` (hidden 768, 12 layers, vocab 32000: ~0.1B parameters). With `--lora R` the
policy carries LoRA adapters of rank R on the attention projections: the ranks publish the
adapters alone and the engine is a `LoraTorchEngine` (docs/scale.md, "LoRA on data-parallel ranks").

    .venv/bin/python benchmarks/weight_sync.py            # tiny and 100m, 3 repeats
    .venv/bin/python benchmarks/weight_sync.py --quick    # tiny only, 1 repeat
    .venv/bin/python benchmarks/weight_sync.py --lora 16  # the same with a LoRA policy

Last line: seconds per sync for each size and path, and via_driver / direct.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray  # noqa: E402
import torch  # noqa: E402

from tiderl.config import RunConfig, TrainConfig  # noqa: E402
from tiderl.embedded.tiny import init_tiny_model, tiny_qwen2_config, train_tokenizer  # noqa: E402
from tiderl.rollout import make_engine  # noqa: E402
from tiderl.system.ray_trainer import RankBundle, TrainerRank  # noqa: E402
from tiderl.train.lora import apply_lora, policy_state  # noqa: E402

SIZES = {
    "tiny": dict(vocab_size=512, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1),
    "100m": dict(vocab_size=32000, hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=4,
                 intermediate_size=2048),
}


class EngineHost:
    """A rollout engine in its own process."""

    def __init__(self, model: torch.nn.Module):
        tokenizer = train_tokenizer(["a b c"], vocab_size=300)
        self.engine = make_engine(RunConfig(), model, tokenizer, seed=0)  # a LoraTorchEngine for a LoRA policy

    def load(self, state: dict, version: int) -> float:
        self.engine.update_weights(state, version)
        return self.engine.state_checksum()


def measure(size: str, repeats: int, lora: int = 0) -> dict[str, float]:
    model = init_tiny_model(tiny_qwen2_config(**SIZES[size], max_position_embeddings=256), seed=0)
    params = sum(p.numel() for p in model.parameters())
    if lora:
        model = apply_lora(model, lora, 16.0, ["q_proj", "k_proj", "v_proj", "o_proj"])
    sent_mib = sum(v.numel() * v.element_size() for v in policy_state(model).values()) / 2**20
    cfg = RunConfig(train=TrainConfig(parallel="fsdp2", world_size=2))
    bundle = ray.put(RankBundle(cfg, model, None, None, 0))
    ranks = [ray.remote(TrainerRank).options(num_cpus=0).remote(r, 2, bundle) for r in range(2)]
    init = ray.get(ranks[0].endpoint.remote(), timeout=300)
    ray.get([r.join.remote(init) for r in ranks], timeout=600)
    engine = ray.remote(EngineHost).options(num_cpus=0).remote(model)
    del model
    times: dict[str, list[float]] = {"direct": [], "via_driver": [], "gather": [], "load": []}
    version = 0
    for rep in range(repeats + 1):  # the first round warms up (first gather, first load) and is not counted
        for path in ("direct", "via_driver"):
            version += 1
            t0 = time.perf_counter()
            (ref,), sent = ray.get([r.publish.remote(version) for r in ranks], timeout=600)[0]
            t1 = time.perf_counter()
            if path == "via_driver":
                ref = ray.put(ray.get(ref, timeout=600))
            t2 = time.perf_counter()
            held = ray.get(engine.load.remote(ref, version), timeout=600)
            if rep > 0:
                times[path].append(time.perf_counter() - t0)
                times["gather"].append(t1 - t0)
                if path == "direct":
                    times["load"].append(time.perf_counter() - t2)
            if held != sent:
                raise RuntimeError(f"{size} {path}: the engine holds checksum {held}, rank 0 sent {sent}")
    for actor in (*ranks, engine):
        ray.kill(actor)
    out = {k: statistics.median(v) for k, v in times.items()}
    print(f"{size}{f' LoRA r={lora}' if lora else ''}: {params / 1e6:.1f}M parameters ({params * 4 / 2**20:.0f} MiB "
          f"fp32), {sent_mib:.2f} MiB per sync: "
          f"direct {out['direct']:.3f}s (gather, checksum and put on rank 0 {out['gather']:.3f}s, engine "
          f"load and checksum {out['load']:.3f}s), via driver {out['via_driver']:.3f}s per sync (median of {repeats})", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model only, 1 repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lora", type=int, default=0, help="LoRA rank of the policy (0 = full weights)")
    args = parser.parse_args()
    sizes, repeats = (["tiny"], 1) if args.quick else (["tiny", "100m"], args.repeats)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        results = {size: measure(size, repeats, args.lora) for size in sizes}
    finally:
        ray.shutdown()
    print("; ".join(f"{s}: direct {r['direct']:.3f}s, via_driver {r['via_driver']:.3f}s, "
                    f"ratio {r['via_driver'] / r['direct']:.2f}" for s, r in results.items()))


if __name__ == "__main__":
    main()
