"""Images as model inputs (issue 31): telling a processor from a tokenizer, turning an episode's
images into pixel inputs, and embedding a token sequence with its images' features scattered into
the image-placeholder positions (`embed_inputs`), the one way the trainer and the torch engine feed
images to a vision-language model. docs/multimodal.md describes the whole path.
"""

from __future__ import annotations

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


def split_processor(tokenizer_or_processor: Any) -> tuple[Any, Any | None]:
    """(tokenizer, processor) of a Hugging Face tokenizer (processor None) or of a multi-modal
    processor (one with `image_processor` and `tokenizer`)."""
    obj = tokenizer_or_processor
    if hasattr(obj, "image_processor") and hasattr(obj, "tokenizer"):
        return obj.tokenizer, obj
    return obj, None


def image_inputs(image_processor: Any, images: list[Any]) -> dict[str, torch.Tensor]:
    """The pixel inputs of `images` (PIL images, in placeholder order) as one sample of the model:
    `pixel_values` `[1, N, C, H, W]` (and `pixel_attention_mask` `[1, N, H, W]` where the processor
    makes one)."""
    out = image_processor(images=[list(images)], return_tensors="pt")
    return {k: out[k] for k in ("pixel_values", "pixel_attention_mask") if k in out}


def image_token_id(model: Any) -> int:
    """The id of the placeholder token whose positions take image features."""
    config = model.config
    token = getattr(config, "image_token_id", None)
    if token is None:
        token = getattr(config, "image_token_index", None)
    if token is None:
        raise ValueError(f"{type(model).__name__} has no image_token_id in its config: it is not a vision-language "
                         "model tiderl can feed images to (supported: Idefics3 / SmolVLM)")
    return int(token)


def image_features(model: Any, pixels: dict[str, torch.Tensor]) -> torch.Tensor:
    """`[N * tokens_per_image, hidden]`: the features of one sample's images (`image_inputs`), vision
    tower then connector, in order, as the language model embeds them."""
    inputs = {k: v.to(model.device) for k, v in pixels.items() if k in ("pixel_values", "pixel_attention_mask")}
    out = model.get_image_features(**inputs, return_dict=True)
    features = out.pooler_output if hasattr(out, "pooler_output") else out
    if isinstance(features, (list, tuple)):
        features = torch.cat([f.reshape(-1, f.shape[-1]) for f in features])
    return features.reshape(-1, features.shape[-1])


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
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        # The wrapper has only `forward`; the embeddings and the vision tower are the wrapped
        # model's. Using them before the wrapper's forward is sound: their gradients flow back
        # through `inputs_embeds`, and DDP averages every parameter's gradient wherever it was used.
        model = model.module
    embeds = model.get_input_embeddings()(input_ids)
    if not pixels or all(p is None for p in pixels):
        return embeds
    token = image_token_id(model)
    rows = []
    for row, row_pixels in enumerate(pixels):
        if row_pixels is None:  # no images: placeholder tokens (sampled ones) are text, as without pixel values
            rows.append(embeds[row])
            continue
        where = input_ids[row] == token
        if "forced" in row_pixels:  # (as long as the row's tokens: padding beyond them is not forced)
            forced = row_pixels["forced"][: input_ids.shape[1]].to(where.device, torch.bool)
            where[len(forced):] = False
            where[: len(forced)] &= forced
        features = image_features(model, row_pixels).to(embeds.dtype)
        if int(where.sum()) != features.shape[0]:
            raise ValueError(f"row {row} has {int(where.sum())} image placeholder tokens but its image(s) give "
                             f"{features.shape[0]} features: the tokens and Trajectory.images disagree (were the "
                             "images expanded with another processor?)")
        rows.append(embeds[row].masked_scatter(where.unsqueeze(-1), features))
    return torch.stack(rows)


def model_inputs(model: Any, input_ids: torch.Tensor,
                 pixels: list[dict[str, torch.Tensor] | None] | None) -> dict[str, torch.Tensor]:
    """The token inputs of a forward pass: `input_ids` when no row has images (the text-only call
    as it always was), else `inputs_embeds` from `embed_inputs`."""
    if not pixels or all(p is None for p in pixels):
        return {"input_ids": input_ids}
    return {"inputs_embeds": embed_inputs(model, input_ids, pixels)}
