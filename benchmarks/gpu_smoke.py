"""GPU smoke test: a few SAO steps of a 0.5B-class Qwen2 model (random weights, built from a
config) on the torch engine, on one CUDA device; reports step time, tokens/s and trainer MFU.

Without a CUDA device it prints why it skipped and exits 0. The model has Qwen2.5-0.5B's shape
(hidden 896, 24 layers, 14 heads, 2 KV heads, MLP 4864, tied embeddings) except its vocabulary,
which is the embedded tiny tokenizer's (the KG environment's tokenizer, so episodes decode and
parse as in training): ~0.36B parameters without Qwen's 152k-token embedding. Training runs in
bf16 autocast over fp32 master weights (`train.autocast=bfloat16`); the engine samples in the
same fp32 weights. The run is tiderl's one training path (`recipe.train`) at staleness 0.

Trainer MFU = trainer FLOPs / (trainer seconds x peak bf16 FLOP/s), with trainer FLOPs per
trained token = 6 x actor parameters (one actor update) + 6 x critic parameters x critic
updates (attention FLOPs left out; sequences are a few hundred tokens). Peak: a table by device
name (H100/H200 989 TFLOP/s dense bf16, A100 312) or `--peak-tflops`.

    .venv/bin/python benchmarks/gpu_smoke.py                 # 4 steps of 64 episodes (1 warm-up)
    .venv/bin/python benchmarks/gpu_smoke.py --quick         # 2 steps of 16 episodes
    .venv/bin/python benchmarks/gpu_smoke.py --device cpu --shape tiny --quick   # the code path on CPU

Last line: seconds per step, trained tokens/s, generated tokens/s, trainer MFU, weight sync seconds.
`--staleness 2` runs it asynchronously (the pool decodes the next batches while the trainer steps;
generated tokens/s is then per second of the whole step, not of a decode phase).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

SHAPES = {
    "0.5b": dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864),
    "tiny": dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1),
}
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0, "L4": 121.0}


def peak_tflops(device: str, given: float) -> float | None:
    if given > 0:
        return given
    if not device.startswith("cuda"):
        return None
    name = torch.cuda.get_device_name(torch.device(device))
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 steps of 16 episodes")
    parser.add_argument("--device", default="cuda", help="torch device (default cuda)")
    parser.add_argument("--shape", default="0.5b", choices=tuple(SHAPES))
    parser.add_argument("--steps", type=int, default=0, help="measured steps (default 3, quick 1), after 1 warm-up")
    parser.add_argument("--batch", type=int, default=0, help="episodes per step (default 64, quick 16)")
    parser.add_argument("--staleness", type=int, default=0, help="system.max_staleness (default 0: synchronous)")
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="peak bf16 TFLOP/s of the device")
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_smoke: SKIPPED: no CUDA device here (torch.cuda.is_available() is False, torch "
              f"{torch.__version__}); nothing was measured. Run it on a GPU machine, or pass --device cpu "
              "--shape tiny to exercise the code path.")
        return 0

    from tiderl.config import load_config
    from tiderl.embedded.build import ensure_embedded_model
    from tiderl.embedded.tiny import init_tiny_model, tiny_qwen2_config
    from tiderl.envs.setup import load_setup
    from tiderl.models.loading import count_parameters, load_tokenizer, save_model_dir
    from tiderl.recipe import train
    from tiderl.run import build_run

    steps = args.steps or (1 if args.quick else 3)
    batch = args.batch or (16 if args.quick else 64)
    work = Path(tempfile.mkdtemp(prefix="tiderl-gpu-smoke-"))
    base = ["env.options.num_films=60", "env.options.num_people=60", "data.eval_size=16", "log.progress=false",
            "log.tensorboard=false", f"model.cache_dir={work / 'cache'}", "model.warmstart.num_traces=200",
            "model.warmstart.steps=1"]
    # The tokenizer (and chat template) of the embedded model, under a model of the chosen shape.
    tiny_cfg = load_config("configs/kg_sao_tiny.yaml", base + [f"run_dir={work / 'tiny'}"])
    tokenizer = load_tokenizer(ensure_embedded_model(tiny_cfg, load_setup(tiny_cfg)))
    config = tiny_qwen2_config(len(tokenizer), max_position_embeddings=1024, **SHAPES[args.shape])
    model_dir = save_model_dir(init_tiny_model(config, seed=0), tokenizer, work / "model")

    cfg = load_config("configs/kg_sao_tiny.yaml", base + [
        f"run_dir={work / 'run'}", f"model.path={model_dir}", f"model.device={args.device}",
        "train.autocast=bfloat16", f"rollout.batch_size={batch}", f"rollout.engine_batch_size={batch}",
        f"train.steps={steps + 1}", "algo.critic_warmup_steps=0", "train.micro_batch_tokens=16384",
        "algo.actor_lr=1e-6", "algo.critic_lr=5e-6", f"system.max_staleness={args.staleness}"])
    run = build_run(cfg)
    n_actor = count_parameters(run.actor.model)
    n_critic = count_parameters(run.critic.model) if run.critic is not None else 0
    flops_per_token = 6 * n_actor * cfg.algo.actor_updates + 6 * n_critic * cfg.algo.critic_updates
    rows: list[dict[str, float]] = []

    def observer(version: int, metrics: dict[str, float], trajectories) -> None:
        rows.append({"step_s": metrics["step_s"], "train_s": metrics["time/train_s"],
                     "sync_s": metrics.get("time/sync_s", float("nan")),
                     "tokens": float(sum(len(t.tokens) for t in trajectories)),
                     "generated": float(sum(t.num_action_tokens for t in trajectories))})

    t0 = time.monotonic()
    train(run, observer=observer)
    wall = time.monotonic() - t0
    measured = rows[1:]  # the first step warms up (allocator, kernels)
    step_s = statistics.mean(r["step_s"] for r in measured)
    train_s = statistics.mean(r["train_s"] for r in measured)
    tokens = statistics.mean(r["tokens"] for r in measured)
    generated = statistics.mean(r["generated"] for r in measured)
    sync_s = statistics.mean(r["sync_s"] for r in measured)
    # Synchronous: decoding is the step less training; asynchronous: it overlaps, so the whole step.
    decode_s = step_s if args.staleness else max(step_s - train_s, 1e-9)
    peak = peak_tflops(args.device, args.peak_tflops)
    mfu = flops_per_token * tokens / train_s / (peak * 1e12) if peak else float("nan")
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    memory = torch.cuda.max_memory_allocated() / 2**30 if args.device.startswith("cuda") else float("nan")
    print(f"gpu_smoke: {device_name}, {args.shape}: actor {n_actor / 1e6:.2f}M + critic {n_critic / 1e6:.2f}M "
          f"parameters, {batch} episodes/step, staleness {args.staleness}, {len(measured)} measured steps after 1 "
          f"warm-up ({wall:.0f}s in all); "
          f"peak GPU memory {memory:.1f} GiB; peak {peak or float('nan'):g} TFLOP/s")
    print(f"step {step_s:.2f}s (trainer {train_s:.2f}s), trained {tokens / step_s:.0f} tok/s "
          f"(trainer alone {tokens / train_s:.0f} tok/s), generated {generated / decode_s:.0f} tok/s, "
          f"trainer MFU {100 * mfu:.1f}%, weight sync {sync_s:.3f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
