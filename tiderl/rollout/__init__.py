"""Rollout engines: token-in/token-out generation with log-probs and versioned weights. `make_engine`
builds every one (docs/extending.md, "inference engine").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tiderl.registry import ENGINES, resolve
from tiderl.rollout.base import Completion, Engine, SamplingParams, sampling_params

if TYPE_CHECKING:
    from tiderl.config import RunConfig

__all__ = ["Completion", "Engine", "SamplingParams", "make_engine", "sampling_params"]


def make_engine(cfg: RunConfig, model: Any, tokenizer: Any, seed: int, copy_model: bool = True) -> Engine:
    """The engine `rollout.engine` names (`tiderl.registry.ENGINES` or a "module:Class"), built by
    its `from_config`, holding its own copy of `model`'s weights.

    `copy_model=False` hands `model` over to the engine instead of copying it: for a caller
    that no longer uses `model` (evaluation), this saves a copy of the weights. The caller must
    not train or change `model` afterwards: the engine samples with it (and re-lays out its
    layers). Training keeps the default, so that its updates reach the engine only through
    `update_weights`.
    """
    engine_cls = resolve(ENGINES, cfg.rollout.engine, "rollout.engine")
    if getattr(model, "peft_config", None) and cfg.rollout.engine == "torch":  # LoRA: adapters beside the base, unmerged
        from tiderl.rollout.lora import LoraTorchEngine

        engine_cls = LoraTorchEngine
    return engine_cls.from_config(cfg, model, tokenizer, seed=seed, copy_model=copy_model)
