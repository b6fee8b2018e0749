"""Rollout engines: token-in/token-out generation with log-probs and versioned weights.

`make_engine` is the one place an engine is built (training, evaluation, Ray workers): it
resolves `rollout.engine` (`tiderl.registry.ENGINES`, or a user's "module:Class") and calls
`Class(model, tokenizer, device=..., seed=..., max_batch_size=...)`, or
`Class.from_config(cfg, model, tokenizer, seed=...)` for a class that has it (the HTTP engine).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tiderl.registry import ENGINES, resolve
from tiderl.rollout.base import Completion, Engine, SamplingParams, sampling_params

if TYPE_CHECKING:
    from tiderl.config import RunConfig

__all__ = ["Completion", "Engine", "SamplingParams", "make_engine", "sampling_params"]


def make_engine(cfg: "RunConfig", model: Any, tokenizer: Any, seed: int) -> Engine:
    """The engine `rollout.engine` names, holding its own copy of `model`'s weights."""
    engine_cls = resolve(ENGINES, cfg.rollout.engine, "rollout.engine")
    if getattr(model, "peft_config", None) and cfg.rollout.engine == "torch":  # LoRA: merge synced adapters
        from tiderl.rollout.lora import LoraTorchEngine

        engine_cls = LoraTorchEngine
    if hasattr(engine_cls, "from_config"):  # an engine with settings of its own (rollout.http)
        return engine_cls.from_config(cfg, model, tokenizer, seed=seed)
    return engine_cls(model, tokenizer, device=cfg.model.device, seed=seed,
                      max_batch_size=cfg.rollout.engine_batch_size)
