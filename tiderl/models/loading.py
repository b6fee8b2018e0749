"""Load and save Hugging Face causal LMs and their tokenizers as they are.

A model directory is a normal Hugging Face one (config.json, *.safetensors, tokenizer files and
the chat template), so any tool that reads Hugging Face models reads tiderl's checkpoints.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoProcessor,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2VLProcessor,
)

from tiderl.models.vision import MROPE_MODEL_TYPES  # (the Qwen2-VL family: its image processor too)

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}

# "org/name" or "name": what a Hugging Face hub id looks like (no leading "/", ".", "~").
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def _resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: use one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def _check_source(path_or_name: str | Path) -> str:
    """Return the source as a string; fail early on a local path that is not a model dir.

    An existing path must be a directory holding config.json. A string that does not exist
    locally is accepted only if it looks like a hub id ("org/name"); anything else is a
    mistyped local path and gets a FileNotFoundError.
    """
    source = str(path_or_name)
    path = Path(source).expanduser()
    if path.exists():
        if not path.is_dir():
            raise FileNotFoundError(
                f"{source} is a file, not a model directory: pass the folder that holds config.json"
            )
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"{source} has no config.json: it is not a Hugging Face model directory; "
                "save one with tiderl.models.loading.save_model_dir or model.save_pretrained"
            )
        return str(path)
    if not _HUB_ID.match(source):
        raise FileNotFoundError(
            f"model directory {source} does not exist: check the path (a hub id looks like 'org/name')"
        )
    return source


def check_device(device: str | torch.device) -> None:
    """Fail with the fix when `device` (model.device) is not available in this torch build."""
    kind = torch.device(device).type
    if kind == "cuda" and not torch.cuda.is_available():
        why = ("this torch build has no CUDA support" if torch.version.cuda is None
               else "no CUDA device is visible")
        raise ValueError(f"model.device={device}: {why} (torch {torch.__version__}). Fix: model.device=cpu, "
                         "or install a CUDA build of torch on a machine with a GPU.")
    if kind == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"model.device={device}: MPS is not available here. Fix: model.device=cpu.")


def check_finite_weights(model: torch.nn.Module, source: str, only: str = "") -> None:
    """Refuse a model whose weights (those whose name contains `only`) hold NaN or infinity,
    naming the first such tensor."""
    for name, tensor in model.state_dict().items():
        if only in name and tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise ValueError(f"{source}: weight {name} holds {bad} non-finite values (NaN or inf). Fix: load "
                             "an earlier checkpoint (train.resume=<run_dir>/checkpoints/step_N) or re-export the model.")


def load_model(
    path_or_name: str | Path, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu"
) -> PreTrainedModel:
    """Load any Hugging Face causal LM (config + safetensors) in eval mode on `device`.

    `dtype` is "float32", "bfloat16" or "float16" (or a torch.dtype). A hub id is resolved
    through the local Hugging Face cache or the network, like `from_pretrained`.
    """
    source = _check_source(path_or_name)
    torch_dtype = _resolve_dtype(dtype)
    check_device(device)
    auto = AutoModelForCausalLM
    if _is_vision_language(source):  # (docs/multimodal.md)
        from transformers import AutoModelForImageTextToText as auto
    try:
        model = auto.from_pretrained(source, dtype=torch_dtype)
    except OSError as err:
        raise FileNotFoundError(
            f"could not load a causal LM from {source!r}: it is neither a local model directory "
            f"nor a hub model available here ({err})"
        ) from err
    except Exception as err:  # safetensors raises its own error type, without the file
        if "safetensor" not in type(err).__name__.lower() and "safetensor" not in str(err).lower():
            raise
        files = sorted(p.name for p in Path(source).glob("*.safetensors")) if Path(source).is_dir() else []
        raise ValueError(
            f"the weights of {source} cannot be read ({type(err).__name__}: {err}); files: {files}. The file is "
            "corrupt or truncated (a copy or save that did not finish). Fix: copy the model again, or resume "
            "from another checkpoint."
        ) from err
    check_finite_weights(model, source)
    return model.to(device).eval()


def lora_base_of(path: str | Path) -> Path | None:
    """The base model directory named by the LoRA adapter directory `path` (a LoRA run's
    checkpoint `actor/`), or None when `path` holds no adapters."""
    config = Path(path) / "adapter_config.json"
    if not config.is_file():
        return None
    return Path(json.loads(config.read_text()).get("base_model_name_or_path") or "")


def load_policy(
    path: str | Path, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu",
    base_model: str | Path | None = None,
) -> torch.nn.Module:
    """A model directory as `load_model` loads it, or a LoRA adapter directory as the peft model
    the trainer had: its base model (`base_model`, by default the one the adapters name) in
    `dtype`, the adapters beside it, unmerged and in fp32 as peft keeps them, from which
    `make_engine` builds a `LoraTorchEngine` that samples what the trainer scored."""
    base = lora_base_of(path)
    if base is None:
        return load_model(path, dtype, device)
    base = Path(base_model) if base_model else base
    if not (base / "config.json").is_file():
        raise FileNotFoundError(
            f"{path} holds LoRA adapters of the base model {str(base) or '(unnamed)'}, which is not a model "
            "directory here. Fix: pass the base model the run trained from (tiderl export --base-model DIR; "
            "its model.path, or the embedded model's directory under model.cache_dir), or fetch it again "
            "(tiderl models fetch).")
    try:
        from peft import PeftModel
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(f"{path} holds LoRA adapters, which need peft. Fix: pip install 'tiderl[lora]'") from err
    model = PeftModel.from_pretrained(load_model(base, dtype, device), str(path))
    check_finite_weights(model, str(path), only=".lora_")  # load_model checked the base
    return model.eval()


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """Load the tokenizer of a model directory (or hub id); it must carry a chat template.

    tiderl renders every conversation with the tokenizer's own chat template, so a tokenizer
    without one is refused rather than guessed at. A LoRA adapter directory (a LoRA run's
    checkpoint `actor/`) holds its tokenizer too.
    """
    source = str(Path(path).expanduser()) if lora_base_of(Path(path).expanduser()) else _check_source(path)
    if _is_vision_language(source):
        from tiderl.models.vision import ChatProcessor

        tokenizer = ChatProcessor(load_processor(source))  # a tokenizer that carries its processor
    elif _declares_generic_tokenizer(source):
        # AutoTokenizer maps model_type "qwen2" to Qwen2Tokenizer whatever tokenizer_config.json
        # declares, and that class swaps in Qwen's own pre-tokenizer and an NFC normaliser. A
        # directory that declares the generic class (every tiny-model dir does) is loaded from
        # its tokenizer.json exactly as written, so token ids never change between save and load.
        tokenizer = PreTrainedTokenizerFast.from_pretrained(source)
    else:
        tokenizer = AutoTokenizer.from_pretrained(source)
    if not tokenizer.chat_template:
        raise ValueError(
            f"the tokenizer at {source} has no chat template: use an instruct/chat model, or set "
            "tokenizer.chat_template (e.g. tiderl.embedded.chat_template.CHAT_TEMPLATE) and save it "
            "with tiderl.models.loading.save_model_dir"
        )
    return tokenizer


class ImageQwen2VLProcessor(Qwen2VLProcessor):
    """Qwen2-VL's processor for images only: the image processor and the tokenizer, no video
    processor. transformers' own insists on its video processor, which needs torchvision;
    tiderl shows images, never videos. It saves as a Qwen2VLProcessor (`processor_class`): the
    name transformers' own class loads by where torchvision is installed."""

    def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: str | None = None,
                 **kwargs: Any):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "processor_class": "Qwen2VLProcessor"}


def _load_qwen2vl_processor(source: str) -> ImageQwen2VLProcessor:
    """A Qwen2-VL folder's processor without torchvision: its PIL image processor, its tokenizer
    and its chat template."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    # transformers 5 saves the image processor in processor_config.json, older checkpoints beside it.
    nested = Path(source) / "processor_config.json"
    nested = json.loads(nested.read_text()).get("image_processor") if nested.is_file() else None
    if nested is not None:
        image_processor = Qwen2VLImageProcessorPil.from_dict(nested)
    elif (Path(source) / "preprocessor_config.json").is_file():
        image_processor = Qwen2VLImageProcessorPil.from_pretrained(source)
    else:
        raise ValueError(f"{source} holds no image processor (no processor_config.json with one, no "
                         "preprocessor_config.json): save the vision-language model's processor there with "
                         "processor.save_pretrained(path), not only its tokenizer")
    tokenizer = (PreTrainedTokenizerFast if _declares_generic_tokenizer(source) else AutoTokenizer).from_pretrained(source)
    legacy = Path(source) / "chat_template.json"  # (where such checkpoints keep the processor's template)
    if not tokenizer.chat_template and legacy.is_file():
        tokenizer.chat_template = json.loads(legacy.read_text()).get("chat_template")
    return ImageQwen2VLProcessor(image_processor, tokenizer, chat_template=tokenizer.chat_template)


def load_processor(path: str | Path) -> Any:
    """The multi-modal processor saved in `path` (`processor.save_pretrained`); for Qwen2-VL and
    Qwen2.5-VL (the same image processor), an `ImageQwen2VLProcessor` (no torchvision needed).

    `AutoProcessor` falls back to the bare tokenizer when the folder has no processor config (a
    model saved with only `tokenizer.save_pretrained`): that is refused here, with the fix, rather
    than found later as images that never reach the model.
    """
    config = Path(path) / "config.json"
    if config.is_file() and json.loads(config.read_text()).get("model_type") in MROPE_MODEL_TYPES:
        return _load_qwen2vl_processor(str(path))
    processor = AutoProcessor.from_pretrained(str(path))
    if not (hasattr(processor, "image_processor") and hasattr(processor, "tokenizer")):
        raise ValueError(f"{path} holds no image processor (AutoProcessor gave a {type(processor).__name__}): save the "
                         "vision-language model's processor there with processor.save_pretrained(path), not only its "
                         "tokenizer")
    return processor


def _is_vision_language(source: str) -> bool:
    """True when a local model dir holds a vision-language model (its config has a vision config)."""
    config = Path(source) / "config.json"
    return config.is_file() and "vision_config" in json.loads(config.read_text())


def _declares_generic_tokenizer(source: str) -> bool:
    """True when a local dir's tokenizer_config.json names the generic tokenizers-backed class."""
    config_path = Path(source) / "tokenizer_config.json"
    if not (Path(source) / "tokenizer.json").is_file() or not config_path.is_file():
        return False
    declared = json.loads(config_path.read_text()).get("tokenizer_class")
    return declared in ("TokenizersBackend", "PreTrainedTokenizerFast")


def save_model_dir(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: str | Path) -> Path:
    """Write `model` (safetensors), its config, the tokenizer and its chat template to `path`.

    The result is a normal Hugging Face model directory: `AutoModelForCausalLM.from_pretrained`
    and `load_model` reload it with identical logits. Returns the directory.
    """
    if not tokenizer.chat_template:
        raise ValueError(
            "the tokenizer has no chat template, so the saved model could not be loaded by "
            "load_tokenizer: set tokenizer.chat_template before saving"
        )
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def count_parameters(model: torch.nn.Module) -> int:
    """Number of parameters, each shared (tied) tensor counted once (`Module.parameters()` yields
    a tied tensor only once)."""
    return sum(p.numel() for p in model.parameters())
