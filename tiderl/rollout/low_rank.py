"""LoRA adapters applied beside frozen linear layers, in the arithmetic of the trainer's peft
forward, so that an engine samples from exactly the policy the trainer scores (why not merged:
docs/scale.md, "LoRA"; measured in docs/real_models.md, "The LoRA engine applies its adapters unmerged").

A layer with a term keeps it in two non-persistent buffers, `lora_a` `[r, in]` and `lora_b`
`[out, r]`, each stored column-major (moved with the module, absent from its state dict), and a
forward hook adds `scaling * lora_b @ (lora_a @ x)`. Layers that read the same input can share
one stacked term (`fuse`, used by the fast decode step); their own buffers then become views of
it, so an update copied into a layer's buffers (`set_adapters`) reaches both paths.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F


@dataclass
class LowRankTerm:
    """`out + scaling * b @ (a @ x)`, computed in `a`'s dtype and rounded to `out`'s dtype once,
    as peft's LoRA layer does: `a` is `[r, in]`, `b` is `[out, r]`."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float

    def add_to(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """`out` (a linear layer's output for input `x`) with the term added."""
        # In place on the fresh fp32 product: (B (A x)) * scaling + out, the very sums peft's
        # `out + B(A(x)) * scaling` computes, with two fewer temporaries.
        low_rank = F.linear(F.linear(x.to(self.a.dtype), self.a), self.b).mul_(self.scaling)
        return low_rank.add_(out).to(out.dtype)


def attach(linear: torch.nn.Linear, a: torch.Tensor, b: torch.Tensor, scaling: float) -> None:
    """Give `linear` the term `scaling * b @ a` beside its own weight (copies of `a` and `b`, kept
    in their dtype); its forward returns what peft's LoRA layer with these adapters returns."""
    if type(linear) is not torch.nn.Linear:
        raise TypeError(f"attach takes a plain torch.nn.Linear, got {type(linear).__name__}")
    if a.shape[1] != linear.in_features or b.shape[0] != linear.out_features or a.shape[0] != b.shape[1]:
        raise ValueError(f"adapters of shapes {tuple(a.shape)} and {tuple(b.shape)} do not fit a linear layer "
                         f"{linear.in_features} -> {linear.out_features}")
    if hasattr(linear, "lora_a"):
        raise ValueError("this layer has a low-rank term already")
    linear.register_buffer("lora_a", transposed_copy(a.detach()), persistent=False)
    linear.register_buffer("lora_b", transposed_copy(b.detach()), persistent=False)
    linear.lora_scaling = float(scaling)
    linear.register_forward_hook(_add_term)


def term_of(linear: torch.nn.Module) -> LowRankTerm | None:
    """The term attached to `linear` (reading its current buffers), or None."""
    if getattr(linear, "lora_a", None) is None:
        return None
    return LowRankTerm(linear.lora_a, linear.lora_b, linear.lora_scaling)


def set_adapters(linear: torch.nn.Module, a: torch.Tensor, b: torch.Tensor) -> None:
    """Copy new adapters into `linear`'s term in place (shapes as attached; views stay views)."""
    with torch.no_grad():
        linear.lora_a.copy_(a)
        linear.lora_b.copy_(b)


def fuse(*linears: torch.nn.Linear) -> LowRankTerm | None:
    """One term for `linears`, which read the same input and whose outputs are concatenated in
    this order (as the fast decode step stacks q/k/v and gate/up): `a` stacks every layer's `a`,
    and `b` is block-diagonal, so one pair of products computes every layer's term; a layer
    without a term gets zero rows. The layers' own buffers become views of the stacked ones.
    None when no layer has a term; ValueError when their scalings or dtypes differ."""
    terms = [term_of(m) for m in linears]
    present = [t for t in terms if t is not None]
    if not present:
        return None
    if len({t.scaling for t in present}) > 1 or len({t.a.dtype for t in present}) > 1:
        raise ValueError("layers with different LoRA scalings or dtypes cannot share one term")
    dtype, device = present[0].a.dtype, present[0].a.device
    rank = sum(t.a.shape[0] for t in present)
    a = torch.zeros(linears[0].in_features, rank, dtype=dtype, device=device).t()
    b = torch.zeros(rank, sum(m.out_features for m in linears), dtype=dtype, device=device).t()
    row = col = 0
    for linear, term in zip(linears, terms):
        if term is not None:
            r = term.a.shape[0]
            a[col: col + r] = term.a
            b[row: row + linear.out_features, col: col + r] = term.b
            linear._buffers["lora_a"] = a[col: col + r]
            linear._buffers["lora_b"] = b[row: row + linear.out_features, col: col + r]
            col += r
        row += linear.out_features
    return LowRankTerm(a, b, present[0].scaling)


def transposed_copy(w: torch.Tensor) -> torch.Tensor:
    """A copy of `w` (`[rows, columns]`) with the same values, stored column-major (a transposed
    view of a contiguous `[columns, rows]` tensor): `F.linear(x, w)` multiplies by `w.T`, and on a
    CPU, with the few rows of a decode step in `x`, a row-major `w` is repacked at every call."""
    return w.t().contiguous().t()


def _add_term(module: torch.nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
    term = term_of(module)
    return output if term is None else term.add_to(output, args[0])
