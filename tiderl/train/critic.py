"""The value model: the policy's backbone plus a scalar head, trained as SAO's critic."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModel, PreTrainedModel


class ValueModel(torch.nn.Module):
    """`backbone` (a transformer without LM head) and `head` (hidden -> 1).

    forward() returns `[B, T]` values, one per position: the value of the state after reading
    tokens 0..t (`tiderl.train.forward.token_values` shifts it onto the next token).
    """

    def __init__(self, backbone: PreTrainedModel, head: torch.nn.Linear):
        super().__init__()
        self.backbone = backbone
        self.head = head

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=False
        ).last_hidden_state
        return self.head(hidden.to(self.head.weight.dtype)).squeeze(-1)

    @classmethod
    def from_policy(cls, policy: PreTrainedModel) -> "ValueModel":
        """A critic initialised from the policy's weights; the head starts at zero (V = 0)."""
        backbone = copy.deepcopy(getattr(policy, policy.base_model_prefix))
        head = torch.nn.Linear(policy.config.hidden_size, 1)
        torch.nn.init.zeros_(head.weight)
        torch.nn.init.zeros_(head.bias)
        return cls(backbone, head.to(next(backbone.parameters()).dtype))

    def save(self, path: str | Path) -> None:
        """Backbone as a Hugging Face model dir, head as safetensors."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.backbone.save_pretrained(path / "backbone")
        save_file({k: v.contiguous() for k, v in self.head.state_dict().items()},
                  str(path / "value_head.safetensors"))
        (path / "tiderl_value_model.json").write_text(json.dumps({"format": 1}))

    @classmethod
    def load(cls, path: str | Path, dtype: torch.dtype = torch.float32) -> "ValueModel":
        path = Path(path)
        if not (path / "value_head.safetensors").is_file():
            raise FileNotFoundError(
                f"{path} is not a tiderl value model (no value_head.safetensors). Fix: point "
                "algo.value_init at a directory written by ValueModel.save or a checkpoint's critic/."
            )
        try:
            config = AutoConfig.from_pretrained(path / "backbone")
            backbone = AutoModel.from_pretrained(path / "backbone", config=config, dtype=dtype)
            head = torch.nn.Linear(config.hidden_size, 1).to(dtype)
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


def freeze_matching(module: torch.nn.Module, pattern: str) -> list[str]:
    """Freeze every parameter whose name matches the regex `pattern`; return their names.

    Fails loudly when nothing matches: a silent no-op would train a different critic than the
    config says (e.g. a model family whose attention is not named like the pattern).
    """
    regex = re.compile(pattern)
    frozen = [name for name, p in module.named_parameters() if regex.search(name)]
    if not frozen:
        sample = ", ".join(name for name, _ in list(module.named_parameters())[:6])
        raise ValueError(
            f"critic freeze pattern {pattern!r} matched no parameter (names look like: {sample}). "
            "Fix: set algo.critic_freeze_pattern to a regex over these names, or "
            "algo.freeze_critic_attention=false."
        )
    for name, p in module.named_parameters():
        if regex.search(name):
            p.requires_grad_(False)
    return frozen
