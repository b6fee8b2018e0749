"""LoRA on the policy through `peft` (the optional extra `lora`): adapters in, adapters out.

`apply_lora` wraps a causal LM so that only its LoRA adapters train (the base weights are
frozen); `policy_state` is what a weight sync sends: the adapters alone for a LoRA policy (a few
MiB instead of the whole model), the full state dict otherwise. The torch engine applies them
beside its own base weights, unmerged (`tiderl.rollout.lora.LoraTorchEngine`).
"""

from __future__ import annotations

from typing import Any

import torch


def is_lora(model: Any) -> bool:
    """Whether `model` carries peft adapters."""
    return bool(getattr(model, "peft_config", None))


def apply_lora(model: torch.nn.Module, r: int, alpha: float, target_modules: list[str]) -> torch.nn.Module:
    """`model` with LoRA adapters (rank `r`, scale alpha / r) on the linear layers named in
    `target_modules`; only the adapters require gradients. B starts at zero, so the wrapped model
    computes exactly what `model` did."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("model.lora needs peft. Fix: pip install 'tiderl[lora]' (or set model.lora.r=0)") from err
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = sorted(set(target_modules) - present)
    if missing:
        raise ValueError(f"model.lora.target_modules: {missing} name no layer of this model (its layers are "
                         f"named like {sorted(present)[:12]}). Fix: use names of its linear layers")
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(target_modules), lora_dropout=0.0, bias="none")
    return get_peft_model(model, config)


def apply_critic_lora(critic: Any, r: int, alpha: float, target_modules: list[str]) -> Any:
    """The value model `critic` with LoRA adapters on its backbone (`apply_lora`); the value head
    stays fully trainable. Returns `critic` (changed in place)."""
    critic.backbone = apply_lora(critic.backbone, r, alpha, target_modules)
    return critic


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The LoRA adapter weights of a peft model, under their own state-dict names."""
    return {k: v for k, v in model.state_dict().items() if ".lora_A." in k or ".lora_B." in k}


def policy_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a weight sync sends to the engines: the adapters of a LoRA policy, else every weight."""
    return adapter_state(model) if is_lora(model) else model.state_dict()


def merged_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A plain model with the adapters of `model` merged into its weights (model is unchanged)."""
    import copy

    return copy.deepcopy(model).merge_and_unload()
