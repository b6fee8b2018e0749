"""Does `torch.compile` pay on this hardware? The decode step and the training step, eager against
compiled, with the compile time counted.

tiderl runs eager PyTorch. Before adding a compiled path this benchmark measures what one would
buy, on the two shapes of `benchmarks/vs_trl.py` (`h128`, `h256`: Qwen2, vocab 512, random
weights; the arithmetic does not depend on the values):

- **decode**: one decode step of `B` rows against a KV cache of `W` columns, written as tiderl's
  fast decode step computes it (RMSNorm, fused q/k/v product, rotary, grouped-query SDPA, fused
  gate/up product, SiLU, residuals, final norm, output head). The compiled variant is
  `torch.compile(step, dynamic=True)` over the same function; the batch and cache width change
  every call (as in a real decode loop), so a compile that specialised on shapes would recompile.
- **train**: the forward and backward of a padded batch through the Hugging Face model (token
  log-probs of the sampled tokens, their mean as the loss), eager against
  `torch.compile(model, dynamic=True)`; several batch shapes, as packed micro-batches vary.

For each: the first compiled call's time (compile included), then median milliseconds per call of
both variants, alternated call by call so both see the same load; and the break-even: how many
calls the compile time needs to be paid back (infinite when compiled is not faster).

    python benchmarks/compile.py            # h128 and h256, 200 decode calls, 30 train calls
    python benchmarks/compile.py --quick    # h128, decode only, 50 calls

Last line: compiled/eager speed ratio and break-even calls for each part and size. A ratio above
1.0 only pays when a run makes more calls than the break-even (a 30-step vs_trl run makes about
1,000 decode steps and 30 train steps).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch.nn import functional as F

from benchmarks.vs_trl import SIZES, VOCAB
from tiderl.embedded.tiny import init_tiny_model, tiny_qwen2_config


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def make_decode_weights(size: str, seed: int = 0) -> dict:
    s = SIZES[size]
    g = torch.Generator().manual_seed(seed)
    h, heads, kv, f = s["hidden_size"], s["num_heads"], s["num_kv_heads"], s["intermediate_size"]
    d = h // heads

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.05

    layers = [{"ln1": torch.ones(h), "qkv": w((heads + 2 * kv) * d, h), "qkv_b": w((heads + 2 * kv) * d),
               "o": w(h, heads * d), "ln2": torch.ones(h), "gate_up": w(2 * f, h), "down": w(h, f)}
              for _ in range(s["num_layers"])]
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.arange(512).float()[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), -1)
    return {"embed": w(VOCAB, h), "layers": layers, "norm": torch.ones(h), "cos": emb.cos(), "sin": emb.sin(),
            "heads": heads, "kv": kv, "d": d}


def decode_step(tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, keys: list[torch.Tensor],
                values: list[torch.Tensor], wts: dict) -> torch.Tensor:
    """One new token per row against caches `keys[i]`/`values[i]` ([B, kv, W, d]); the new
    key/value column is concatenated (functional, so that the compiled graph has no mutation)."""
    b = tokens.shape[0]
    heads, kv, d = wts["heads"], wts["kv"], wts["d"]
    h = F.embedding(tokens[:, None], wts["embed"])
    cos = wts["cos"][positions][:, None, None, :]
    sin = wts["sin"][positions][:, None, None, :]
    half = d // 2
    for i, lw in enumerate(wts["layers"]):
        x = _rms(h, lw["ln1"])
        qkv = F.linear(x, lw["qkv"], lw["qkv_b"])
        q = qkv[..., : heads * d].view(b, 1, heads, d).transpose(1, 2)
        k = qkv[..., heads * d: (heads + kv) * d].view(b, 1, kv, d).transpose(1, 2)
        v = qkv[..., (heads + kv) * d:].view(b, 1, kv, d).transpose(1, 2)
        q = q * cos + torch.cat((-q[..., half:], q[..., :half]), -1) * sin
        k = k * cos + torch.cat((-k[..., half:], k[..., :half]), -1) * sin
        all_k = torch.cat([keys[i], k], 2)
        all_v = torch.cat([values[i], v], 2)
        q = q.reshape(b, kv, heads // kv, d)
        out = F.scaled_dot_product_attention(q, all_k, all_v, attn_mask=mask)
        h = h + F.linear(out.reshape(b, 1, heads * d), lw["o"])
        x = _rms(h, lw["ln2"])
        gate, up = F.linear(x, lw["gate_up"]).chunk(2, -1)
        h = h + F.linear(F.silu(gate) * up, lw["down"])
    return F.linear(_rms(h, wts["norm"])[:, 0], wts["embed"])


def decode_inputs(wts: dict, b: int, width: int, g: torch.Generator) -> tuple:
    tokens = torch.randint(0, VOCAB, (b,), generator=g)
    positions = torch.full((b,), width)
    mask = torch.zeros(b, 1, 1, width + 1)
    keys = [torch.randn(b, wts["kv"], width, wts["d"], generator=g) for _ in wts["layers"]]
    values = [torch.randn(b, wts["kv"], width, wts["d"], generator=g) for _ in wts["layers"]]
    return tokens, positions, mask, keys, values


def bench_decode(size: str, calls: int) -> dict:
    wts = make_decode_weights(size)
    g = torch.Generator().manual_seed(1)
    compiled = torch.compile(decode_step, dynamic=True)
    shapes = [(16 - (i % 8), 40 + (i % 32)) for i in range(calls)]  # rows leave, the cache grows
    with torch.inference_mode():
        t0 = time.perf_counter()
        ref = decode_step(*decode_inputs(wts, 16, 40, torch.Generator().manual_seed(2)), wts)
        got = compiled(*decode_inputs(wts, 16, 40, torch.Generator().manual_seed(2)), wts)
        first = time.perf_counter() - t0
        err = (ref - got).abs().max().item()
        for b, w in shapes[:8]:  # the remaining compiles (dynamic shapes settle in a few calls)
            t = time.perf_counter()
            compiled(*decode_inputs(wts, b, w, g), wts)
            first += time.perf_counter() - t
        eager_ms, comp_ms = [], []
        for i, (b, w) in enumerate(shapes):
            args = decode_inputs(wts, b, w, g)
            for fn, out in ((decode_step, eager_ms), (compiled, comp_ms))[:: 1 if i % 2 == 0 else -1]:
                t = time.perf_counter()
                fn(*args, wts)
                out.append((time.perf_counter() - t) * 1e3)
    return _summary("decode", size, first, eager_ms, comp_ms, err)


def bench_train(size: str, calls: int) -> dict:
    s = SIZES[size]
    config = tiny_qwen2_config(VOCAB, s["hidden_size"], s["num_layers"], s["num_heads"], s["num_kv_heads"],
                               intermediate_size=s["intermediate_size"], max_position_embeddings=256)
    model = init_tiny_model(config, 0)
    compiled = torch.compile(model, dynamic=True)
    g = torch.Generator().manual_seed(3)
    shapes = [(16, 48 + 8 * (i % 4)) for i in range(calls)]

    def loss_of(fn, ids: torch.Tensor) -> torch.Tensor:
        logits = fn(input_ids=ids).logits[:, :-1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
        return -lp.mean()

    def step(fn, ids: torch.Tensor) -> float:
        model.zero_grad(set_to_none=True)
        loss = loss_of(fn, ids)
        loss.backward()
        return loss.item()

    ids = torch.randint(0, VOCAB, (16, 48), generator=g)
    t0 = time.perf_counter()
    step(compiled, ids)
    for b, n in shapes[1:4]:
        step(compiled, torch.randint(0, VOCAB, (b, n), generator=g))
    first = time.perf_counter() - t0
    err = abs(step(model, ids) - step(compiled, ids))
    eager_ms, comp_ms = [], []
    for i, (b, n) in enumerate(shapes):
        ids = torch.randint(0, VOCAB, (b, n), generator=g)
        for fn, out in ((model, eager_ms), (compiled, comp_ms))[:: 1 if i % 2 == 0 else -1]:
            t = time.perf_counter()
            step(fn, ids)
            out.append((time.perf_counter() - t) * 1e3)
    return _summary("train", size, first, eager_ms, comp_ms, err)


def _summary(part: str, size: str, first_s: float, eager_ms: list[float], comp_ms: list[float], err: float) -> dict:
    e, c = statistics.median(eager_ms), statistics.median(comp_ms)
    gain_ms = e - c
    breakeven = first_s * 1e3 / gain_ms if gain_ms > 0 else float("inf")
    row = {"part": part, "size": size, "compile_s": first_s, "eager_ms": e, "compiled_ms": c,
           "eager_spread": (min(eager_ms), max(eager_ms)), "compiled_spread": (min(comp_ms), max(comp_ms)),
           "ratio": e / c, "breakeven_calls": breakeven, "max_abs_diff": err, "load": os.getloadavg()[0]}
    print(f"| {part} | {size} | {first_s:.1f} | {e:.3f} ({min(eager_ms):.3f}-{max(eager_ms):.3f}) "
          f"| {c:.3f} ({min(comp_ms):.3f}-{max(comp_ms):.3f}) | {e / c:.2f}x | "
          f"{_calls(breakeven)} | {err:.1e} | {row['load']:.2f} |",
          flush=True)
    return row


def _calls(n: float) -> str:
    return "never" if n == float("inf") else f"{n:.0f} calls"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sizes", default="h128,h256")
    parser.add_argument("--decode-calls", type=int, default=200)
    parser.add_argument("--train-calls", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1, as vs_trl)")
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.decode_calls, args.train_calls = "h128", 50, 0
    torch.set_num_threads(args.threads)
    # A fresh compile cache, so that "compile s" is what a first run pays (inductor reuses kernels
    # from earlier runs through its on-disk cache, which would hide most of the compile time).
    cache = tempfile.mkdtemp(prefix="tiderl-compile-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    print(f"torch {torch.__version__}, {args.threads} thread(s), fresh compile cache {cache}")
    print("| part | size | compile s (first calls) | eager ms median (min-max) | compiled ms median (min-max) "
          "| eager/compiled | break-even calls | max abs diff | load |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    rows = []
    for size in args.sizes.split(","):
        torch._dynamo.reset()
        rows.append(bench_decode(size, args.decode_calls))
        if args.train_calls:
            torch._dynamo.reset()
            rows.append(bench_train(size, args.train_calls))
    parts = [f"{r['part']} {r['size']} {r['ratio']:.2f}x (break-even {_calls(r['breakeven_calls'])})" for r in rows]
    print("\ncompiled/eager speed: " + "; ".join(parts))


if __name__ == "__main__":
    main()
