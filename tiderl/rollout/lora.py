"""The torch engine for a LoRA policy: it decodes with the base model and the adapters beside it,
unmerged, in the arithmetic of the trainer's peft forward (each adapted linear layer gets a
`tiderl.rollout.low_rank` term, which says why not merged), and its weight syncs and
`state_checksum` carry only the adapters (A, B). `make_engine` builds it when the policy carries
peft adapters (`model.lora.r > 0`).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from tiderl.rollout import low_rank
from tiderl.rollout.base import check_update
from tiderl.rollout.torch_engine import TorchEngine
from tiderl.rollout.weights import weights_checksum

_PEFT_PREFIX = "base_model.model."


class LoraTorchEngine(TorchEngine):
    """A `TorchEngine` built from a peft LoRA model; `update_weights` takes its adapters only."""

    def __init__(self, model: Any, tokenizer: Any, copy_model: bool = True, **kwargs: Any) -> None:
        # name of each adapted layer in the plain model -> (scaling, adapter keys A and B)
        self._layers: dict[str, tuple[float, str, str]] = {}
        for name, module in model.named_modules():
            if getattr(module, "base_layer", None) is None or not hasattr(module, "lora_A"):
                continue
            if "default" not in module.lora_A or not isinstance(module.base_layer, torch.nn.Linear):
                raise ValueError(f"LoraTorchEngine applies LoRA adapters on linear layers only, and {name} is a "
                                 f"{type(module.base_layer).__name__}. Fix: name only linear layers in "
                                 "model.lora.target_modules")
            plain = name[len(_PEFT_PREFIX):] if name.startswith(_PEFT_PREFIX) else name
            self._layers[plain] = (float(module.scaling["default"]),
                                   f"{name}.lora_A.default.weight", f"{name}.lora_B.default.weight")
        if not self._layers:
            raise ValueError("LoraTorchEngine got a model without LoRA adapters; use TorchEngine for a plain model")
        self._adapters = {k: v.detach().clone() for k, v in model.state_dict().items()
                          if ".lora_A." in k or ".lora_B." in k}
        # The base model without its adapters (a deep copy unless handed over: the trainer keeps
        # training `model`), each adapted layer given its adapters back as an unmerged term.
        plain_model = (copy.deepcopy(model) if copy_model else model).unload()
        modules = dict(plain_model.named_modules())
        for plain, (scaling, key_a, key_b) in self._layers.items():
            low_rank.attach(modules[plain], self._adapters[key_a], self._adapters[key_b], scaling)
        super().__init__(plain_model, tokenizer, **{**kwargs, "copy_model": False})

    def update_weights(self, state_dict: dict[str, Any], version: int) -> None:
        """Load the adapters in `state_dict` (every adapter key of the policy, nothing else) and set
        `version` (never lower than the current one). Kept prefix caches are dropped."""
        check_update(self._adapters, state_dict, version, self.version,
                     send="the policy's LoRA adapters, tiderl.train.lora.policy_state(model), of the same model.lora.r")
        modules = dict(self.model.named_modules())
        with self._lock:
            for plain, (_, key_a, key_b) in self._layers.items():
                low_rank.set_adapters(modules[plain], state_dict[key_a], state_dict[key_b])
            self._adapters = {k: v.detach().to("cpu").clone() for k, v in state_dict.items()}
            self.version = version
            self._drop_kept_caches()

    def state_checksum(self) -> float:
        """`weights_checksum` of the adapters the engine holds (what the trainer sends)."""
        with self._lock:
            return weights_checksum(self._adapters)
