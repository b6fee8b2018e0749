"""What every engine speaks: token ids in, sampled token ids and their log-probs out."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class SamplingParams:
    """How to sample one completion.

    temperature: 0 means greedy (argmax; log-probs are then those of the temperature-1
        distribution, so they stay comparable with the trainer's).
    top_p: nucleus sampling; 1.0 keeps the full distribution so that `behavior_logprobs` are the
        true behaviour distribution (what SAO needs).
    max_new_tokens: hard cap on sampled tokens per completion.
    stop: stop strings; generation ends on the token that completes one (that token is kept).
    stop_token_ids: token ids that end generation (kept in the output), e.g. end-of-turn.
    seed: None draws from the engine's own random stream, shared by the rows in batch order. An
        int gives the request its own stream: the draw at sequence position i is
        `stream_uniform(seed, i)`, whatever else shares a decode step (bf16 logits may still
        depend on the batch: docs/real_models.md). The agent loop gives each episode one.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None


def episode_seed(seed: int, key: str) -> int:
    """A 63-bit seed for one episode, a function of the run's `seed` and the episode's `key`
    (e.g. a task id and sample index) only."""
    digest = hashlib.blake2b(f"{seed}\x00{key}".encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _stream_bits(seed: int, position: int) -> int:
    """64 bits of a keyed hash of (seed, position): a counter-based stream, so any position is
    drawn without the ones before it."""
    digest = hashlib.blake2b(struct.pack("<qq", seed & (2**63 - 1), position), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def stream_uniform(seed: int, position: int) -> float:
    """The uniform draw in [0, 1) of a seeded request's token at sequence `position`."""
    return (_stream_bits(seed, position) >> 11) / float(1 << 53)


def stream_seed(seed: int, position: int) -> int:
    """A 62-bit seed for a seeded request to an inference server whose prompt ends at `position`
    (the server draws the turn's tokens from it)."""
    return _stream_bits(seed, position) >> 2


@dataclass
class Completion:
    """One sampled continuation.

    token_ids: the sampled tokens, stop token included.
    logprobs: log-prob of each sampled token under the distribution it was sampled from
        (after temperature and top-p), one per token.
    text: `token_ids` decoded (special tokens kept).
    finish_reason: "stop" (stop token or stop string) or "length" (hit max_new_tokens).
    policy_version: the engine's weight version when each token was sampled (one entry per token).
    """

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    policy_version: list[int]


# What a continuous engine's caller is told when a request finishes: its Completion, or the exception that ended it.
OnDone = Callable[[Any], None]


class Engine(Protocol):
    """A generation backend. `version` is the weight version it currently samples with.

    Optional, for engines that keep per-episode state (a KV cache between turns), which the
    batching client uses when present: `generate(prompts, params, sessions=[...])` takes one
    hashable episode identity (or None) per prompt, and `end_session(session)` is called when
    that episode ends. An engine with `continuous()` returning True is driven token by token
    through `submit(prompt, params, session, on_done)` / `serve()` / `pending()` instead of
    `generate` (`TorchEngine` documents the contract).
    """

    version: int

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """Sample one completion per prompt (a batch of token-id lists)."""
        ...

    def update_weights(self, state_dict: dict[str, Any], version: int) -> None:
        """Load new policy weights; subsequent tokens carry `version`."""
        ...

    def state_checksum(self) -> float:
        """`tiderl.rollout.weights.weights_checksum` of the weights it samples with: the trainer
        compares it with the fingerprint of what it sent after every sync (a few elements per
        tensor: compute it once per weight load)."""
        ...

    # Optional (checkpoints): an engine with `rng_state() -> Any` and `set_rng_state(state)` has
    # its sampler's random state saved and restored, so a resumed run draws what the original
    # would have. Without them a resume re-seeds nothing and draws a different stream.


def token_decoder(tokenizer: Any) -> Callable[[list[int]], str]:
    """Ids to text with special tokens kept, as an engine checks stop strings after every token:
    the raw `tokenizers` decoder where the tokenizer has one (about 10x cheaper per call than
    `tokenizer.decode`), else `tokenizer.decode` without clean-up."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return lambda ids: backend.decode(ids, skip_special_tokens=False)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def check_request(prompt: list[int], params: SamplingParams, i: int, vocab_size: int,
                  max_positions: int | None) -> None:
    """Raise ValueError naming the first bad sampling parameter or prompt (the `i`-th of its batch),
    before an engine spends anything on it. `max_positions`: the model's context (None = no limit)."""
    if params.temperature < 0:
        raise ValueError(f"temperature={params.temperature} is negative: use 0 for greedy or a value > 0")
    if not 0.0 < params.top_p <= 1.0:
        raise ValueError(f"top_p={params.top_p} is outside (0, 1]: use 1.0 to keep the full distribution")
    if params.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={params.max_new_tokens} must be at least 1")
    if len(prompt) == 0:
        raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        raise ValueError(f"prompt {i} has token ids outside [0, {vocab_size}): was it tokenized "
                         "with this model's tokenizer?")
    if max_positions is not None and len(prompt) + params.max_new_tokens > max_positions:
        raise ValueError(
            f"prompt {i} has {len(prompt)} tokens, plus max_new_tokens={params.max_new_tokens} "
            f"exceeds the model's max_position_embeddings={max_positions}: shorten the "
            "prompt or lower max_new_tokens")


def check_update(own: dict[str, Any], state_dict: dict[str, Any], version: int, current: int,
                 send: str = "model.state_dict() of the same architecture (unwrap DDP/FSDP/compile prefixes first)",
                 ) -> None:
    """Raise ValueError, before an engine changes anything, when `version` is lower than the
    engine's `current` one (weights never go back in time; the same version may load again) or
    when `state_dict`'s keys or shapes are not those of `own`; `send` says what to send instead."""
    if version < current:
        raise ValueError(f"update_weights got version {version}, lower than the engine's current version "
                         f"{current}: versions must not decrease; pass the trainer's latest version")
    missing = sorted(set(own) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(own))
    if missing or unexpected:
        raise ValueError(f"update_weights state dict does not match the engine's model: missing keys "
                         f"{missing[:5]}, unexpected keys {unexpected[:5]}; send {send}")
    wrong_shapes = [k for k, v in state_dict.items() if tuple(v.shape) != tuple(own[k].shape)]
    if wrong_shapes:
        raise ValueError(f"update_weights state dict has wrong shapes for {wrong_shapes[:5]}: send {send}")


def sampling_params(rollout: Any, eos_id: int, greedy: bool) -> SamplingParams:
    """The sampling of a `RolloutConfig` (or greedy decoding), stopping at the end-of-turn token."""
    return SamplingParams(
        temperature=0.0 if greedy else rollout.temperature,
        top_p=1.0 if greedy else rollout.top_p,
        max_new_tokens=rollout.max_new_tokens,
        stop_token_ids=[eos_id],
    )
