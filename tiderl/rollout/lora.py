"""The torch engine for a LoRA policy: it decodes with a plain model whose adapted weights are
W = W_base + (alpha / r) * B A, and its weight syncs carry only the adapters (A, B).

`make_engine` builds it when the policy carries peft adapters (`model.lora.r > 0`). The engine
keeps the base weights of every adapted layer and merges each adapter set it receives into a
copy of them (never into an already merged weight, so rounding does not drift over syncs). Its
`state_checksum` is the checksum of the adapters it holds, which is what the trainer sends.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch

from tiderl.rollout.fast_decode import copy_into
from tiderl.rollout.torch_engine import TorchEngine
from tiderl.rollout.weights import weights_checksum

_PEFT_PREFIX = "base_model.model."

logger = logging.getLogger(__name__)

# Relative half-step of each low-precision float: W + dW rounds back to W where |dW| is smaller.
_HALF_STEP = {torch.bfloat16: 2.0 ** -9, torch.float16: 2.0 ** -12}


class LoraTorchEngine(TorchEngine):
    """A `TorchEngine` built from a peft LoRA model; `update_weights` takes its adapters only."""

    def __init__(self, model: Any, tokenizer: Any, **kwargs: Any) -> None:
        # name of each adapted layer in the plain model -> (its base weight, scaling, adapter keys)
        self._layers: dict[str, tuple[torch.Tensor, float, str, str]] = {}
        for name, module in model.named_modules():
            base = getattr(module, "base_layer", None)
            if base is None or not hasattr(module, "lora_A") or "default" not in module.lora_A:
                continue
            plain = name[len(_PEFT_PREFIX):] if name.startswith(_PEFT_PREFIX) else name
            self._layers[plain] = (base.weight.detach().clone(), float(module.scaling["default"]),
                                   f"{name}.lora_A.default.weight", f"{name}.lora_B.default.weight")
        if not self._layers:
            raise ValueError("LoraTorchEngine got a model without LoRA adapters; use TorchEngine for a plain model")
        self._adapters = {k: v.detach().clone() for k, v in model.state_dict().items()
                          if ".lora_A." in k or ".lora_B." in k}
        # The merged deep copy is the engine's own already: no second copy.
        super().__init__(copy.deepcopy(model).merge_and_unload(), tokenizer, **{**kwargs, "copy_model": False})
        self._layers = {k: (w.to(self.device), s, a, b) for k, (w, s, a, b) in self._layers.items()}
        dtype = next(iter(self._layers.values()))[0].dtype
        if dtype in _HALF_STEP:
            # Measured on the 0.5B model after 9 actor steps at lr 1e-5: |dW| / |W| 1.6e-4, and
            # the bf16 merge changed 6 % of the adapted elements (docs/real_models.md).
            logger.warning("LoRA on a %s base: the engine merges the adapters into %s weights, which keeps "
                           "a weight's change only where it exceeds about %.2g of the weight, so small early "
                           "updates barely reach the rollouts. For exact rollouts use model.dtype=float32 "
                           "(slower).", str(dtype).removeprefix("torch."), str(dtype).removeprefix("torch."),
                           _HALF_STEP[dtype])

    def update_weights(self, state_dict: dict[str, Any], version: int) -> None:
        """Merge the adapters in `state_dict` (every adapter key of the policy, nothing else) into
        the base weights and set `version` (never lower than the current one)."""
        if version < self.version:
            raise ValueError(f"update_weights got version {version}, lower than the engine's current version "
                             f"{self.version}: versions must not decrease")
        missing = sorted(set(self._adapters) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(self._adapters))
        if missing or unexpected:
            raise ValueError(f"update_weights expects the LoRA adapters of the policy: missing keys {missing[:3]}, "
                             f"unexpected keys {unexpected[:3]}; send tiderl.train.lora.policy_state(model)")
        wrong = [k for k, v in state_dict.items() if tuple(v.shape) != tuple(self._adapters[k].shape)]
        if wrong:
            raise ValueError(f"update_weights got adapters of the wrong shape for {wrong[:3]} (another model.lora.r?)")
        params = dict(self.model.named_parameters())
        with self._lock, torch.no_grad():
            for plain, (base, scaling, key_a, key_b) in self._layers.items():
                # In fp32, rounded once to the base's dtype: a product of bf16 adapters would
                # round the update before the sum rounds it again.
                a = state_dict[key_a].to(self.device, torch.float32)
                b = state_dict[key_b].to(self.device, torch.float32)
                copy_into(params[f"{plain}.weight"], (base.float() + (b @ a) * scaling).to(base.dtype))
            self._adapters = {k: v.detach().to("cpu").clone() for k, v in state_dict.items()}
            self.version = version

    def state_checksum(self) -> float:
        """`weights_checksum` of the adapters the engine holds (what the trainer sends)."""
        with self._lock:
            return weights_checksum(self._adapters)
