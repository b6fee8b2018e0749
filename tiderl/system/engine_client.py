"""An asyncio front for a batch engine: many episodes ask for one completion each, the client
decodes whatever is waiting as one batch.

Episodes in a continuous rollout arrive at the engine at different times and with different
token budgets. `BatchingEngine.generate(prompt, params)` queues the request; one decode loop
takes every waiting request with compatible sampling settings (the same temperature, top-p,
stop strings and stop ids), decodes them together with the largest `max_new_tokens` asked, and
cuts each completion back to its own budget (a sample stopped at that length). Requests that
arrive while a batch decodes wait for the next batch. Decoding runs on its own thread so the
event loop keeps serving environments; weight updates run on another thread and reach the
engine between two decode steps (the engine's lock), so a turn in flight may carry two
versions, token by token.
"""

from __future__ import annotations

import asyncio
import dataclasses
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tiderl.rollout.base import Completion, Engine, SamplingParams
from tiderl.system.aio import cancel_and_wait


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

    def __init__(self, engine: Engine, max_batch_size: int = 64):
        self.engine = engine
        self.max_batch_size = max_batch_size
        self._pending: list[tuple[list[int], SamplingParams, asyncio.Future[Completion]]] = []
        self._wake = asyncio.Event()
        self._decoder = ThreadPoolExecutor(1, thread_name_prefix="tiderl-decode")
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="tiderl-weights")
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
        for _, _, future in self._pending:
            if not future.done():
                future.set_exception(RuntimeError("the engine client was closed"))
        self._pending.clear()
        self._decoder.shutdown(wait=True)
        self._loader.shutdown(wait=True)

    async def generate(self, prompt: list[int], params: SamplingParams) -> Completion:
        """One completion for `prompt` (decoded in a batch with whatever else is waiting)."""
        if self._task is None:
            raise RuntimeError("BatchingEngine.start() was not called")
        future: asyncio.Future[Completion] = asyncio.get_running_loop().create_future()
        self._pending.append((prompt, params, future))
        self._wake.set()
        return await future

    async def update_weights(self, state_dict: dict[str, Any], version: int) -> None:
        """Load new weights without waiting for the batch in flight to finish."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._loader, self.engine.update_weights, state_dict, version)

    async def call(self, fn: Any, *args: Any) -> Any:
        """Run `fn(*args)` on the weights thread (checksums and other engine queries)."""
        return await asyncio.get_running_loop().run_in_executor(self._loader, fn, *args)

    def _take_batch(self) -> list[tuple[list[int], SamplingParams, asyncio.Future[Completion]]]:
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
        return batch

    async def _decode_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while True:
                batch = self._take_batch()
                if not batch:
                    break
                budget = max(p.max_new_tokens for _, p, _ in batch)
                params = dataclasses.replace(batch[0][1], max_new_tokens=budget)
                prompts = [prompt for prompt, _, _ in batch]
                t0 = loop.time()
                try:
                    completions = await loop.run_in_executor(self._decoder, self.engine.generate, prompts, params)
                except Exception as exc:  # noqa: BLE001 - each waiting episode gets the failure
                    for _, _, future in batch:
                        if not future.done():
                            future.set_exception(exc)
                    continue
                finally:
                    self.busy_s += loop.time() - t0
                self.batches += 1
                self.requests += len(batch)
                for (_, p, future), completion in zip(batch, completions):
                    if not future.done():
                        future.set_result(cut_completion(completion, p.max_new_tokens))
