"""The tiny model's tokenizer, chat template, config/initialisation, and model-dir save/load."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from tiderl.embedded.chat_template import IM_END, IM_START, PAD
from tiderl.embedded.tiny import (
    IM_END_ID,
    IM_START_ID,
    PAD_ID,
    init_tiny_model,
    tiny_qwen2_config,
    train_tokenizer,
)
from tiderl.models.loading import count_parameters, load_model, load_tokenizer, save_model_dir

CORPUS = [
    f"{IM_START}user\nWho directed film_{i:03d}? It stars Grégoire Colin and person_{i % 17}.{IM_END}\n"
    f"{IM_START}assistant\nThe director of film_{i:03d} is person_{(i * 7) % 23}.{IM_END}\n"
    for i in range(120)
]

# Texts the tokenizer never saw, including decomposed accents (NFC would change them), emoji,
# CJK, tabs, runs of spaces and leading/trailing whitespace.
ROUND_TRIP_TEXTS = [
    "Who directed film_042?",
    "  leading and trailing spaces  ",
    "tabs\tand\nnew\n\nlines\r\n",
    "Grégoire Colin, Françoise Dorléac, Zoë",
    "cafe\u0301 (decomposed) vs caf\u00e9 (composed)",
    "日本語のテキスト, Ελληνικά, русский, العربية",
    "emoji 😀👍🏽 and symbols ∑∫ ≤ ≥ ©",
    "",
]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_relations",
            "description": "List the relations of an entity.",
            "parameters": {
                "type": "object",
                "properties": {"entity": {"type": "string"}, "limit": {"type": "integer"}},
                "required": ["entity"],
            },
        },
    }
]

CONVERSATION = [
    {"role": "system", "content": "Answer with the knowledge graph."},
    {"role": "user", "content": "Who directed film_042?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": "get_relations", "arguments": {"entity": "film_042"}}}
        ],
    },
    {"role": "tool", "content": "directed_by"},
    {"role": "tool", "content": "starred_actors"},
]

# Written by hand from the template's contract: ChatML turns, each closed by <|im_end|> and a
# newline; tools listed by name(argument names) in the system turn; tool calls as JSON inside
# <tool_call> with "name" before "arguments"; consecutive tool messages grouped in one user turn.
EXPECTED_RENDERING = (
    "<|im_start|>system\nAnswer with the knowledge graph.\nTools:\n- get_relations(entity, limit)<|im_end|>\n"
    "<|im_start|>user\nWho directed film_042?<|im_end|>\n"
    "<|im_start|>assistant\n<tool_call>\n"
    '{"name": "get_relations", "arguments": {"entity": "film_042"}}\n'
    "</tool_call><|im_end|>\n"
    "<|im_start|>user\n<tool_response>\ndirected_by\n</tool_response>\n"
    "<tool_response>\nstarred_actors\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(CORPUS, vocab_size=400)


@pytest.fixture(scope="module")
def model(tokenizer):
    return init_tiny_model(tiny_qwen2_config(len(tokenizer)), seed=0)


# ---------------------------------------------------------------- tokenizer


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_tokenizer_round_trips_any_text(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text


def test_special_tokens_are_single_fixed_ids_and_never_split(tokenizer):
    assert tokenizer.convert_tokens_to_ids([PAD, IM_START, IM_END]) == [PAD_ID, IM_START_ID, IM_END_ID]
    ids = tokenizer.encode(f"x{IM_START}user\nhi{IM_END}{PAD}y", add_special_tokens=False)
    assert ids[1] == IM_START_ID and ids[-3] == IM_END_ID and ids[-2] == PAD_ID
    assert ids.count(IM_START_ID) == 1 and ids.count(IM_END_ID) == 1
    # A prefix of a special token is ordinary text and never produces a special id.
    partial = tokenizer.encode("<|im_", add_special_tokens=False)
    assert not set(partial) & {PAD_ID, IM_START_ID, IM_END_ID}
    assert tokenizer.eos_token_id == IM_END_ID and tokenizer.pad_token_id == PAD_ID
    assert tokenizer.bos_token is None
    assert tokenizer.encode("hi") == tokenizer.encode("hi", add_special_tokens=False), "no BOS is added"


def test_every_digit_is_its_own_token(tokenizer):
    text = "film_042 in 1999"
    tokens = [tokenizer.decode([i]) for i in tokenizer.encode(text, add_special_tokens=False)]
    digit_tokens = [t for t in tokens if any(c.isdigit() for c in t)]
    assert digit_tokens == list("0421999")


def test_tokenizer_training_is_deterministic():
    first = train_tokenizer(CORPUS, vocab_size=400)
    second = train_tokenizer(list(CORPUS), vocab_size=400)
    assert first.backend_tokenizer.to_str() == second.backend_tokenizer.to_str()
    # Merges were learned: common words are single tokens, not bytes.
    assert len(first.encode(" directed", add_special_tokens=False)) == 1


def test_tokenizer_rejects_a_vocab_without_room_for_bytes():
    with pytest.raises(ValueError, match="vocab_size=100"):
        train_tokenizer(CORPUS, vocab_size=100)


def test_chat_template_renders_chatml_with_tool_calls_and_responses(tokenizer):
    rendered = tokenizer.apply_chat_template(
        CONVERSATION, tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    assert rendered == EXPECTED_RENDERING


def test_chat_template_tokenizes_turn_markers_as_special_ids(tokenizer):
    ids = tokenizer.apply_chat_template(CONVERSATION, tools=TOOLS, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    # system, user, assistant (tool call), user (both tool responses), generation prompt.
    assert ids.count(IM_START_ID) == 5
    assert ids.count(IM_END_ID) == 4
    assert ids[-1] != IM_END_ID
    text = tokenizer.decode(ids)
    assert text.endswith(f"{IM_START}assistant\n")
    assert "get_relations(entity, limit)" in text
    assert '{"name": "get_relations", "arguments": {"entity": "film_042"}}' in text


# ---------------------------------------------------------------- config and init


def test_init_is_deterministic_for_a_seed_and_leaves_global_rng_alone(tokenizer):
    config = tiny_qwen2_config(len(tokenizer))
    rng_before = torch.get_rng_state()
    first, again, other = (init_tiny_model(config, seed=s) for s in (7, 7, 8))
    assert torch.equal(torch.get_rng_state(), rng_before)
    for name, tensor in first.state_dict().items():
        assert torch.equal(tensor, again.state_dict()[name]), name
    assert not torch.equal(first.model.embed_tokens.weight, other.model.embed_tokens.weight)
    assert first.dtype == torch.float32
    assert first.lm_head.weight is first.model.embed_tokens.weight, "embeddings are tied"
    assert config.pad_token_id == PAD_ID and config.eos_token_id == IM_END_ID


def test_config_rejects_inconsistent_heads():
    with pytest.raises(ValueError, match="num_heads=3"):
        tiny_qwen2_config(300, hidden_size=128, num_heads=3)
    with pytest.raises(ValueError, match="num_kv_heads=3"):
        tiny_qwen2_config(300, num_heads=4, num_kv_heads=3)


def test_count_parameters_counts_tied_embeddings_once(tokenizer, model):
    vocab, hidden, inner, kv = len(tokenizer), 128, 512, 64  # kv = 2 kv heads x head dim 32
    per_layer = (
        (hidden * hidden + hidden)  # q_proj (with bias)
        + 2 * (hidden * kv + kv)  # k_proj, v_proj (with bias)
        + hidden * hidden  # o_proj
        + 3 * hidden * inner  # gate, up, down
        + 2 * hidden  # two RMSNorms
    )
    assert count_parameters(model) == vocab * hidden + 2 * per_layer + hidden


# ---------------------------------------------------------------- save / load


def test_save_and_reload_gives_identical_logits_and_tokens(tmp_path, tokenizer, model):
    save_model_dir(model, tokenizer, tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "model.safetensors").is_file()
    ids = torch.tensor([tokenizer.encode("Who directed film_042?")])
    with torch.no_grad():
        expected = model(ids).logits
        for reloaded in (AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt"), load_model(tmp_path / "ckpt")):
            assert torch.equal(reloaded(ids).logits, expected)

    reloaded_tokenizer = load_tokenizer(tmp_path / "ckpt")
    assert reloaded_tokenizer.chat_template == tokenizer.chat_template
    for text in ROUND_TRIP_TEXTS:
        ids = reloaded_tokenizer.encode(text, add_special_tokens=False)
        assert ids == tokenizer.encode(text, add_special_tokens=False)
        assert reloaded_tokenizer.decode(ids) == text


def test_load_model_casts_dtype_and_rejects_unknown_dtype(tmp_path, tokenizer, model):
    save_model_dir(model, tokenizer, tmp_path)
    assert load_model(tmp_path, dtype="bfloat16").dtype == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        load_model(tmp_path, dtype="float8")


def test_load_errors_name_the_problem(tmp_path, tokenizer, model):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(tmp_path)
    save_model_dir(model, tokenizer, tmp_path / "ckpt")
    with pytest.raises(FileNotFoundError, match="not a model directory"):
        load_model(tmp_path / "ckpt" / "config.json")

    # A tokenizer saved without a chat template is refused, and the error names the fix.
    config_path = tmp_path / "ckpt" / "tokenizer_config.json"
    (tmp_path / "ckpt" / "chat_template.jinja").unlink()
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="chat_template"):
        load_tokenizer(tmp_path / "ckpt")
