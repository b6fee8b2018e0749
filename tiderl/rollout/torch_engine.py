"""The embedded engine: batched KV-cache sampling with any Hugging Face causal LM, on CPU or GPU.

Prompts are left-padded into one batch; `attention_mask` hides the padding and `position_ids`
count only real tokens, so a padded row gets the same log-probs as the same prompt alone.
Finished rows are dropped from the batch (and from the KV cache) as soon as they stop.

Log-probs are those of the distribution each token was actually sampled from:
`log_softmax(logits / temperature)`, restricted to the top-p nucleus and renormalised when
`top_p < 1`. With `temperature == 0` the engine takes the argmax and reports the log-prob under
the temperature-1 distribution (a greedy choice has no sampling distribution of its own, and
the temperature-1 value is what the trainer recomputes).

Weights can be swapped while a `generate` call runs in another thread: each decoding step holds
a lock for its forward pass, `update_weights` takes the same lock, and every token carries the
version of the weights that produced its logits (the KV cache of earlier tokens is kept).
"""

from __future__ import annotations

import copy
import inspect
import threading
from collections.abc import Callable
from typing import Any

import torch
from transformers import Cache, PreTrainedModel, PreTrainedTokenizerBase

from tiderl.rollout.base import Completion, SamplingParams
from tiderl.rollout.weights import weights_checksum


class TorchEngine:
    """Token-in/token-out generation with log-probs and versioned weights (the Engine protocol).

    The engine keeps its own deep copy of `model` on `device` (so training the original does not
    change what the engine samples until `update_weights` is called). Sampling uses a
    `torch.Generator` seeded with `seed` at construction: a fresh engine with the same seed,
    prompts and params returns the same completions; successive calls continue the stream.
    Prompts are processed in chunks of at most `max_batch_size`.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        device: str | torch.device = "cpu",
        seed: int = 0,
        max_batch_size: int = 64,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size} must be at least 1")
        self.device = torch.device(device)
        self.model = copy.deepcopy(model).to(self.device).eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.version = 0
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self._lock = threading.Lock()
        self._vocab_size = self.model.get_output_embeddings().weight.shape[0]
        # Any id works under a zero attention mask; the pad id keeps debugging output readable.
        self._pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self._max_positions = getattr(self.model.config, "max_position_embeddings", None)
        # Argument names differ across transformers versions: the KV cache is `cache` in recent 5.x
        # and `past_key_values` before; computing only the last position's logits is
        # `logits_to_keep` (>= 4.50) or `num_logits_to_keep` (4.45-4.49).
        forward_args = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in forward_args else "past_key_values"
        self._last_logits_only = {
            name: 1 for name in ("logits_to_keep", "num_logits_to_keep") if name in forward_args
        }
        # The raw `tokenizers` decoder is ~10x cheaper per call than `tokenizer.decode`, which
        # matters because stop strings are checked after every token of every row.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._decode: Callable[[list[int]], str]
        if backend is not None:
            self._decode = lambda ids: backend.decode(ids, skip_special_tokens=False)
        else:
            self._decode = lambda ids: tokenizer.decode(
                ids, skip_special_tokens=False, clean_up_tokenization_spaces=False
            )

    # ------------------------------------------------------------------ generation

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """Sample one completion per prompt, in prompt order (see the module docstring)."""
        self._check_request(prompts, params)
        completions: list[Completion] = []
        for start in range(0, len(prompts), self.max_batch_size):
            completions.extend(self._generate_batch(prompts[start : start + self.max_batch_size], params))
        return completions

    def _check_request(self, prompts: list[list[int]], params: SamplingParams) -> None:
        """Raise ValueError naming the first bad parameter or prompt, before any compute."""
        if params.temperature < 0:
            raise ValueError(f"temperature={params.temperature} is negative: use 0 for greedy or a value > 0")
        if not 0.0 < params.top_p <= 1.0:
            raise ValueError(f"top_p={params.top_p} is outside (0, 1]: use 1.0 to keep the full distribution")
        if params.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={params.max_new_tokens} must be at least 1")
        for i, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
            if min(prompt) < 0 or max(prompt) >= self._vocab_size:
                raise ValueError(
                    f"prompt {i} has token ids outside [0, {self._vocab_size}): was it tokenized "
                    "with this model's tokenizer?"
                )
            if self._max_positions is not None and len(prompt) + params.max_new_tokens > self._max_positions:
                raise ValueError(
                    f"prompt {i} has {len(prompt)} tokens, plus max_new_tokens={params.max_new_tokens} "
                    f"exceeds the model's max_position_embeddings={self._max_positions}: shorten the "
                    "prompt or lower max_new_tokens"
                )

    @torch.inference_mode()
    def _generate_batch(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """Sample one left-padded batch to completion; rows leave the batch as they finish."""
        batch = len(prompts)
        lengths = [len(p) for p in prompts]
        width = max(lengths)
        input_ids = torch.full((batch, width), self._pad_id, dtype=torch.long)
        attention_mask = torch.zeros((batch, width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            attention_mask[row, width - len(prompt) :] = 1
        input_ids = input_ids.to(self.device)
        attention_mask = attention_mask.to(self.device)
        # Positions count real tokens only, so left padding does not shift a row's positions.
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        next_position = torch.tensor(lengths, dtype=torch.long, device=self.device)

        stop_ids = set(params.stop_token_ids)
        # A stop string completed by the newest token lies within its last `len(bytes)` tokens
        # (every token decodes to at least one byte); one more token absorbs a partial UTF-8
        # character or a stripped leading space at the window's start.
        stop_window = max((len(s.encode("utf-8")) for s in params.stop), default=0) + 2

        tokens_out: list[list[int]] = [[] for _ in range(batch)]
        logprobs_out: list[list[float]] = [[] for _ in range(batch)]
        versions_out: list[list[int]] = [[] for _ in range(batch)]
        finish: list[str] = ["length"] * batch
        active = list(range(batch))  # original row index of each row still in the batch

        # The model builds its own cache on the first forward (the right layer types for
        # sliding-window or hybrid models); later steps pass it back.
        logits, cache, version = self._forward(input_ids, attention_mask, position_ids, None)
        for _ in range(params.max_new_tokens):
            sampled, sampled_logprobs = self._sample(logits, params)
            keep: list[int] = []
            for j, (token, logprob) in enumerate(zip(sampled.tolist(), sampled_logprobs.tolist())):
                row = active[j]
                tokens_out[row].append(token)
                logprobs_out[row].append(logprob)
                versions_out[row].append(version)
                if token in stop_ids or (
                    params.stop and _contains_stop(self._decode(tokens_out[row][-stop_window:]), params.stop)
                ):
                    finish[row] = "stop"
                elif len(tokens_out[row]) < params.max_new_tokens:
                    keep.append(j)
            if not keep:
                break
            if len(keep) < len(active):
                # Drop finished rows so they stop costing compute.
                index = torch.tensor(keep, dtype=torch.long, device=self.device)
                cache.batch_select_indices(index)
                attention_mask = attention_mask[index]
                next_position = next_position[index]
                sampled = sampled[index]
                active = [active[j] for j in keep]
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((len(active), 1))], dim=1)
            logits, cache, version = self._forward(sampled[:, None], attention_mask, next_position[:, None], cache)
            next_position = next_position + 1

        return [
            Completion(
                token_ids=tokens_out[row],
                logprobs=logprobs_out[row],
                text=self._decode(tokens_out[row]),
                finish_reason=finish[row],
                policy_version=versions_out[row],
            )
            for row in range(batch)
        ]

    def _forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache: Cache | None,
    ) -> tuple[torch.Tensor, Cache, int]:
        """Last-position logits (float32), the updated KV cache, and the weight version used."""
        cache_kwargs = {self._cache_arg: cache} if cache is not None else {}
        with self._lock:
            output = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=True,
                **self._last_logits_only,
                **cache_kwargs,
            )
            version = self.version
        new_cache = output["cache"] if "cache" in output else output["past_key_values"]
        return output.logits[:, -1].float(), new_cache, version

    def _sample(self, logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
        """Sampled token per row and its log-prob under the distribution it was drawn from."""
        if params.temperature == 0:
            tokens = logits.argmax(dim=-1)
            logprobs = torch.log_softmax(logits, dim=-1)
        else:
            logprobs = torch.log_softmax(logits / params.temperature, dim=-1)
            if params.top_p < 1.0:
                logprobs = _nucleus_logprobs(logprobs, params.top_p)
            tokens = torch.multinomial(logprobs.exp(), 1, generator=self.generator).squeeze(-1)
        return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)

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
        same version may be loaded again. Nothing is changed when the check fails.
        """
        if version < self.version:
            raise ValueError(
                f"update_weights got version {version}, lower than the engine's current version "
                f"{self.version}: versions must not decrease; pass the trainer's latest version"
            )
        own = self.model.state_dict()
        missing = sorted(set(own) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(own))
        if missing or unexpected:
            raise ValueError(
                f"update_weights state dict does not match the engine's model: missing keys "
                f"{missing[:5]}, unexpected keys {unexpected[:5]}; send model.state_dict() of the "
                "same architecture (unwrap DDP/FSDP/compile prefixes first)"
            )
        wrong_shapes = [k for k, v in state_dict.items() if tuple(v.shape) != tuple(own[k].shape)]
        if wrong_shapes:
            raise ValueError(
                f"update_weights state dict has wrong shapes for {wrong_shapes[:5]}: send the weights "
                "of the same model configuration"
            )
        with self._lock:
            self.model.load_state_dict(state_dict, strict=True)
            self.version = version

    def state_checksum(self) -> float:
        """`weights_checksum` of the engine's current weights."""
        with self._lock:
            return weights_checksum(self.model.state_dict())


def _contains_stop(text: str, stops: list[str]) -> bool:
    return any(stop in text for stop in stops)


def _nucleus_logprobs(logprobs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches `top_p`; renormalise.

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
