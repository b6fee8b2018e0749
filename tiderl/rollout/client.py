"""An asyncio front for an engine: many episodes ask for one completion each, the client
decodes whatever is waiting together: token by token for a continuous engine, in request-level
batches for any other; when to start decoding and on which thread: docs/engines.md, "The
batching client".
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import functools
import inspect
import itertools
from collections.abc import Iterator
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any

from tiderl.rollout.base import Completion, Engine, SamplingParams
from tiderl.aio import cancel_and_wait


# The serial number of the episode the running task plays (set by `BatchingEngine.episode()`):
# a batch is decoded in episode order, so the engine's random stream reaches the same episodes
# in the same order whatever order their threads happened to finish in.
_EPISODE: contextvars.ContextVar[int] = contextvars.ContextVar("tiderl_episode", default=-1)
# Episode and request serials, unique in the process: an episode's serial is also its session key
# in the engine, and several clients may share one engine (training and evaluation, say).
_SERIALS = itertools.count()


def _batch_key(params: SamplingParams) -> tuple[Any, ...]:
    # A request-level engine takes one SamplingParams per batch: requests with their own random
    # streams (`seed`) cannot share one.
    return (params.temperature, params.top_p, tuple(params.stop), tuple(params.stop_token_ids), params.seed)


def cut_completion(completion: Completion, max_new_tokens: int) -> Completion:
    """`completion` with at most `max_new_tokens` tokens (finish_reason 'length' when cut)."""
    if len(completion.token_ids) <= max_new_tokens:
        return completion
    return Completion(
        token_ids=completion.token_ids[:max_new_tokens],
        logprobs=completion.logprobs[:max_new_tokens],
        # The agent loop decodes the kept ids itself; the text of a cut completion is not used.
        text="",
        finish_reason="length",
        policy_version=completion.policy_version[:max_new_tokens],
    )


class BatchingEngine:
    """Gathers concurrent `generate` requests into batched `engine.generate` calls.

    Use from one event loop. `start()` begins the decode loop, `close()` ends it (pending
    requests fail with RuntimeError). Counters: `batches`, `requests`, `busy_s` (time spent
    decoding).
    """

    def __init__(self, engine: Engine, max_batch_size: int = 64, patience_s: float = 0.02,
                 gather_s: float = 0.1, thread_init: Any = None, executor: Executor | None = None):
        self.engine = engine
        self.max_batch_size = max_batch_size
        self.patience_s = patience_s
        self.gather_s = gather_s
        self._episodes = 0  # registered episodes (`episode()`)
        self._env_since: dict[int, float] = {}  # of those, inside an environment call: since when
        # (prompt, params, future, episode serial, arrival serial)
        self._pending: list[tuple[list[int], SamplingParams, asyncio.Future[Completion], int, int]] = []
        # Token-level decoding through the engine's continuous interface, when it has one.
        continuous = getattr(engine, "continuous", None)
        self._continuous = bool(callable(continuous) and continuous())
        self._serving = False  # the engine is serving a batch now (token-level decoding)
        self._submitted: dict[asyncio.Future[Completion], Any] = {}  # futures of requests in the engine
        self._sessions = not self._continuous and _accepts(engine.generate, "sessions")
        self._end_session = getattr(engine, "end_session", None)
        self._wake = asyncio.Event()
        # Decoding and weight loads run on their own threads (`thread_init` runs first in each, e.g.
        # a torch thread budget), or on `executor` when the caller shares one compute thread
        # between components that never run at once (synchronous training).
        self._own_threads = executor is None
        self._decoder = executor or ThreadPoolExecutor(1, thread_name_prefix="tiderl-decode", initializer=thread_init)
        self._loader = executor or ThreadPoolExecutor(1, thread_name_prefix="tiderl-weights", initializer=thread_init)
        self._task: asyncio.Task[None] | None = None
        self.batches = 0
        self.requests = 0
        self.busy_s = 0.0

    @property
    def version(self) -> int:
        return self.engine.version

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._decode_loop(), name="tiderl-decode")

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        for handle in self._submitted.values():
            handle.cancelled = True  # the engine drops them at its next step
        for future in [r[2] for r in self._pending] + list(self._submitted):
            if not future.done():
                future.set_exception(RuntimeError("the engine client was closed"))
        self._pending.clear()
        self._submitted.clear()
        if self._own_threads:
            self._decoder.shutdown(wait=True)
            self._loader.shutdown(wait=True)

    async def generate(self, prompt: list[int], params: SamplingParams, images: Any = None) -> Completion:
        """One completion for `prompt` (decoded in a batch with whatever else is waiting); `images`:
        the prompt's `models.vision.PromptImages`, for an engine that takes them."""
        if self._task is None:
            raise RuntimeError("BatchingEngine.start() was not called")
        if images:
            entry = self.engine.submit if self._continuous else self.engine.generate  # type: ignore[attr-defined]
            if not _accepts(entry, "images"):
                raise ValueError(f"{type(self.engine).__name__} takes no images, and this episode shows some: use an "
                                 "engine that decodes with images (rollout.engine=torch with a vision-language model)")
            prompt = _ImagePrompt(prompt, images)
        future: asyncio.Future[Completion] = asyncio.get_running_loop().create_future()
        request = (prompt, params, future, _EPISODE.get(), next(_SERIALS))
        if self._serving and self._own_threads:
            # The engine is decoding on its thread: join its batch at the next step.
            self._submit(request)
            self.requests += 1
        else:
            self._pending.append(request)
            self._wake.set()
        return await future

    def _submit(self, request: tuple[list[int], SamplingParams, asyncio.Future[Completion], int, int]) -> None:
        """Hand one request to a continuous engine; its future resolves from the decoding thread."""
        prompt, params, future, episode, _ = request
        loop = asyncio.get_running_loop()

        def resolve(result: Any) -> None:
            self._submitted.pop(future, None)
            if future.done():
                return
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)

        def on_done(result: Any) -> None:  # runs on the decoding thread
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
                loop.call_soon_threadsafe(resolve, result)

        try:
            handle = self.engine.submit(prompt, params, session=episode if episode >= 0 else None,  # type: ignore[attr-defined]
                                        on_done=on_done, **_images_of([prompt], single=True))
        except Exception as exc:  # noqa: BLE001 - a bad request fails only its own episode
            future.set_exception(exc)
            return
        self._submitted[future] = handle
        # A cancelled episode's row leaves the batch at the next step.
        future.add_done_callback(lambda f: setattr(handle, "cancelled", True) if f.cancelled() else None)

    @contextlib.contextmanager
    def episode(self) -> Iterator[None]:
        """Register one episode for the whole of its life (see "When to decode")."""
        self._episodes += 1
        token = _EPISODE.set(next(_SERIALS))
        try:
            yield
        finally:
            if self._end_session is not None:
                self._end_session(_EPISODE.get())
            _EPISODE.reset(token)
            self._episodes -= 1
            self._wake.set()

    @contextlib.contextmanager
    def in_env(self) -> Iterator[None]:
        """Mark a registered episode as busy in its environment (it will not ask meanwhile)."""
        key = object()
        self._env_since[id(key)] = asyncio.get_running_loop().time()
        try:
            yield
        finally:
            del self._env_since[id(key)]

    def _next_check(self, now: float) -> float | None:
        """None when every registered episode has asked or is slow in its environment; else
        the time at which an episode in its environment will count as slow."""
        waiting = sum(1 for r in self._pending if not r[2].done())
        fast = [t + self.patience_s for t in self._env_since.values() if now - t < self.patience_s]
        if waiting >= self._episodes - (len(self._env_since) - len(fast)):
            return None
        return min(fast, default=now + self.gather_s)

    async def _gather(self) -> None:
        """Wait until every registered episode has asked or is slow in its environment (at most
        `gather_s`)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.gather_s
        while (check := self._next_check(loop.time())) is not None and loop.time() < deadline:
            self._wake.clear()
            # A timer rather than asyncio.wait_for, which on Python 3.11 can swallow a
            # cancellation that arrives together with the wake-up (and then close() hangs).
            timer = loop.call_at(min(check, deadline), self._wake.set)
            try:
                await self._wake.wait()
            finally:
                timer.cancel()

    async def update_weights(self, state_dict: dict[str, Any], version: int) -> None:
        """Load new weights without waiting for the batch in flight to finish."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._loader, self.engine.update_weights, state_dict, version)

    async def call(self, fn: Any, *args: Any) -> Any:
        """Run `fn(*args)` on the weights thread (checksums and other engine queries)."""
        return await asyncio.get_running_loop().run_in_executor(self._loader, fn, *args)

    def _take_batch(self) -> list[tuple[list[int], SamplingParams, asyncio.Future[Completion], int, int]]:
        """The oldest request and every waiting request compatible with it (up to the cap); every
        waiting request for a continuous engine (it batches any settings and queues beyond its
        slots)."""
        live = [r for r in self._pending if not r[2].done()]  # drop requests of cancelled episodes
        if not live:
            self._pending = []
            return []
        if self._continuous:
            self._pending = []
            return sorted(live, key=lambda r: (r[3], r[4]))
        key = _batch_key(live[0][1])
        batch, rest = [], []
        for request in live:
            if len(batch) < self.max_batch_size and _batch_key(request[1]) == key:
                batch.append(request)
            else:
                rest.append(request)
        self._pending = rest
        return sorted(batch, key=lambda r: (r[3], r[4]))

    async def _decode_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while True:
                await self._gather()
                batch = self._take_batch()
                if not batch:
                    break
                if self._continuous:
                    await self._serve(batch)
                    continue
                budget = max(r[1].max_new_tokens for r in batch)
                params = dataclasses.replace(batch[0][1], max_new_tokens=budget)
                prompts = [r[0] for r in batch]
                sessions = {"sessions": [r[3] if r[3] >= 0 else None for r in batch]} if self._sessions else {}
                sessions.update(_images_of(prompts))
                t0 = loop.time()
                try:
                    completions = await loop.run_in_executor(
                        self._decoder, functools.partial(self.engine.generate, prompts, params, **sessions))
                except Exception as exc:  # noqa: BLE001 - each waiting episode gets the failure
                    for *_, future, _, _ in batch:
                        if not future.done():
                            future.set_exception(exc)
                    continue
                finally:
                    self.busy_s += loop.time() - t0
                self.batches += 1
                self.requests += len(batch)
                for (_, p, future, _, _), completion in zip(batch, completions):
                    if not future.done():
                        future.set_result(cut_completion(completion, p.max_new_tokens))

    async def _serve(self, batch: list[tuple[list[int], SamplingParams, asyncio.Future[Completion], int, int]]) -> None:
        """Submit `batch` to the continuous engine and let it decode until nothing is left (requests
        that arrive meanwhile join; see `generate`)."""
        loop = asyncio.get_running_loop()
        for request in batch:
            self._submit(request)
        self.requests += len(batch)
        t0 = loop.time()
        self._serving = True
        try:
            # A request submitted after the engine found its queue empty, but before this loop
            # saw it return, would wait forever: serve again while anything is left.
            while True:
                await loop.run_in_executor(self._decoder, self.engine.serve)  # type: ignore[attr-defined]
                self.batches += 1
                if not self.engine.pending():  # type: ignore[attr-defined]
                    break
        finally:
            self._serving = False
            self.busy_s += loop.time() - t0


def _accepts(method: Any, keyword: str) -> bool:
    """Whether an engine's `method` accepts `keyword=` (`sessions`: episode identities for prefix
    reuse; `images`: the prompts' images)."""
    try:
        return keyword in inspect.signature(method).parameters
    except (TypeError, ValueError):
        return False


class _ImagePrompt(list):  # type: ignore[type-arg]
    """A prompt's token ids that carry its images (`generate(images=)`) through the queue."""

    def __init__(self, ids: list[int], images: Any):
        super().__init__(ids)
        self.images = images


def _images_of(prompts: list[list[int]], single: bool = False) -> dict[str, Any]:
    """The `images=` argument for the engine: one `PromptImages` (or None) per prompt (the one
    prompt's with `single`), or nothing when no prompt has images (the text-only call is unchanged)."""
    images = [getattr(p, "images", None) for p in prompts]
    if all(i is None for i in images):
        return {}
    return {"images": images[0] if single else images}
