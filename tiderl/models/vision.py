"""Images as model inputs (issue 31): telling a processor from a tokenizer, turning an episode's
images into pixel inputs, and embedding a token sequence with its images' features scattered into
the image-placeholder positions (`embed_inputs`), the one way the trainer and the torch engine feed
images to a vision-language model. docs/multimodal.md describes the whole path.
"""

from __future__ import annotations

from typing import Any

import torch


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


def image_features(model: Any, image_processor: Any, images: list[Any]) -> torch.Tensor:
    """`[N * tokens_per_image, hidden]`: the features of `images` (vision tower then connector), in
    order, as the language model embeds them."""
    pixels = {k: v.to(model.device) for k, v in image_inputs(image_processor, images).items()}
    out = model.get_image_features(**pixels, return_dict=True)
    features = out.pooler_output if hasattr(out, "pooler_output") else out
    if isinstance(features, (list, tuple)):
        features = torch.cat([f.reshape(-1, f.shape[-1]) for f in features])
    return features.reshape(-1, features.shape[-1])


def embed_inputs(model: Any, input_ids: torch.Tensor, images: list[list[Any]] | None,
                 image_processor: Any) -> torch.Tensor:
    """`[B, T, hidden]` input embeddings of `input_ids`, each row's image placeholders replaced by
    the features of that row's `images[row]` (PIL images in placeholder order), as the model's own
    forward with pixel values embeds them.

    ValueError, naming the row, when a row's placeholder count is not its images' token count
    (an episode whose tokens and images disagree must not train on the wrong pixels).
    """
    embeds = model.get_input_embeddings()(input_ids)
    if not images or not any(images):
        return embeds
    token = image_token_id(model)
    rows = []
    for row, row_images in enumerate(images):
        if not row_images:
            rows.append(embeds[row])
            continue
        features = image_features(model, image_processor, row_images).to(embeds.dtype)
        where = input_ids[row] == token
        if int(where.sum()) != features.shape[0]:
            raise ValueError(f"row {row} has {int(where.sum())} image placeholder tokens but its "
                             f"{len(row_images)} image(s) give {features.shape[0]} features: the tokens and "
                             "Trajectory.images disagree (were the images expanded with another processor?)")
        rows.append(embeds[row].masked_scatter(where.unsqueeze(-1), features))
    return torch.stack(rows)
