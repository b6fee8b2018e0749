"""The value model: the policy's backbone plus a scalar head, trained as SAO's critic; with
`model.critic_lora=lora` its backbone carries LoRA adapters (docs/scale.md, "A LoRA critic")."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModel, PreTrainedModel

from tiderl.models.vision import model_inputs

LORA_STATE = "lora_adapters.safetensors"  # a LoRA critic's adapters, under the critic's own names


class ValueModel(torch.nn.Module):
    """`backbone` (a transformer without LM head) and `head` (hidden -> 1).

    forward() returns `[B, T]` values, one per position: the value of the state after reading
    tokens 0..t (`tiderl.train.forward.token_values` shifts it onto the next token).
    """

    def __init__(self, backbone: PreTrainedModel, head: torch.nn.Linear):
        super().__init__()
        self.backbone = backbone
        self.head = head

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                pixels: list[dict[str, torch.Tensor] | None] | None = None) -> torch.Tensor:
        hidden = self.backbone(
            **model_inputs(self.backbone, input_ids, pixels), attention_mask=attention_mask, use_cache=False
        ).last_hidden_state
        return self.head(hidden.to(self.head.weight.dtype)).squeeze(-1)

    @classmethod
    def from_policy(cls, policy: PreTrainedModel, share_weights: bool = False) -> ValueModel:
        """A critic initialised from the policy's weights; the head starts at zero (V = 0).
        `share_weights`: the backbone's parameters are the policy's own tensors, not copies (for
        a LoRA policy and a LoRA critic, whose base weights both stay frozen).

        The head is float32 whatever the backbone's dtype: it is a few thousand weights, and
        in bfloat16 a bias near 0.05 cannot take a step below its 2.4e-4 spacing, so at a
        critic learning rate of 1e-4 or less the values would stop moving."""
        inner = getattr(policy, policy.base_model_prefix)
        backbone = copy.deepcopy(inner, {id(p): p for p in inner.parameters()} if share_weights else {})
        head = torch.nn.Linear(policy.config.get_text_config(decoder=True).hidden_size, 1, dtype=torch.float32)
        torch.nn.init.zeros_(head.weight)
        torch.nn.init.zeros_(head.bias)
        return cls(backbone, head)

    def save(self, path: str | Path) -> None:
        """Backbone as a Hugging Face model dir, head as safetensors; a LoRA backbone also as its
        adapters (`LORA_STATE`), and in backbone/ as peft's adapter folder over its base model's
        directory (a 0.5B critic's checkpoint: 68 MB, not 1.9 GB), or merged when the base has none."""
        from tiderl.train.lora import adapter_state, is_lora, merged_copy

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        backbone = self.backbone
        if is_lora(backbone):
            save_file({k: v.contiguous() for k, v in adapter_state(self).items()}, str(path / LORA_STATE))
            base = backbone.peft_config["default"].base_model_name_or_path
            backbone = backbone if base and (Path(base) / "config.json").is_file() else merged_copy(backbone)
        backbone.save_pretrained(path / "backbone")
        save_file({k: v.contiguous() for k, v in self.head.state_dict().items()},
                  str(path / "value_head.safetensors"))
        (path / "tiderl_value_model.json").write_text(json.dumps({"format": 1}))

    @classmethod
    def load(cls, path: str | Path, dtype: torch.dtype = torch.float32) -> ValueModel:
        path = Path(path)
        if not (path / "value_head.safetensors").is_file():
            raise FileNotFoundError(
                f"{path} is not a tiderl value model (no value_head.safetensors). Fix: point "
                "algo.value_init at a directory written by ValueModel.save or a checkpoint's critic/."
            )
        try:
            adapters = path / "backbone" / "adapter_config.json"
            base = json.loads(adapters.read_text())["base_model_name_or_path"] if adapters.is_file() else None
            if base is not None and not (Path(base) / "config.json").is_file():
                raise FileNotFoundError(f"{path}'s critic is LoRA adapters over {base}, which is gone. Fix: put the "
                                        f"base model back there, or set base_model_name_or_path in {adapters}")
            config = AutoConfig.from_pretrained(base or path / "backbone")
            backbone = AutoModel.from_pretrained(base or path / "backbone", config=config, dtype=dtype)
            if base is not None:
                from peft import PeftModel

                backbone = PeftModel.from_pretrained(backbone, path / "backbone").merge_and_unload()
            head = torch.nn.Linear(config.get_text_config(decoder=True).hidden_size, 1, dtype=torch.float32)  # see from_policy
            head.load_state_dict(load_file(str(path / "value_head.safetensors")))
        except Exception as err:
            # safetensors' own errors name neither the file nor the fix.
            if "safetensor" not in type(err).__name__.lower() and "safetensor" not in str(err).lower():
                raise
            raise ValueError(
                f"the value model at {path} cannot be read ({type(err).__name__}: {err}): a weights file is "
                "corrupt or truncated (a copy or save that did not finish). Fix: resume from another "
                "checkpoint, or point algo.value_init at an intact critic directory.") from err
        return cls(backbone, head)


def load_lora_critic(model: ValueModel, path: str | Path) -> None:
    """Load the adapters and the value head that `ValueModel.save` wrote for a LoRA critic at
    `path` into `model` (a LoRA critic of the same settings); its base weights stay as built."""
    path = Path(path)
    if not (path / LORA_STATE).is_file():
        raise ValueError(f"{path} holds a fully trained critic, and this run's critic is LoRA (model.critic_lora=lora). "
                         "Fix: resume with the model.critic_lora it was trained with (full).")
    adapters = load_file(str(path / LORA_STATE))
    own = {k for k in model.state_dict() if ".lora_" in k}
    if set(adapters) != own:
        raise ValueError(f"the critic adapters at {path} do not fit this run's LoRA critic (missing "
                         f"{sorted(own - set(adapters))[:3]}, unexpected {sorted(set(adapters) - own)[:3]}). Fix: resume "
                         "with the model.lora settings (r, target_modules) it was trained with.")
    model.load_state_dict(adapters, strict=False)
    model.head.load_state_dict(load_file(str(path / "value_head.safetensors")))


def freeze_matching(module: torch.nn.Module, pattern: str) -> list[str]:
    """Freeze every parameter whose name matches the regex `pattern`; return their names.

    Fails loudly when nothing matches: a silent no-op would train a different critic than the
    config says (e.g. a model family whose attention is not named like the pattern).
    """
    regex = re.compile(pattern)
    frozen = [(name, p) for name, p in module.named_parameters() if regex.search(name)]
    if not frozen:
        sample = ", ".join(name for name, _ in list(module.named_parameters())[:6])
        raise ValueError(
            f"critic freeze pattern {pattern!r} matched no parameter (names look like: {sample}). "
            "Fix: set algo.critic_freeze_pattern to a regex over these names, or "
            "algo.freeze_critic_attention=false."
        )
    for _, p in frozen:
        p.requires_grad_(False)
    return [name for name, _ in frozen]
