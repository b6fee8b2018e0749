"""The tiny vision-language model (issue 31): an Idefics3 (SmolVLM architecture) built from a config,
no download. A small vision tower (SigLIP-shaped), the Idefics3 connector (pixel shuffle, linear
projection) and a small Llama-shaped language model; tiderl's byte-level BPE tokenizer
(`tiny.train_tokenizer`) plus the image tokens the Idefics3 processor writes; the processor's
image processor is the PIL one (no torchvision), without image splitting: every image is resized
to `image_size` x `image_size` and becomes `image_seq_len(...)` `<image>` tokens between
`<fake_token_around_image><global-img>` and `<fake_token_around_image>`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import torch
from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor

from tiderl.embedded.chat_template import VLM_CHAT_TEMPLATE
from tiderl.embedded.tiny import IM_END_ID, PAD_ID, TINY_ATTN_IMPLEMENTATION, train_tokenizer
from tiderl.envs.protocol import Env, Observation, Task
from tiderl.models.vision import IMAGE_PLACEHOLDER, ChatProcessor

# The tokens the Idefics3 processor writes around and for an image (it adds the first two and
# `<end_of_utterance>` itself; `<global-img>` would otherwise be split into bytes).
IMAGE_TOKENS = ["<fake_token_around_image>", IMAGE_PLACEHOLDER, "<global-img>", "<end_of_utterance>"]


def image_seq_len(image_size: int, patch_size: int, scale_factor: int) -> int:
    """`<image>` tokens per image: the vision tower's patches, pixel-shuffled by `scale_factor`."""
    if image_size % patch_size or (image_size // patch_size) % scale_factor:
        raise ValueError(f"image_size={image_size} must be a multiple of patch_size={patch_size} times "
                         f"scale_factor={scale_factor}: choose sizes that divide evenly")
    return (image_size // patch_size) ** 2 // scale_factor**2


def train_vlm_tokenizer(texts: Iterable[str], vocab_size: int = 1024) -> Any:
    """`tiny.train_tokenizer` plus the image tokens (`IMAGE_TOKENS`, one id each, after the learned
    ones) and the template that renders image parts (`VLM_CHAT_TEMPLATE`)."""
    tokenizer = train_tokenizer(texts, vocab_size)
    tokenizer.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    return tokenizer


def make_processor(tokenizer: Any, image_size: int = 64, patch_size: int = 16, scale_factor: int = 2) -> Any:
    """The Idefics3 processor of `tokenizer`: the PIL image processor, one `image_size` square per
    image (no splitting), `image_seq_len` tokens per image, the tokenizer's chat template."""
    from transformers.models.idefics3 import Idefics3ImageProcessorPil

    image_processor = Idefics3ImageProcessorPil(
        size={"longest_edge": image_size}, max_image_size={"longest_edge": image_size}, do_image_splitting=False)
    return Idefics3Processor(image_processor, tokenizer, image_seq_len=image_seq_len(image_size, patch_size, scale_factor),
                             chat_template=tokenizer.chat_template)


def tiny_vlm_config(tokenizer: Any, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                    num_kv_heads: int = 2, vision_hidden_size: int = 32, vision_layers: int = 1,
                    image_size: int = 64, patch_size: int = 16, scale_factor: int = 2,
                    max_position_embeddings: int = 1024) -> Idefics3Config:
    """An Idefics3 config for `tokenizer` (from `train_vlm_tokenizer`): pad/eos ids as the tiny text
    model's, `image_token_id` the tokenizer's `<image>`, embeddings tied."""
    image_seq_len(image_size, patch_size, scale_factor)  # checks the sizes
    token = tokenizer.convert_tokens_to_ids(IMAGE_PLACEHOLDER)
    if not isinstance(token, int) or token == tokenizer.unk_token_id:
        raise ValueError(f"the tokenizer has no {IMAGE_PLACEHOLDER} token: build it with train_vlm_tokenizer")
    text = dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=hidden_size,
                intermediate_size=4 * hidden_size, num_hidden_layers=num_layers, num_attention_heads=num_heads,
                num_key_value_heads=num_kv_heads, max_position_embeddings=max_position_embeddings,
                tie_word_embeddings=True, pad_token_id=PAD_ID, eos_token_id=IM_END_ID, bos_token_id=None)
    vision = dict(hidden_size=vision_hidden_size, intermediate_size=2 * vision_hidden_size,
                  num_hidden_layers=vision_layers, num_attention_heads=2, image_size=image_size, patch_size=patch_size)
    config = Idefics3Config(text_config=text, vision_config=vision, image_token_id=token, scale_factor=scale_factor,
                            tie_word_embeddings=True, pad_token_id=PAD_ID)
    config._attn_implementation = TINY_ATTN_IMPLEMENTATION
    return config


# The pixel shuffle the visual demo's embedded build uses (`model.tiny.image_scale_factor=4`; issue 31):
# a 64 px picture of 16 px patches becomes ONE `<image>` token whose features hold every patch in a
# slot of its own (a 4x4 grid: each cell's colour at a fixed place). With 2 (4 tokens) or 1 (16, one
# a cell) the language model has to find the agent's token by attention, which carries a token's
# content but not its place, and the warm start did not learn to read the grid (`vlm_probe`;
# docs/multimodal.md, "The visual demo").
EMBEDDED_SCALE_FACTOR = 4


def init_tiny_vlm(config: Idefics3Config, seed: int) -> Idefics3ForConditionalGeneration:
    """A freshly initialised fp32 model; the same config and seed give identical weights (the
    global torch RNG is left untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Idefics3ForConditionalGeneration(config)
    return model.to(torch.float32).eval()


def build_tiny_vlm(texts: Iterable[str], seed: int = 0, vocab_size: int = 512, **config: Any) -> tuple[Any, Any]:
    """(model, processor): a tokenizer trained on `texts`, its processor and a fresh tiny VLM
    (`config`: `tiny_vlm_config`'s size arguments; the image sizes go to the processor too)."""
    tokenizer = train_vlm_tokenizer(texts, vocab_size)
    sizes = {k: config[k] for k in ("image_size", "patch_size", "scale_factor") if k in config}
    processor = make_processor(tokenizer, **sizes)
    return init_tiny_vlm(tiny_vlm_config(tokenizer, **config), seed), processor




def oracle_texts(env: Env, tasks: list[Task], scripts: dict[str, list[str]]) -> list[str]:
    """What an oracle episode writes: the system prompt, the tool schemas, the questions and
    the scripted turns (a corpus to train a tokenizer on when no model brings one)."""
    texts = [env.system_prompt(), json.dumps(env.tool_schemas()), "system", "user", "assistant",
             "Tools:", "<tool_response>", "</tool_response>"]
    for task in tasks:
        texts.append(task.prompt)
        texts.extend(scripts[task.task_id])
    return texts


def oracle_tokenizer(setup: Any, scripts: dict[str, list[str]], vocab_size: int) -> tuple[Any, str]:
    """A tokenizer trained on the oracle's texts as the tiny model's is, for `tiderl eval --oracle`
    without a model (the tiny VLM's processor, as a `ChatProcessor`, when the environment's prompts
    show images), and a phrase that says which."""
    texts = oracle_texts(setup.make_env(), setup.eval_tasks, scripts)
    first = setup.make_env().reset(setup.eval_tasks[0]) if setup.eval_tasks else ""
    if isinstance(first, Observation) and first.images:  # a processor renders the images
        tokenizer = ChatProcessor(make_processor(train_vlm_tokenizer(texts, vocab_size)))
        return tokenizer, (f"the tiny vision-language model's processor ({len(tokenizer.tokenizer)} tokens) trained "
                           "on the oracle's texts")
    tokenizer = train_tokenizer(texts, vocab_size=vocab_size)
    return tokenizer, f"byte-level BPE ({len(tokenizer)} tokens) trained on the oracle's texts"
