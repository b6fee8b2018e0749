"""Data-parallel training: the same `train_step` on every rank of a torch.distributed group, only the
model passes split by micro-batch and summed across ranks, so the step equals the single-process one
(docs/ray.md, "The data-parallel trainer"). Where the ranks run is `tiderl.system.ray_trainer`'s concern.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from tiderl.train.learner import Learner, LossFn
from tiderl.train.lora import is_lora

__all__ = ["ParallelLearner", "assign_micro_batches", "backend_for", "full_state_dict", "init_rank", "published_state",
           "wrap_model"]


def backend_for(device: str) -> str:
    """The torch.distributed backend for a device: NCCL for CUDA, gloo otherwise."""
    return "nccl" if str(device).startswith("cuda") else "gloo"


def init_rank(rank: int, world_size: int, init_method: str, device: str = "cpu",
              timeout_s: float = 600.0) -> None:
    """Join the process group (`init_method` like 'tcp://127.0.0.1:29500'), once per process."""
    if dist.is_initialized():
        if dist.get_rank() != rank or dist.get_world_size() != world_size:
            raise RuntimeError(f"this process is already rank {dist.get_rank()} of {dist.get_world_size()}, "
                               f"not rank {rank} of {world_size}")
        return
    if str(device).startswith("cuda"):
        torch.cuda.set_device(torch.device(device).index or 0)  # 'cuda': the first GPU this process sees
    import datetime

    dist.init_process_group(backend_for(device), init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


def assign_micro_batches(tokens: Sequence[int], world_size: int) -> list[list[int | None]]:
    """Micro-batch indices for each rank, balanced by (padded) tokens: the largest first, each to
    the rank with the fewest tokens so far among those with a free place. Every rank gets the
    same number of places, ceil(M / world_size); a place left empty is None (a ghost: the rank
    runs some micro-batch with weight 0, because FSDP2 and DDP need every rank to make the same
    collective calls). Every index appears exactly once."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    places = max(1, math.ceil(len(tokens) / world_size))
    shares: list[list[int | None]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for i in sorted(range(len(tokens)), key=lambda i: (-tokens[i], i)):
        r = min((r for r in range(world_size) if len(shares[r]) < places), key=lambda r: (load[r], r))
        shares[r].append(i)
        load[r] += tokens[i]
    for share in shares:
        share.extend([None] * (places - len(share)))
    return shares


# Where the vision-language models tiderl feeds images to keep their vision tower: Idefics3 /
# SmolVLM `vision_model`, Qwen2-VL and Qwen2.5-VL `visual`, LLaVA-style `vision_tower`.
VISION_TOWERS = ("vision_model", "visual", "vision_tower")


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks of every `ModuleList` in `model` (a transformer's decoder layers) but a vision
    tower's, which stay in the root's FSDP2 unit: a rank whose micro-batch has no images skips the
    tower, and its blocks' own all-gathers would put the ranks out of step (gloo aborted)."""
    return [layer for name, m in model.named_modules() if isinstance(m, torch.nn.ModuleList)
            and not set(name.split(".")) & set(VISION_TOWERS) for layer in m]


def wrap_model(model: torch.nn.Module, mode: str, device: str = "cpu") -> torch.nn.Module:
    """`model` on `device`, ready for data-parallel training: wrapped in DDP, or sharded in place
    with FSDP2 (`fully_shard` on each decoder layer, then on the whole model). The process group
    must exist."""
    model = model.to(device)
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [torch.cuda.current_device()] if str(device).startswith("cuda") else None  # init_rank set it
        # Buffers (rotary frequencies) are equal on every rank and never trained: no broadcast.
        return DistributedDataParallel(model, device_ids=ids, broadcast_buffers=False)
    if mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        from tiderl.models.vision import embed_in_forward

        for layer in _decoder_layers(model):
            fully_shard(layer)
        fully_shard(model)
        # A VLM policy embeds its images inside its forward, where the root's shards are whole.
        embed_in_forward(model)
        return model
    raise ValueError(f"train.parallel: {mode!r} is not a data-parallel mode; use ddp or fsdp2")


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside a DDP wrapper (an FSDP2 model is its own module)."""
    return getattr(model, "module", model) if type(model).__name__ == "DistributedDataParallel" else model


def full_state_dict(model: torch.nn.Module, mode: str, adapters_only: bool = False) -> dict[str, torch.Tensor]:
    """The whole model's weights on the CPU, on rank 0 (other ranks get {}); `adapters_only`: a LoRA
    model's adapters alone (FSDP2 then gathers only the trainable parameters, so the frozen base
    never travels). A collective: every rank must call it."""
    if mode == "fsdp2":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                     ignore_frozen_params=adapters_only))
    elif dist.get_rank() != 0:
        return {}
    else:
        state = unwrapped(model).state_dict()
    return {k: v.detach().to("cpu") for k, v in state.items()
            if not adapters_only or ".lora_A." in k or ".lora_B." in k}


def published_state(model: torch.nn.Module, mode: str) -> dict[str, torch.Tensor]:
    """What rank 0 sends to the engines after a step (`full_state_dict`, a collective): the adapters
    of a LoRA policy (as `tiderl.train.lora.policy_state`), else every weight."""
    return full_state_dict(model, mode, adapters_only=is_lora(unwrapped(model)))


class ParallelLearner(Learner):
    """A `Learner` on one rank of a data-parallel group (DDP or FSDP2).

    `local_share` picks this rank's micro-batches (ghosts marked), `sum_across_ranks` sums a
    batch-wide tensor over the ranks, and `step` accumulates this rank's gradients, lets DDP or
    FSDP2 sum them across ranks (each loss is scaled by the world size, because both average),
    clips by the global norm and steps; its loss and metrics are those of the whole batch.
    """

    def __init__(self, model: torch.nn.Module, mode: str, lr: float, device: str = "cpu",
                 weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.999),
                 grad_clip: float = 1.0):
        if not dist.is_initialized():
            raise RuntimeError("ParallelLearner needs a torch.distributed process group: call init_rank first")
        self.mode = mode
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.device = device
        # Wrapped (and for FSDP2, sharded) before the optimizer sees the parameters.
        super().__init__(wrap_model(model, mode, device), lr, weight_decay=weight_decay, betas=betas,
                         grad_clip=grad_clip)

    def local_share(self, micro_batches: Sequence[Any]) -> list[Any]:
        micro_batches = list(micro_batches)
        tokens = [int(m.batch.input_ids.numel()) for m in micro_batches]
        share = assign_micro_batches(tokens, self.world_size)[self.rank]
        smallest = min(range(len(micro_batches)), key=lambda i: tokens[i])
        return [micro_batches[i] if i is not None else dataclasses.replace(micro_batches[smallest], ghost=True)
                for i in share]

    def sum_across_ranks(self, tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.to(self.device) if backend_for(self.device) == "nccl" else tensor.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out.to(tensor.device)

    @contextlib.contextmanager
    def _accumulating(self, accumulate: bool) -> Iterator[None]:
        """Gradients of this backward stay on the rank (the last micro-batch sums them)."""
        if self.mode == "ddp" and accumulate:
            with self.model.no_sync():
                yield
        elif self.mode == "fsdp2":
            self.model.set_requires_gradient_sync(not accumulate)
            yield
        else:
            yield

    def _backward(self, micro_batches: Sequence[Any], loss_fn: LossFn) -> tuple[float, dict[str, float], int]:
        """This rank's `micro_batches` (the same count on every rank; a ghost's loss weighs 0)
        backward, then the whole batch's summed loss and metrics and its micro-batch count."""
        totals: dict[str, float] = {}
        loss_total, count = 0.0, 0
        last = len(micro_batches) - 1
        for i, mb in enumerate(micro_batches):
            ghost = getattr(mb, "ghost", False)
            with self._accumulating(i < last):
                loss, metrics = loss_fn(mb)
                (loss * (0.0 if ghost else float(self.world_size))).backward()
            if ghost:
                continue
            count += 1
            loss_total += float(loss.detach())
            for k, v in metrics.items():
                totals[k] = totals.get(k, 0.0) + float(v)
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, (loss_total, count, totals))
        summed: dict[str, float] = {}
        for _, _, t in everyone:
            for k, v in t.items():
                summed[k] = summed.get(k, 0.0) + v
        return sum(lt for lt, _, _ in everyone), summed, sum(c for _, c, _ in everyone)
