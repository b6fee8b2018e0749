"""tiderl: asynchronous reinforcement learning for LLM agents."""

import os

# Hub kernels off unless the user sets USE_HUB_KERNELS: transformers 5 turns them on, and on a GPU
# `model.train()` then downloads kernels mid-run; the engine (eval) and trainer (train) could differ.
os.environ.setdefault("USE_HUB_KERNELS", "0")

__version__ = "0.1.0"
