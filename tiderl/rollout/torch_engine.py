"""The embedded engine: KV-cache sampling with any Hugging Face causal LM, on CPU or GPU, with
token-level continuous batching and per-episode prefix reuse. How the batch, prefix reuse,
sampling, weight updates and images work: docs/engines.md, "The torch engine" (and "The torch
engine's memory"; images: docs/multimodal.md)."""

from __future__ import annotations

import collections
import copy
import inspect
import threading
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import Cache, DynamicCache, PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import DynamicLayer

from tiderl.models.vision import PromptImages, check_images, embed_inputs, image_inputs, rope_positions, split_processor
from tiderl.rollout import low_rank
from tiderl.rollout.base import (Completion, OnDone, SamplingParams, check_request, check_update, stream_uniform,
                                 token_decoder)
from tiderl.rollout.fast_decode import DecodeStep, copy_into
from tiderl.rollout.options import TorchEngineOptions
from tiderl.rollout.weights import weights_checksum


@dataclass(eq=False)
class Request:
    """One completion asked of the engine (see `TorchEngine.submit`).

    Set `cancelled = True` (from any thread) to drop it: it leaves the batch at the next step
    and its `on_done` is not called.
    """

    prompt: list[int]
    params: SamplingParams
    session: Hashable | None = None
    on_done: OnDone | None = None
    cancelled: bool = False
    result: Completion | None = None
    error: BaseException | None = None
    images: PromptImages | None = None  # the images the prompt shows


@dataclass(eq=False)
class _Row:
    """A request while it decodes."""

    request: Request
    fed: list[int]  # the tokens whose KV is in the batch cache, in order
    cache_version: int  # the version all of that KV was computed with; -1 when mixed
    stop_ids: frozenset[int]
    stop_window: int
    logit_version: int  # the version of the weights that computed the row's next-token logits
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    rope_lag: int = 0  # M-RoPE (Qwen2-VL): a decode step's position is its index plus this (vision.rope_positions)


@dataclass
class _Kept:
    """The KV cache of a finished row, kept for its session's next turn."""

    tokens: list[int]
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer, [1, heads, len(tokens), head_dim]
    version: int
    nbytes: int
    images: list[Any] = field(default_factory=list)  # the images its tokens show (same objects, in order)


class TorchEngine:
    """Token-in/token-out generation with log-probs and versioned weights (the Engine protocol),
    plus the continuous interface (`submit`, `serve`, `end_session`) the batching client uses.

    The engine samples with its own deep copy of `model` on `device` (training the original
    reaches it only through `update_weights`), or with `copy_model=False` with `model` itself, for
    a caller with no further use for it (evaluation). Sampling draws from one `torch.Generator`
    seeded with `seed`: a fresh engine with the same seed, prompts and params returns the same
    completions. At most `max_batch_size` rows decode at once; kept prefix caches take at most
    `prefix_cache_mb` MiB (0: no prefix reuse); joining requests are prefilled in forward passes of
    at most `prefill_tokens` tokens, rows x columns with padding (0: one pass), which bounds the
    prefill's activations (docs/engines.md, "The torch engine's memory").
    """

    Options = TorchEngineOptions  # rollout.options, with rollout.engine naming this class or a subclass

    @classmethod
    def from_config(cls, cfg: Any, model: Any, tokenizer: Any, *, seed: int, copy_model: bool = True) -> Any:
        """The engine `cfg` describes (`tiderl.rollout.make_engine` calls this)."""
        return cls(model, tokenizer, device=cfg.rollout.options.device or cfg.model.device, seed=seed,
                   max_batch_size=cfg.rollout.engine_batch_size, copy_model=copy_model,
                   prefill_tokens=cfg.rollout.options.prefill_tokens, dtype=cfg.rollout.options.dtype)

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        device: str | torch.device = "cpu",
        seed: int = 0,
        max_batch_size: int = 64,
        prefix_cache_mb: float = 1024.0,
        copy_model: bool = True,
        prefill_tokens: int = TorchEngineOptions.prefill_tokens,
        dtype: str | torch.dtype = "",
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size} must be at least 1")
        if prefix_cache_mb < 0:
            raise ValueError(f"prefix_cache_mb={prefix_cache_mb} is negative: use 0 to keep no prefix caches")
        if prefill_tokens < 0:
            raise ValueError(f"prefill_tokens={prefill_tokens} is negative: use 0 for no limit")
        self.device = torch.device(device)
        source_dtype = next(model.parameters()).dtype
        # Computing in another dtype than the weights it is sent (bf16 against an fp32 trainer): each
        # update is cast on load and checked against the cast of what was sent; the engine then
        # reports the checksum of what was sent, which is what the trainer compares.
        self._cast = getattr(torch, dtype) if isinstance(dtype, str) and dtype else dtype or None
        if self._cast == source_dtype:
            self._cast = None
        fingerprint = weights_checksum(model.state_dict()) if self._cast else None
        self.model = (copy.deepcopy(model) if copy_model else model).to(self.device).eval().requires_grad_(False)
        if self._cast is not None:  # the parameters only: buffers such as rotary frequencies stay as built
            for param in self.model.parameters():
                param.data = param.data.to(self._cast)
        if not copy_model and self.device.type == "cpu":
            _own_memory(self.model)
        tokenizer, self.processor = split_processor(tokenizer)  # (the processor: None for a text model)
        self.tokenizer = tokenizer
        processor = self.processor
        self._image_processor = processor.image_processor if processor is not None else None
        self.max_batch_size = max_batch_size
        self.prefix_cache_bytes = int(prefix_cache_mb * 2**20)
        self.prefill_tokens = prefill_tokens
        self.version = 0
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self._lock = threading.Lock()  # the weights: one forward pass or one weight load at a time
        self._released = self._fast_model = False  # release_memory: the weights are in host memory
        self._serve_lock = threading.Lock()  # the batch: one thread decodes it at a time
        self._inbox_lock = threading.Lock()  # the waiting requests and the kept caches
        self._inbox: collections.deque[Request] = collections.deque()
        self._kept: collections.OrderedDict[Hashable, _Kept] = collections.OrderedDict()
        self._kept_bytes = 0
        self._fingerprint: float | None = fingerprint  # weights_checksum of the held weights (or of those sent)
        # The running batch: rows, their KV cache (cache columns = self._width) and the logits of
        # each row's next token.
        self._rows: list[_Row] = []
        self._cache: Cache | None = None
        self._width = 0
        self._logits: torch.Tensor | None = None
        self._joining: list[Request] = []  # taken from the inbox, being prefilled
        # Counters: rows prefilled, prompt tokens encoded, prompt tokens reused from a kept cache,
        # prompt tokens copied from an identical prompt that joined at the same time, decode
        # forward passes, prefill forward passes.
        self.stats = {"requests": 0, "encoded_tokens": 0, "reused_tokens": 0, "shared_tokens": 0,
                      "decode_steps": 0, "prefill_passes": 0}
        self._vocab_size = self.model.get_output_embeddings().weight.shape[0]
        # Any id works under a zero attention mask; the pad id keeps debugging output readable.
        self._pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self._max_positions = getattr(self.model.config, "max_position_embeddings", None)
        # Plain caches (every layer full attention) can be re-laid out: joins, trims, prefix reuse.
        text_config = self.model.config.get_text_config(decoder=True)
        layer_types = getattr(text_config, "layer_types", None)
        sliding = getattr(text_config, "use_sliding_window", False) and getattr(text_config, "sliding_window", None)
        self._plain = not sliding and (layer_types is None or all(t == "full_attention" for t in layer_types))
        # The decode step without the Hugging Face module stack, where the model allows it.
        self._fast = DecodeStep.of(self.model) if self._plain else None
        # Argument names differ across transformers versions: the KV cache is `cache` in recent 5.x
        # and `past_key_values` before; computing only the last position's logits is
        # `logits_to_keep` (>= 4.50) or `num_logits_to_keep` (4.45-4.49).
        forward_args = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in forward_args else "past_key_values"
        self._last_logits_only = {
            name: 1 for name in ("logits_to_keep", "num_logits_to_keep") if name in forward_args
        }
        # Those arguments hand the head the strided view `[:, -1:]` of the hidden states, which
        # torch's bf16 CPU projection costs as much as every position (gigabytes at a 151k-token
        # vocabulary: docs/real_models.md), so the head gets a contiguous input.
        self.model.get_output_embeddings().register_forward_pre_hook(_contiguous_input)
        self._decode = token_decoder(tokenizer)  # stop strings are checked after every token of every row

    # ------------------------------------------------------------------ the batch interface

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, sessions: list[Hashable | None] | None = None,
        images: list[PromptImages | None] | None = None,
    ) -> list[Completion]:
        """Sample one completion per prompt, in prompt order (docs/engines.md, "The torch engine").

        `sessions[i]` (optional) names prompt i's episode: its kept cache is reused when the
        prompt extends it, and the row's cache is kept for the session's next turn. `images[i]`
        (optional): the images prompt i shows.
        """
        if sessions is not None and len(sessions) != len(prompts):
            raise ValueError(f"{len(sessions)} sessions for {len(prompts)} prompts: give one per prompt (or None)")
        if images is not None and len(images) != len(prompts):
            raise ValueError(f"{len(images)} PromptImages for {len(prompts)} prompts: give one per prompt (None for none)")
        for i, prompt in enumerate(prompts):
            check_request(prompt, params, i, self._vocab_size, self._max_positions)
            check_images(prompt, images[i] if images else None, self.processor)
        if not prompts:
            return []
        finished = threading.Event()
        remaining = [len(prompts)]

        def on_done(_: Any) -> None:
            remaining[0] -= 1  # only the decoding thread calls it
            if remaining[0] == 0:
                finished.set()

        requests = [Request(list(p), params, sessions[i] if sessions else None, on_done,
                            images=images[i] if images else None)
                    for i, p in enumerate(prompts)]
        with self._inbox_lock:
            self._inbox.extend(requests)
        # Decode here, unless another thread is decoding: it serves these requests too.
        while not finished.is_set():
            if self._serve_lock.acquire(blocking=False):
                try:
                    self._serve()
                finally:
                    self._serve_lock.release()
            else:
                finished.wait(0.005)
        for request in requests:
            if request.error is not None:
                raise request.error
        return [r.result for r in requests]  # type: ignore[misc]

    # ------------------------------------------------------------------ the continuous interface

    def continuous(self) -> bool:
        """Whether a client should drive this engine through `submit`/`serve` (token-level
        joining) rather than `generate`: not when a subclass overrides `generate` (to wrap it, say),
        since `serve` would bypass the override."""
        return type(self).generate is TorchEngine.generate

    def submit(self, prompt: list[int], params: SamplingParams, session: Hashable | None = None,
               on_done: OnDone | None = None, images: PromptImages | None = None) -> Request:
        """Queue one request (any thread); it joins the batch at the next step of `serve`.

        Raises ValueError at once for a bad request. `on_done(result)` is called from the decoding
        thread with the Completion, or with the exception that ended the request. `images`: the
        images the prompt shows.
        """
        check_request(prompt, params, 0, self._vocab_size, self._max_positions)
        check_images(prompt, images, self.processor)
        request = Request(list(prompt), params, session, on_done, images=images)
        with self._inbox_lock:
            self._inbox.append(request)
        return request

    def pending(self) -> int:
        """Requests waiting to join or decoding now."""
        with self._inbox_lock:
            return len(self._inbox) + len(self._rows)

    def serve(self) -> None:
        """Decode until no request waits or decodes (requests submitted meanwhile join).

        One thread decodes at a time; a second caller waits, and finds its requests served.
        An exception in a forward pass ends every request in the batch and in the queue (each
        gets it through `on_done` or `Request.error`); the engine stays usable.
        """
        with self._serve_lock:
            self._serve()

    def _serve(self) -> None:
        """`serve` for the thread that holds `_serve_lock`."""
        try:
            while True:
                self._admit()
                if not self._rows:
                    with self._inbox_lock:
                        if not self._inbox:
                            return
                    continue
                self._step()
        except Exception as exc:  # noqa: BLE001 - handed to every request it ended
            with self._inbox_lock:
                failed = self._joining + [row.request for row in self._rows] + list(self._inbox)
                self._inbox.clear()
                self._joining = []
            self._reset_batch()
            for request in failed:
                request.error = exc
                if request.on_done is not None and not request.cancelled:
                    request.on_done(exc)

    def end_session(self, session: Hashable) -> None:
        """Forget `session`'s kept cache (its episode is over). Any thread."""
        with self._inbox_lock:
            kept = self._kept.pop(session, None)
            if kept is not None:
                self._kept_bytes -= kept.nbytes

    # ------------------------------------------------------------------ decoding

    def _reset_batch(self) -> None:
        self._rows, self._cache, self._width, self._logits = [], None, 0, None

    @torch.inference_mode()
    def _admit(self) -> None:
        """Prefill waiting requests into the free slots and append them to the batch."""
        free = self.max_batch_size - len(self._rows)
        if free <= 0 or (self._rows and not self._plain):
            return
        with self._inbox_lock:
            joining: list[Request] = []
            while self._inbox and len(joining) < free:
                request = self._inbox.popleft()
                if not request.cancelled:
                    joining.append(request)
            reuse = [self._take_kept(r) for r in joining]
        if not joining:
            return
        self._joining = joining  # so that an error in their prefill reaches them
        suffixes = [r.prompt[len(kept[0]):] if kept else r.prompt for r, kept in zip(joining, reuse)]
        prefix = [len(kept[0]) if kept else 0 for kept in reuse]
        # At most `prefill_tokens` (rows x columns) per forward pass: the joining requests are
        # prefilled in groups of consecutive rows, each copied into one cache as soon as it is
        # done (so one group's cache is alive at a time), which is merged once.
        groups = _prefill_groups(suffixes, prefix, self.prefill_tokens if self._plain else 0, self._plain)
        # Every group's cache is at most as wide as its longest prompt.
        width = max(len(r.prompt) for r in joining)
        buffers: list[tuple[torch.Tensor, torch.Tensor]] = []
        cache, logit_parts, versions, logit_versions, lags, row = None, [], [], [], [], 0
        for g in groups:
            cache, logits, group_versions, logit_version = self._prefill(
                [suffixes[i] for i in g], [prefix[i] for i in g], [reuse[i] for i in g], [joining[i] for i in g], lags)
            logit_parts.append(logits)
            versions += group_versions
            logit_versions += [logit_version] * len(g)
            if len(groups) > 1:
                buffers = buffers or [(layer.keys.new_zeros(len(joining), layer.keys.shape[1], width + _SPARE,
                                                            layer.keys.shape[3]),
                                       layer.values.new_zeros(len(joining), layer.values.shape[1], width + _SPARE,
                                                              layer.values.shape[3])) for layer in cache.layers]
                for (keys, values), layer in zip(buffers, cache.layers):
                    n = layer.keys.shape[2]
                    keys[row: row + len(g), :, width - n: width] = layer.keys
                    values[row: row + len(g), :, width - n: width] = layer.values
                row += len(g)
                cache = None  # released before the next group's forward pass
        if len(groups) > 1:
            cache = _cache_of([_GrowingLayer(keys, values, width) for keys, values in buffers])
        logits = logit_parts[0] if len(logit_parts) == 1 else torch.cat(logit_parts)
        del buffers, logit_parts
        self.stats["requests"] += len(joining)
        # A stop string completed by the newest token lies within its last `len(bytes)` tokens
        # (every token decodes to at least one byte); one more token absorbs a partial UTF-8
        # character or a stripped leading space at the window's start.
        rows = [
            _Row(r, list(r.prompt), v, frozenset(r.params.stop_token_ids),
                 max((len(s.encode("utf-8")) for s in r.params.stop), default=0) + 2, logit_version, rope_lag=lag)
            for r, v, logit_version, lag in zip(joining, versions, logit_versions, lags)
        ]
        self._merge(rows, cache, logits)
        self._joining = []

    def _prefill(
        self,
        suffixes: list[list[int]],
        prefix: list[int],
        reuse: list[tuple[list[int], list[tuple[torch.Tensor, torch.Tensor]], int] | None],
        requests: list[Request],
        lags: list[int],
    ) -> tuple[Cache, torch.Tensor, list[int], int]:
        """Encode `suffixes` (after each row's kept prefix of `prefix[g]` tokens, `reuse[g]`):
        the rows' right-aligned cache, their next-token logits, each row's cache version (-1
        when mixed) and the version of the weights that computed the logits; each row's
        `_Row.rope_lag` is appended to `lags`. Passes of at most `prefill_tokens` tokens (0: one
        pass) go along the columns, each continuing from the last."""
        group, span, width = len(suffixes), max(len(s) for s in suffixes), max(prefix)
        # Identical prompts joining together (the completions of one group) are encoded once and
        # their rows of the cache copied; only when no row reuses a kept cache (all are whole prompts).
        encode, copies = suffixes, None
        with_images = any(r.images is not None and r.images.images for r in requests)
        if width == 0 and self._plain and not with_images:  # (equal tokens may show different images)
            first: dict[tuple[int, ...], int] = {}
            source = [first.setdefault(tuple(s), len(first)) for s in suffixes]
            if len(first) < group:
                encode, copies = [list(k) for k in first], source
        input_ids = torch.full((len(encode), span), self._pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(encode), width + span), dtype=torch.long)
        position_ids = torch.zeros((len(encode), span), dtype=torch.long)
        for g, (suffix, p) in enumerate(zip(encode, prefix)):
            input_ids[g, span - len(suffix):] = torch.tensor(suffix, dtype=torch.long)
            attention_mask[g, width - p: width] = 1
            attention_mask[g, width + span - len(suffix):] = 1
            position_ids[g, span - len(suffix):] = torch.arange(p, p + len(suffix))
        cache = None
        if width > 0:
            cache = _cache_of([
                _GrowingLayer(*(_stack_rows([kept[1][layer][i] if kept else None for kept in reuse], width,
                                            spare=span + _SPARE) for i in (0, 1)), width)
                for layer in range(len(next(k for k in reuse if k)[1]))
            ])
        elif self._plain:
            cache = _cache_of(None)
        step = max(1, self.prefill_tokens // len(encode)) if self.prefill_tokens and self._plain else span
        input_ids, attention_mask, position_ids = (t.to(self.device) for t in (input_ids, attention_mask, position_ids))
        seen: set[int] = set()
        embeds, rope = self._embed(input_ids, requests, suffixes, prefix, seen) if with_images else (None, {})
        lags += [rope[g][1] if g in rope else 0 for g in range(len(suffixes))]
        if rope:  # M-RoPE: 3-D positions, a row with images at its whole prompt's (vision.rope_positions)
            position_ids = position_ids.expand(3, -1, -1).clone()
            for g, (positions, _) in rope.items():
                position_ids[:, g, span - len(suffixes[g]):] = positions[:, prefix[g]:]
        for start in range(0, span, step):
            stop = min(span, start + step)
            logits, cache, version = self._forward(input_ids[:, start:stop], attention_mask[:, :width + stop],
                                                   position_ids[..., start:stop], cache,
                                                   None if embeds is None else embeds[:, start:stop])
            seen.add(version)
            self.stats["prefill_passes"] += 1
        if copies is not None:
            index = torch.tensor(copies, dtype=torch.long, device=self.device)
            logits = logits[index]
            for layer in cache.layers:
                layer.batch_select_indices(index)
        versions = [version if len(seen) == 1 and (not kept or kept[2] == version) else -1 for kept in reuse]
        lengths = [p + len(s) for p, s in zip(prefix, suffixes)]
        if self._plain and any(p > 0 and len(s) < span for p, s in zip(prefix, suffixes)):
            # Rows that reused a prefix and encoded fewer tokens than the longest suffix have a gap
            # of padding between the two parts: move each row's tokens to the right end.
            cache = _compact(cache, attention_mask, max(lengths))
        self.stats["encoded_tokens"] += sum(len(s) for s in encode)
        self.stats["shared_tokens"] += sum(len(s) for s in suffixes) - sum(len(s) for s in encode)
        self.stats["reused_tokens"] += sum(prefix)
        return cache, logits, versions, version

    def _embed(self, input_ids: torch.Tensor, requests: list[Request], suffixes: list[list[int]], prefix: list[int],
               seen: set[int]) -> tuple[torch.Tensor, dict[int, tuple[torch.Tensor, int]]]:
        """Input embeddings of a prefill (`input_ids`: the suffixes, right-aligned): the suffix part
        of each row's whole prompt embedded with all its images (`embed_inputs`: a placeholder run
        cut by a reused prefix still gets its own features). Adds the weights' version to `seen`.
        For a model with M-RoPE, also {row: (its whole prompt's [3, len] positions, its rope lag)}
        for the rows with images."""
        rope: dict[int, tuple[torch.Tensor, int]] = {}
        with self._lock:
            self._restore()
            embeds = self.model.get_input_embeddings()(input_ids)
            for g, (request, suffix, p) in enumerate(zip(requests, suffixes, prefix)):
                if request.images is not None and request.images.images:
                    pixels = {**image_inputs(self._image_processor, request.images.images),
                              "forced": torch.tensor(request.images.forced, dtype=torch.bool)}
                    whole = torch.tensor([request.prompt], dtype=torch.long, device=self.device)
                    embeds[g, embeds.shape[1] - len(suffix):] = embed_inputs(self.model, whole, [pixels])[0, p:]
                    lag: list[int] = []
                    positions = rope_positions(self.model, whole, [pixels], lag)
                    if positions is not None:
                        rope[g] = (positions[:, 0].to(self.device), lag[0])
            seen.add(self.version)
        return embeds, rope

    def _take_kept(self, request: Request) -> tuple[list[int], list[tuple[torch.Tensor, torch.Tensor]], int] | None:
        """The kept cache of `request`'s session cut to what the prompt shares with it (at least one
        prompt token is left to encode), or None. The entry leaves the store (the row keeps it
        again when it finishes). Caller holds `_inbox_lock`."""
        if request.session is None or not self._plain:
            return None
        kept = self._kept.pop(request.session, None)
        if kept is None:
            return None
        self._kept_bytes -= kept.nbytes
        if kept.version != self.version:
            return None
        # The kept tokens showed these images: reuse only for a prompt that shows them first.
        shown = request.images.images if request.images is not None else []
        if len(kept.images) > len(shown) or any(a is not b for a, b in zip(kept.images, shown)):
            return None
        shared = _common_prefix(kept.tokens, request.prompt)
        shared = min(shared, len(request.prompt) - 1)
        if shared <= 0:
            return None
        return kept.tokens[:shared], [(k[:, :, :shared], v[:, :, :shared]) for k, v in kept.kv], kept.version

    def _merge(self, rows: list[_Row], cache: Cache, logits: torch.Tensor) -> None:
        """Append prefilled `rows` (their right-aligned `cache` and next-token `logits`)."""
        if not self._rows:
            self._rows, self._cache, self._logits = rows, cache, logits
            self._width = cache.get_seq_length()
            return
        width = max(self._width, cache.get_seq_length())
        self._cache = _cache_of([
            _GrowingLayer(_stack_rows([own.keys, joined.keys], width), _stack_rows([own.values, joined.values], width),
                          width)
            for own, joined in zip(self._cache.layers, cache.layers)  # type: ignore[union-attr]
        ])
        self._width = width
        self._rows = self._rows + rows
        self._logits = torch.cat([self._logits, logits])  # type: ignore[list-item]

    @torch.inference_mode()
    def _step(self) -> None:
        """Sample the next token of every row; finished rows leave; the rest take one decode step."""
        assert self._logits is not None and self._cache is not None
        rows = self._rows
        sampled, sampled_logprobs = self._sample(self._logits, [row.request.params for row in rows],
                                                 [len(row.request.prompt) + len(row.tokens) for row in rows])
        keep: list[int] = []
        done: list[tuple[int, _Row]] = []
        for j, (row, token, logprob) in enumerate(zip(rows, sampled.tolist(), sampled_logprobs.tolist())):
            params = row.request.params
            row.tokens.append(token)
            row.logprobs.append(logprob)
            row.versions.append(row.logit_version)
            if row.request.cancelled:
                continue
            if token in row.stop_ids or (
                params.stop and any(stop in self._decode(row.tokens[-row.stop_window:]) for stop in params.stop)
            ):
                done.append((j, row))
                row.request.result = self._completion(row, "stop")
            elif len(row.tokens) >= params.max_new_tokens:
                done.append((j, row))
                row.request.result = self._completion(row, "length")
            else:
                keep.append(j)
        for j, row in done:
            self._keep_cache(row, j)
        if len(keep) < len(rows):
            if not keep:
                self._reset_batch()
            else:
                index = torch.tensor(keep, dtype=torch.long, device=self.device)
                self._cache.batch_select_indices(index)
                self._rows = [rows[j] for j in keep]
                sampled = sampled[index]
                self._trim()
        for _, row in done:
            if row.request.on_done is not None:
                row.request.on_done(row.request.result)
        if not self._rows:
            return
        rows = self._rows
        if self._released:
            with self._lock:
                self._restore()
        fed = torch.tensor([len(row.fed) for row in rows], device=self.device)
        columns = torch.arange(self._width + 1, device=self.device)
        attend = columns[None, :] >= (self._width - fed)[:, None]
        if self._fast is not None:
            # The additive form SDPA turns a boolean mask into, made once for all layers.
            mask = torch.zeros(attend.shape, dtype=self._fast.dtype, device=self.device)
            mask = mask.masked_fill_(~attend, float("-inf"))[:, None, None, :]
            with self._lock:
                self._restore()
                logits = self._fast(sampled, fed, mask, self._cache.layers)
                version = self.version
            self._logits = logits.float()
        else:
            lag = torch.tensor([row.rope_lag for row in rows], device=self.device)
            self._logits, self._cache, version = self._forward(sampled[:, None], attend.long(), (fed + lag)[:, None],
                                                               self._cache)
        self._width += 1
        self.stats["decode_steps"] += 1
        for row, token in zip(rows, sampled.tolist()):
            row.fed.append(token)
            row.logit_version = version
            if row.cache_version != version:
                row.cache_version = -1

    def _completion(self, row: _Row, finish: str) -> Completion:
        return Completion(token_ids=row.tokens, logprobs=row.logprobs, text=self._decode(row.tokens),
                          finish_reason=finish, policy_version=row.versions)

    def _trim(self) -> None:
        """Drop cache columns that are padding in every remaining row."""
        if not self._plain:
            return
        longest = max(len(row.fed) for row in self._rows)
        if longest < self._width:
            for layer in self._cache.layers:  # type: ignore[union-attr]
                layer.drop_left(self._width - longest)
            self._width = longest

    def _keep_cache(self, row: _Row, b: int) -> None:
        """Keep a finished row's cache for its session's next turn (when it is all of the current
        weights and fits the memory bound)."""
        session = row.request.session
        if session is None or not self._plain or self.prefix_cache_bytes == 0 or row.cache_version != self.version:
            return
        n = len(row.fed)
        kv = [(layer.keys[b: b + 1, :, self._width - n:].clone(), layer.values[b: b + 1, :, self._width - n:].clone())
              for layer in self._cache.layers]  # type: ignore[union-attr]
        nbytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)
        if nbytes > self.prefix_cache_bytes:
            return
        with self._inbox_lock:
            old = self._kept.pop(session, None)
            if old is not None:
                self._kept_bytes -= old.nbytes
            self._kept[session] = _Kept(list(row.fed), kv, row.cache_version, nbytes,
                                         list(row.request.images.images) if row.request.images is not None else [])
            self._kept_bytes += nbytes
            while self._kept_bytes > self.prefix_cache_bytes:
                _, evicted = self._kept.popitem(last=False)
                self._kept_bytes -= evicted.nbytes

    def _forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache: Cache | None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, Cache, int]:
        """Last-position logits (float32), the updated KV cache, and the weight version used
        (`inputs_embeds`, when given, in place of `input_ids`' embeddings: a prefill with images)."""
        cache_kwargs = {self._cache_arg: cache} if cache is not None else {}
        tokens = {"input_ids": input_ids} if inputs_embeds is None else {"inputs_embeds": inputs_embeds}
        with self._lock:
            self._restore()
            output = self.model(
                **tokens,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=True,
                **self._last_logits_only,
                **cache_kwargs,
            )
            version = self.version
        new_cache = output["cache"] if "cache" in output else output["past_key_values"]
        return output.logits[:, -1].float(), new_cache, version

    def _sample(self, logits: torch.Tensor, params: list[SamplingParams],
                positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Sampled token per row and its log-prob under the distribution it was drawn from.

        Greedy rows take the argmax (log-prob at temperature 1) and draw nothing; the other rows
        draw together, in row order, from `self.generator`, except seeded rows, which draw
        `stream_uniform(seed, positions[row])` (positions: the sequence position of each row's
        next token).
        """
        temperatures = [p.temperature for p in params]
        if not any(temperatures):
            tokens = logits.argmax(dim=-1)
            logprobs = torch.log_softmax(logits, dim=-1)
            return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)
        scale = torch.tensor([t if t > 0 else 1.0 for t in temperatures], device=logits.device)
        logprobs = torch.log_softmax(logits / scale[:, None], dim=-1)
        nucleus = [j for j, p in enumerate(params) if p.temperature > 0 and p.top_p < 1.0]
        if nucleus:
            index = torch.tensor(nucleus, device=logits.device)
            top_p = torch.tensor([params[j].top_p for j in nucleus], device=logits.device)
            logprobs[index] = _nucleus_logprobs(logprobs[index], top_p[:, None])
        drawn = [j for j, t in enumerate(temperatures) if t > 0]
        seeds = [params[j].seed for j in drawn]
        fixed = None
        if any(seed is not None for seed in seeds):
            fixed = [None if seed is None else stream_uniform(seed, positions[j]) for j, seed in zip(drawn, seeds)]
        if len(drawn) == len(params):
            tokens = self._draw(logprobs, fixed)
        else:
            index = torch.tensor(drawn, device=logits.device)
            tokens = logits.argmax(dim=-1)
            tokens[index] = self._draw(logprobs[index], fixed)
        return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)

    def _draw(self, logprobs: torch.Tensor, fixed: list[float | None] | None = None) -> torch.Tensor:
        """One token per row from `exp(logprobs)`, by inverting the cumulative distribution at one
        uniform draw per row (from `self.generator`, in row order; a row whose `fixed[row]` is a
        number uses that number instead; the generator still advances one draw per row).

        The token drawn is the first whose cumulative mass exceeds the draw, so a token of zero
        probability (outside a nucleus) is never drawn (why not `torch.multinomial`: docs/bench_vs_trl.md).
        """
        cdf = logprobs.exp().cumsum(dim=-1)
        u = torch.rand((cdf.shape[0], 1), generator=self.generator, device=cdf.device, dtype=cdf.dtype)
        if fixed is not None:
            rows = [j for j, value in enumerate(fixed) if value is not None]
            values = torch.tensor([fixed[j] for j in rows], device=cdf.device, dtype=cdf.dtype)
            # Rounded to the dtype, a draw just below 1 could become 1: keep it below, as rand's.
            below_one = torch.nextafter(torch.ones((), dtype=cdf.dtype), torch.zeros((), dtype=cdf.dtype))
            u[rows, 0] = values.clamp_(max=below_one.item())
        tokens = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(-1)
        return tokens.clamp_(max=cdf.shape[-1] - 1)

    def rng_state(self) -> torch.Tensor:
        """The sampler's random state (for checkpoints)."""
        return self.generator.get_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        """Continue the sampler's stream from `rng_state()`'s output."""
        self.generator.set_state(state)

    # ------------------------------------------------------------------ weights

    def update_weights(self, state_dict: dict[str, Any], version: int) -> None:
        """Load `state_dict` into the engine's model (all keys, same shapes) and set `version`.

        A version lower than the current one is refused (weights never go back in time); the
        same version may be loaded again. Nothing is changed when the check fails. Kept prefix
        caches are dropped (they were computed with the weights being replaced).
        """
        own = self.model.state_dict()
        check_update(own, state_dict, version, self.version)
        # Weights the engine stores transposed (fast_decode on a CPU) are copied in blocks of rows
        # (`copy_into`), each tensor once (tied weights are one tensor under two names); the
        # others through load_state_dict. The keys were checked above.
        strided = {k for k, t in own.items() if not t.is_contiguous()}
        with self._lock:
            self.model.load_state_dict({k: v for k, v in state_dict.items() if k not in strided}, strict=False)
            copied: set[tuple[int, tuple[int, ...]]] = set()
            with torch.no_grad():
                for k in sorted(strided):
                    target = (own[k].data_ptr(), tuple(own[k].stride()))
                    if target not in copied:
                        copy_into(own[k], state_dict[k])
                        copied.add(target)
            self.version = version
            self._fingerprint = None
            if self._cast is not None:
                if weights_checksum(self.model.state_dict()) != weights_checksum(state_dict, self._cast):
                    raise RuntimeError(f"the engine's {self._cast} weights are not the cast of version {version}'s")
                self._fingerprint = weights_checksum(state_dict)
            self._drop_kept_caches()

    def release_memory(self) -> None:
        """Free the device memory the engine holds while it has nothing to decode (synchronous
        training, `rollout.options.release_memory`: the trainer's step has the device): the weights
        go to host memory, the kept prefix caches and the fast decode step's stacked weights are
        dropped, and the allocator's cache is emptied. The next forward pass brings the weights
        back (with any update loaded meanwhile); rows still decoding just wait for it."""
        with self._lock:
            if self._released:
                return
            self._fast_model, self._fast = self._fast is not None, None  # it holds the stacked weights
            with torch.inference_mode(False):
                self.model.to("cpu")
            self._released = True
        self._drop_kept_caches()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _restore(self) -> None:
        """Back on the device after `release_memory` (caller holds `_lock`)."""
        if self._released:
            with torch.inference_mode(False):  # (a forward pass may run in inference mode: weights it made could not load)
                self.model.to(self.device)
                self._fast = DecodeStep.of(self.model) if self._fast_model else None
            self._released = False

    def load_adapters(self, layers: dict[str, tuple[float, torch.Tensor, torch.Tensor]], version: int) -> None:
        """LoRA adapters beside the weights, unmerged (`tiderl.rollout.low_rank`), as `version`:
        `layers` maps a linear layer's name to (scaling, A `[r, in]`, B `[out, r]`). The first call
        attaches them (and rebuilds the fast decode step, which stacks them); later ones copy new
        values into the same layers, which they must name exactly. Kept prefix caches are dropped."""
        modules = dict(self.model.named_modules())
        held = {name for name, module in modules.items() if low_rank.term_of(module) is not None}
        if version < self.version or any(name not in modules for name in layers) or held and held != set(layers):
            raise ValueError(f"adapters for {sorted(layers)[:3]}... at version {version}: this engine (version "
                             f"{self.version}) has the layers {sorted(modules)[:3]}... and holds adapters on "
                             f"{sorted(held)[:3]}...; send adapters for the same layers, at no lower version")
        with self._lock:
            for name, (scaling, a, b) in layers.items():
                if held:
                    low_rank.set_adapters(modules[name], a, b)
                else:
                    low_rank.attach(modules[name], a.to(self.device, self._cast), b.to(self.device, self._cast), scaling)
            if not held and self._fast is not None:
                self._fast = DecodeStep.of(self.model)
            self.version = version
            self._fingerprint = None
            self._drop_kept_caches()

    def _drop_kept_caches(self) -> None:
        """Forget every kept prefix cache (they were computed with weights being replaced)."""
        with self._inbox_lock:
            self._kept.clear()
            self._kept_bytes = 0

    def state_checksum(self) -> float:
        """`weights_checksum` of the engine's current weights (computed once per weight load)."""
        with self._lock:
            if self._fingerprint is None:
                self._fingerprint = weights_checksum(self.model.state_dict())
            return self._fingerprint


def _own_memory(model: torch.nn.Module) -> None:
    """Copy every parameter and buffer of `model` (a CPU model the engine was handed) into memory
    of its own, one tensor at a time, keeping the parameter objects (so tied weights stay tied):
    out of the loader's memory map (why: docs/engines.md, "The torch engine's memory")."""
    with torch.no_grad():
        for param in model.parameters():
            param.data = param.data.clone()
        for module in model.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[name] = buffer.clone()


def _contiguous_input(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """A forward pre-hook: the module's first input made contiguous (a no-op when it is)."""
    if args and isinstance(args[0], torch.Tensor) and not args[0].is_contiguous():
        return (args[0].contiguous(), *args[1:])
    return args


def _common_prefix(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i


# Free cache columns allocated beyond what a batch holds, so that decode steps append in place.
_SPARE = 64


class _GrowingLayer(DynamicLayer):
    """A full-attention cache layer that appends new keys and values in place into a buffer with
    spare columns (doubling it when full), where `DynamicLayer` concatenates the whole cache at
    every decode step. `keys`/`values` are views of the filled columns."""

    def __init__(self, keys: torch.Tensor | None = None, values: torch.Tensor | None = None,
                 filled: int | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if keys is not None and values is not None:
            # `keys`/`values` may be buffers already (wider than `filled`), or exactly filled.
            self._adopt(keys, values, keys.shape[2] if filled is None else filled)

    def _adopt(self, key_buffer: torch.Tensor, value_buffer: torch.Tensor, filled: int) -> None:
        self._key_buffer, self._value_buffer, self._filled = key_buffer, value_buffer, filled
        self.keys, self.values = key_buffer[:, :, :filled], value_buffer[:, :, :filled]
        self.device = key_buffer.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        add = key_states.shape[2]
        if not self.is_initialized:
            self._adopt(_with_spare(key_states, _SPARE), _with_spare(value_states, _SPARE), 0)
        filled = self._filled
        if filled + add > self._key_buffer.shape[2]:
            more = max(filled + add, _SPARE)
            self._adopt(_with_spare(self.keys, more + add), _with_spare(self.values, more + add), filled)
        self._key_buffer[:, :, filled: filled + add] = key_states
        self._value_buffer[:, :, filled: filled + add] = value_states
        self._adopt(self._key_buffer, self._value_buffer, filled + add)
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._adopt(self._key_buffer[indices], self._value_buffer[indices], self._filled)

    def drop_left(self, columns: int) -> None:
        """Forget the first `columns` columns (padding in every row)."""
        self._adopt(self._key_buffer[:, :, columns:], self._value_buffer[:, :, columns:], self._filled - columns)


def _with_spare(t: torch.Tensor, spare: int) -> torch.Tensor:
    """A buffer holding `t` ([batch, heads, length, dim]) in its first columns, `spare` more free."""
    out = t.new_empty(t.shape[0], t.shape[1], t.shape[2] + spare, t.shape[3])
    out[:, :, : t.shape[2]] = t
    return out


def _cache_of(layers: list[_GrowingLayer] | None) -> DynamicCache:
    """A DynamicCache of growing layers (`None`: empty, the layers made on the first forward)."""
    cache = DynamicCache()
    if layers is None:
        cache.layer_class_to_replicate = _GrowingLayer
    else:
        cache.layers = list(layers)
        cache.layer_class_to_replicate = None
    return cache


def _prefill_groups(suffixes: list[list[int]], prefix: list[int], budget: int, dedup: bool) -> list[list[int]]:
    """Consecutive row indices, grouped so that each group's prefill encodes at most `budget`
    tokens (0: no limit, one group): its rows to encode (identical whole prompts once, where
    `dedup`) times its longest suffix, padding included. A group of rows whose longest suffix
    alone passes the budget holds just those rows (and copies of them, which cost nothing more),
    and is encoded in passes along its length."""
    groups: list[list[int]] = []
    for i in range(len(suffixes)):
        trial = (groups[-1] + [i]) if groups else [i]
        cost = _prefill_cost(trial, suffixes, prefix, dedup)
        if len(trial) > 1 and budget and cost > budget and cost > _prefill_cost(groups[-1], suffixes, prefix, dedup):
            groups.append([i])
        elif groups:
            groups[-1] = trial
        else:
            groups.append(trial)
    return groups


def _prefill_cost(group: list[int], suffixes: list[list[int]], prefix: list[int], dedup: bool) -> int:
    """Tokens one forward pass over `group` encodes: rows (identical whole prompts once, where
    `dedup` and no row reuses a prefix) times the longest suffix."""
    rows = len(group)
    if dedup and all(prefix[i] == 0 for i in group):
        rows = len({tuple(suffixes[i]) for i in group})
    return rows * max(len(suffixes[i]) for i in group)


def _stack_rows(parts: list[torch.Tensor | None], width: int, spare: int = _SPARE) -> torch.Tensor:
    """One buffer of `parts`' rows in order ([rows, heads, length, dim] each; None: one row of
    zeros), each right-aligned in the first `width` columns with zeros to its left, and `spare`
    free columns after."""
    like = next(p for p in parts if p is not None)
    rows = [1 if p is None else p.shape[0] for p in parts]
    out = like.new_empty(sum(rows), like.shape[1], width + spare, like.shape[3])
    start = 0
    for part, n in zip(parts, rows):
        pad = width - (0 if part is None else part.shape[2])
        out[start: start + n, :, :pad] = 0
        if part is not None:
            out[start: start + n, :, pad:width] = part
        start += n
    return out


def _compact(cache: Cache, attention_mask: torch.Tensor, width: int) -> DynamicCache:
    """`cache` with each row's unmasked columns moved, in order, to the last columns of a cache
    `width` wide (zeros to their left)."""
    rows = attention_mask.shape[0]
    index = torch.zeros((rows, width), dtype=torch.long, device=attention_mask.device)
    valid = torch.zeros((rows, width), dtype=torch.bool, device=attention_mask.device)
    for g in range(rows):
        columns = attention_mask[g].nonzero().squeeze(-1)
        index[g, width - len(columns):] = columns
        valid[g, width - len(columns):] = True
    layers = []
    for layer in cache.layers:
        pair = []
        for t in (layer.keys, layer.values):
            gathered = t.gather(2, index[:, None, :, None].expand(rows, t.shape[1], width, t.shape[3]))
            pair.append(gathered.masked_fill_(~valid[:, None, :, None], 0))
        layers.append(_GrowingLayer(*pair))
    return _cache_of(layers)


def _nucleus_logprobs(logprobs: torch.Tensor, top_p: float | torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches `top_p` (a float, or one
    value per row shaped [rows, 1]); renormalise.

    Tokens outside the nucleus get -inf. The most likely token is always kept.
    """
    sorted_logprobs, order = logprobs.sort(dim=-1, descending=True)
    sorted_probs = sorted_logprobs.exp()
    # A token is dropped when the mass of the tokens before it already reaches top_p.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop_sorted = mass_before >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    kept = logprobs.masked_fill(drop, float("-inf"))
    return kept - torch.logsumexp(kept, dim=-1, keepdim=True)
