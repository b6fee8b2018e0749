"""Checkpoint save and load: one process (`save_checkpoint`: Hugging Face dirs + torch.save of
the AdamW states) against 2 gloo ranks writing a sharded checkpoint (`save_sharded`, DCP) under
FSDP2 and under DDP; seconds to save and to load, and bytes on disk.

The state is what a SAO run checkpoints: a Qwen2 actor and its critic (attention frozen), each
with AdamW state after one optimizer step, random weights. Repeats interleave the three so that
all see the same machine load; each figure is the median over repeats. The ranks' times are
rank 0's wall time between barriers (the save or load is done when the slowest rank is).

    .venv/bin/python benchmarks/checkpoint_sharded.py            # ~40M-parameter Qwen2 (x2: actor, critic)
    .venv/bin/python benchmarks/checkpoint_sharded.py --quick    # the tiny test shape

Last line: save / load seconds and MiB on disk for each, and the ratios single / sharded.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from tiderl.embedded.tiny import init_tiny_model, tiny_qwen2_config, train_tokenizer  # noqa: E402
from tiderl.lab.ranks import spawn_ranks  # noqa: E402
from tiderl.train.checkpoint import load_checkpoint, load_sharded, save_checkpoint, save_sharded  # noqa: E402
from tiderl.train.critic import ValueModel, freeze_matching  # noqa: E402
from tiderl.train.learner import Learner  # noqa: E402

SHAPES = {
    "tiny": {"vocab_size": 512, "hidden_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1},
    "40m": {"vocab_size": 32000, "hidden_size": 512, "num_layers": 8, "num_heads": 8, "num_kv_heads": 4,
            "intermediate_size": 1408},
}
MIB = 2**20


def learners(shape: str, make=Learner) -> tuple[Learner, Learner]:
    """Actor and critic with AdamW state (one step on the gradients of a random batch)."""
    config = tiny_qwen2_config(**SHAPES[shape], max_position_embeddings=256)
    critic_model = ValueModel.from_policy(init_tiny_model(config, seed=0))
    freeze_matching(critic_model, r"self_attn\.")
    actor, critic = make(init_tiny_model(config, seed=0), 1e-4), make(critic_model, 1e-4)
    ids = torch.randint(3, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    actor.model(input_ids=ids).logits.float().mean().backward()
    critic.model(ids, torch.ones_like(ids)).mean().backward()
    for learner in (actor, critic):
        learner.optimizer.step()
    return actor, critic


def dir_mib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / MIB


def single(shape: str, root: Path) -> dict[str, float]:
    actor, critic = learners(shape)
    tokenizer = train_tokenizer(["a tiny corpus for the tokenizer"] * 3, vocab_size=300)
    t0 = time.perf_counter()
    path = save_checkpoint(root / "single", 1, actor, critic, tokenizer)
    save_s = time.perf_counter() - t0
    fresh_actor, fresh_critic = learners(shape)
    t0 = time.perf_counter()
    load_checkpoint(path, fresh_actor, fresh_critic)
    load_s = time.perf_counter() - t0
    return {"save_s": save_s, "load_s": load_s, "mib": dir_mib(path)}


def rank_main(rank: int, world_size: int, shape: str, mode: str, out: str) -> None:
    import torch.distributed as dist

    from tiderl.train.parallel import ParallelLearner

    def make(model, lr):
        return ParallelLearner(model, mode, lr=lr)

    actor, critic = learners(shape, make)
    dist.barrier()
    t0 = time.perf_counter()
    save_sharded(f"{out}/{mode}", actor, critic)
    dist.barrier()
    save_s = time.perf_counter() - t0
    fresh_actor, fresh_critic = learners(shape, make)
    dist.barrier()
    t0 = time.perf_counter()
    load_sharded(f"{out}/{mode}", fresh_actor, fresh_critic)
    dist.barrier()
    load_s = time.perf_counter() - t0
    if rank == 0:
        Path(f"{out}/{mode}.json").write_text(json.dumps({"save_s": save_s, "load_s": load_s,
                                                          "mib": dir_mib(Path(f"{out}/{mode}"))}))


def sharded(shape: str, mode: str, root: Path) -> dict[str, float]:
    spawn_ranks(rank_main, 2, shape, mode, str(root), timeout_s=1200)
    return json.loads((root / f"{mode}.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the tiny test shape, one repeat")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    shape = "tiny" if args.quick else "40m"
    repeats = 1 if args.quick else args.repeats
    with open("/proc/loadavg") as f:
        print(f"load before: {f.read().strip()}", flush=True)
    runs: dict[str, list[dict[str, float]]] = {"single": [], "fsdp2": [], "ddp": []}
    for r in range(repeats):
        for name, results in runs.items():
            with tempfile.TemporaryDirectory() as tmp:
                got = single(shape, Path(tmp)) if name == "single" else sharded(shape, name, Path(tmp))
            results.append(got)
            print(f"repeat {r + 1} {name}: save {got['save_s']:.2f}s, load {got['load_s']:.2f}s, "
                  f"{got['mib']:.1f} MiB", flush=True)
    with open("/proc/loadavg") as f:
        print(f"load after: {f.read().strip()}", flush=True)
    med = {name: {k: statistics.median(x[k] for x in xs) for k in xs[0]} for name, xs in runs.items()}
    s = med["single"]
    print(f"{shape}: single save {s['save_s']:.2f}s load {s['load_s']:.2f}s {s['mib']:.1f} MiB; " + "; ".join(
        f"{m} x2 save {med[m]['save_s']:.2f}s load {med[m]['load_s']:.2f}s {med[m]['mib']:.1f} MiB (save ratio "
        f"{s['save_s'] / med[m]['save_s']:.2f}, load ratio {s['load_s'] / med[m]['load_s']:.2f})"
        for m in ("fsdp2", "ddp")))


if __name__ == "__main__":
    main()
