"""TorchEngine's memory: the prefill projects only the last position, from a contiguous input,
and the KV caches the engine holds (`kv_memory`) are the rows' and sessions' tokens, released when
the batch empties and the session ends. The resident-memory figures with a real model are in
benchmarks/engine_memory.py."""

from __future__ import annotations

import copy

import pytest
import torch

from support import kept_sessions
from tiderl.embedded.tiny import init_tiny_model, tiny_qwen2_config, train_tokenizer
from tiderl.lab.engine_memory import kv_bytes_per_token, kv_memory
from tiderl.rollout.base import SamplingParams
from tiderl.rollout.torch_engine import TorchEngine

CORPUS = [
    f"<|im_start|>user\nWho directed film_{i:03d}? It stars person_{i % 17}.<|im_end|>\n"
    f"<|im_start|>assistant\nperson_{(i * 7) % 23} directed film_{i:03d}.<|im_end|>\n"
    for i in range(40)
]


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(CORPUS, vocab_size=320)


@pytest.fixture(scope="module")
def model(tokenizer):
    return init_tiny_model(tiny_qwen2_config(len(tokenizer), max_position_embeddings=512), seed=0)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    lengths = [40, 7, 23, 1]  # different lengths: the prefill batch is padded
    return [tokenizer.encode(text, add_special_tokens=False)[:n] for text, n in zip(CORPUS, lengths)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_projects_only_the_last_position_from_a_contiguous_input(model, tokenizer, prompts, dtype):
    engine = TorchEngine(copy.deepcopy(model).to(dtype), tokenizer, max_batch_size=8)
    head = engine.model.get_output_embeddings()
    calls = []
    head.register_forward_hook(lambda module, args, out: calls.append((args[0], out.shape)))
    engine.generate(prompts, SamplingParams(max_new_tokens=3, temperature=0.0))
    assert calls, "the prefill did not go through the model's output head"
    for hidden, out_shape in calls:
        # One position per row: a strided [:, -1:] view of every position (what the model's
        # logits_to_keep slice gives) made torch's bf16 CPU projection cost all of them.
        assert hidden.shape[:-1] == (len(prompts), 1)
        assert hidden.is_contiguous()
        assert tuple(out_shape) == (len(prompts), 1, len(tokenizer))


def test_memory_counts_kept_caches_exactly_and_releases_them(model, tokenizer, prompts):
    engine = TorchEngine(model, tokenizer, max_batch_size=8)
    assert kv_memory(engine) == {"batch_bytes": 0, "kept_bytes": 0, "needed_bytes": 0}
    per_token = kv_bytes_per_token(engine.model)
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    assert per_token == 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4  # float32
    sessions = [f"episode {i}" for i in range(len(prompts))]
    completions = engine.generate(prompts, SamplingParams(max_new_tokens=5, temperature=0.0), sessions=sessions)
    memory = kv_memory(engine)
    # The batch is empty: its cache is gone. Each session keeps the KV of every token it fed
    # (prompt + sampled tokens but the last), with no padding or spare columns.
    fed = sum(len(p) + len(c.token_ids) - 1 for p, c in zip(prompts, completions))
    assert memory == {"batch_bytes": 0, "kept_bytes": fed * per_token, "needed_bytes": fed * per_token}
    for session in sessions[:2]:
        engine.end_session(session)
    rest = sum(len(p) + len(c.token_ids) - 1 for p, c in zip(prompts[2:], completions[2:]))
    assert kv_memory(engine)["kept_bytes"] == rest * per_token
    for session in sessions[2:]:
        engine.end_session(session)
    assert kv_memory(engine) == {"batch_bytes": 0, "kept_bytes": 0, "needed_bytes": 0}
    assert kept_sessions(engine) == 0


def test_memory_during_decoding_covers_the_rows_tokens(model, tokenizer, prompts):
    engine = TorchEngine(model, tokenizer, max_batch_size=8)
    seen = []
    original = engine._step

    def step() -> None:
        seen.append((kv_memory(engine), [len(row.fed) for row in engine._rows], engine._width))
        original()

    engine._step = step  # type: ignore[method-assign]
    engine.generate(prompts, SamplingParams(max_new_tokens=4, temperature=0.0))
    assert seen
    per_token = kv_bytes_per_token(engine.model)
    for memory, fed, width in seen:
        assert memory["needed_bytes"] == sum(fed) * per_token
        # The batch cache is rectangular (rows x the longest row), plus spare columns.
        assert memory["batch_bytes"] >= len(fed) * width * per_token >= memory["needed_bytes"]
