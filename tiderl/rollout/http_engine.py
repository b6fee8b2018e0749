"""The HTTP engine (`rollout.engine=http`): an OpenAI-compatible inference server (vLLM) samples,
tiderl sends token ids and reads back token ids and log-probs. Requests, log-probs, versions, weight
updates and what the probe verifies: docs/engines.md, "The HTTP engine"."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import copy
import dataclasses
import itertools
import logging
import math
import shutil
import threading
import time
from collections.abc import Hashable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tiderl.models.vision import (PromptImages, check_images, collapse_images, model_inputs, placeholder_expansion,
                                  placeholder_id, split_processor)
from tiderl.rollout import lora
from tiderl.rollout.base import (Completion, OnDone, SamplingParams, check_request, check_update, stream_seed,
                                 token_decoder)
from tiderl.rollout.options import HttpEngineOptions
from tiderl.rollout.weights import weights_checksum
from tiderl.types import image_to_data_url

if TYPE_CHECKING:
    from tiderl.config import RunConfig
    from tiderl.rollout.launch import ServerLauncher

logger = logging.getLogger(__name__)

# The fixed probe: its text (the first PROBE_PROMPT_TOKENS of its tokens) and greedy continuation.
PROBE_TEXT = "Probe: the quick brown fox jumps over the lazy dog, 0123456789 times."
PROBE_PROMPT_TOKENS = 16
PROBE_NEW_TOKENS = 8
# How weights reach the servers (rollout.options.weight_sync; docs/engines.md, "Weight updates").
WEIGHT_SYNCS = ("vllm", "collective", "adapters", "none")
# The temperature of the start-up check that the server reports processed log-probs.
PROBE_TEMPERATURE = 0.5
# Where a prompt with images goes: token ids in, with the images beside them (vLLM's scale-out route).
GENERATE_PATH = "/inference/v1/generate"


class ServerError(RuntimeError):
    """A server could not be reached or answered with an error; the message says which and why."""


class ServerLost(ServerError):
    """The connection to a server failed (refused, reset, closed mid-answer): it is down, not
    slow. Requests to a launched server that is lost are retried on the others."""


@dataclasses.dataclass
class ServerView:
    """What the owner of the servers tells an engine that only sends requests (`owner=False`, a
    Ray rollout worker's): the weights version the servers hold, its checksum, the servers not
    to use (lost, not yet back)."""

    version: int
    checksum: float
    down: list[int]
    model: str = ""  # the name requests give, when it changes (weight_sync=adapters: the adapter's)


class Handle:
    """One submitted request (`HttpEngine.submit`). Setting `cancelled = True` (any thread)
    aborts its HTTP request (the server stops decoding it) and its `on_done` is not called."""

    def __init__(self) -> None:
        self._cancelled = False
        self.future: concurrent.futures.Future[Completion] | None = None

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    @cancelled.setter
    def cancelled(self, value: bool) -> None:
        self._cancelled = bool(value)
        if value and self.future is not None:
            self.future.cancel()


class HttpEngine:
    """The Engine protocol over an OpenAI-compatible server (docs/engines.md), plus the
    continuous interface (`submit`, `serve`, `pending`) the batching client uses, so that
    requests reach the server as soon as episodes ask and the server batches them.

    `model` is the policy the server was started with: its copy is the reference for the probe
    (and the template for the weight files the server reloads); with `copy_model=False` the
    engine takes `model` itself as the reference (a caller with no further use for it:
    evaluation). Construction checks every server (reachable, serving one model, the same
    weights, processed log-probs) and raises `ServerError` saying what is wrong. Call `close()`
    when done (it ends the engine's thread and stops launched servers).

    `launch=N` starts N servers serving `model` (`tiderl.rollout.launch`) instead of using
    `urls`. Requests go to the least-loaded server that is up (an episode's turns stay on its
    first server while it lives); when a launched server is lost, its requests are retried on
    the others and it is restarted in the background, loaded with the current weights and
    probed before it takes requests again (`events` records each loss and return).

    `owner=False` makes an engine that only sends requests to servers another engine owns (the
    Ray backend's workers; the driver's engine syncs the servers): no start-up probe, and
    `update_weights` takes the owner's `ServerView` after `pause()` (docs/scale.md).
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        device: str | torch.device = "cpu",
        seed: int = 0,
        max_batch_size: int = 64,
        *,
        urls: list[str] | tuple[str, ...] = ("http://127.0.0.1:8000",),
        served_model: str = "",
        timeout_s: float = 600.0,
        weight_sync: str = "vllm",
        weights_dir: str | Path = "engine_weights",
        sync_timeout_s: float = 600.0,
        probe_tolerance: float = 0.02,
        seed_requests: bool = False,
        copy_model: bool = True,
        launch: int = 0,
        server: str = "tiderl",
        server_dtype: str = "float32",
        launch_timeout_s: float = 300.0,
        server_executable: str = "",
        launch_on: str = "local",
        server_resources: dict[str, float] | None = None,
        ray_address: str = "",
        owner: bool = True,
    ) -> None:
        import httpx  # the optional extra `http`; imported here so that tiderl runs without it

        if not urls and not launch:
            raise ValueError("rollout.options.urls is empty: give the base URL of at least one server")
        if weight_sync not in WEIGHT_SYNCS:
            raise ValueError(f"rollout.options.weight_sync={weight_sync!r}: use one of {', '.join(WEIGHT_SYNCS)}")
        if weight_sync == "adapters" and not getattr(model, "peft_config", None):
            raise ValueError("rollout.options.weight_sync=adapters sends LoRA adapters, and the policy has none: set "
                             "model.lora.r > 0, or use weight_sync=vllm")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size} must be at least 1")
        self.tokenizer = tokenizer
        # A vision-language model's processor: episodes with images go to /inference/v1/generate.
        self._text_tokenizer, self._processor = split_processor(tokenizer)
        self._placeholder = -1 if self._processor is None else placeholder_id(self._processor)
        self.seed = seed
        self.weight_sync = weight_sync
        self.weights_dir = Path(weights_dir)
        self.sync_timeout_s = sync_timeout_s
        self.probe_tolerance = probe_tolerance
        self.seed_requests = seed_requests
        self.version = 0
        self.device = torch.device(device)
        # A LoRA policy: the reference is the base model with the adapters beside it, unmerged (the
        # trainer's arithmetic), and the servers get the merged weights, so the probe checks the merge.
        self._lora: dict[str, tuple[float, str, str]] = {}
        if getattr(model, "peft_config", None):
            self._peft_config = copy.deepcopy(model.peft_config["default"])  # for adapter folders
            owned, self._lora, self._adapters = lora.unmerged_plain(model, copy_model, share_frozen=True)
        else:
            owned = copy.deepcopy(model) if copy_model else model
        self.reference = owned.to(self.device).eval().requires_grad_(False)
        self._vocab_size = self.reference.get_output_embeddings().weight.shape[0]
        self._max_positions = getattr(self.reference.config, "max_position_embeddings", None)
        self._checksum = weights_checksum(self._adapters if self._lora else self.reference.state_dict())
        self._serials = itertools.count()  # request counter: the per-request seeds
        self._round_robin = itertools.count()
        self.launcher: ServerLauncher | None = None
        self._folder: Path | None = None  # the weights the servers hold, as a folder they read
        self._reference_memo: dict[tuple[Any, ...], list[float]] = {}  # reference_logprobs' last answer
        self._closing = False
        self._senders: dict[int, Any] = {}  # weight_sync=collective: a gloo group per server, by index
        self.events: list[dict[str, Any]] = []  # servers lost, restarted, failed to come back
        self.retried = 0  # requests retried on another server after theirs was lost
        # Held by a weight update from the reload to the probe, and by a restarted server's
        # catch-up: the reference model, `_folder` and the servers' weights change together.
        self._sync_lock = threading.Lock()
        if launch:
            served_model = served_model or "tiderl"
            urls = self._launch(tokenizer, launch, server, launch_timeout_s, server_executable, served_model,
                                {"on": launch_on, "resources": server_resources, "ray_address": ray_address,
                                 "dtype": server_dtype, "device": str(self.device)})
        self.urls = [u.rstrip("/") for u in urls]
        self.owner = owner
        self._failover = bool(launch) or not owner  # lost servers are routed around (and restarted)
        # Figures of the last weight update and of the probes, for logs and tests.
        self.last_sync: dict[str, float] = {}
        self.last_probe_diff = math.nan
        # Requests submitted and not yet finished (continuous interface), guarded by `_done`.
        self._pending = 0
        self._done = threading.Condition()
        self._decode = token_decoder(self._text_tokenizer)
        # The engine's event loop, on its own thread: callers may be threads of any kind,
        # including one that runs another event loop (synchronous training decodes inline).
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tiderl-http-engine", daemon=True)
        self._thread.start()

        async def setup() -> None:
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 30.0)))
            self._slots = asyncio.Semaphore(max_batch_size)
            self._open = asyncio.Event()  # set while requests may be admitted (no update running)
            self._open.set()
            self._idle = asyncio.Event()  # set while no admitted request is in flight
            self._idle.set()
            self._in_flight = 0
            self._load = [0] * len(self.urls)  # requests outstanding per server
            self._down: set[int] = set()  # servers lost and not yet back
            self._up_again = asyncio.Event()  # set when a lost server is back
            self._affinity: dict[Hashable, int] = {}  # session -> its server

        self._run(setup())
        try:
            self.served_model = served_model or self._run(self._served_model())
            if owner and weight_sync == "collective":
                for index in range(len(self.urls)):
                    self._join(index)
            if owner and weight_sync == "adapters":  # the servers serve the base: load the first adapters
                self._folder = self._write_adapters(0)
                self._run(self._reload_all(self._folder), timeout=self.sync_timeout_s + 5)
                self.served_model = _adapter_name(self._folder)
            for url in self.urls if owner else ():
                self._check_probe(url, what="at start-up")
                self._check_processed_logprobs(url)
                if self._processor is not None:
                    self._check_probe(url, what="with an image at start-up", image=True)
            if self.launcher is not None:
                self._watchdog = asyncio.run_coroutine_threadsafe(self._watch(), self._loop)
        except BaseException:
            self.close()
            raise

    Options = HttpEngineOptions  # rollout.options with rollout.engine=http

    @classmethod
    def from_config(cls, cfg: RunConfig, model: Any, tokenizer: Any, *, seed: int, copy_model: bool = True,
                    owner: bool = True, urls: list[str] | None = None, served_model: str = "") -> HttpEngine:
        """The engine `cfg.rollout.options` describes (`tiderl.rollout.make_engine` calls this): each
        option is the keyword of the same name. `owner=False` with the owner's `urls` and
        `served_model`: an engine that only sends requests (it launches nothing)."""
        h = cfg.rollout.options
        options = {**dataclasses.asdict(h), "weights_dir": h.weights_dir or Path(cfg.run_dir) / "engine_weights",
                   "ray_address": getattr(cfg.system.options, "address", "")}
        if not owner:
            options.update(urls=urls or h.urls, launch=0,
                           served_model=served_model or h.served_model or ("tiderl" if h.launch else ""))
        return cls(model, tokenizer, device=cfg.model.device, seed=seed, max_batch_size=cfg.rollout.engine_batch_size,
                   copy_model=copy_model and owner, owner=owner, **options)

    def _launch(self, tokenizer: Any, count: int, kind: str, timeout_s: float, executable: str,
                served_model: str, where: dict[str, Any]) -> list[str]:
        """Write the policy (with its tokenizer) as the servers' model directory, start `count`
        servers and wait for them; their URLs."""
        from tiderl.models.loading import save_model_dir
        from tiderl.rollout.launch import ServerLauncher

        base = save_model_dir(self.reference, tokenizer, self.weights_dir / "base")
        if self._lora and self.weight_sync != "adapters":  # the servers start from the merged policy
            for stale in base.glob("model*.safetensors*"):
                stale.unlink()
            self._write_state(base)
        self._folder = base.resolve()
        self.launcher = ServerLauncher(count, kind, base, self.weights_dir.parent / "servers", served_model,
                                       timeout_s, executable, self.weight_sync,
                                       lora_rank=self._peft_config.r if self.weight_sync == "adapters" else 0, **where)
        seconds = self.launcher.start()
        self.events.append({"event": "launched", "servers": count, "seconds": round(seconds, 3)})
        logger.info("launched %d %s servers in %.1f s: %s", count, kind, seconds, self.launcher.urls)
        return self.launcher.urls

    def close(self) -> None:
        """Close the HTTP client, end the engine's thread and stop launched servers (idempotent)."""
        self._closing = True  # a server stopped now is not lost: no restart
        watchdog = getattr(self, "_watchdog", None)
        if watchdog is not None:
            watchdog.cancel()
        if self.launcher is not None:
            self.launcher.stop()
        if self._loop.is_closed():
            return
        if threading.current_thread() is self._thread:  # from a callback: nothing can be awaited here
            self._loop.stop()
            return
        if self._thread.is_alive():
            client = getattr(self, "_client", None)
            if client is not None:
                with contextlib.suppress(Exception):
                    self._run(client.aclose(), timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()

    # ------------------------------------------------------------------ the batch interface

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 sessions: list[Hashable | None] | None = None,
                 images: list[PromptImages | None] | None = None) -> list[Completion]:
        """Sample one completion per prompt, in prompt order, all requests concurrently.
        `sessions[i]` (optional) keeps prompt i's episode on one server (its prefix cache);
        `images[i]` (optional): the images prompt i shows."""
        if sessions is not None and len(sessions) != len(prompts):
            raise ValueError(f"{len(sessions)} sessions for {len(prompts)} prompts: give one per prompt (or None)")
        if images is not None and len(images) != len(prompts):
            raise ValueError(f"{len(images)} PromptImages for {len(prompts)} prompts: give one per prompt (None for none)")
        for i, prompt in enumerate(prompts):
            check_request(prompt, params, i, self._vocab_size, self._max_positions)
            check_images(prompt, images[i] if images else None, self._processor)

        async def all_of() -> list[Completion]:
            return list(await asyncio.gather(*(
                self._complete(list(p), params, sessions[i] if sessions else None, images=images[i] if images else None)
                for i, p in enumerate(prompts))))

        return self._run(all_of()) if prompts else []

    # ------------------------------------------------------------------ the continuous interface

    def continuous(self) -> bool:
        """True: the batching client submits each request as soon as it arrives."""
        return True

    def submit(self, prompt: list[int], params: SamplingParams, session: Hashable | None = None,
               on_done: OnDone | None = None, images: PromptImages | None = None) -> Handle:
        """Send one request now (any thread). `on_done(result)` is called, from the engine's
        thread, with the Completion or the exception that ended it (not when cancelled);
        `images`: the images the prompt shows. Raises ValueError at once for a bad request."""
        check_request(prompt, params, 0, self._vocab_size, self._max_positions)
        check_images(prompt, images, self._processor)
        handle = Handle()
        with self._done:
            self._pending += 1
        handle.future = asyncio.run_coroutine_threadsafe(self._complete(list(prompt), params, session, images=images),
                                                         self._loop)

        def finished(future: concurrent.futures.Future[Completion]) -> None:
            with self._done:
                self._pending -= 1
                self._done.notify_all()
            if on_done is None or handle.cancelled or future.cancelled():
                return
            error = future.exception()
            on_done(error if error is not None else future.result())

        handle.future.add_done_callback(finished)
        return handle

    def pending(self) -> int:
        """Requests submitted and not yet finished."""
        with self._done:
            return self._pending

    def serve(self) -> None:
        """Wait until every submitted request has finished (the server does the decoding)."""
        with self._done:
            self._done.wait_for(lambda: self._pending == 0)

    def end_session(self, session: Hashable) -> None:
        """Forget the session's server (the server evicts its prefix cache by itself)."""
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._affinity.pop, session, None)

    # ------------------------------------------------------------------ requests

    async def _server_for(self, session: Hashable | None) -> int:
        """The server for a request: its session's while that one is up, else the least-loaded up
        server (ties rotate). Waits for a lost server to come back when none is up."""
        deadline = time.monotonic() + self.sync_timeout_s
        while len(self._down) == len(self.urls):
            if time.monotonic() > deadline:
                raise ServerError(f"every server is down ({self.urls}) and none came back within "
                                  f"rollout.options.sync_timeout_s={self.sync_timeout_s:g} s: see their logs")
            self._up_again.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._up_again.wait(), max(0.01, deadline - time.monotonic()))
        kept = self._affinity.get(session) if session is not None else None
        if kept is not None and kept not in self._down:
            return kept
        turn, n = next(self._round_robin), len(self.urls)
        index = min((i for i in range(n) if i not in self._down), key=lambda i: (self._load[i], (i - turn) % n))
        if session is not None:
            self._affinity[session] = index
        return index

    def _lost(self, index: int, error: BaseException) -> None:
        """Route around server `index` from now on and bring it back in the background (on the
        engine's loop; once per loss however many requests saw it)."""
        if index in self._down:
            return
        self._down.add(index)
        self.events.append({"event": "lost", "server": index, "url": self.urls[index], "reason": str(error)[:300]})
        logger.warning("server %s lost (%s); %d of %d up", self.urls[index], error, len(self.urls) - len(self._down),
                       len(self.urls))
        if self.launcher is not None and not self._closing:
            threading.Thread(target=self._bring_back, args=(index,), name=f"tiderl-restart-{index}",
                             daemon=True).start()

    def _bring_back(self, index: int) -> None:
        """Restart launched server `index`, load the current weights, probe, then take requests."""
        url = self.urls[index]
        try:
            assert self.launcher is not None
            seconds = self.launcher.restart(index)
            if self._closing:  # the engine closed meanwhile: no server outlives it
                self.launcher.stop()
                return
            with self._sync_lock:
                if self.weight_sync == "collective":  # a new group, and the current weights if they moved on
                    self._join(index)
                    if self.version:
                        self._senders[index].send(self.served_state())
                elif self._folder.name != "base":  # it started from the base or the first weights: catch up
                    self._run(self._reload(url, self._folder), timeout=self.sync_timeout_s + 5)
                version = self.version
                self._check_probe(url, what=f"after its restart at version {version}", during_update=True)
                self._run(self._back_up(index))
            self.events.append({"event": "restarted", "server": index, "version": version,
                                "seconds": round(seconds, 3), "probe_max_abs_diff": self.last_probe_diff})
            logger.info("server %s is back at weights version %d after %.1f s", url, self.version, seconds)
        except Exception as exc:  # noqa: BLE001 - it stays down; the others serve, the event says why
            self.events.append({"event": "restart_failed", "server": index, "reason": str(exc)[:500]})
            logger.error("restarting server %s failed: %s", url, exc)

    async def _watch(self) -> None:
        """Notice a launched server whose process exited, even with no request on it."""
        assert self.launcher is not None
        while True:
            await asyncio.sleep(0.5)
            for server in [] if self.launcher.stopped else self.launcher.servers:
                if server.index not in self._down and not server.alive():
                    self._lost(server.index, ServerLost(f"{server.url}: its process exited (log: {server.log_path})"))

    async def _back_up(self, index: int) -> None:
        self._down.discard(index)
        self._up_again.set()

    def request_body(self, prompt: list[int], params: SamplingParams, seed: int) -> dict[str, Any]:
        """The JSON of one `/v1/completions` request (docs/engines.md, "Requests")."""
        body: dict[str, Any] = {
            "model": getattr(self, "served_model", ""),
            "prompt": prompt,
            "max_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "logprobs": 0,
            "return_token_ids": True,
            "ignore_eos": True,
            "skip_special_tokens": False,
            "stop_token_ids": list(params.stop_token_ids),
        }
        if self.seed_requests:
            body["seed"] = seed
        if params.stop:
            body["stop"] = list(params.stop)
            body["include_stop_str_in_output"] = True
        return body

    def generate_body(self, prompt: list[int], params: SamplingParams, seed: int,
                      images: PromptImages) -> dict[str, Any]:
        """The JSON of one `/inference/v1/generate` request, for a prompt with images: each image's
        tokens collapsed into one placeholder token (the server expands it again, and answers with
        the prompt it expanded: `parse_completion` checks it is `prompt`), the images as PNG data
        URLs (docs/multimodal.md, "The HTTP engine")."""
        expansions = [placeholder_expansion(self._processor, image) for image in images.images]
        sampling: dict[str, Any] = {
            "max_tokens": params.max_new_tokens, "temperature": params.temperature, "top_p": params.top_p,
            "logprobs": 0, "ignore_eos": True, "skip_special_tokens": False,
            "stop_token_ids": list(params.stop_token_ids)}
        if self.seed_requests:
            sampling["seed"] = seed
        if params.stop:
            sampling.update(stop=list(params.stop), include_stop_str_in_output=True)
        return {"model": getattr(self, "served_model", ""), "return_token_ids": True, "sampling_params": sampling,
                "token_ids": collapse_images(prompt, images.forced, expansions, self._placeholder),
                "content_parts": [{"type": "image_url", "url": image_to_data_url(image)} for image in images.images]}

    async def _complete(self, prompt: list[int], params: SamplingParams, session: Hashable | None,
                        url: str | None = None, during_update: bool = False,
                        images: PromptImages | None = None) -> Completion:
        """One completion; admitted only while no weight update runs (unless it is the update's
        own probe), so that all its tokens carry one version."""
        if not during_update:
            while not self._open.is_set():
                await self._open.wait()
            self._in_flight += 1
            self._idle.clear()
        try:
            version = self.version
            # A seeded request (an episode's own stream) gets a seed of its own and its prompt's
            # length, so a turn's draw does not depend on the order requests reach the engine.
            seed = (self.seed * 1_000_003 + next(self._serials)) % 2**62 if params.seed is None \
                else stream_seed(params.seed, len(prompt))
            if images is not None and images.images:
                path, body = GENERATE_PATH, self.generate_body(prompt, params, seed, images)
            else:
                path, body = "/v1/completions", self.request_body(prompt, params, seed)
            async with self._slots:
                if url is not None:  # a probe of this very server
                    return self.parse_completion(await self._post(url, path, body), params, version, prompt)
                while True:
                    index = await self._server_for(session)
                    self._load[index] += 1
                    try:
                        data = await self._post(self.urls[index], path, body)
                        break
                    except ServerLost as exc:
                        if not self._failover:
                            raise
                        self._lost(index, exc)
                        self.retried += 1  # the same request (and version) on another server
                    finally:
                        self._load[index] -= 1
            return self.parse_completion(data, params, version, prompt)
        finally:
            if not during_update:
                self._in_flight -= 1
                if self._in_flight == 0:
                    self._idle.set()

    def parse_completion(self, data: dict[str, Any], params: SamplingParams, version: int,
                         prompt: list[int] | None = None) -> Completion:
        """A `Completion` from one `/v1/completions` or `/inference/v1/generate` response
        (docs/engines.md, "Requests"); for the latter, ServerError unless the server expanded
        the images into `prompt`'s tokens."""
        if "prompt_token_ids" in data and prompt is not None and data["prompt_token_ids"] != prompt:
            theirs = data["prompt_token_ids"]
            at = next((i for i, (a, b) in enumerate(zip(theirs, prompt)) if a != b), min(len(theirs), len(prompt)))
            raise ServerError(f"the server expanded the prompt's images into other tokens than the trainer's processor "
                              f"({len(theirs)} tokens against {len(prompt)}, first difference at {at}): serve the "
                              "model with the processor saved beside it")
        try:
            choice = data["choices"][0]
            if "token_logprobs" in choice["logprobs"]:
                logprobs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
            else:  # /inference/v1/generate's
                logprobs = [float(entry["logprob"]) for entry in choice["logprobs"]["content"]]
            token_ids = choice.get("token_ids")
            if token_ids is None:  # servers that spell the ids into the tokens instead
                token_ids = [int(t.split(":", 1)[1]) for t in choice["logprobs"]["tokens"]]
            token_ids = [int(t) for t in token_ids]
            finish = choice.get("finish_reason")
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
            raise ServerError(f"the server's completion has no token ids and log-probs ({exc!r}): is it "
                              "vLLM with return_token_ids support? Response: " + str(data)[:300]) from exc
        if len(token_ids) != len(logprobs):
            raise ServerError(f"the server returned {len(token_ids)} token ids but {len(logprobs)} log-probs")
        if finish not in ("stop", "length"):
            raise ServerError(f"the server ended a completion with finish_reason={finish!r} (aborted?)")
        cut = self._stop_cut(token_ids, params)
        if cut is not None:
            token_ids, logprobs, finish = token_ids[:cut], logprobs[:cut], "stop"
        elif len(token_ids) > params.max_new_tokens:
            token_ids, logprobs, finish = token_ids[:params.max_new_tokens], logprobs[:params.max_new_tokens], "length"
        return Completion(token_ids=token_ids, logprobs=logprobs, text=self._decode(token_ids),
                          finish_reason=finish, policy_version=[version] * len(token_ids))

    def _stop_cut(self, token_ids: list[int], params: SamplingParams) -> int | None:
        """The length up to and including the first stop token or the token that completes a
        stop string (None when neither occurs)."""
        stops = set(params.stop_token_ids)
        for n, token in enumerate(token_ids, start=1):
            if token in stops:
                return n
            if params.stop and any(s in self._decode(token_ids[:n]) for s in params.stop):
                return n
        return None

    async def _post(self, url: str, path: str, body: dict[str, Any] | None = None,
                    timeout: float | None = None) -> Any:
        """POST `body` (GET when None) and return the JSON answer; ServerError otherwise."""
        import httpx

        kwargs: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        try:
            if body is None:
                response = await self._client.get(url + path, **kwargs)
            else:
                response = await self._client.post(url + path, json=body, **kwargs)
        except httpx.TimeoutException as exc:
            raise ServerError(f"{url}{path}: no answer within the timeout ({exc!r}); raise "
                              "rollout.options.timeout_s (or sync_timeout_s) or check the server") from exc
        except httpx.TransportError as exc:
            raise ServerLost(f"{url}{path}: cannot reach the server ({exc!r}); start it (docs/engines.md) "
                             "or correct rollout.options.urls") from exc
        except httpx.HTTPError as exc:
            raise ServerError(f"{url}{path}: cannot reach the server ({exc!r}); start it (docs/engines.md) "
                              "or correct rollout.options.urls") from exc
        if response.status_code == 404 and path in ("/collective_rpc", "/reset_prefix_cache"):
            raise ServerError(f"{url}{path} does not exist: start vLLM with VLLM_SERVER_DEV_MODE=1 so that "
                              "tiderl can reload weights (or set rollout.options.weight_sync=none)")
        if response.status_code in (403, 404) and path == GENERATE_PATH:
            raise ServerError(f"{url}{path} is {'disabled' if response.status_code == 403 else 'missing'}: episodes "
                              "with images need it; start vLLM (0.32 or newer) with --enable-scale-out "
                              "(rollout.options.launch does)")
        if response.status_code == 404 and path == "/v1/load_lora_adapter":
            raise ServerError(f"{url}{path} does not exist: start vLLM with --enable-lora --max-lora-rank R and "
                              "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True for weight_sync=adapters (or use weight_sync=vllm)")
        if response.status_code >= 400:
            raise ServerError(f"{url}{path} answered {response.status_code}: {response.text[:500]}")
        if response.headers.get("content-type", "").startswith("application/json"):
            return response.json()
        return response.text or None  # vLLM's adapter endpoints answer in plain text

    async def _served_model(self) -> str:
        """The one model the first server lists (an ambiguous list needs rollout.options.served_model)."""
        data = await self._post(self.urls[0], "/v1/models")
        names = [m["id"] for m in data.get("data", [])]
        if len(names) != 1:
            raise ServerError(f"{self.urls[0]} serves {names}: set rollout.options.served_model to one of them")
        return names[0]

    def _run(self, coroutine: Any, timeout: float | None = None) -> Any:
        """Run `coroutine` on the engine's loop and wait for its result (from any other thread)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    # ------------------------------------------------------------------ weights

    def update_weights(self, state_dict: dict[str, Any], version: int) -> None:
        """Send `state_dict` to every server as `version` and verify it (docs/engines.md).

        Checks the keys and shapes first (nothing changes when they are wrong), refuses a version
        lower than the current one, then drains, writes, reloads and probes. Raises ServerError
        when a server fails to reload or the probe differs by more than `probe_tolerance`; the
        engine then reports a NaN checksum until an update succeeds.
        """
        if not self.owner:
            return self._follow(state_dict, version)
        if self.weight_sync == "none":
            raise RuntimeError("rollout.options.weight_sync=none: the server's weights are fixed, so the engine "
                               "cannot follow training; use weight_sync=vllm (or adapters) to train")
        if self._lora:
            check_update(self._adapters, state_dict, version, self.version,
                         send="the policy's LoRA adapters, tiderl.train.lora.policy_state(model), of the same "
                              "model.lora.r")
        else:
            check_update(self.reference.state_dict(), state_dict, version, self.version)
        t0 = time.perf_counter()
        self._run(self._close_and_drain(), timeout=self.sync_timeout_s + 5)
        try:
            t_drained = time.perf_counter()
            with self._sync_lock:  # a restarted server catches up before or after, not during
                self._checksum = math.nan  # until the new weights pass the probe
                if self._lora:
                    lora.set_all_adapters(self.reference, self._lora, state_dict)
                    self._adapters = {k: v.detach().to("cpu").clone() for k, v in state_dict.items()}
                else:
                    self.reference.load_state_dict(state_dict, strict=True)
                self._reference_memo = {}
                adapters = self.weight_sync == "adapters"
                if self.weight_sync == "collective":
                    folder, t_write = self._folder, time.perf_counter()
                    reloaded = self._send_all(self.served_state())
                else:
                    folder = self._write_adapters(version) if adapters else self._write_weights(version)
                    t_write = time.perf_counter()
                    reloaded = self._run(self._reload_all(folder), timeout=self.sync_timeout_s + 5)
                t_reloaded = time.perf_counter()
                replaced = self.served_model
                if adapters:  # requests (the probe first) name the new adapters
                    self.served_model = _adapter_name(folder)
                self._probe_all(reloaded, version)
                self.version = version
                self._folder = folder
                self._checksum = weights_checksum(state_dict)
                if adapters:
                    self._run(self._unload_all(replaced, reloaded), timeout=self.sync_timeout_s + 5)
                if folder is not None:
                    self._remove_older(folder)
        finally:
            self._loop.call_soon_threadsafe(self._open.set)
        self.last_sync = {"drain_s": t_drained - t0, "write_s": t_write - t_drained,
                          "reload_s": t_reloaded - t_write, "probe_s": time.perf_counter() - t_reloaded,
                          "total_s": time.perf_counter() - t0, "probe_max_abs_diff": self.last_probe_diff}

    def pause(self) -> None:
        """Stop admitting requests and wait for those in flight (the owner reloads the servers
        next; `update_weights` with its `ServerView` admits them again)."""
        self._run(self._close_and_drain(), timeout=self.sync_timeout_s + 5)

    def view(self) -> ServerView:
        """The servers' state for the engines that only send requests (`owner=False`)."""
        return ServerView(self.version, self._checksum, sorted(self._down), self.served_model)

    def _follow(self, view: Any, version: int) -> None:
        """owner=False: take the owner's `ServerView` of `version` and admit requests again."""
        if not isinstance(view, ServerView) or view.version != version:
            raise TypeError(f"an HTTP engine with owner=False takes the owner's ServerView of version {version}, "
                            f"not {type(view).__name__}: the owner's engine reloads the servers")
        if version < self.version:
            raise ValueError(f"update_weights got version {version}, lower than the engine's current version "
                             f"{self.version}: versions must not decrease")

        async def adopt() -> None:
            self._down = set(view.down)
            self._affinity.clear()
            self._up_again.set()
            self.version, self._checksum = version, view.checksum
            self.served_model = view.model or self.served_model
            self._open.set()

        self._run(adopt())

    def state_checksum(self) -> float:
        """`weights_checksum` of the last weights every server was verified to serve (NaN after a
        failed update)."""
        return self._checksum

    def rng_state(self) -> int:
        """The request counter the per-request seeds derive from (for checkpoints)."""
        state = next(self._serials)
        self._serials = itertools.count(state)
        return state

    def set_rng_state(self, state: int) -> None:
        """Continue the per-request seeds from `rng_state()`'s output."""
        self._serials = itertools.count(int(state))

    def served_state(self) -> dict[str, torch.Tensor]:
        """The weights the servers load: the reference's, with a LoRA policy's adapters merged
        (`tiderl.rollout.lora.merged_state`, W + (alpha / r) B A)."""
        return lora.merged_state(self.reference, self._lora) if self._lora else self.reference.state_dict()

    def _write_adapters(self, version: int) -> Path:
        """The policy's adapters as a folder in peft's layout (weight_sync=adapters)."""
        return lora.write_adapter_folder(self.weights_dir / f"v{version:08d}-{time.time_ns()}", self._adapters,
                                         self._peft_config)

    def _write_weights(self, version: int) -> Path:
        """The new weights (`served_state`) as an HF directory the server reads (`_write_state`)."""
        return self._write_state(self.weights_dir / f"v{version:08d}-{time.time_ns()}")

    def _write_state(self, folder: Path) -> Path:
        """`served_state()` into `folder`: the config and one safetensors file with EVERY key of
        the state dict, tied tensors under each name (without the tied head `save_pretrained`
        drops, vLLM 0.32's in-place reload keeps the OLD one: docs/engines.md, "A vLLM bug the
        probe caught")."""
        from safetensors.torch import save_file

        folder.mkdir(parents=True, exist_ok=True)
        tensors, seen = {}, set()
        for name, tensor in self.served_state().items():
            tensor = tensor.detach().to("cpu").contiguous()
            if tensor.data_ptr() in seen:  # safetensors refuses shared storage
                tensor = tensor.clone()
            seen.add(tensor.data_ptr())
            tensors[name] = tensor
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        self.reference.config.save_pretrained(folder)
        return folder.resolve()

    def _remove_older(self, keep: Path) -> None:
        """Delete the weight directories before `keep` (the server now reads from `keep`)."""
        for old in self.weights_dir.glob("v*-*"):
            if old.resolve() != keep and old.is_dir():
                shutil.rmtree(old, ignore_errors=True)

    async def _close_and_drain(self) -> None:
        """Stop admitting requests and wait for those in flight (at most `sync_timeout_s`)."""
        self._open.clear()
        try:
            await asyncio.wait_for(self._idle.wait(), self.sync_timeout_s)
        except asyncio.TimeoutError as exc:
            self._open.set()
            raise ServerError(f"a weight update waited {self.sync_timeout_s} s for {self._in_flight} requests in "
                              "flight to finish: raise rollout.options.sync_timeout_s or lower max_new_tokens") from exc

    def _join(self, index: int) -> None:
        """weight_sync=collective: open a gloo group with server `index` (`tiderl.collective`); its
        requests go through `_post` on the engine's loop (called from other threads)."""
        from tiderl.collective import GlooSender

        url = self.urls[index]
        sender = GlooSender(url, lambda path, body, timeout: self._run(self._post(url, path, body, timeout=timeout)))
        try:
            sender.join()
        except ServerLost:
            raise
        except ServerError as exc:
            raise ServerError(f"{exc}; for weight_sync=collective start vLLM with --worker-extension-cls "
                              "tiderl.collective.GlooWeightReceiver and the checkout on its PYTHONPATH") from exc
        self._senders[index] = sender

    def _send_all(self, state: dict[str, torch.Tensor]) -> list[int]:
        """weight_sync=collective: broadcast `state` to every server that is up, each over its own
        group, at once; the indices of those that loaded it (a lost launched server is left to its
        restart, any other failure raises)."""
        up = [i for i in range(len(self.urls)) if i not in self._down]

        def send(index: int) -> BaseException | None:
            try:
                self._senders[index].send(state)
            except Exception as exc:  # noqa: BLE001 - sorted out below
                return exc
            return None

        with concurrent.futures.ThreadPoolExecutor(max(1, len(up)), thread_name_prefix="tiderl-send") as pool:
            failures = list(pool.map(send, up))
        done = []
        for index, failure in zip(up, failures):
            if isinstance(failure, ServerLost) and self._failover:
                self._loop.call_soon_threadsafe(self._lost, index, failure)
            elif failure is not None:
                raise failure
            else:
                done.append(index)
        if not done:
            raise ServerError(f"no server took the weights: every server is down ({self.urls})")
        return done

    async def _reload_all(self, folder: Path) -> list[int]:
        """Reload every server that is up; the indices of those that did. A launched server lost
        meanwhile is left to its restart (which loads the newest weights); any other failure raises."""
        up = [i for i in range(len(self.urls)) if i not in self._down]
        results = await asyncio.gather(*(self._reload(self.urls[i], folder) for i in up), return_exceptions=True)
        done = []
        for index, result in zip(up, results):
            if isinstance(result, ServerLost) and self._failover:
                self._lost(index, result)
            elif isinstance(result, BaseException):
                raise result
            else:
                done.append(index)
        if not done:
            raise ServerError(f"no server took weights {folder.name}: every server is down ({self.urls})")
        return done

    def _probe_all(self, indices: list[int], version: int) -> None:
        """Probe the servers `indices` at once after loading `version` (ServerError when one serves
        other weights); a launched server lost meanwhile is routed around instead. A vision-language
        model's probe shows the probe image (whose features the servers computed afresh: their
        encoder caches are emptied first), so it checks the vision tower's weights too."""
        prompt, images = self.image_probe() if self._processor is not None else (self.probe_prompt(), None)
        params = SamplingParams(temperature=0.0, max_new_tokens=PROBE_NEW_TOKENS)

        async def ask_all() -> list[Any]:
            if images is not None:  # features of images computed with the old weights must not be reused
                await asyncio.gather(*(self._post(self.urls[i], "/reset_encoder_cache", {}) for i in indices),
                                     return_exceptions=True)
            return await asyncio.gather(*(self._complete(prompt, params, None, url=self.urls[i], during_update=True,
                                                         images=images) for i in indices), return_exceptions=True)

        for index, answer in zip(indices, self._run(ask_all(), timeout=self.sync_timeout_s + 5)):
            if isinstance(answer, ServerLost) and self._failover:
                self._loop.call_soon_threadsafe(self._lost, index, answer)
            elif isinstance(answer, BaseException):
                raise answer
            else:
                self._compare_probe(self.urls[index], answer,
                                    self.reference_logprobs(prompt, answer.token_ids, 1.0, images),
                                    f"after loading version {version}")

    async def _reload(self, url: str, folder: Path) -> None:
        """Make the server at `url` load the weights (or with weight_sync=adapters, the adapters) in `folder`."""
        timeout = self.sync_timeout_s
        if self.weight_sync == "adapters":
            await self._post(url, "/v1/load_lora_adapter", {"lora_name": _adapter_name(folder),
                                                            "lora_path": str(folder)}, timeout=timeout)
        else:
            await self._post(url, "/collective_rpc", {"method": "reload_weights", "timeout": timeout,
                                                      "kwargs": {"weights_path": str(folder)}}, timeout=timeout)
        await self._post(url, "/reset_prefix_cache", {}, timeout=timeout)

    async def _unload_all(self, name: str, indices: list[int]) -> None:
        """Unload the replaced adapter `name` from the servers `indices` (a failure only logged:
        nothing names it any more, it only holds memory)."""
        answers = await asyncio.gather(*(self._post(self.urls[i], "/v1/unload_lora_adapter", {"lora_name": name})
                                         for i in indices), return_exceptions=True)
        for index, answer in zip(indices, answers):
            if isinstance(answer, BaseException):
                logger.warning("%s kept the replaced adapter %s: %s", self.urls[index], name, answer)

    # ------------------------------------------------------------------ the probe

    def probe_prompt(self) -> list[int]:
        """The fixed probe prompt: the first tokens of PROBE_TEXT (ids within the vocabulary)."""
        ids = [i for i in self._text_tokenizer.encode(PROBE_TEXT, add_special_tokens=False) if 0 <= i < self._vocab_size]
        if len(ids) < 4:  # a tokenizer that cannot spell the text: any fixed ids do
            ids = [(7 * k + 3) % self._vocab_size for k in range(PROBE_PROMPT_TOKENS)]
        return ids[:PROBE_PROMPT_TOKENS]

    def image_probe(self) -> tuple[list[int], PromptImages]:
        """The image probe's prompt and image: the probe prompt's first half, one fixed picture (a
        64 px gradient with a square) expanded by the model's processor, its second half."""
        from PIL import Image

        picture = Image.new("RGB", (64, 64))
        picture.putdata([(4 * x, 4 * y, 255 * (16 <= x < 32 and 16 <= y < 32)) for y in range(64) for x in range(64)])
        text = self.probe_prompt()
        prompt = text[:len(text) // 2] + placeholder_expansion(self._processor, picture) + text[len(text) // 2:]
        return prompt, PromptImages([picture], [1] * len(prompt))

    def reference_logprobs(self, prompt: list[int], tokens: list[int], temperature: float = 1.0,
                           images: PromptImages | None = None) -> list[float]:
        """Log-probs of `tokens` after `prompt` (showing `images`) under the reference model at
        `temperature` (one full forward pass, no cache; remembered until the reference changes,
        so N servers that answer a probe alike cost one pass)."""
        key = (tuple(prompt), tuple(tokens), temperature, images is not None)
        if key not in self._reference_memo:
            sequence = torch.tensor([prompt + tokens], device=self.device)
            pixels = None
            if images is not None:
                from tiderl.models.vision import image_inputs

                pixels = [{**image_inputs(self._processor.image_processor, images.images),
                           "forced": torch.tensor(images.forced + [0] * len(tokens), dtype=torch.bool)}]
            with torch.no_grad():
                logits = self.reference(**model_inputs(self.reference, sequence, pixels)).logits
            logits = logits[0, len(prompt) - 1: -1].float()
            logprobs = torch.log_softmax(logits / temperature, dim=-1)
            self._reference_memo = {key: logprobs.gather(-1, torch.tensor(tokens, device=self.device)[:, None])
                                    .squeeze(-1).tolist()}
        return self._reference_memo[key]

    def _probe(self, url: str, params: SamplingParams, during_update: bool = False,
               image: bool = False) -> tuple[Completion, list[float]]:
        prompt, images = self.image_probe() if image else (self.probe_prompt(), None)
        request = self._complete(prompt, params, None, url=url, during_update=during_update, images=images)
        completion = self._run(request, timeout=self.sync_timeout_s + 5)
        expected = self.reference_logprobs(prompt, completion.token_ids, params.temperature or 1.0, images)
        return completion, expected

    def _check_probe(self, url: str, what: str, during_update: bool = False, image: bool = False) -> None:
        """Raise ServerError unless the server's greedy probe log-probs (with the probe image:
        `probe_images`) match the reference's."""
        completion, expected = self._probe(url, SamplingParams(temperature=0.0, max_new_tokens=PROBE_NEW_TOKENS),
                                           during_update, image)
        self._compare_probe(url, completion, expected, what)

    def _compare_probe(self, url: str, completion: Completion, expected: list[float], what: str) -> None:
        diff = max(abs(a - b) for a, b in zip(completion.logprobs, expected))
        self.last_probe_diff = diff
        if not diff <= self.probe_tolerance:
            raise ServerError(
                f"{url} {what}: its log-probs of the probe differ from the trainer's weights by up to {diff:.3g} "
                f"(rollout.options.probe_tolerance={self.probe_tolerance}): it does not serve the weights tiderl "
                "holds (another model, a failed reload, or a lower-precision dtype: then raise the tolerance)")

    def _check_processed_logprobs(self, url: str) -> None:
        """Raise ServerError when the server reports temperature-1 log-probs for sampled tokens."""
        completion, expected = self._probe(url, SamplingParams(temperature=PROBE_TEMPERATURE,
                                                               max_new_tokens=PROBE_NEW_TOKENS))
        raw = self.reference_logprobs(self.probe_prompt(), completion.token_ids, 1.0)
        processed_diff = max(abs(a - b) for a, b in zip(completion.logprobs, expected))
        raw_diff = max(abs(a - b) for a, b in zip(completion.logprobs, raw))
        if processed_diff > self.probe_tolerance and raw_diff <= self.probe_tolerance:
            raise ServerError(f"{url} reports temperature-1 log-probs for tokens sampled at another temperature: "
                              "start vLLM with --logprobs-mode processed_logprobs (docs/engines.md)")
        if processed_diff > self.probe_tolerance:
            raise ServerError(f"{url}: its log-probs at temperature {PROBE_TEMPERATURE} differ from the trainer's "
                              f"by up to {processed_diff:.3g} (rollout.options.probe_tolerance={self.probe_tolerance})")


def _adapter_name(folder: Path) -> str:
    """The name the servers know the adapters in `folder` by (one folder per version)."""
    return f"tiderl-lora-{folder.name}"
