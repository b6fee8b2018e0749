"""What a `TorchEngine`'s KV caches hold, in bytes (benchmarks/engine_memory.py samples it while
episodes run; tests/test_engine_memory.py checks that the caches are released)."""

from __future__ import annotations

from typing import Any

import torch


def kv_bytes_per_token(model: Any) -> int:
    """Bytes of keys and values one token takes in `model`'s KV cache (all layers)."""
    text = model.config.get_text_config(decoder=True)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    element = torch.empty((), dtype=model.dtype).element_size()
    return 2 * text.num_hidden_layers * text.num_key_value_heads * head_dim * element


def kv_memory(engine: Any) -> dict[str, int]:
    """What `engine`'s KV caches hold now, in bytes: `batch_bytes`, the storage of the running
    batch's cache (padding and spare columns included); `kept_bytes`, the kept prefix caches;
    `needed_bytes`, the KV of the tokens those rows and kept caches hold (no padding). Any
    thread (a snapshot; the decoding thread may change the batch meanwhile)."""
    cache, rows = engine._cache, list(engine._rows)
    storages: dict[int, int] = {}
    for layer in getattr(cache, "layers", None) or []:
        for t in (getattr(layer, "_key_buffer", None), getattr(layer, "_value_buffer", None),
                  getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor) and t.numel():
                storage = t.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    with engine._inbox_lock:
        kept_bytes = engine._kept_bytes
        kept_tokens = sum(len(k.tokens) for k in engine._kept.values())
    needed = (sum(len(row.fed) for row in rows) + kept_tokens) * kv_bytes_per_token(engine.model)
    return {"batch_bytes": sum(storages.values()), "kept_bytes": kept_bytes, "needed_bytes": needed}
