"""`tiderl serve --api engine`: a model served by the torch engine behind the vLLM endpoints the
HTTP engine uses (docs/engines.md, "The engine server"), so that `rollout.engine=http` runs, and
`rollout.options.launch` starts servers, on a machine without vLLM.

Endpoints: `GET /health`, `GET /v1/models`, `POST /v1/completions` (token-id prompts, per-token
log-probs, token ids back), `POST /inference/v1/generate` (the same with images: one placeholder
token per image, the images as base64 data URLs in `content_parts`), `POST /collective_rpc` with
method `reload_weights` (a folder with `model.safetensors` holding every key of the model) or the
collective way's `tiderl_join` and `tiderl_receive` (`tiderl.collective`), `POST
/reset_prefix_cache` and `/reset_encoder_cache` (nothing is kept across updates), and
`POST /v1/load_lora_adapter` / `/v1/unload_lora_adapter` (LoRA adapters applied unmerged; unlike
vLLM it holds one at a time, the last loaded, which requests then name). The standard
library's threading HTTP server: one thread per request, and the torch engine batches the
requests that wait together (one thread decodes for all of them).
"""

from __future__ import annotations

import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from tiderl.rollout.base import SamplingParams


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: the HTTP engine reuses its connections

    def log_message(self, *args: Any) -> None:  # one line per request would drown the log
        pass

    def _answer(self, status: int, payload: Any) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - the standard library's name
        server: EngineServer = self.server.owner  # type: ignore[attr-defined]
        if self.path == "/health":
            return self._answer(200, {"status": "ok", "version": server.engine.version})
        if self.path == "/v1/models":
            names = [server.served_model] + [server.adapter] * bool(server.adapter)
            return self._answer(200, {"object": "list", "data": [{"id": n, "object": "model"} for n in names]})
        return self._answer(404, {"detail": f"no route GET {self.path}"})

    def do_POST(self) -> None:  # noqa: N802
        server: EngineServer = self.server.owner  # type: ignore[attr-defined]
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
            if self.path == "/v1/completions":
                return self._answer(200, server.complete(body))
            if self.path == "/inference/v1/generate":
                return self._answer(200, server.generate_tokens(body))
            if self.path == "/collective_rpc":
                return self._answer(200, server.collective_rpc(body))
            if self.path in ("/reset_prefix_cache", "/reset_encoder_cache"):
                return self._answer(200, {"success": True})
            if self.path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
                return self._answer(200, server.lora_adapter(body, load=self.path == "/v1/load_lora_adapter"))
        except (ValueError, KeyError, TypeError, FileNotFoundError) as exc:
            return self._answer(400, {"error": {"message": f"{type(exc).__name__}: {exc}"}})
        return self._answer(404, {"detail": f"no route POST {self.path}"})


class _HTTPServer(ThreadingHTTPServer):
    # The HTTP engine opens up to rollout.engine_batch_size connections at once; the standard
    # library's backlog of 5 overflowed beside a busy decoding thread (the kernel's "SYN flooding"),
    # and the engine took the refused connections for a lost server.
    request_queue_size = 1024
    daemon_threads = True


class EngineServer:
    """`engine` (a TorchEngine) behind the vLLM endpoints, on `host:port` (0 = a free port).
    `start()` serves on a thread, `serve_forever()` on this one; `close()` stops it. `reloads`
    counts the weight loads (each one bumps the engine's version by one)."""

    def __init__(self, engine: Any, served_model: str = "tiderl", host: str = "127.0.0.1", port: int = 0):
        self.engine = engine
        self.served_model = served_model
        self.reloads = 0
        self.adapter = ""  # the LoRA adapter loaded last, which requests name ('' = none)
        self._replaced: set[str] = set()  # adapters loaded before it
        self.httpd = _HTTPServer((host, port), _Handler)
        self.httpd.owner = self  # type: ignore[attr-defined]
        self.url = f"http://{host}:{self.httpd.server_address[1]}"
        self._thread: threading.Thread | None = None

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        """The `/v1/completions` answer for `body` (ValueError for what this server does not take)."""
        prompt = body.get("prompt")
        if not isinstance(prompt, list) or not all(isinstance(t, int) for t in prompt):
            raise ValueError("prompt must be a list of token ids (this server takes token ids, not text)")
        serving = self.adapter or self.served_model
        if body.get("model", serving) != serving:
            raise ValueError(f"model {body.get('model')!r} is not served here; this server serves {serving!r}")
        params = SamplingParams(temperature=float(body.get("temperature", 1.0)), top_p=float(body.get("top_p", 1.0)),
                                max_new_tokens=int(body.get("max_tokens", 16)), stop=list(body.get("stop") or []),
                                stop_token_ids=list(body.get("stop_token_ids") or []), seed=body.get("seed"))
        (completion,) = self.engine.generate([prompt], params)
        choice = {"index": 0, "text": completion.text, "token_ids": completion.token_ids,
                  "logprobs": {"token_logprobs": completion.logprobs,
                               "tokens": [f"token_id:{t}" for t in completion.token_ids]},
                  "finish_reason": completion.finish_reason}
        return {"object": "text_completion", "model": self.served_model, "choices": [choice],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(completion.token_ids)}}

    def generate_tokens(self, body: dict[str, Any]) -> dict[str, Any]:
        """The `/inference/v1/generate` answer for `body`, as vLLM's: token ids with one placeholder
        token per image in `content_parts` (base64 data URLs), expanded here by the model's
        processor; `prompt_token_ids` in the answer is the expanded prompt."""
        from tiderl.models.vision import PromptImages, expand_images, placeholder_expansion, placeholder_id
        from tiderl.serve.images import decode_data_url

        ids, sampling = body.get("token_ids"), body.get("sampling_params") or {}
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
            raise ValueError("token_ids must be a non-empty list of token ids")
        images = [decode_data_url(part.get("url")) for part in body.get("content_parts") or []]
        processor = getattr(self.engine, "processor", None)
        if images and processor is None:
            raise ValueError("content_parts hold images but this server's model is not a vision-language model")
        shown = None
        if images:
            expansions = [placeholder_expansion(processor, image) for image in images]
            ids = expand_images(ids, expansions, placeholder_id(processor))
            shown = [PromptImages(images, [1] * len(ids))]
        params = SamplingParams(temperature=float(sampling.get("temperature", 1.0)), top_p=float(sampling.get("top_p", 1.0)),
                                max_new_tokens=int(sampling.get("max_tokens", 16)), stop=list(sampling.get("stop") or []),
                                stop_token_ids=list(sampling.get("stop_token_ids") or []), seed=sampling.get("seed"))
        (completion,) = self.engine.generate([ids], params, **({"images": shown} if shown else {}))
        content = [{"token_id": t, "logprob": lp} for t, lp in zip(completion.token_ids, completion.logprobs)]
        return {"model": self.served_model, "prompt_token_ids": ids,
                "choices": [{"index": 0, "token_ids": completion.token_ids, "logprobs": {"content": content},
                             "finish_reason": completion.finish_reason}]}

    def collective_rpc(self, body: dict[str, Any]) -> dict[str, Any]:
        """`reload_weights` from `kwargs.weights_path`, or the collective way's `tiderl_join` (a
        gloo group with the sender, `kwargs` its address and ranks) and `tiderl_receive` (the
        state dict `kwargs.spec` lists, by broadcast; `tiderl.collective`)."""
        from tiderl import collective

        method, kwargs = body.get("method"), body.get("kwargs") or {}
        if method == "tiderl_join":
            self._group = collective.join_group(**kwargs)
            return {"results": ["joined"]}
        if method == "tiderl_receive":
            if getattr(self, "_group", None) is None:
                raise ValueError("tiderl_receive before tiderl_join: join the sender's group first")
            state = dict(collective.receive_state(self._group, kwargs["spec"]))
        elif method == "reload_weights":
            from safetensors.torch import load_file

            file = Path(kwargs["weights_path"]) / "model.safetensors"
            if not file.is_file():
                raise FileNotFoundError(f"{file} does not exist (reload_weights needs a folder with model.safetensors)")
            state = load_file(str(file))
        else:
            raise ValueError(f"collective_rpc method {method!r}: this server runs reload_weights, tiderl_join "
                             "and tiderl_receive")
        self.engine.update_weights(state, self.engine.version + 1)
        self.reloads += 1
        return {"results": [len(state)]}

    def lora_adapter(self, body: dict[str, Any], load: bool) -> str:
        """Load the adapter folder `lora_path` as `lora_name` (requests name it from now on), or
        unload `lora_name`: one that a later load replaced (the one in use stays)."""
        from tiderl.rollout.lora import read_adapter_folder

        name = str(body["lora_name"])
        if not load:
            if name == self.adapter:
                raise ValueError(f"adapter {name!r} is in use: this server holds one at a time (load the next first)")
            if name not in self._replaced:
                raise ValueError(f"adapter {name!r} is not loaded")
            self._replaced.discard(name)
            return f"Success: LoRA adapter '{name}' removed successfully."
        self.engine.load_adapters(read_adapter_folder(body["lora_path"]), self.engine.version + 1)
        self._replaced |= {self.adapter} - {""}
        self.adapter = name
        self.reloads += 1
        return f"Success: LoRA adapter '{name}' added successfully."

    def start(self) -> EngineServer:
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="tiderl-engine-server", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self.httpd.serve_forever(poll_interval=0.2)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _exit_with_parent(parent: int) -> None:
    """End this process when `parent` is gone (a launched server must not outlive its run, even
    one killed without a chance to stop it)."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(0)


def serve_engine(model_dir: str, host: str = "127.0.0.1", port: int = 8000, served_model: str = "tiderl",
                 tokenizer_dir: str = "", dtype: str = "float32", device: str = "cpu", seed: int = 0,
                 parent_pid: int = 0) -> None:
    """Load `model_dir` (and its tokenizer, or `tokenizer_dir`'s) into a TorchEngine and serve it
    until interrupted (`tiderl serve --api engine`)."""
    from tiderl.models.loading import load_model, load_tokenizer
    from tiderl.rollout.torch_engine import TorchEngine

    model = load_model(model_dir, dtype, device)
    tokenizer = load_tokenizer(tokenizer_dir or model_dir)
    server = EngineServer(TorchEngine(model, tokenizer, device=device, seed=seed, copy_model=False), served_model, host, port)
    if parent_pid:
        threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    print(f"tiderl engine server: {model_dir} as {served_model!r} at {server.url}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
