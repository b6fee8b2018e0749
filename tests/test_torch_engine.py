"""TorchEngine: batched KV-cache sampling, per-row stopping, exact log-probs, versioned weights.

The fixtures `model`, `tokenizer` and `prompts` (a peaky tiny model) are conftest.py's."""

from __future__ import annotations

import pytest
import torch

from support import greedy_reference, peaky_model
from tiderl.rollout.base import Completion, SamplingParams
from tiderl.rollout.torch_engine import TorchEngine, _nucleus_logprobs, weights_checksum


def _full_forward_logprobs(model, prompt: list[int], completion: list[int], temperature: float = 1.0):
    """Per-token log-probs of `completion` after `prompt`: one unpadded forward, no KV cache."""
    sequence = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(sequence).logits[0, len(prompt) - 1 : -1].float()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    return logprobs, logprobs.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


def _check_shapes(completion: Completion, version: int = 0) -> None:
    n = len(completion.token_ids)
    assert len(completion.logprobs) == n and len(completion.policy_version) == n
    assert completion.policy_version == [version] * n


def test_same_seed_same_outputs_and_stream_continues(model, tokenizer, prompts):
    params = SamplingParams(temperature=1.0, max_new_tokens=12)
    first = TorchEngine(model, tokenizer, seed=3).generate(prompts, params)
    engine = TorchEngine(model, tokenizer, seed=3)
    assert engine.generate(prompts, params) == first
    assert engine.generate(prompts, params) != first, "a second call continues the random stream"
    assert TorchEngine(model, tokenizer, seed=4).generate(prompts, params) != first


def test_max_new_tokens_gives_length_finish(model, tokenizer, prompts):
    completions = TorchEngine(model, tokenizer).generate(prompts, SamplingParams(max_new_tokens=7))
    assert len(completions) == len(prompts)
    for completion in completions:
        assert len(completion.token_ids) == 7
        assert completion.finish_reason == "length"
        assert completion.text == tokenizer.decode(completion.token_ids)
        _check_shapes(completion)


def test_logprobs_match_an_unpadded_full_forward(model, tokenizer, prompts):
    for temperature in (1.0, 0.7):
        engine = TorchEngine(model, tokenizer, seed=1)
        completions = engine.generate(prompts, SamplingParams(temperature=temperature, max_new_tokens=20))
        for prompt, completion in zip(prompts, completions):
            _, expected = _full_forward_logprobs(model, prompt, completion.token_ids, temperature)
            assert torch.allclose(torch.tensor(completion.logprobs), expected, atol=1e-4), (
                f"prompt of length {len(prompt)} at temperature {temperature}"
            )


def test_temperature_zero_is_greedy_with_temperature_one_logprobs(model, tokenizer, prompts):
    completions = TorchEngine(model, tokenizer).generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=10))
    for prompt, completion in zip(prompts, completions):
        assert completion.token_ids == greedy_reference(model, prompt, 10)
        _, expected = _full_forward_logprobs(model, prompt, completion.token_ids, temperature=1.0)
        assert torch.allclose(torch.tensor(completion.logprobs), expected, atol=1e-4)


def test_chunking_by_max_batch_size_keeps_order_and_results(model, tokenizer, prompts):
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    whole = TorchEngine(model, tokenizer).generate(prompts, params)
    chunked = TorchEngine(model, tokenizer, max_batch_size=2).generate(prompts, params)
    assert [c.token_ids for c in chunked] == [c.token_ids for c in whole]


def _two_distinct_greedy_rows(model, tokenizer, prompts, steps: int):
    greedy = TorchEngine(model, tokenizer).generate(prompts[:2], SamplingParams(temperature=0.0, max_new_tokens=steps))
    first, second = greedy[0].token_ids, greedy[1].token_ids
    assert first != second, "test setup: the two greedy rows must differ"
    return first, second


def test_stop_token_ends_its_row_and_is_kept_while_others_continue(model, tokenizer, prompts):
    steps = 24
    first, second = _two_distinct_greedy_rows(model, tokenizer, prompts, steps)
    stop_token = next((t for t in first if t not in second), None)
    assert stop_token is not None, "test setup: row 0 needs a token that row 1 never produces"
    cut = first.index(stop_token) + 1

    params = SamplingParams(temperature=0.0, max_new_tokens=steps, stop_token_ids=[stop_token])
    stopped, running = TorchEngine(model, tokenizer).generate(prompts[:2], params)
    assert stopped.token_ids == first[:cut] and stopped.token_ids[-1] == stop_token
    assert stopped.finish_reason == "stop"
    assert running.token_ids == second and running.finish_reason == "length"
    _check_shapes(stopped)
    _check_shapes(running)


def test_stop_string_spanning_tokens_ends_on_the_completing_token(model, tokenizer, prompts):
    steps = 24
    first, second = _two_distinct_greedy_rows(model, tokenizer, prompts, steps)
    second_text = tokenizer.decode(second)
    # A stop string made of the last character of one token and the first of the next, absent
    # from row 1: it is completed by the later token, never by a token on its own.
    stop = None
    for k in range(1, len(first)):
        left, right = tokenizer.decode(first[k - 1 : k]), tokenizer.decode(first[k : k + 1])
        candidate = left[-1:] + right[:1]
        if len(candidate) == 2 and "\ufffd" not in candidate and candidate not in second_text:
            stop = candidate
            break
    assert stop is not None, "test setup: no two-character stop string found in row 0"
    # Reference: the first prefix of row 0 whose decoded text contains the stop string.
    cut = next(n for n in range(1, len(first) + 1) if stop in tokenizer.decode(first[:n]))

    params = SamplingParams(temperature=0.0, max_new_tokens=steps, stop=[stop])
    stopped, running = TorchEngine(model, tokenizer).generate(prompts[:2], params)
    assert stopped.token_ids == first[:cut] and stopped.finish_reason == "stop"
    assert stopped.text.endswith(tokenizer.decode(first[cut - 1 : cut]))
    assert stop in stopped.text
    assert running.token_ids == second and running.finish_reason == "length"


def test_top_p_samples_only_from_the_renormalised_nucleus(model, tokenizer, prompts):
    top_p = 0.6
    engine = TorchEngine(model, tokenizer, seed=5)
    completions = engine.generate(prompts, SamplingParams(temperature=1.0, top_p=top_p, max_new_tokens=20))
    sampled_outside_top1 = 0
    for prompt, completion in zip(prompts, completions):
        full, _ = _full_forward_logprobs(model, prompt, completion.token_ids)
        for position, token in enumerate(completion.token_ids):
            probs = full[position].exp()
            order = probs.argsort(descending=True)
            mass_before = probs[order].cumsum(0) - probs[order]
            nucleus = order[mass_before < top_p]
            assert token in nucleus.tolist(), f"token {token} is outside the top-p nucleus"
            expected = probs[token] / probs[nucleus].sum()
            assert abs(completion.logprobs[position] - float(expected.log())) < 1e-4
            sampled_outside_top1 += token != int(order[0])
    assert sampled_outside_top1 > 0, "test setup: nucleus had a single token everywhere"


def test_nucleus_keeps_the_smallest_set_reaching_top_p():
    logprobs = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    # Mass before each token: 0, 0.5, 0.8, 0.95. With top_p = 0.7 the first two are kept.
    kept = _nucleus_logprobs(logprobs, 0.7).exp()
    assert torch.allclose(kept, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    # With top_p = 0.85 the third joins: 0.5, 0.3, 0.15 renormalised by 0.95.
    kept = _nucleus_logprobs(logprobs, 0.85).exp()
    assert torch.allclose(kept, torch.tensor([[0.5, 0.3, 0.15, 0.0]]) / 0.95)


def test_update_weights_changes_outputs_version_and_checksum(model, tokenizer, prompts):
    params = SamplingParams(temperature=0.0, max_new_tokens=10)
    engine = TorchEngine(model, tokenizer)
    before = engine.generate(prompts, params)
    checksum_before = engine.state_checksum()
    assert checksum_before == pytest.approx(weights_checksum(model.state_dict()), rel=1e-12)

    new_model = peaky_model(len(tokenizer), seed=1)
    engine.update_weights(new_model.state_dict(), version=3)
    assert engine.version == 3
    assert engine.state_checksum() == pytest.approx(weights_checksum(new_model.state_dict()), rel=1e-12)
    assert engine.state_checksum() != pytest.approx(checksum_before, rel=1e-6)
    after = engine.generate(prompts, params)
    assert [c.token_ids for c in after] != [c.token_ids for c in before]
    assert after[0].token_ids == greedy_reference(new_model, prompts[0], 10)
    for completion in after:
        _check_shapes(completion, version=3)

    engine.update_weights(new_model.state_dict(), version=3)  # the same version may be re-sent
    with pytest.raises(ValueError, match="version 2, lower than the engine's current version 3"):
        engine.update_weights(model.state_dict(), version=2)
    assert engine.version == 3


def test_engine_owns_its_weights_and_rejects_mismatched_state_dicts(model, tokenizer):
    engine = TorchEngine(model, tokenizer)
    checksum = engine.state_checksum()
    partial = {k: v for k, v in model.state_dict().items() if not k.startswith("model.norm")}
    with pytest.raises(ValueError, match="missing keys"):
        engine.update_weights(partial, version=1)
    wrong = dict(model.state_dict())
    wrong["model.norm.weight"] = torch.zeros(3)
    with pytest.raises(ValueError, match="wrong shapes"):
        engine.update_weights(wrong, version=1)
    assert engine.version == 0 and engine.state_checksum() == checksum

    # Training the original model does not leak into the engine before a sync.
    other = peaky_model(len(tokenizer), seed=2)
    with torch.no_grad():
        other.model.norm.weight.add_(1.0)
    engine_of_other = TorchEngine(other, tokenizer)
    with torch.no_grad():
        other.model.norm.weight.sub_(1.0)
    assert engine_of_other.state_checksum() != pytest.approx(weights_checksum(other.state_dict()), rel=1e-9)


@pytest.mark.parametrize(
    ("params", "prompt", "message"),
    [
        (SamplingParams(temperature=-1.0), [5], "temperature=-1.0"),
        (SamplingParams(top_p=0.0), [5], "top_p=0.0"),
        (SamplingParams(max_new_tokens=0), [5], "max_new_tokens=0"),
        (SamplingParams(), [], "prompt 0 is empty"),
        (SamplingParams(), [10**6], "token ids outside"),
        (SamplingParams(max_new_tokens=250), [5] * 10, "max_position_embeddings=256"),
    ],
)
def test_bad_requests_get_clear_errors(model, tokenizer, params, prompt, message):
    with pytest.raises(ValueError, match=message):
        TorchEngine(model, tokenizer).generate([prompt], params)


@pytest.mark.slow
def test_fast_decode_step_gives_the_model_forwards_tokens_and_logprobs(model, tokenizer, prompts):
    """The decode step without the Hugging Face module stack (`fast_decode.DecodeStep`) computes
    what the model's own forward computes: the same greedy tokens and the same log-probs, with
    rows joining a running batch (max_batch_size=2) and sampling from the same stream."""
    fast = TorchEngine(model, tokenizer, seed=5, max_batch_size=2)
    slow = TorchEngine(model, tokenizer, seed=5, max_batch_size=2)
    assert fast._fast is not None
    slow._fast = None
    for params in (SamplingParams(temperature=0.0, max_new_tokens=12),
                   SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=12)):
        a, b = fast.generate(prompts, params), slow.generate(prompts, params)
        assert [c.token_ids for c in a] == [c.token_ids for c in b]
        for x, y in zip(a, b):
            assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5)
    assert fast.stats["decode_steps"] == slow.stats["decode_steps"] > 0
    # Weights loaded in place reach the stacked (and, on a CPU, transposed) weights of the step.
    assert fast.model.model.layers[0].mlp.down_proj.weight.stride()[0] == 1
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    before = fast.generate(prompts, params)
    state = {k: v + 0.05 * torch.randn_like(v) for k, v in model.state_dict().items()}
    if "lm_head.weight" in state:  # tied to the input embedding: one tensor, one value
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    for engine in (fast, slow):
        engine.update_weights(state, 1)
        assert engine.state_checksum() == weights_checksum(state)
    a, b = fast.generate(prompts, params), slow.generate(prompts, params)
    assert [c.token_ids for c in a] == [c.token_ids for c in b] != [c.token_ids for c in before]


def test_fast_decode_step_only_for_models_it_reproduces(model):
    import copy

    from tiderl.rollout.fast_decode import DecodeStep

    assert DecodeStep.of(model) is not None
    eager = copy.deepcopy(model)
    eager.config._attn_implementation = "eager"
    assert DecodeStep.of(eager) is None
    wrapped = copy.deepcopy(model)
    wrapped.model.layers[0].mlp.up_proj = torch.nn.Sequential(wrapped.model.layers[0].mlp.up_proj)
    assert DecodeStep.of(wrapped) is None
    assert DecodeStep.of(torch.nn.Linear(2, 2)) is None


def test_identical_prompts_joining_together_are_encoded_once(model, tokenizer, prompts):
    p, q = prompts[1], prompts[3]
    engine = TorchEngine(model, tokenizer)
    completions = engine.generate([p, q, p, p], SamplingParams(temperature=0.0, max_new_tokens=6))
    assert engine.stats["encoded_tokens"] == len(p) + len(q)
    assert engine.stats["shared_tokens"] == 2 * len(p)
    alone = TorchEngine(model, tokenizer).generate([p], SamplingParams(temperature=0.0, max_new_tokens=6))[0]
    for c in (completions[0], completions[2], completions[3]):
        assert c.token_ids == alone.token_ids
        assert torch.allclose(torch.tensor(c.logprobs), torch.tensor(alone.logprobs), atol=1e-5)
    sampled = TorchEngine(model, tokenizer, seed=1).generate([p] * 4, SamplingParams(max_new_tokens=12))
    assert len({tuple(c.token_ids) for c in sampled}) > 1, "the copies sample independently"
    for c in sampled:
        _, expected = _full_forward_logprobs(model, p, c.token_ids)
        assert torch.allclose(torch.tensor(c.logprobs), expected, atol=1e-4)


def test_a_bf16_engine_of_an_fp32_model_casts_each_update_and_reports_what_was_sent(model, tokenizer, prompts):
    """rollout.options.dtype=bfloat16: the engine's parameters are bf16 (buffers as built), its
    log-probs differ from the fp32 model's by bf16 rounding only, and the checksum it reports is
    that of the fp32 weights it was sent, checked against their cast."""
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    exact = TorchEngine(model, tokenizer)
    engine = TorchEngine(model, tokenizer, dtype="bfloat16")
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
    assert next(model.parameters()).dtype == torch.float32  # the model handed over is not touched
    assert all(b.dtype == torch.float32 for b in engine.model.buffers() if b.is_floating_point())
    assert engine.state_checksum() == weights_checksum(model.state_dict())
    ours, theirs = engine.generate(prompts, params), exact.generate(prompts, params)
    gap = max(abs(a - b) for c, e in zip(ours, theirs) for a, b in zip(c.logprobs, e.logprobs))
    assert 1e-4 < gap < 0.3, gap  # a mismatch, of bf16's size

    new_model = peaky_model(len(tokenizer), seed=1)
    engine.update_weights(new_model.state_dict(), version=2)
    assert engine.state_checksum() == weights_checksum(new_model.state_dict())
    assert weights_checksum(engine.model.state_dict()) == weights_checksum(new_model.state_dict(), torch.bfloat16)
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
    assert TorchEngine(model, tokenizer, dtype="float32")._cast is None  # the model's own dtype: no cast


def test_released_memory_comes_back_with_the_same_outputs_and_any_update_loaded_meanwhile(model, tokenizer, prompts):
    """rollout.options.release_memory: `release_memory` moves the weights to host memory and drops
    the fast decode step and the kept caches; the next forward pass brings them back (the fast step
    rebuilt), giving exactly the tokens and log-probs an engine never released gives, and weights
    loaded while released are the ones it decodes with."""
    params = SamplingParams(temperature=1.0, max_new_tokens=8)
    kept, released = TorchEngine(model, tokenizer, seed=3), TorchEngine(model, tokenizer, seed=3)
    assert released._fast is not None
    released.release_memory()
    released.release_memory()  # twice: nothing more
    assert released._released and released._fast is None
    ours, theirs = released.generate(prompts, params), kept.generate(prompts, params)
    assert [(c.token_ids, c.logprobs) for c in ours] == [(c.token_ids, c.logprobs) for c in theirs]
    assert not released._released and released._fast is not None  # back, with its fast step

    new_model = peaky_model(len(tokenizer), seed=1)
    released.release_memory()
    released.update_weights(new_model.state_dict(), version=2)
    assert released.state_checksum() == weights_checksum(new_model.state_dict())
    greedy = SamplingParams(temperature=0.0, max_new_tokens=10)
    assert released.generate(prompts[:1], greedy)[0].token_ids == greedy_reference(new_model, prompts[0], 10)


def test_the_engines_options_place_it_and_set_its_dtype(model, tokenizer):
    """rollout.options.device ('' = model.device) and dtype reach the engine from a config; a
    device for the engine is refused where the backend places engines itself."""
    from tiderl.config import ConfigError, load_config

    cfg = load_config(None, ["model.device=cpu", "rollout.options.device=cpu", "rollout.options.dtype=bfloat16"])
    engine = TorchEngine.from_config(cfg, model, tokenizer, seed=0)
    assert engine.device == torch.device("cpu") and next(engine.model.parameters()).dtype == torch.bfloat16
    with pytest.raises(ConfigError, match="rollout.options.device.*system.backend=ray"):
        load_config(None, ["system.backend=ray", "rollout.options.device=cuda:1"])
