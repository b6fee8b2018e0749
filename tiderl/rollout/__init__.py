"""Rollout engines: token-in/token-out generation with log-probs and versioned weights.

`make_engine` is the one place an engine is built (training, evaluation, Ray workers): it
resolves `rollout.engine` (`tiderl.registry.ENGINES`, or a user's "module:Class") and calls
`Class(model, tokenizer, device=..., seed=..., max_batch_size=...)` (plus `prefill_tokens`, from
`rollout.prefill_tokens`, for a class whose constructor takes it), or
`Class.from_config(cfg, model, tokenizer, seed=...)` for a class that has it (the HTTP engine).
An engine copies the model it is given unless the caller hands it over (`copy_model=False`).
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

from tiderl.registry import ENGINES, resolve
from tiderl.rollout.base import Completion, Engine, SamplingParams, sampling_params

if TYPE_CHECKING:
    from tiderl.config import RunConfig

__all__ = ["Completion", "Engine", "SamplingParams", "make_engine", "sampling_params"]


def make_engine(cfg: RunConfig, model: Any, tokenizer: Any, seed: int, copy_model: bool = True) -> Engine:
    """The engine `rollout.engine` names, holding its own copy of `model`'s weights.

    `copy_model=False` hands `model` over to the engine instead of copying it: for a caller
    that no longer uses `model` (evaluation), this saves a copy of the weights. The caller must
    not train or change `model` afterwards: the engine samples with it (and re-lays out its
    layers). Training keeps the default, so that its updates reach the engine only through
    `update_weights`. An engine class whose constructor takes no `copy_model` gets the default
    (it copies, or does what it always did).
    """
    engine_cls = resolve(ENGINES, cfg.rollout.engine, "rollout.engine")
    if getattr(model, "peft_config", None) and cfg.rollout.engine == "torch":  # LoRA: adapters beside the base, unmerged
        from tiderl.rollout.lora import LoraTorchEngine

        engine_cls = LoraTorchEngine
    build = getattr(engine_cls, "from_config", None) or engine_cls
    ownership = {} if copy_model or not _takes(build, "copy_model") else {"copy_model": False}
    if build is not engine_cls:  # an engine with settings of its own (rollout.http)
        return build(cfg, model, tokenizer, seed=seed, **ownership)
    budget = {"prefill_tokens": cfg.rollout.prefill_tokens} if _takes(engine_cls, "prefill_tokens") else {}
    return engine_cls(model, tokenizer, device=cfg.model.device, seed=seed,
                      max_batch_size=cfg.rollout.engine_batch_size, **ownership, **budget)


def _takes(function: Any, name: str) -> bool:
    """Whether `function` (a class: its constructor) accepts the keyword argument `name`."""
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False
    return name in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())
