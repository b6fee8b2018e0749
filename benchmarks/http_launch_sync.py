"""Weight-sync time through servers the run launches (`rollout.options.launch`, tiderl's engine
server) against parameter count: for each model shape (Qwen2 with random weights), the HTTP
engine launches `--servers` tiderl servers, then times three `update_weights` to new weights
(write the directory, drain, reload on every server, probe every server) and prints the median
with its parts, and the launch time. No vLLM or GPU needed.

    .venv/bin/python benchmarks/http_launch_sync.py            # 0.1M, 5.9M, 47M parameters
    .venv/bin/python benchmarks/http_launch_sync.py --quick    # 0.1M only

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

SHAPES = {"0.1M": (64, 2, 320), "5.9M": (256, 4, 8000), "47M": (512, 8, 32000)}  # hidden, layers, vocabulary
CORPUS = [f"film_{i:03d} was directed by person_{(i * 7) % 23}." for i in range(60)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="the smallest model only")
    args = parser.parse_args()
    tokenizer = train_tokenizer(CORPUS, vocab_size=320)  # the probe's text; ids beyond it are fine
    for name, (hidden, layers, vocab) in list(SHAPES.items())[:1 if args.quick else None]:
        cfg = tiny_qwen2_config(vocab, hidden_size=hidden, num_layers=layers, num_heads=8, num_kv_heads=2,
                                max_position_embeddings=256)
        model = init_tiny_model(cfg, seed=0)
        with tempfile.TemporaryDirectory() as folder:
            engine = HttpEngine(model, tokenizer, urls=[], launch=args.servers,
                                weights_dir=os.path.join(folder, "engine_weights"))
            try:
                syncs = []
                for version in (1, 2, 3):
                    engine.update_weights(init_tiny_model(cfg, seed=version).state_dict(), version)
                    syncs.append(engine.last_sync)
            finally:
                engine.close()
        s = sorted(syncs, key=lambda t: t["total_s"])[1]
        print(f"{name}: {count_parameters(model) / 1e6:.1f}M parameters, {args.servers} servers launched in "
              f"{engine.events[0]['seconds']:.1f} s; sync median {s['total_s']:.2f} s (write {s['write_s']:.2f}, "
              f"reload {s['reload_s']:.2f}, probe {s['probe_s']:.2f}); load {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
