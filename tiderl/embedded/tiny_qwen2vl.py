"""A tiny Qwen2-VL or Qwen2.5-VL (issue 31), built from a config, no download: the vision transformer
(patches of `patch_size` px, 2x2 patches merged into one token; Qwen2.5-VL's with window attention in
every block but the last, RMSNorm and a gated MLP) and the language model with 3-D rotary positions
(M-RoPE), small; tiderl's byte-level BPE tokenizer (`tiny.train_tokenizer`) plus
Qwen2-VL's vision tokens; the image processor is transformers' PIL one (no torchvision), inside
`models.loading.ImageQwen2VLProcessor` (no video processor).

An image keeps its aspect ratio: it is resized to multiples of `patch_size * merge_size` px within
`min_pixels`..`max_pixels` and becomes `(h / patch) * (w / patch) / merge**2` `<|image_pad|>`
tokens between `<|vision_start|>` and `<|vision_end|>`: a 40 x 40 picture 4 tokens, 50 x 40 six.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLConfig,
                          Qwen2VLForConditionalGeneration)

from tiderl.embedded.chat_template import CHAT_TEMPLATE
from tiderl.embedded.tiny import IM_END_ID, PAD_ID, TINY_ATTN_IMPLEMENTATION, train_tokenizer
from tiderl.models.loading import ImageQwen2VLProcessor

VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"
QWEN2VL_TOKENS = [VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]
# The architectures built here (config.model_type) -> (config class, model class).
ARCHITECTURES = {"qwen2_vl": (Qwen2VLConfig, Qwen2VLForConditionalGeneration),
                 "qwen2_5_vl": (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration)}

# tiderl's ChatML template where a message's content may be a list of parts: `{"type": "image"}`
# renders as Qwen2-VL's templates write an image (`<|vision_start|><|image_pad|><|vision_end|>`,
# the processor expands `<|image_pad|>` into the image's tokens) and `{"type": "text", "text": ...}`
# its text, in order.
_CONTENT_MACRO = (
    "{%- macro content(c) -%}"
    "{%- if c is string -%}{{ c }}"
    "{%- else -%}{%- for p in c -%}"
    "{%- if p['type'] == 'image' -%}{{ '" + VISION_START + IMAGE_PAD + VISION_END + "' }}"
    "{%- elif p['type'] == 'text' -%}{{ p['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
)
QWEN2VL_CHAT_TEMPLATE = _CONTENT_MACRO + CHAT_TEMPLATE.replace(
    "m['content'] if m['content']", "content(m['content']) if m['content']").replace(
    "nl + m['content'] + nl", "nl + content(m['content']) + nl")


def train_qwen2vl_tokenizer(texts: Iterable[str], vocab_size: int = 1024) -> Any:
    """`tiny.train_tokenizer` plus Qwen2-VL's vision tokens (one id each, after the learned ones)
    and the template that renders image parts (`QWEN2VL_CHAT_TEMPLATE`)."""
    tokenizer = train_tokenizer(texts, vocab_size)
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN2VL_TOKENS})
    tokenizer.chat_template = QWEN2VL_CHAT_TEMPLATE
    return tokenizer


def make_qwen2vl_processor(tokenizer: Any, patch_size: int = 8, merge_size: int = 2, min_pixels: int = 16 * 16,
                           max_pixels: int = 64 * 64) -> ImageQwen2VLProcessor:
    """The processor of `tokenizer`: the PIL image processor with these sizes and the tokenizer's
    chat template."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    if min_pixels > max_pixels or max_pixels < (patch_size * merge_size) ** 2:
        raise ValueError(f"min_pixels={min_pixels}, max_pixels={max_pixels}: need min_pixels <= max_pixels and "
                         f"max_pixels >= (patch_size * merge_size) ** 2 = {(patch_size * merge_size) ** 2}")
    image_processor = Qwen2VLImageProcessorPil(patch_size=patch_size, merge_size=merge_size, temporal_patch_size=2,
                                               min_pixels=min_pixels, max_pixels=max_pixels)
    return ImageQwen2VLProcessor(image_processor, tokenizer, chat_template=tokenizer.chat_template)


def tiny_qwen2vl_config(tokenizer: Any, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                        num_kv_heads: int = 2, vision_hidden_size: int = 32, vision_layers: int = 1,
                        patch_size: int = 8, merge_size: int = 2, max_position_embeddings: int = 1024,
                        architecture: str = "qwen2_vl") -> Qwen2VLConfig | Qwen2_5_VLConfig:
    """A Qwen2-VL (or, with `architecture="qwen2_5_vl"`, Qwen2.5-VL) config for `tokenizer` (from
    `train_qwen2vl_tokenizer`): pad/eos ids as the tiny text model's, the vision token ids the
    tokenizer's, embeddings tied; the rotary frequencies of a head split into (temporal, height,
    width) sections as the real models' (16, 24, 24) of 64. Qwen2.5-VL's vision windows are 2 x 2
    merged tokens (so a 64 px picture spans four), its last vision block attends to the whole image."""
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture={architecture!r}: use one of {', '.join(ARCHITECTURES)}")
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN2VL_TOKENS}
    if any(not isinstance(i, int) or i == tokenizer.unk_token_id for i in ids.values()):
        raise ValueError(f"the tokenizer lacks Qwen2-VL's vision tokens {QWEN2VL_TOKENS}: build it with "
                         "train_qwen2vl_tokenizer")
    if hidden_size % num_heads or (hidden_size // num_heads) % 2:
        raise ValueError(f"hidden_size={hidden_size} must be num_heads={num_heads} times an even head size")
    half = hidden_size // num_heads // 2
    spatial = half * 3 // 8
    text = dict(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=4 * hidden_size,
                num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                max_position_embeddings=max_position_embeddings, tie_word_embeddings=True, pad_token_id=PAD_ID,
                eos_token_id=IM_END_ID, bos_token_id=None,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": [half - 2 * spatial, spatial, spatial]})
    vision = dict(depth=vision_layers, embed_dim=vision_hidden_size, hidden_size=hidden_size, num_heads=2,
                  mlp_ratio=2, patch_size=patch_size, spatial_merge_size=merge_size, temporal_patch_size=2)
    if architecture == "qwen2_5_vl":
        vision = dict(depth=vision_layers, hidden_size=vision_hidden_size, out_hidden_size=hidden_size, num_heads=2,
                      intermediate_size=2 * vision_hidden_size, patch_size=patch_size, spatial_merge_size=merge_size,
                      temporal_patch_size=2, window_size=2 * patch_size * merge_size,
                      fullatt_block_indexes=[vision_layers - 1])
    config = ARCHITECTURES[architecture][0](text_config=text, vision_config=vision, image_token_id=ids[IMAGE_PAD],
                           video_token_id=ids[VIDEO_PAD], vision_start_token_id=ids[VISION_START],
                           vision_end_token_id=ids[VISION_END], tie_word_embeddings=True)
    config._attn_implementation = TINY_ATTN_IMPLEMENTATION
    return config


def init_tiny_qwen2vl(config: Qwen2VLConfig | Qwen2_5_VLConfig, seed: int) -> Any:
    """A freshly initialised fp32 model of `config`'s architecture; the same config and seed give
    identical weights (the global torch RNG is left untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = ARCHITECTURES[config.model_type][1](config)
    return model.to(torch.float32).eval()


def build_tiny_qwen2vl(texts: Iterable[str], seed: int = 0, vocab_size: int = 512,
                       **config: Any) -> tuple[Any, ImageQwen2VLProcessor]:
    """(model, processor): a tokenizer trained on `texts`, its processor and a fresh tiny Qwen2-VL
    (`config`: `tiny_qwen2vl_config`'s arguments, e.g. `architecture="qwen2_5_vl"` for a Qwen2.5-VL;
    the patch sizes go to the processor too)."""
    tokenizer = train_qwen2vl_tokenizer(texts, vocab_size)
    sizes = {k: config[k] for k in ("patch_size", "merge_size") if k in config}
    processor = make_qwen2vl_processor(tokenizer, **sizes)
    return init_tiny_qwen2vl(tiny_qwen2vl_config(tokenizer, **config), seed), processor
