"""One model and its optimizer: micro-batched gradient accumulation, clipping, a step."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

LossFn = Callable[[Any], tuple[torch.Tensor, dict[str, float]]]


def fused_adam_supported(params: Sequence[torch.Tensor]) -> bool:
    """Whether AdamW's fused kernel takes these parameters: plain floating-point tensors (not the
    DTensors of FSDP2) on the CPU or a CUDA device. It updates each parameter in one pass instead of
    a dozen elementwise ops, equal to the default up to float rounding (docs/bench_vs_trl.md)."""
    return all(type(p) in (torch.Tensor, torch.nn.Parameter) and p.is_floating_point()
               and p.device.type in ("cpu", "cuda") for p in params)


class Learner:
    """Owns a model's AdamW optimizer and applies one optimizer step over micro-batches.

    The loss function receives a micro-batch and returns a loss that is already normalised
    by the whole batch (e.g. divided by all action tokens of the step), so gradients of the
    micro-batches simply add up to the gradient of the full batch.
    """

    def __init__(self, model: torch.nn.Module, lr: float, weight_decay: float = 0.0,
                 betas: tuple[float, float] = (0.9, 0.999), grad_clip: float = 1.0, fused: bool = True):
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("Learner got a model with no trainable parameters")
        # fused=False keeps AdamW's default kernel (`fused_adam_supported` says why fused is the rule).
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, weight_decay=weight_decay, betas=betas,
                                           fused=(fused and fused_adam_supported(self.params)) or None)
        self.grad_clip = grad_clip

    def step(self, micro_batches: Sequence[Any], loss_fn: LossFn) -> dict[str, float]:
        """Accumulate gradients over `micro_batches`, clip, step.

        Returns the summed loss, the pre-clip gradient norm, and each metric averaged over the
        micro-batches.
        """
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss_total, totals, count = self._backward(micro_batches, loss_fn)
        out = {k: v / max(count, 1) for k, v in totals.items()}
        out["loss"] = loss_total
        max_norm = self.grad_clip if self.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)
        out["grad_norm"] = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # FSDP2: a DTensor
        self.optimizer.step()
        return out

    def _backward(self, micro_batches: Sequence[Any], loss_fn: LossFn) -> tuple[float, dict[str, float], int]:
        """Each micro-batch's loss backward; returns the summed loss, each metric summed, and how
        many micro-batches they sum over."""
        totals: dict[str, float] = {}
        loss_total = 0.0
        for mb in micro_batches:
            loss, metrics = loss_fn(mb)
            loss.backward()
            loss_total += float(loss.detach())
            for k, v in metrics.items():
                totals[k] = totals.get(k, 0.0) + float(v)
        return loss_total, totals, len(micro_batches)

    # Data-parallel hooks (`tiderl.train.parallel.ParallelLearner` overrides both): a single
    # process trains on every micro-batch and its batch-wide tensors are already whole.

    def local_share(self, micro_batches: Sequence[Any]) -> list[Any]:
        """The micro-batches this process runs: all of them."""
        return list(micro_batches)

    def sum_across_ranks(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` summed over the data-parallel ranks: itself, in one process."""
        return tensor
