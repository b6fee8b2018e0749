"""An asyncio front for a batch engine: many episodes ask for one completion each, the client
decodes whatever is waiting as one batch.

Episodes in a continuous rollout arrive at the engine at different times and with different
token budgets. `BatchingEngine.generate(prompt, params)` queues the request; one decode loop
takes every waiting request with compatible sampling settings (the same temperature, top-p,
stop strings and stop ids), decodes them together with the largest `max_new_tokens` asked, and
cuts each completion back to its own budget (a sample stopped at that length). Requests that
arrive while a batch decodes wait for the next batch.

When to decode: episodes that register with `episode()` and mark their environment calls with
`in_env()` let the client wait until every registered episode has asked for its turn, except
those that have been inside their environment for longer than `patience_s` (a slow tool), and
never longer than `gather_s` in all. Episodes that move together therefore decode together:
with fast tools a staleness-0 step decodes one batch per turn, exactly like a lock-step loop,
while a slow tool holds the others back by `patience_s` at most. Unregistered callers are
served as soon as they ask.

Where it decodes: on its own thread, so the event loop keeps serving environments, with weight
updates on another that reach the engine between two decode steps (the engine's lock), so a
turn in flight may carry two versions, token by token; or on an executor the caller passes
(synchronous training and `play_episodes` pass an `InlineExecutor`: decoding in the loop's own
thread, while no episode could run anyway).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
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


def _batch_key(params: SamplingParams) -> tuple[Any, ...]:
    return (params.temperature, params.top_p, tuple(params.stop), tuple(params.stop_token_ids))


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
        self._serials = itertools.count()
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
        for *_, future, _, _ in self._pending:
            if not future.done():
                future.set_exception(RuntimeError("the engine client was closed"))
        self._pending.clear()
        if self._own_threads:
            self._decoder.shutdown(wait=True)
            self._loader.shutdown(wait=True)

    async def generate(self, prompt: list[int], params: SamplingParams) -> Completion:
        """One completion for `prompt` (decoded in a batch with whatever else is waiting)."""
        if self._task is None:
            raise RuntimeError("BatchingEngine.start() was not called")
        future: asyncio.Future[Completion] = asyncio.get_running_loop().create_future()
        self._pending.append((prompt, params, future, _EPISODE.get(), next(self._serials)))
        self._wake.set()
        return await future

    @contextlib.contextmanager
    def episode(self) -> Iterator[None]:
        """Register one episode for the whole of its life (see "When to decode")."""
        self._episodes += 1
        token = _EPISODE.set(next(self._serials))
        try:
            yield
        finally:
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
        """The oldest request and every waiting request compatible with it (up to the cap)."""
        live = [r for r in self._pending if not r[2].done()]  # drop requests of cancelled episodes
        if not live:
            self._pending = []
            return []
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
                budget = max(r[1].max_new_tokens for r in batch)
                params = dataclasses.replace(batch[0][1], max_new_tokens=budget)
                prompts = [r[0] for r in batch]
                t0 = loop.time()
                try:
                    completions = await loop.run_in_executor(self._decoder, self.engine.generate, prompts, params)
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
