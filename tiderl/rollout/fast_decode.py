"""One decode step (one new token per row) of a Llama-family causal LM without the Hugging Face
module stack: the model's own arithmetic in plain torch calls on its own parameters (what it
computes and what it saves: docs/bench_vs_trl.md, "A decode step without the Hugging Face module stack").

`DecodeStep.of(model)` returns None for anything it does not reproduce exactly (other
architectures, sliding windows, q/k norms, non-default rotary scaling, adapters or quantised
layers wrapped around `nn.Linear`); the engine then uses the model's forward. The parameters are
read at every call, so weights loaded in place (`load_state_dict`) are used at once; replacing a
parameter object of the engine's model (rather than copying into it) is not supported. LoRA
terms attached to the linear layers (`tiderl.rollout.low_rank`) are added after each product,
stacked like the weights, in the arithmetic of the layers' own forward hooks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F

from tiderl.rollout import low_rank

# Model types whose decoder layers are exactly: x + attn(rmsnorm(x)); x + mlp(rmsnorm(x)), with
# q/k/v/o projections (biases optional), rotary embedding on q and k, SiLU-gated MLP.
_FAMILIES = ("qwen2", "llama")


class DecodeStep:
    """Logits of the next token for one new token per row; appends the new keys and values to
    the engine's cache layers (`update(keys, values)` in place, returning the full keys/values)."""

    def __init__(self, model: Any, cos: torch.Tensor, sin: torch.Tensor) -> None:
        inner = model.model
        text = model.config.get_text_config(decoder=True)
        self.embed = inner.embed_tokens
        self.layers = list(inner.layers)
        self.norm = inner.norm
        self.lm_head = model.get_output_embeddings()
        self.eps = [(layer.input_layernorm.variance_epsilon, layer.post_attention_layernorm.variance_epsilon)
                    for layer in self.layers]
        self.final_eps = inner.norm.variance_epsilon
        self.heads = text.num_attention_heads
        self.kv_heads = text.num_key_value_heads
        self.head_dim = self.layers[0].self_attn.head_dim
        self.scaling = self.layers[0].self_attn.scaling
        self.cos, self.sin = cos, sin  # [max_positions, head_dim]
        self.dtype = cos.dtype  # the model's
        # On a CPU every weight is stored transposed (see `_fuse`); tied input and output
        # embeddings stay one tensor.
        t = self.embed.weight.device.type == "cpu"
        # Per layer: the stacked (weight, bias) of q/k/v and of gate/up (one product each).
        self.qkv = [_fuse(layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, transposed=t)
                    for layer in self.layers]
        self.gate_up = [_fuse(layer.mlp.gate_proj, layer.mlp.up_proj, transposed=t) for layer in self.layers]
        # Per layer: the LoRA terms (None where a layer has none) of q/k/v, o, gate/up and down.
        self.terms = [(low_rank.fuse(layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj),
                       low_rank.term_of(layer.self_attn.o_proj),
                       low_rank.fuse(layer.mlp.gate_proj, layer.mlp.up_proj),
                       low_rank.term_of(layer.mlp.down_proj)) for layer in self.layers]
        self.head_term = low_rank.term_of(self.lm_head)
        if t:
            for layer in self.layers:
                _fuse(layer.self_attn.o_proj, transposed=True)
                _fuse(layer.mlp.down_proj, transposed=True)
            if self.lm_head.weight is not self.embed.weight:
                _fuse(self.lm_head, transposed=True)
            elif self.embed.weight.numel() <= TRANSPOSE_MAX_ELEMENTS:
                tied = torch.nn.Parameter(low_rank.transposed_copy(self.embed.weight.detach()),
                                          requires_grad=self.embed.weight.requires_grad)
                self.lm_head.weight = self.embed.weight = tied

    @classmethod
    def of(cls, model: Any) -> DecodeStep | None:
        """The fast step for `model`, or None when it is not a plain Llama-family model."""
        config = getattr(model, "config", None)
        if config is None or getattr(config, "model_type", None) not in _FAMILIES:
            return None
        text = config.get_text_config(decoder=True)
        if getattr(config, "_attn_implementation", None) != "sdpa":
            return None
        if getattr(text, "hidden_act", None) != "silu" or getattr(text, "pretraining_tp", 1) != 1:
            return None
        if getattr(text, "use_sliding_window", False) and getattr(text, "sliding_window", None):
            return None
        layer_types = getattr(text, "layer_types", None)
        if layer_types is not None and any(t != "full_attention" for t in layer_types):
            return None
        inner = getattr(model, "model", None)
        rotary = getattr(inner, "rotary_emb", None)
        if rotary is None or getattr(rotary, "rope_type", None) != "default":
            return None
        linears = [model.get_output_embeddings()]
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if hasattr(attn, "q_norm") or hasattr(attn, "k_norm"):
                return None
            linears += [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        if any(type(m) is not torch.nn.Linear for m in linears) or type(inner.embed_tokens) is not torch.nn.Embedding:
            return None
        terms = [t for t in map(low_rank.term_of, linears) if t is not None]
        if len({(t.scaling, t.a.dtype) for t in terms}) > 1:  # stacked terms share one scaling
            return None
        positions = getattr(text, "max_position_embeddings", None)
        if not positions:
            return None
        # The rotary table, by the formula the model's rotary module applies per position.
        inv_freq = rotary.inv_freq.float()
        freqs = torch.arange(positions, device=inv_freq.device).float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        dtype = inner.embed_tokens.weight.dtype
        cos = (emb.cos() * rotary.attention_scaling).to(dtype)
        sin = (emb.sin() * rotary.attention_scaling).to(dtype)
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if len({m.bias is None for m in (attn.q_proj, attn.k_proj, attn.v_proj)}) > 1 or \
                    len({m.bias is None for m in (mlp.gate_proj, mlp.up_proj)}) > 1:
                return None
        return cls(model, cos, sin)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                 cache_layers: list[Any]) -> torch.Tensor:
        """tokens, positions: `[B]`; mask: `[B, 1, 1, W + 1]`, bool (True: attend) or additive
        (0 or -inf, in the model's dtype), W the cache width before this step. Returns the
        last-position logits `[B, V]` (model dtype)."""
        b = tokens.shape[0]
        h = F.embedding(tokens[:, None], self.embed.weight)  # [B, 1, hidden]
        cos = self.cos[positions][:, None, None, :]  # [B, 1, 1, D]
        sin = self.sin[positions][:, None, None, :]
        half = self.head_dim // 2
        groups = self.heads // self.kv_heads
        q_width, kv_width = self.heads * self.head_dim, self.kv_heads * self.head_dim
        for layer, cache, (eps1, eps2), qkv_weights, gate_up_weights, terms in zip(
                self.layers, cache_layers, self.eps, self.qkv, self.gate_up, self.terms):
            attn, mlp = layer.self_attn, layer.mlp
            qkv_term, o_term, gate_up_term, down_term = terms
            x = _rms_norm(h, layer.input_layernorm.weight, eps1)
            qkv = _linear(x, *qkv_weights, qkv_term)
            q = qkv[..., :q_width].view(b, 1, self.heads, self.head_dim).transpose(1, 2)
            k = qkv[..., q_width: q_width + kv_width].view(b, 1, self.kv_heads, self.head_dim).transpose(1, 2)
            v = qkv[..., q_width + kv_width:].view(b, 1, self.kv_heads, self.head_dim).transpose(1, 2)
            q = q * cos + torch.cat((-q[..., half:], q[..., :half]), dim=-1) * sin
            k = k * cos + torch.cat((-k[..., half:], k[..., :half]), dim=-1) * sin
            keys, values = cache.update(k, v)
            if groups > 1:  # one query token: the query heads of a KV head attend as its rows
                q = q.reshape(b, self.kv_heads, groups, self.head_dim)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scaling)
            h = h + _linear(out.reshape(b, 1, self.heads * self.head_dim), attn.o_proj.weight, attn.o_proj.bias, o_term)
            x = _rms_norm(h, layer.post_attention_layernorm.weight, eps2)
            gate, up = _linear(x, *gate_up_weights, gate_up_term).chunk(2, dim=-1)
            h = h + _linear(F.silu(gate) * up, mlp.down_proj.weight, mlp.down_proj.bias, down_term)
        h = _rms_norm(h, self.norm.weight, self.final_eps)
        return _linear(h[:, 0], self.lm_head.weight, self.lm_head.bias, self.head_term)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            term: low_rank.LowRankTerm | None) -> torch.Tensor:
    """A linear layer's output for `x` (its LoRA term added, if any) without the module call."""
    out = F.linear(x, weight, bias)
    return out if term is None else term.add_to(out, x)


def _fuse(*linears: torch.nn.Linear, transposed: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One stacked weight (and bias) for `linears`, which read the same input, so that one matrix
    product computes all their outputs side by side; the modules' own weights and biases become
    views of it, which their own forward uses and `load_state_dict` overwrites in place, so the
    stacked tensor always holds the current weights (and no second copy is kept). `transposed`: a
    stacked weight of at most `TRANSPOSE_MAX_ELEMENTS` is stored as its transpose (why:
    docs/bench_vs_trl.md, "Weights stored transposed on a CPU")."""
    weights = [m.weight.detach() for m in linears]
    whole = torch.cat(weights)
    if transposed and whole.numel() <= TRANSPOSE_MAX_ELEMENTS:
        whole = low_rank.transposed_copy(whole)
    start = 0
    for m, w in zip(linears, weights):
        m.weight = torch.nn.Parameter(whole[start: start + w.shape[0]], requires_grad=m.weight.requires_grad)
        start += w.shape[0]
    biases = [m.bias for m in linears]
    if biases[0] is None:
        return whole, None
    stacked = torch.cat([b.detach() for b in biases])
    start = 0
    for m, b in zip(linears, biases):
        m.bias = torch.nn.Parameter(stacked[start: start + b.shape[0]], requires_grad=b.requires_grad)
        start += b.shape[0]
    return whole, stacked


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst.copy_(src)`, in blocks of rows when `dst` is stored transposed (a weight `_fuse`
    laid out column-major): a whole-matrix transposing copy walks one side a full row apart,
    about 10x slower than a plain copy; blocks of a few rows stay in cache."""
    if dst.dim() != 2 or dst.is_contiguous() or dst.stride(0) != 1:
        dst.copy_(src)
        return
    for start in range(0, dst.shape[0], _COPY_ROWS):
        dst[start: start + _COPY_ROWS].copy_(src[start: start + _COPY_ROWS])


_COPY_ROWS = 32


# The largest stacked weight stored transposed (2 MiB of float32; the h256 benchmark model's
# gate/up weight is exactly this size).
TRANSPOSE_MAX_ELEMENTS = 2**19


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Llama-family RMSNorm, computed in float32 as the models do."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)
