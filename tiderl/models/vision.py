"""Images as model inputs (issue 31): telling a processor from a tokenizer, turning an episode's
images into pixel inputs, and embedding a token sequence with its images' features scattered into
the image-placeholder positions (`embed_inputs`), the one way the trainer and the torch engine feed
images to a vision-language model. docs/multimodal.md describes the whole path.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass
from typing import Any

import torch

# The image placeholder of a processor that does not name its own (`image_token`): Idefics3's,
# which the tiny vision-language model's chat template writes too.
IMAGE_PLACEHOLDER = "<image>"


@dataclass
class PromptImages:
    """The images a prompt shows, as an engine gets them: `images` (PIL images, in the order of
    their placeholder tokens) and `forced`, one flag per prompt token, 1 where the token was forced
    (prompt, observations). Image features go to the forced placeholder tokens only: a placeholder
    token the model sampled itself is text, as it is for the trainer (`Trajectory.loss_mask`)."""

    images: list[Any]
    forced: list[int]


class ChatProcessor:
    """A vision-language model's processor that also answers as its tokenizer: every attribute it
    does not have is the tokenizer's (pad and eos ids, `decode`, `chat_template`, ...), so code
    written for a tokenizer (a run's `tokenizer`) takes it unchanged, while the agent loop and the
    engines find the processor in it (`split_processor`). `save_pretrained` saves the processor
    (the tokenizer with it), so a checkpoint reloads as a vision-language model."""

    def __init__(self, processor: Any):
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.image_processor = processor.image_processor
        self.image_token = getattr(processor, "image_token", None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.processor(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("processor", "tokenizer", "image_processor"):
            raise AttributeError(name)  # (unpickling looks these up before __init__ has set them)
        return getattr(self.tokenizer, name)

    def __setattr__(self, name: str, value: Any) -> None:
        # What is set on it (a tool-call format, say) is set on the tokenizer, where readers look.
        if name in ("processor", "tokenizer", "image_processor", "image_token"):
            object.__setattr__(self, name, value)
        else:
            setattr(self.tokenizer, name, value)

    def __len__(self) -> int:
        return len(self.tokenizer)

    def save_pretrained(self, path: Any, **kwargs: Any) -> Any:
        return self.processor.save_pretrained(path, **kwargs)


def check_images(prompt: list[int], images: PromptImages | None, processor: Any) -> None:
    """ValueError, before an engine spends anything on it, for a request whose images it cannot
    show: no `processor`, or not one `forced` flag per prompt token."""
    if images is None or not images.images:
        return
    if processor is None:
        raise ValueError("a request shows images but the engine was given a tokenizer: pass the vision-language "
                         "model's processor as the engine's tokenizer")
    if len(images.forced) != len(prompt):
        raise ValueError(f"PromptImages.forced has {len(images.forced)} flags for a prompt of {len(prompt)} tokens: "
                         "give one per prompt token")


def split_processor(tokenizer_or_processor: Any) -> tuple[Any, Any | None]:
    """(tokenizer, processor) of a Hugging Face tokenizer (processor None) or of a multi-modal
    processor (one with `image_processor` and `tokenizer`)."""
    obj = tokenizer_or_processor
    if hasattr(obj, "image_processor") and hasattr(obj, "tokenizer"):
        return obj.tokenizer, obj
    return obj, None


# The image processor outputs a model takes (Idefics3's and Qwen2-VL's: `image_inputs`).
_PIXEL_KEYS = ("pixel_values", "pixel_attention_mask", "image_grid_thw")


def image_inputs(image_processor: Any, images: list[Any]) -> dict[str, torch.Tensor]:
    """The pixel inputs of `images` (PIL images, in placeholder order) as one sample of the model:
    Idefics3's `pixel_values` `[1, N, C, H, W]` (and `pixel_attention_mask` `[1, N, H, W]`), or
    Qwen2-VL's `pixel_values` `[patches, C * T * P * P]` and `image_grid_thw` `[N, 3]`. Those
    `prepare_image_inputs` computed for the same processor and images are returned as they are
    (the same tensors: not to be changed in place)."""
    cached = _prepared(image_processor, images)
    if cached is not None:
        return cached
    out = image_processor(images=[list(images)], return_tensors="pt")
    return {k: out[k] for k in _PIXEL_KEYS if k in out}


# Pixel inputs computed ahead (`tiderl.train.annotate.ImagePixels`), keyed by the ids of the processor
# and the images (an episode's images never change once it ends; hashing pixels costs what processing
# does); weak references check that each id still names its object; an entry goes with its last image.
_PREPARED: dict[tuple[int, ...], tuple[list[Any], dict[str, torch.Tensor]]] = {}


def prepare_image_inputs(image_processor: Any, images: list[Any]) -> None:
    """Compute `image_inputs(image_processor, images)` now: later calls with the same (identical)
    processor and images return it without processing the images again, while the images live."""
    if images and _prepared(image_processor, images) is None:
        key, pixels = (id(image_processor), *map(id, images)), image_inputs(image_processor, images)
        _PREPARED[key] = ([weakref.ref(obj) for obj in (image_processor, *images)], pixels)
        weakref.finalize(images[-1], _PREPARED.pop, key, None)


def _prepared(image_processor: Any, images: list[Any]) -> dict[str, torch.Tensor] | None:
    entry = _PREPARED.get((id(image_processor), *map(id, images)))
    if entry is None or not all(ref() is obj for ref, obj in zip(entry[0], (image_processor, *images))):
        return None
    return entry[1]


def image_token_id(model: Any) -> int:
    """The id of the placeholder token whose positions take image features."""
    config = model.config
    token = getattr(config, "image_token_id", None)
    if token is None:
        token = getattr(config, "image_token_index", None)
    if token is None:
        raise ValueError(f"{type(model).__name__} has no image_token_id in its config: it is not a vision-language "
                         "model tiderl can feed images to (supported: Idefics3 / SmolVLM, Qwen2-VL, Qwen2.5-VL)")
    return int(token)


def image_features(model: Any, pixels: dict[str, torch.Tensor]) -> torch.Tensor:
    """`[N * tokens_per_image, hidden]`: the features of one sample's images (`image_inputs`), vision
    tower then connector, in order, as the language model embeds them."""
    inputs = {k: v.to(model.device) for k, v in pixels.items() if k in _PIXEL_KEYS}
    out = model.get_image_features(**inputs, return_dict=True)
    features = out.pooler_output if hasattr(out, "pooler_output") else out
    if isinstance(features, (list, tuple)):
        features = torch.cat([f.reshape(-1, f.shape[-1]) for f in features])
    return features.reshape(-1, features.shape[-1])


def _unwrap(model: Any) -> Any:
    """The model inside a DDP wrapper, which has only `forward`. Using the embeddings and the vision
    tower before the wrapper's forward is sound: their gradients flow back through `inputs_embeds`,
    and DDP averages every parameter's gradient wherever it was used."""
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def _placeholders(ids: torch.Tensor, token: int, row_pixels: dict[str, torch.Tensor]) -> torch.Tensor:
    """`[T]` bool: the positions of `ids` (one row) that take image features: its placeholder
    tokens, only the forced ones where `row_pixels` has "forced" (padding beyond it is not)."""
    where = ids == token
    if "forced" in row_pixels:
        forced = row_pixels["forced"][: ids.shape[0]].to(where.device, torch.bool)
        where[len(forced):] = False
        where[: len(forced)] &= forced
    return where


# --- Placeholders a server expands itself (the HTTP engine with images; docs/multimodal.md) ---------
# tiderl's prompts hold each image's placeholder already expanded (the processor's tokens, which the
# trainer sees); a server such as vLLM takes one placeholder token per image and expands it again.

def placeholder_id(processor: Any) -> int:
    """The id of `processor`'s image placeholder token (one per image in a prompt a server expands)."""
    return int(processor.tokenizer.convert_tokens_to_ids(getattr(processor, "image_token", None) or IMAGE_PLACEHOLDER))


def placeholder_expansion(processor: Any, image: Any) -> list[int]:
    """The tokens `processor` expands one placeholder of `image` into (its size sets their count)."""
    placeholder = getattr(processor, "image_token", IMAGE_PLACEHOLDER)
    return [int(t) for t in processor(text=[placeholder], images=[[image]], add_special_tokens=False)["input_ids"][0]]


def collapse_images(prompt: list[int], forced: list[int], expansions: list[list[int]], placeholder: int) -> list[int]:
    """`prompt` with each image's expansion (in order, forced tokens only) replaced by the one
    `placeholder` token: the prompt a server that expands placeholders itself takes. ValueError
    when an expansion is missing or a placeholder token the model wrote itself is left (a server
    would take it for an image)."""
    out: list[int] = []
    i, found = 0, 0
    while i < len(prompt):
        span = expansions[found] if found < len(expansions) else None
        if span and prompt[i:i + len(span)] == span and all(forced[i:i + len(span)]):
            out.append(placeholder)
            i, found = i + len(span), found + 1
            continue
        if prompt[i] == placeholder:
            raise ValueError(f"token {i} of the prompt is the image placeholder but shows no image (the model wrote it): "
                             "a server that expands placeholders would take it for one; use rollout.engine=torch")
        out.append(prompt[i])
        i += 1
    if found != len(expansions):
        raise ValueError(f"found {found} of {len(expansions)} images' tokens in the prompt: the prompt and its images "
                         "do not match (were they expanded by this model's processor?)")
    return out


def expand_images(prompt: list[int], expansions: list[list[int]], placeholder: int) -> list[int]:
    """The inverse of `collapse_images`: each `placeholder` token replaced by its image's
    expansion, in order. ValueError when the counts differ."""
    count = prompt.count(placeholder)
    if count != len(expansions):
        raise ValueError(f"the prompt holds {count} image placeholder tokens for {len(expansions)} images: "
                         "send one placeholder token per image")
    images = iter(expansions)
    return [t for token in prompt for t in (next(images) if token == placeholder else [token])]


def embed_inputs(model: Any, input_ids: torch.Tensor, pixels: list[dict[str, torch.Tensor] | None] | None) -> torch.Tensor:
    """`[B, T, hidden]` input embeddings of `input_ids`, each row's image placeholders replaced by
    the features of that row's pixel inputs `pixels[row]` (`image_inputs` of its images in
    placeholder order; None: a row without images), as the model's own forward with pixel values
    embeds them. The trainer and the torch engine both feed images this way. Where `pixels[row]`
    has "forced" (bool, 1 on the row's forced tokens), only forced placeholders take features
    (`PromptImages`).

    ValueError, naming the row, when a row's placeholder count is not its images' token count
    (an episode whose tokens and images disagree must not train on the wrong pixels).
    """
    model = _unwrap(model)
    embeds = model.get_input_embeddings()(input_ids)
    if not pixels or all(p is None for p in pixels):
        return embeds
    token = image_token_id(model)
    rows = []
    for row, row_pixels in enumerate(pixels):
        if row_pixels is None:  # no images: placeholder tokens (sampled ones) are text, as without pixel values
            rows.append(embeds[row])
            continue
        where = _placeholders(input_ids[row], token, row_pixels)
        features = image_features(model, row_pixels).to(embeds.dtype)
        if int(where.sum()) != features.shape[0]:
            raise ValueError(f"row {row} has {int(where.sum())} image placeholder tokens but its image(s) give "
                             f"{features.shape[0]} features: the tokens and Trajectory.images disagree (were the "
                             "images expanded with another processor?)")
        rows.append(embeds[row].masked_scatter(where.unsqueeze(-1), features))
    return torch.stack(rows)


def embed_in_forward(model: torch.nn.Module) -> None:
    """Make `model` embed its images inside its own forward: `model_inputs` then passes the ids and
    the pixels, which a forward pre-hook turns into `inputs_embeds` (and M-RoPE positions). For an
    FSDP2 root, whose own weights (token embeddings, vision tower) are whole only in its forward:
    FSDP2's pre-hook, prepended, gathers them first."""

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if (pixels := kwargs.pop("tiderl_pixels", None)) is not None:
            kwargs.update(_image_model_inputs(module, kwargs.pop("input_ids"), pixels))
        return args, kwargs

    model.register_forward_pre_hook(hook, with_kwargs=True)
    model._tiderl_embeds_in_forward = True


def model_inputs(model: Any, input_ids: torch.Tensor,
                 pixels: list[dict[str, torch.Tensor] | None] | None) -> dict[str, Any]:
    """The token inputs of a forward pass: `input_ids` when no row has images (the text-only call
    as it always was), else `inputs_embeds` from `embed_inputs`, with the 3-D `position_ids` of
    `rope_positions` for a model with M-RoPE (Qwen2-VL); for a model that embeds them in its own
    forward (`embed_in_forward`), the ids and the pixels for its pre-hook."""
    if not pixels or all(p is None for p in pixels):
        return {"input_ids": input_ids}
    if getattr(model, "_tiderl_embeds_in_forward", False):
        return {"input_ids": input_ids, "tiderl_pixels": pixels}
    return _image_model_inputs(model, input_ids, pixels)


def _image_model_inputs(model: Any, input_ids: torch.Tensor,
                        pixels: list[dict[str, torch.Tensor] | None]) -> dict[str, torch.Tensor]:
    inputs = {"inputs_embeds": embed_inputs(model, input_ids, pixels)}
    positions = rope_positions(model, input_ids, pixels)
    if positions is not None:
        inputs["position_ids"] = positions.to(input_ids.device)
    return inputs


# --- M-RoPE (Qwen2-VL): 3-D rotary positions -------------------------------------------------------
# A text token's (temporal, height, width) position is one number, one more than the largest
# before it; an image's tokens start from the next one, plus their grid cell's (t, h, w), and the
# text after the image resumes at that start plus the grid's larger side: positions fall behind
# token indices after each image, and the engine's decode steps add that lag.

MROPE_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")  # (their image positions agree; they differ for videos only)


def uses_mrope(model: Any) -> bool:
    """Whether `model` takes 3-D rotary positions for image tokens (Qwen2-VL, Qwen2.5-VL). ValueError
    for a model with M-RoPE of another kind (Qwen3-VL, ...): its positions are not computed here."""
    config = _unwrap(model).config
    if getattr(config, "model_type", None) in MROPE_MODEL_TYPES:
        return True
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    if "mrope_section" in (getattr(text, "rope_parameters", None) or {}):
        raise ValueError(f"{config.model_type} uses 3-D rotary positions (M-RoPE) that tiderl does not compute: "
                         f"supported with images: Idefics3 / SmolVLM, {', '.join(MROPE_MODEL_TYPES)}")
    return False


def mrope_positions(image_mask: list[bool], grids: list[list[int]], merge: int) -> tuple[torch.Tensor, int]:
    """`[3, T]` M-RoPE positions of a sequence whose image tokens are at `image_mask` (each image
    `t * (h / merge) * (w / merge)` of them, its grid `(t, h, w)` in `grids`), and the next text
    token's position. ValueError when the image tokens and the grids disagree."""
    out = torch.empty(3, len(image_mask), dtype=torch.long)
    start, i, images = 0, 0, iter(grids)
    for is_image, run in itertools.groupby(image_mask):  # (runs, not tokens: a row is thousands long)
        end = i + sum(1 for _ in run)
        if not is_image:
            out[:, i:end] = torch.arange(start, start + end - i)
            start, i = start + end - i, end
        while i < end:  # one image after another (a run may hold several)
            t, h, w = next(images, (0, 0, 0))
            gh, gw = h // merge, w // merge
            n = t * gh * gw
            if n == 0 or i + n > end:
                raise ValueError(f"the image tokens at {i} do not match the images' grids {grids} (merge {merge}): "
                                 "the tokens and Trajectory.images disagree")
            cell = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij"))
            out[:, i: i + n] = cell.reshape(3, n) + start
            start, i = start + max(gh, gw), i + n
    if next(images, None) is not None:
        raise ValueError(f"{len(grids)} images but fewer image token runs: the tokens and Trajectory.images disagree")
    return out, start


def rope_positions(model: Any, input_ids: torch.Tensor, pixels: list[dict[str, torch.Tensor] | None] | None,
                   lag: list[int] | None = None) -> torch.Tensor | None:
    """`[3, B, T]` position ids of `input_ids` with their images (`pixels`, as `embed_inputs`
    takes them; a row without images is 0..T-1) for a model with M-RoPE, else None. `lag`, when
    given, receives each row's next text position minus T (a decode step's position is its index
    plus that)."""
    if not uses_mrope(model):
        return None
    model = _unwrap(model)
    merge, token, rows = int(model.config.vision_config.spatial_merge_size), image_token_id(model), []
    for row in range(input_ids.shape[0]):
        row_pixels = pixels[row] if pixels else None
        if row_pixels is None:
            positions, following = torch.arange(input_ids.shape[1]).expand(3, -1), input_ids.shape[1]
        elif "image_grid_thw" not in row_pixels:
            raise ValueError(f"row {row}'s pixel inputs have no image_grid_thw, which {type(model).__name__} needs "
                             "for its positions: process the images with the model's own image processor")
        else:
            where = _placeholders(input_ids[row], token, row_pixels).tolist()
            positions, following = mrope_positions(where, row_pixels["image_grid_thw"].tolist(), merge)
        rows.append(positions)
        if lag is not None:
            lag.append(following - input_ids.shape[1])
    return torch.stack(rows, dim=1)
