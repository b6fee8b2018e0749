"""Activation checkpointing (`train.activation_checkpointing`) against keeping the activations:
peak resident memory and seconds of one SAO training step (actor and critic) of a real-size
model on the CPU.

Each mode runs in a fresh Python process: it loads the policy, builds the critic from it (as
`tiderl train` does), optionally puts LoRA adapters on both, then runs one `train_step` of the
SAO preset (actor trained, one critic update) on the same synthetic trajectories, while a thread
samples the process's resident memory every 5 ms. "Step growth" is the peak during the step
minus the resident memory just before it: activations, gradients, optimizer state and the
allocator's slack, the part that checkpointing changes. The first mode to run alternates with
`--repeats`.

    .venv/bin/python benchmarks/train_memory.py                 # Qwen2.5-Coder-0.5B (fetched), bf16 + LoRA r=16
    .venv/bin/python benchmarks/train_memory.py --quick         # the tiny test shape, a smoke test
    .venv/bin/python benchmarks/train_memory.py --model DIR --dtype float32 --lora 0   # full fine-tuning

Defaults: the model `tiderl models fetch qwen2.5-coder-0.5b-instruct` puts in the cache (or a
Qwen2.5-0.5B-shaped model with random weights when it is absent), 4 trajectories of 1,280 tokens
(1,000 prompt + 280 generated, an AgentBench DB episode's size), `train.micro_batch_tokens` 2,560.

Last line: peak step growth without and with checkpointing, seconds per step, and the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GB = 1e9
DEFAULT_MODEL = Path(os.environ.get("TIDERL_CACHE", "~/.cache/tiderl")).expanduser() / "models" / "qwen2.5-coder-0.5b-instruct"
SHAPES = {  # used when no model directory is given or found
    "0.5b": dict(vocab_size=151936, hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2,
                 intermediate_size=4864),
    "tiny": dict(vocab_size=512, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1),
}


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def one_mode(args: argparse.Namespace) -> dict:
    """Run in the child process: one measured SAO step with or without checkpointing."""
    import torch

    from tiderl.config import AlgoConfig, preset_defaults
    from tiderl.embedded.tiny import init_tiny_model, tiny_qwen2_config
    from tiderl.train.critic import ValueModel
    from tiderl.train.learner import Learner
    from tiderl.train.memory import enable_activation_checkpointing
    from tiderl.train.step import train_step
    from tiderl.types import NO_VERSION, Trajectory

    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    if args.model:
        from tiderl.models.loading import load_model

        policy = load_model(args.model, dtype=args.dtype)
    else:
        policy = init_tiny_model(tiny_qwen2_config(**SHAPES[args.shape], max_position_embeddings=4096), seed=0)
        policy = policy.to(dtype)
    critic = ValueModel.from_policy(policy)
    if args.lora:
        from tiderl.train.lora import apply_critic_lora, apply_lora

        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        policy = apply_lora(policy, args.lora, 2.0 * args.lora, targets)
        apply_critic_lora(critic, args.lora, 2.0 * args.lora, targets)
    if args.checkpointing:
        enable_activation_checkpointing(policy)
        enable_activation_checkpointing(critic)
    vocab = policy.config.vocab_size
    g = torch.Generator().manual_seed(0)
    batch = []
    for i in range(args.batch):
        mask = [0] * args.prompt + [1] * args.generated
        batch.append(Trajectory(tokens=torch.randint(3, vocab, (len(mask),), generator=g).tolist(), loss_mask=mask,
                                behavior_logprobs=[-1.0 if m else 0.0 for m in mask],
                                policy_version=[0 if m else NO_VERSION for m in mask], reward=float(i % 2),
                                task_id=f"t{i}"))
    cfg = AlgoConfig(**{**preset_defaults("sao"), "critic_updates": 1})
    actor, critic_learner = Learner(policy, lr=1e-5), Learner(critic, lr=1e-5)
    before = rss()
    peak = [before]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.005)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    t0 = time.perf_counter()
    metrics = train_step(batch, actor, critic_learner, None, cfg, pad_id=0,
                         micro_batch_tokens=args.micro_batch_tokens, train_actor=True)
    seconds = time.perf_counter() - t0
    stop.set()
    thread.join()
    return {"checkpointing": args.checkpointing, "before_gb": before / GB, "peak_gb": peak[0] / GB,
            "growth_gb": (peak[0] - before) / GB, "step_s": seconds,
            "micro_batches": metrics.get("micro_batches", float("nan"))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the tiny shape, 2 short trajectories (a smoke test)")
    parser.add_argument("--model", default=None, help="HF model dir (default: the fetched Qwen2.5-Coder-0.5B)")
    parser.add_argument("--shape", default="0.5b", choices=tuple(SHAPES), help="random-weight shape without a model")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--lora", type=int, default=16, help="LoRA rank on policy and critic (0 = full fine-tuning)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=1000)
    parser.add_argument("--generated", type=int, default=280)
    parser.add_argument("--micro-batch-tokens", type=int, default=2560)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(one_mode(args)))
        return 0
    if args.quick:
        args.shape, args.model, args.dtype, args.batch, args.prompt, args.generated = "tiny", None, "float32", 2, 40, 24
        args.micro_batch_tokens = 128
    elif args.model is None and (DEFAULT_MODEL / "config.json").is_file():
        args.model = str(DEFAULT_MODEL)
    what = args.model or f"random {args.shape}"
    print(f"train_memory: {what}, {args.dtype}, LoRA r={args.lora or 'off'}, {args.batch} x "
          f"({args.prompt}+{args.generated}) tokens, micro_batch_tokens {args.micro_batch_tokens}", flush=True)
    results: dict[bool, list[dict]] = {False: [], True: []}
    for rep in range(args.repeats):
        for checkpointing in ((False, True) if rep % 2 == 0 else (True, False)):
            cmd = [sys.executable, __file__, "--child", "--dtype", args.dtype, "--lora", str(args.lora),
                   "--shape", args.shape, "--batch", str(args.batch), "--prompt", str(args.prompt),
                   "--generated", str(args.generated), "--micro-batch-tokens", str(args.micro_batch_tokens)]
            cmd += ["--model", args.model] if args.model else []
            cmd += ["--checkpointing"] if checkpointing else []
            out = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if out.returncode != 0:
                print(out.stderr[-3000:], file=sys.stderr)
                return out.returncode
            r = json.loads(out.stdout.strip().splitlines()[-1])
            results[checkpointing].append(r)
            print(f"  {'checkpointing' if checkpointing else 'keep activations'}: before the step "
                  f"{r['before_gb']:.2f} GB, peak {r['peak_gb']:.2f} GB, step growth {r['growth_gb']:.2f} GB, "
                  f"{r['step_s']:.1f} s", flush=True)

    def med(key: str, on: bool) -> float:
        return statistics.median(r[key] for r in results[on])

    keep, ckpt = med("growth_gb", False), med("growth_gb", True)
    keep_s, ckpt_s = med("step_s", False), med("step_s", True)
    print(f"step growth keep {keep:.2f} GB vs checkpointing {ckpt:.2f} GB (ratio {keep / max(ckpt, 1e-9):.2f}x less); "
          f"step {keep_s:.1f} s vs {ckpt_s:.1f} s (ratio {ckpt_s / keep_s:.2f}x the time); "
          f"peak {med('peak_gb', False):.2f} vs {med('peak_gb', True):.2f} GB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
