"""The weight-sync fingerprint: cheap (a few elements per tensor), deterministic, and it catches
a stale or wrong weight load."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tiderl.embedded.tiny import init_tiny_model, tiny_qwen2_config
from tiderl.rollout.torch_engine import TorchEngine
from tiderl.rollout.weights import RANDOM_ELEMENTS, STRIDED_ELEMENTS, sample_positions, weights_checksum
from tiderl.run import sync_weights


@pytest.fixture(scope="module")
def model():
    return init_tiny_model(tiny_qwen2_config(300, max_position_embeddings=64), seed=0)


def _stepped(model):
    """The weights after one AdamW step on a language-model loss (what the next sync sends)."""
    trained = init_tiny_model(model.config, seed=0)
    trained.load_state_dict(model.state_dict())
    optimizer = torch.optim.AdamW(trained.parameters(), lr=1e-3)
    ids = torch.randint(3, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    trained(ids, labels=ids).loss.backward()
    optimizer.step()
    return trained.state_dict()


def test_reads_a_bounded_number_of_elements_at_fixed_positions():
    big = sample_positions("model.embed_tokens.weight", 10_000_000)
    assert len(big) <= STRIDED_ELEMENTS + RANDOM_ELEMENTS
    assert big[0] == 0 and big[-1] == 10_000_000 - 1
    assert (big == sample_positions("model.embed_tokens.weight", 10_000_000)).all()
    assert not (big == sample_positions("lm_head.weight", 10_000_000)).all()
    assert list(sample_positions("bias", 5)) == [0, 1, 2, 3, 4]


def test_same_weights_same_fingerprint_on_copies_and_other_dtypes_differ(model):
    state = model.state_dict()
    copied = {k: v.clone() for k, v in state.items()}
    assert weights_checksum(state) == weights_checksum(copied)
    assert weights_checksum(dict(reversed(list(copied.items())))) == weights_checksum(state), "key order is irrelevant"
    halved = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state.items()}
    assert weights_checksum(halved) != weights_checksum(state)


def test_catches_a_stale_or_wrong_load(model):
    state = model.state_dict()
    reference = weights_checksum(state)
    # A stale load: the weights before the optimizer step the trainer just took.
    assert weights_checksum(_stepped(model)) != reference
    # A wrong load: another model, two same-shaped tensors swapped, one tensor left at zero,
    # half of a tensor from the old weights, a missing tensor, a reshaped one.
    assert weights_checksum(init_tiny_model(model.config, seed=1).state_dict()) != reference
    q, k = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight"
    assert state[q].shape == state[k].shape
    assert weights_checksum({**state, q: state[k], k: state[q]}) != reference
    assert weights_checksum({**state, q: torch.zeros_like(state[q])}) != reference
    half = state[q].clone()
    half[half.shape[0] // 2:] = 0.0
    assert weights_checksum({**state, q: half}) != reference
    assert weights_checksum({n: t for n, t in state.items() if n != q}) != reference
    assert weights_checksum({**state, q: state[q].reshape(-1)}) != reference


def test_a_sync_is_checked_with_one_fingerprint_per_side(model):
    engine = TorchEngine(model, tokenizer=SimpleNamespace(pad_token_id=0, eos_token_id=2))
    assert engine.state_checksum() == weights_checksum(model.state_dict())
    stepped = _stepped(model)
    actor = init_tiny_model(model.config, seed=0)
    actor.load_state_dict(stepped)
    run = SimpleNamespace(actor=SimpleNamespace(model=actor), engine=engine, step=1)
    sync_weights(run)
    assert engine.version == 1 and engine.state_checksum() == weights_checksum(stepped)

    # An engine that keeps the previous step's weights is caught.
    loads = []
    engine.update_weights = lambda state, version: loads.append(version)
    with torch.no_grad():
        for p in actor.parameters():
            p.add_(1e-3)
    run.step = 2
    with pytest.raises(RuntimeError, match="weight sync to version 2 failed"):
        sync_weights(run)
    assert loads == [2]


def test_fingerprint_reads_the_same_elements_of_a_non_contiguous_tensor():
    """The engine stores its weights transposed on a CPU (rollout/fast_decode.py): the
    fingerprint of the same values must not depend on the layout."""
    from tiderl.rollout.weights import weights_checksum as checksum

    for shape in [(300, 70), (7, 5, 9)]:
        w = torch.randn(*shape)
        strided = w.transpose(0, -1).contiguous().transpose(0, -1)
        assert not strided.is_contiguous()
        assert checksum({"w": strided}) == checksum({"w": w})
        assert checksum({"w": strided * 1.5}) != checksum({"w": w})
