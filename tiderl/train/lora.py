"""LoRA on the policy through `peft` (the optional extra `lora`; docs/scale.md): `apply_lora` wraps
a causal LM so that only its adapters train; `policy_state` is what a weight sync sends, the
adapters alone for a LoRA policy. `LoraSettings` (`model.lora.*`) are checked when a config loads,
so this module imports torch only for types.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tiderl.options import need, opt

if TYPE_CHECKING:
    import torch


@dataclass
class LoraSettings:
    """LoRA adapters on the policy (through `peft`, the optional extra `lora`): only the adapters
    train (in one process or on DDP/FSDP2 ranks), and only they travel to the engines: the torch
    engine adds them beside its base weights (`tiderl.rollout.lora.LoraTorchEngine`), the HTTP
    engine merges them into the weights its servers reload."""

    r: int = opt(0, "LoRA rank (0 = off: full fine-tuning).")
    alpha: float = opt(16.0, "LoRA scale numerator: the update is (alpha / r) * B A.")
    target_modules: list[str] = opt(["q_proj", "k_proj", "v_proj", "o_proj"], "Names of the linear layers that get "
                                    "adapters (Qwen2/Llama attention by default; add gate_proj, up_proj, down_proj "
                                    "for the MLP).")

    def check(self, cfg: Any) -> None:
        need(self.r >= 0, "r", "must be >= 0", "use 0 (off) or e.g. 8")
        need(self.alpha > 0, "alpha", "must be > 0", "use e.g. 16")
        need(self.r == 0 or bool(self.target_modules), "target_modules", "is empty",
             "name the layers to adapt, e.g. [q_proj, v_proj]")
        need(self.r == 0 or cfg.rollout.engine in ("torch", "http"), "r",
             f"only the torch engine (adapters unmerged) and the HTTP engine (adapters merged into the weights its "
             f"servers reload) take a LoRA policy, not rollout.engine={cfg.rollout.engine}",
             "use rollout.engine=torch or http with LoRA")

    def unread(self, cfg: Any) -> dict[str, str]:
        return dict.fromkeys(("alpha", "target_modules"), "model.lora.r=0 turns LoRA off") if self.r == 0 else {}


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
