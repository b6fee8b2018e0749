"""The torch engine for a LoRA policy: it decodes with the base model and the adapters beside it,
unmerged, in the arithmetic of the trainer's peft forward (each adapted linear layer gets a
`tiderl.rollout.low_rank` term, which says why not merged), and its weight syncs and
`state_checksum` carry only the adapters (A, B). `make_engine` builds it when the policy carries
peft adapters (`model.lora.r > 0`). The helpers below also serve the HTTP engine, which keeps
the same unmerged model as its probe's reference and writes the merged weights (`merged_state`)
for servers that have no adapters (docs/engines.md, "LoRA with the HTTP engine").
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
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
        plain_model, self._layers, self._adapters = unmerged_plain(model, copy_model)
        super().__init__(plain_model, tokenizer, **{**kwargs, "copy_model": False})

    def update_weights(self, state_dict: dict[str, Any], version: int) -> None:
        """Load the adapters in `state_dict` (every adapter key of the policy, nothing else) and set
        `version` (never lower than the current one). Kept prefix caches are dropped."""
        check_update(self._adapters, state_dict, version, self.version,
                     send="the policy's LoRA adapters, tiderl.train.lora.policy_state(model), of the same model.lora.r")
        with self._lock:
            set_all_adapters(self.model, self._layers, state_dict)
            self._adapters = {k: v.detach().to("cpu").clone() for k, v in state_dict.items()}
            self.version = version
            self._drop_kept_caches()

    def state_checksum(self) -> float:
        """`weights_checksum` of the adapters the engine holds (what the trainer sends)."""
        with self._lock:
            return weights_checksum(self._adapters)


def adapted_layers(model: Any) -> dict[str, tuple[float, str, str]]:
    """The adapted layers of a peft LoRA model: each one's name in the plain model -> (its
    scaling, the state-dict keys of its A and B). ValueError for adapters on anything but a
    linear layer, or a model without adapters."""
    layers: dict[str, tuple[float, str, str]] = {}
    for name, module in model.named_modules():
        if getattr(module, "base_layer", None) is None or not hasattr(module, "lora_A"):
            continue
        if "default" not in module.lora_A or not isinstance(module.base_layer, torch.nn.Linear):
            raise ValueError(f"the engines apply LoRA adapters on linear layers only, and {name} is a "
                             f"{type(module.base_layer).__name__}. Fix: name only linear layers in "
                             "model.lora.target_modules")
        plain = name[len(_PEFT_PREFIX):] if name.startswith(_PEFT_PREFIX) else name
        layers[plain] = (float(module.scaling["default"]), f"{name}.lora_A.default.weight",
                         f"{name}.lora_B.default.weight")
    if not layers:
        raise ValueError("a LoRA engine got a model without LoRA adapters; use the plain engine for a plain model")
    return layers


def unmerged_plain(model: Any, copy_model: bool = True, share_frozen: bool = False
                   ) -> tuple[Any, dict[str, tuple[float, str, str]], dict[str, torch.Tensor]]:
    """(the base model of the peft model `model` without its adapters, each adapted layer given
    them back as an unmerged `low_rank` term; `adapted_layers(model)`; copies of the adapters).
    A deep copy unless `copy_model=False` hands `model` over (the trainer keeps training it);
    `share_frozen`: the copy's frozen weights (the base, which LoRA never changes) are `model`'s
    own tensors, not copies, for a caller that only reads them (the HTTP engine's probe)."""
    layers = adapted_layers(model)
    adapters = {k: v.detach().clone() for k, v in model.state_dict().items() if ".lora_A." in k or ".lora_B." in k}
    shared = {id(p): p for p in model.parameters() if not p.requires_grad} if share_frozen else {}
    plain_model = (copy.deepcopy(model, shared) if copy_model else model).unload()
    modules = dict(plain_model.named_modules())
    for plain, (scaling, key_a, key_b) in layers.items():
        low_rank.attach(modules[plain], adapters[key_a], adapters[key_b], scaling)
    return plain_model, layers, adapters


def set_all_adapters(plain_model: Any, layers: dict[str, tuple[float, str, str]],
                     state_dict: dict[str, torch.Tensor]) -> None:
    """Copy the adapters in `state_dict` (peft names) into the terms of `unmerged_plain`'s model."""
    modules = dict(plain_model.named_modules())
    for plain, (_, key_a, key_b) in layers.items():
        low_rank.set_adapters(modules[plain], state_dict[key_a], state_dict[key_b])


def merge_weight(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """W + scaling * B A (`a` is `[r, in]`, `b` `[out, r]`), summed in the adapters' dtype and
    rounded once to `weight`'s: the weight of a plain layer that computes what the layer with
    the unmerged term does, up to that rounding."""
    return (weight.to(a.dtype) + (b @ a) * scaling).to(weight.dtype)


def merged_state(plain_model: Any, layers: dict[str, tuple[float, str, str]]) -> dict[str, torch.Tensor]:
    """The state dict of `unmerged_plain`'s model with each term merged into its layer's weight
    (`merge_weight`), under the plain model's names: what a server without adapters loads. The
    model is unchanged."""
    state = dict(plain_model.state_dict())
    modules = dict(plain_model.named_modules())
    for plain in layers:
        term = low_rank.term_of(modules[plain])
        assert term is not None, plain
        state[f"{plain}.weight"] = merge_weight(state[f"{plain}.weight"], term.a, term.b, term.scaling)
    return state


ADAPTER_FILE = "adapter_model.safetensors"


def write_adapter_folder(folder: Path, adapters: dict[str, torch.Tensor], peft_config: Any) -> Path:
    """`adapters` (peft's names, `...lora_A.default.weight`) in peft's saved layout: the names
    without the adapter's, in `adapter_model.safetensors`, beside `adapter_config.json`; what
    vLLM's `/v1/load_lora_adapter` and `peft.PeftModel.from_pretrained` read."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k.replace(".default.", "."): v.detach().to("cpu").contiguous() for k, v in adapters.items()}
    save_file(tensors, str(folder / ADAPTER_FILE), metadata={"format": "pt"})
    peft_config.save_pretrained(str(folder))
    return folder.resolve()


def read_adapter_folder(folder: str | Path) -> dict[str, tuple[float, torch.Tensor, torch.Tensor]]:
    """A folder `write_adapter_folder` (or peft's `save_pretrained`) wrote, as
    `TorchEngine.load_adapters` takes it: each adapted layer's name in the plain model -> (its
    scaling, A, B). ValueError when it is not a LoRA adapter of one rank and scale."""
    from safetensors.torch import load_file

    folder = Path(folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    if config.get("peft_type") != "LORA" or config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ValueError(f"{folder}: not a LoRA adapter of one rank and scale (peft_type {config.get('peft_type')})")
    r, alpha = int(config["r"]), float(config["lora_alpha"])
    scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    tensors = load_file(str(folder / ADAPTER_FILE))
    suffix = ".lora_A.weight"
    return {name.removeprefix(_PEFT_PREFIX)[: -len(suffix)]: (scaling, a, tensors[name[: -len(suffix)] + ".lora_B.weight"])
            for name, a in tensors.items() if name.endswith(suffix)}
