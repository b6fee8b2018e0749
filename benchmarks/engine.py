"""Generation tokens per second on mixed-length multi-turn agent episodes: tiderl's engine against
Hugging Face `generate` on the same model, the same episodes and the same stop points.

Each episode is scripted from a seed: a prompt (system prompt, tools and question: 120-320 tokens),
then 3-5 turns, each a sampled completion of its own length (8-64 tokens: the turn's stop point)
followed by an observation of 10-200 tokens and the next assistant header. Every engine samples
(temperature 1, full distribution) exactly the scripted number of tokens per turn, so all do the
same work and only the time differs. Three ways to run the episodes:

- `hf`: what an RL loop built on `transformers` does: each turn, the conversations of every
  episode still running are left-padded into one batch and `model.generate` decodes until the
  batch's longest turn (rows whose turn is shorter are cut afterwards: generate decodes a row
  until the whole batch stops), re-encoding every conversation from scratch.
- `engine-before`: tiderl's engine as it was: episodes as coroutines behind the `BatchingEngine`,
  request-level batching (a batch decodes until its last row finishes; requests that arrive
  meanwhile wait for the next batch) and no prefix reuse (every turn re-encodes the whole
  conversation).
- `engine`: the same episodes through the same client with token-level continuous batching
  (a finished turn frees its slot at once, the episode's next turn joins the running batch) and
  prefix reuse (each turn encodes only the observation and the header).

Models, both Qwen2 built from a config with random weights: `tiny` (the embedded model's shape:
hidden 128, 2 layers, vocab 1024) and, unless `--quick`, `medium` (hidden 512, 8 layers,
8 heads, 2 KV heads, vocab 8192). Repeats are interleaved (the order rotates every repeat) to
cancel drift on a shared machine; the load average is printed before each run.

    .venv/bin/python benchmarks/engine.py            # 16 episodes, 3 repeats, tiny and medium
    .venv/bin/python benchmarks/engine.py --quick    # 4 episodes, 1 repeat, tiny (a smoke test)
    python benchmarks/engine.py --device cuda --models medium,0.5b --episodes 64   # on a GPU

Weight sync: the seconds to hand a model's weights to the engine and check them, with the former
check (a float64 sum of every element and its square, on both sides) against the fingerprint
(`weights_checksum`: a few elements per tensor), on a ~100M-parameter Qwen2 (hidden 768,
12 layers, vocab 32000; `--quick`: the tiny model).

Last line: engine / hf tokens per second for each model, engine / engine-before, and the weight
sync seconds before -> after.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from tiderl.aio import thread_budget  # noqa: E402
from tiderl.rollout.base import SamplingParams  # noqa: E402
from tiderl.rollout.client import BatchingEngine  # noqa: E402
from tiderl.rollout.torch_engine import TorchEngine  # noqa: E402
from tiderl.rollout.weights import weights_checksum  # noqa: E402

MODELS = {
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=512, vocab_size=1024),
    "medium": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                   intermediate_size=2048, vocab_size=8192),
    "100m": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                 intermediate_size=2048, vocab_size=32000),
    # Qwen2.5-0.5B's shape and vocabulary (random weights): for a GPU (--device cuda).
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936),
}
PAD_ID = 0


@dataclass
class Script:
    """One episode: its prompt, and per turn the sampled length and the observation after it."""

    prompt: list[int]
    turn_tokens: list[int]
    observations: list[list[int]]


def make_scripts(n: int, seed: int, vocab: int, quick: bool) -> list[Script]:
    rng = random.Random(seed)
    token = lambda: rng.randrange(3, vocab)  # noqa: E731 - ids 0-2 are special
    scripts = []
    for _ in range(n):
        turns = rng.randint(2, 3) if quick else rng.randint(3, 5)
        scripts.append(Script(
            prompt=[token() for _ in range(rng.randint(120, 320))],
            turn_tokens=[rng.randint(8, 64) for _ in range(turns)],
            observations=[[token() for _ in range(rng.randint(10, 200))] for _ in range(turns - 1)],
        ))
    return scripts


def build_model(name: str, device: str = "cpu") -> Qwen2ForCausalLM:
    config = Qwen2Config(**MODELS[name], max_position_embeddings=4096, pad_token_id=PAD_ID, eos_token_id=2,
                         bos_token_id=1, tie_word_embeddings=True)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).to(device).eval().requires_grad_(False)


class _Tokenizer:
    """What TorchEngine needs of a tokenizer: a pad id and a decoder (stop strings are not used)."""

    pad_token_id = PAD_ID

    def decode(self, ids, **_):
        return " ".join(map(str, ids))


class RequestLevel:
    """An Engine that hides TorchEngine's continuous interface and sessions: the client then
    batches by request, as it did before token-level batching."""

    def __init__(self, engine: TorchEngine):
        self.engine = engine

    @property
    def version(self) -> int:
        return self.engine.version

    def generate(self, prompts, params):
        return self.engine.generate(prompts, params)


def run_hf(model, scripts: list[Script]) -> int:
    """Lock-step turns through `model.generate`; returns the tokens sampled (as scripted)."""
    conversations = [list(s.prompt) for s in scripts]
    sampled = 0
    for turn in range(max(len(s.turn_tokens) for s in scripts)):
        active = [i for i, s in enumerate(scripts) if turn < len(s.turn_tokens)]
        width = max(len(conversations[i]) for i in active)
        ids = torch.full((len(active), width), PAD_ID, dtype=torch.long)
        mask = torch.zeros((len(active), width), dtype=torch.long)
        for row, i in enumerate(active):
            ids[row, width - len(conversations[i]):] = torch.tensor(conversations[i])
            mask[row, width - len(conversations[i]):] = 1
        budget = max(scripts[i].turn_tokens[turn] for i in active)
        ids, mask = ids.to(model.device), mask.to(model.device)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=budget, min_new_tokens=budget,
                             do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=PAD_ID)
        for row, i in enumerate(active):
            n = scripts[i].turn_tokens[turn]
            conversations[i] += out[row, width: width + n].tolist()
            sampled += n
            if turn < len(scripts[i].observations):
                conversations[i] += scripts[i].observations[turn]
    return sampled


def run_client(engine, scripts: list[Script], threads: int) -> int:
    """Every episode as a coroutine behind one BatchingEngine (decoding on its own thread)."""

    async def episode(client: BatchingEngine, script: Script) -> int:
        with client.episode():
            conversation, sampled = list(script.prompt), 0
            for turn, n in enumerate(script.turn_tokens):
                completion = await client.generate(conversation, SamplingParams(temperature=1.0, max_new_tokens=n))
                assert len(completion.token_ids) == n
                conversation += completion.token_ids
                sampled += n
                if turn < len(script.observations):
                    with client.in_env():
                        await asyncio.sleep(0)  # an environment that answers at once
                    conversation += script.observations[turn]
            return sampled

    async def main() -> int:
        client = BatchingEngine(engine, max_batch_size=64, thread_init=thread_budget(threads))
        client.start()
        try:
            return sum(await asyncio.gather(*(episode(client, s) for s in scripts)))
        finally:
            await client.close()

    return asyncio.run(main())


def measure(model_name: str, episodes: int, repeats: int, threads: int, quick: bool,
            device: str = "cpu") -> dict[str, list[float]]:
    model = build_model(model_name, device)
    scripts = make_scripts(episodes, seed=0, vocab=MODELS[model_name]["vocab_size"], quick=quick)
    expected = sum(sum(s.turn_tokens) for s in scripts)
    engine = TorchEngine(model, _Tokenizer(), device=device, max_batch_size=64)
    runners = {
        "hf": lambda: run_hf(model, scripts),
        "engine-before": lambda: run_client(RequestLevel(engine), scripts, threads),
        "engine": lambda: run_client(engine, scripts, threads),
    }
    run_client(engine, scripts[:2], threads)  # warm-up (allocator, first calls)
    rates: dict[str, list[float]] = {name: [] for name in runners}
    names = list(runners)
    for r in range(repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:
            load = os.getloadavg()[0]
            t0 = time.perf_counter()
            sampled = runners[name]()
            seconds = time.perf_counter() - t0
            assert sampled == expected, f"{name} sampled {sampled} tokens, the script has {expected}"
            rates[name].append(sampled / seconds)
            print(f"{model_name:6s} repeat {r} {name:13s} {sampled} tokens in {seconds:6.2f} s = "
                  f"{sampled / seconds:8.1f} tok/s  (load {load:.2f})", flush=True)
    print(f"{model_name}: encoded {engine.stats['encoded_tokens']} prompt tokens, reused "
          f"{engine.stats['reused_tokens']} from kept caches (all engine runs)")
    return rates


def full_sum_checksum(state_dict) -> float:
    """The former weight check: sum(x) + sum(x**2) in float64 over every element (NumPy)."""
    total = 0.0
    for name in sorted(state_dict):
        values = state_dict[name].detach().to(device="cpu", dtype=torch.float64).numpy()
        total += float(values.sum()) + float((values * values).sum())
    return total


def measure_sync(model_name: str, repeats: int, device: str = "cpu") -> tuple[float, float, int]:
    """Seconds per verified weight sync, former check and fingerprint (best of `repeats`), and the
    parameter count."""
    model = build_model(model_name, device)
    engine = TorchEngine(model, _Tokenizer(), device=device)
    params = sum(p.numel() for p in model.parameters())
    times: dict[str, list[float]] = {"full-sum": [], "fingerprint": []}
    for version in range(1, repeats + 1):
        for name, check in (("full-sum", full_sum_checksum), ("fingerprint", weights_checksum)):
            state = model.state_dict()
            t0 = time.perf_counter()
            engine.update_weights(state, version)
            with engine._lock:
                held = check(engine.model.state_dict())
            assert held == check(state), f"{name}: the engine does not hold what was sent"
            times[name].append(time.perf_counter() - t0)
    for name, values in times.items():
        print(f"{model_name} ({params / 1e6:.0f}M params) weight sync with {name:11s} check: "
              f"best {min(values):.3f} s, mean {statistics.mean(values):.3f} s (load {os.getloadavg()[0]:.2f})")
    return min(times["full-sum"]), min(times["fingerprint"]), params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 episodes, 1 repeat, tiny model only")
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", default="tiny,medium", help="comma-separated: tiny, medium, 0.5b")
    parser.add_argument("--device", default="cpu", help="torch device of the model and every engine (cuda on a GPU)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for every engine (default 1: on a shared machine a torch thread team stalls on a core another process holds; use the core count on an idle one)")
    args = parser.parse_args()
    if args.quick:
        args.episodes, args.repeats, args.models = 4, 1, "tiny"
    threads = args.threads
    torch.set_num_threads(threads)
    print(f"{args.episodes} episodes, {args.repeats} repeats, {threads} torch threads, "
          f"{os.cpu_count()} cores, load {os.getloadavg()}", flush=True)
    ratios = []
    for name in args.models.split(","):
        rates = measure(name, args.episodes, args.repeats, threads, args.quick, args.device)
        for mode, values in rates.items():
            spread = statistics.stdev(values) if len(values) > 1 else 0.0
            print(f"{name:6s} {mode:13s} {statistics.mean(values):8.1f} +- {spread:6.1f} tok/s")
        hf, before, after = (statistics.mean(rates[m]) for m in ("hf", "engine-before", "engine"))
        ratios.append(f"{name}: engine/hf {after / hf:.2f}x, engine/engine-before {after / before:.2f}x")
    old, new, params = measure_sync("tiny" if args.quick else "100m", 1 if args.quick else 3, args.device)
    ratios.append(f"weight sync {params / 1e6:.1f}M: {old:.3f} s -> {new:.3f} s")
    print("; ".join(ratios))


if __name__ == "__main__":
    main()
