"""The embedded tiny model: a byte-level BPE tokenizer trained on the task's own text and a small
Qwen2-architecture causal LM built from a config (no download).

The tokenizer puts the special tokens of `chat_template.py` first, so their ids are fixed:
`<|pad|>` = 0, `<|im_start|>` = 1, `<|im_end|>` = 2 (see `PAD_ID`, `IM_START_ID`, `IM_END_ID`).
`tiny_qwen2_config` uses the same ids for `pad_token_id` and `eos_token_id`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from tiderl.embedded.chat_template import CHAT_TEMPLATE, IM_END, IM_START, PAD, SPECIAL_TOKENS

# The trainer assigns ids to special tokens in list order before any learned token.
PAD_ID, IM_START_ID, IM_END_ID = 0, 1, 2

# Attention kernel of the tiny model. "sdpa" and "eager" both make KV-cache decoding with left
# padding agree with a full unpadded forward to ~1e-6 in fp32 and run at the same speed at
# hidden 128 on 2 CPU cores; "sdpa" is what `from_pretrained` picks by default, so a saved and
# reloaded tiny model gives bit-identical logits.
TINY_ATTN_IMPLEMENTATION = "sdpa"


def train_tokenizer(texts: Iterable[str], vocab_size: int = 1024) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on `texts` and wrap it for Hugging Face.

    Promises:
    - the special tokens `<|pad|>`, `<|im_start|>`, `<|im_end|>` have ids 0, 1, 2, always encode
      as one id each and are never split or merged with neighbouring text;
    - every digit is its own pre-token (no merges across digits), so `film_042` and `film_043`
      share all but one token and numbers generalise;
    - any unicode text round-trips: `decode(encode(x)) == x` (byte-level alphabet, no
      normaliser, no BOS, no space clean-up);
    - the same texts give the same tokenizer (the `tokenizers` BPE trainer breaks count ties
      by pair order, not by hash order);
    - `chat_template` is tiderl's ChatML template, `eos_token` is `<|im_end|>`, `pad_token` is
      `<|pad|>`, there is no BOS token.

    `vocab_size` is an upper bound: a small corpus may yield fewer merges. It must leave room for
    the 256 byte symbols and the 3 special tokens.
    """
    min_vocab = 256 + len(SPECIAL_TOKENS)
    if vocab_size < min_vocab:
        raise ValueError(
            f"vocab_size={vocab_size} is too small: a byte-level BPE needs at least {min_vocab} "
            "entries (256 bytes + 3 special tokens); pass vocab_size >= 259"
        )
    tokenizer = Tokenizer(models.BPE())
    # Digits first (each digit isolated), then the byte-level split that maps every byte to a
    # printable symbol. add_prefix_space=False keeps "a" and " a" distinct and round-trips exactly.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    for token, expected_id in ((PAD, PAD_ID), (IM_START, IM_START_ID), (IM_END, IM_END_ID)):
        assert tokenizer.token_to_id(token) == expected_id, "special-token ids moved"

    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=IM_END,
        pad_token=PAD,
        additional_special_tokens=[IM_START],
        clean_up_tokenization_spaces=False,
        padding_side="left",
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def tiny_qwen2_config(
    vocab_size: int,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 1024,
    tie_word_embeddings: bool = True,
) -> Qwen2Config:
    """A small Qwen2 config whose pad/eos ids match `train_tokenizer` (0 and 2, no BOS).

    `intermediate_size` defaults to 4 * hidden_size. `vocab_size` should be `len(tokenizer)`.
    """
    if hidden_size % num_heads != 0:
        raise ValueError(
            f"hidden_size={hidden_size} is not divisible by num_heads={num_heads}: "
            "choose num_heads that divides hidden_size"
        )
    if num_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}: "
            "grouped-query attention needs num_kv_heads to divide num_heads"
        )
    if vocab_size <= IM_END_ID:
        raise ValueError(f"vocab_size={vocab_size} must exceed the special-token ids; use len(tokenizer)")
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size if intermediate_size is not None else 4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=PAD_ID,
        eos_token_id=IM_END_ID,
        bos_token_id=None,
    )
    config._attn_implementation = TINY_ATTN_IMPLEMENTATION
    return config


def init_tiny_model(config: Qwen2Config, seed: int) -> Qwen2ForCausalLM:
    """A freshly initialised fp32 model; the same config and seed give identical weights.

    The global torch RNG is left untouched (initialisation runs under a forked RNG).
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.config._attn_implementation = TINY_ATTN_IMPLEMENTATION
    return model.to(torch.float32)
