"""Forward passes that the losses need: per-token log-probs (and entropies) of the policy, values of
the critic.

Both return right-padded `[B, T]` float32 tensors aligned with the tokens: position t holds the
quantity for token t (the log-prob of sampling token t; the value of the state just before token
t). Position 0 has no predecessor and holds 0. Log-probs are those of the distribution the engine
samples from at `temperature` (softmax of the logits divided by it), as the engines' behaviour
log-probs are (docs/algorithms.md, "Notation"); top-p is not applied.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

from tiderl.algos.regularizers import entropy_from_logits
from tiderl.models.vision import model_inputs

__all__ = ["logprob_temperature", "packed_token_logprobs", "packs", "token_logprobs", "token_values"]


def logprob_temperature(sampling_temperature: float) -> float:
    """The temperature to score tokens at for rollouts sampled at `sampling_temperature`: itself,
    or 1 for greedy rollouts (temperature 0), whose behaviour log-probs the engines report at
    temperature 1 (`rollout.base.SamplingParams`)."""
    return sampling_temperature if sampling_temperature > 0 else 1.0


def _tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to score tokens, got {temperature} "
                         "(use logprob_temperature() for greedy rollouts)")
    return logits if temperature == 1.0 else logits / temperature


def _shift(x: torch.Tensor) -> torch.Tensor:
    """[B, T - 1] quantities of positions 1..T-1 -> [B, T] with 0 at position 0."""
    return torch.cat([torch.zeros_like(x[:, :1]), x], dim=1)


def token_logprobs(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
    with_entropy: bool = False, entropy_grad: bool = False, temperature: float = 1.0,
    pixels: list[dict[str, torch.Tensor] | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(token t | tokens < t) under `model` at `temperature` at every position t, and with
    `with_entropy` the entropy H(softmax(z_{t-1} / temperature)) there (None otherwise).
    `pixels` (`Batch.pixels`): the rows' images, fed through `models.vision.embed_inputs`.

    The entropy carries no gradient (a metric) unless `entropy_grad` (for an entropy bonus), which
    implies `with_entropy`. Uses gather minus logsumexp rather than a full log_softmax so that
    large vocabularies do not need a second `[B, T, V]` tensor.
    """
    logits = model(**model_inputs(model, input_ids, pixels), attention_mask=attention_mask, use_cache=False).logits
    logits = _tempered(logits[:, :-1].float(), temperature)
    picked = logits.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    logprobs = _shift(picked - torch.logsumexp(logits, dim=-1))
    entropy = None
    if with_entropy or entropy_grad:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = _shift(entropy_from_logits(logits))
    return logprobs, entropy


def token_values(
    critic: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
    pixels: list[dict[str, torch.Tensor] | None] | None = None,
) -> torch.Tensor:
    """The critic's V(state before token t) at every position t (a `train.critic.ValueModel`); it
    sees the rows' images (`pixels`) as the policy does."""
    with_pixels = {"pixels": pixels} if pixels else {}
    v = critic(input_ids=input_ids, attention_mask=attention_mask, **with_pixels)
    return _shift(v[:, :-1].float())


# --- packed sequences (docs/bench_vs_trl.md, "Packed sequences") -----------------------------------
#
# A micro-batch runs as one row of its real tokens (`batching.pack`); the attention function lays
# the packed queries, keys and values out padded again by one gather (a sequence reads its shared
# prefix from the one copy) and runs causal SDPA per sequence.

PACKED_ATTENTION = "tiderl_packed"


def _packed_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      **kwargs: object) -> tuple[torch.Tensor, None]:
    """Causal attention within each sequence of a packed row (`kwargs["tiderl_packing"]`).

    query `[1, H, L, D]`, key / value `[1, Hkv, L, D]`; returns `[1, L, H, D]` as the Hugging
    Face attention functions do.
    """
    packing = kwargs.get("tiderl_packing")
    if packing is None or query.shape[0] != 1:
        raise RuntimeError("the packed attention kernel ran without a packed layout: call it through "
                           "tiderl.train.forward.packed_token_logprobs")
    if kwargs.get("sliding_window"):
        raise RuntimeError("packed training does not support sliding-window attention: set train.packing=false")
    gather = packing.gather  # [B, T]

    def padded(x: torch.Tensor) -> torch.Tensor:  # [1, H, L, D] -> [B, H, T, D]
        return x[0].transpose(0, 1)[gather].transpose(1, 2)

    q, k, v = padded(query), padded(key), padded(value)
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2)[packing.valid].unsqueeze(0), None  # [1, L, H, D]


@contextlib.contextmanager
def attention_implementation(config: Any, name: str) -> Iterator[None]:
    """Run the block with `config`'s attention kernel set to `name` (restored after). The
    packed forward uses it, and so does an activation-checkpointing replay
    (`tiderl.train.memory`), which must run the kernel its forward ran."""
    previous = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = previous


def _no_mask(*args: object, **kwargs: object) -> None:
    """The packed kernel builds its own causal layout: no mask tensor is needed."""


@functools.cache  # once per process
def _register_packed_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(PACKED_ATTENTION, _packed_attention)
    AttentionMaskInterface.register(PACKED_ATTENTION, _no_mask)


def packs(model: torch.nn.Module) -> bool:
    """Whether `model` can train packed: a Hugging Face model whose full-attention layers dispatch
    through the attention interface (sdpa or eager) and that has no sliding-window layers."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) not in ("sdpa", "eager"):
        return False
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    layer_types = getattr(text, "layer_types", None)
    sliding = getattr(text, "use_sliding_window", False) and getattr(text, "sliding_window", None)
    return not sliding and (layer_types is None or all(t == "full_attention" for t in layer_types))


def packed_token_logprobs(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, action_mask: torch.Tensor,
    with_entropy: bool = False, entropy_grad: bool = False, temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logprobs` where `action_mask` is 1, computed on the packed micro-batch (0 elsewhere).

    Same arguments and `[B, T]` outputs as `token_logprobs`, except that positions whose token is
    not scored (`action_mask` 0, position 0, padding) hold 0 instead of the token's log-prob.
    `model` must satisfy `packs(model)`. Its attention kernel is switched to the packed one for
    the duration of the call (`config._attn_implementation`), so no other thread may run the same
    model object meanwhile (the trainer's actor: engines and snapshots hold their own copies).
    """
    from tiderl.train.batching import pack

    p = pack(input_ids, attention_mask, action_mask)
    _register_packed_attention()
    with attention_implementation(model.config, PACKED_ATTENTION):
        logits = model(input_ids=p.input_ids, position_ids=p.position_ids, use_cache=False,
                       logits_to_keep=p.keep, tiderl_packing=p).logits[0].float()  # [K, V]
    logits = _tempered(logits, temperature)
    labels = input_ids[p.keep_rows, p.keep_cols]
    picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    logprobs = picked.new_zeros(input_ids.shape).index_put((p.keep_rows, p.keep_cols), picked)
    entropy = None
    if with_entropy or entropy_grad:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            ent = entropy_from_logits(logits)
            entropy = ent.new_zeros(input_ids.shape).index_put((p.keep_rows, p.keep_cols), ent)
    return logprobs, entropy
