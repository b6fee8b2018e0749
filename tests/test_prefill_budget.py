"""TorchEngine's prefill token budget (`prefill_tokens`): joining requests prefilled in passes of
at most that many tokens give the same tokens and log-probs as one pass, with kept prefix caches,
mixed prompt lengths, identical prompts and rows joining a running batch."""

from __future__ import annotations

import random

import pytest
import torch

from tiderl.embedded.tiny import init_tiny_model, tiny_qwen2_config, train_tokenizer
from tiderl.rollout.base import SamplingParams
from tiderl.rollout.torch_engine import TorchEngine, _prefill_groups

CORPUS = [f"<|im_start|>user\nquestion {i} about item_{i % 13}<|im_end|>\n" for i in range(40)]


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(CORPUS, vocab_size=300)


@pytest.fixture(scope="module")
def model(tokenizer):
    model = init_tiny_model(tiny_qwen2_config(len(tokenizer), max_position_embeddings=512), seed=0)
    with torch.no_grad():
        model.model.norm.weight.mul_(8.0)  # far-from-uniform next-token distributions
    return model


def _full_logprobs(model, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1: -1].float()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    return logprobs.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


def _prompts(seed: int, n: int, shortest: int = 3, longest: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 280) for _ in range(rng.randrange(shortest, longest))] for _ in range(n)]


def _play(engine: TorchEngine, prompts: list[list[int]], turns: int, temperature: float, seed: int = 0):
    """Multi-turn sessions through `submit`/`serve` (later turns join a running batch and reuse
    their session's kept cache). Returns {(session, turn): (prompt, completion)}."""
    rng = random.Random(seed)
    out = {}

    def ask(e: int, turn: int, prompt: list[int]) -> None:
        params = SamplingParams(temperature=temperature, max_new_tokens=2 + (e * 3 + turn) % 9)

        def on_done(completion, e=e, turn=turn, prompt=prompt):
            out[e, turn] = (prompt, completion)
            if turn + 1 < turns:
                ask(e, turn + 1, prompt + completion.token_ids + [rng.randrange(3, 280) for _ in range(1 + e % 20)])
            else:
                engine.end_session(e)

        engine.submit(prompt, params, session=e, on_done=on_done)

    for e, prompt in enumerate(prompts):
        ask(e, 0, prompt)
    engine.serve()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("budget", [8, 50])
def test_a_small_budget_gives_the_same_tokens_and_logprobs(model, tokenizer, budget):
    prompts = _prompts(1, 6)
    # Identical prompts next to each other (a group's completions: encoded once) and a short one.
    prompts = prompts[:1] * 3 + prompts[1:] + [prompts[1][:5]]
    params = SamplingParams(temperature=1.0, max_new_tokens=6)
    whole = TorchEngine(model, tokenizer, seed=3, prefill_tokens=0).generate(prompts, params)
    engine = TorchEngine(model, tokenizer, seed=3, prefill_tokens=budget)
    split = engine.generate(prompts, params)
    for a, b, prompt in zip(whole, split, prompts):
        assert a.token_ids == b.token_ids
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)
        assert torch.allclose(torch.tensor(b.logprobs), _full_logprobs(model, prompt, b.token_ids, 1.0), atol=1e-5)
    assert engine.stats["shared_tokens"] >= 2 * len(prompts[0]), "identical prompts are still encoded once"
    assert engine.stats["prefill_passes"] > 3, "the budget split the prefill"


@pytest.mark.slow
def test_a_budget_with_kept_caches_and_rows_joining_a_running_batch(model, tokenizer):
    prompts = _prompts(2, 7, longest=45)
    whole_engine = TorchEngine(model, tokenizer, seed=5, max_batch_size=4, prefill_tokens=0)
    split_engine = TorchEngine(model, tokenizer, seed=5, max_batch_size=4, prefill_tokens=8)
    whole = _play(whole_engine, prompts, turns=3, temperature=0.9)
    split = _play(split_engine, prompts, turns=3, temperature=0.9)
    assert whole.keys() == split.keys() and len(split) == 21
    for key in whole:
        (p1, c1), (p2, c2) = whole[key], split[key]
        assert p1 == p2 and c1.token_ids == c2.token_ids, key
        assert torch.allclose(torch.tensor(c2.logprobs), _full_logprobs(model, p2, c2.token_ids, 0.9), atol=1e-5)
    assert split_engine.stats["reused_tokens"] > 0, "later turns reused their kept caches"
    assert split_engine.stats["encoded_tokens"] == whole_engine.stats["encoded_tokens"]
    assert split_engine.stats["prefill_passes"] > 2 * whole_engine.stats["prefill_passes"]


def test_prefill_groups_keep_each_pass_within_the_budget():
    suffixes = [[1] * 10, [2] * 10, [3] * 30, [4] * 4, [4] * 4, [4] * 4, [5] * 100]
    prefix = [0] * len(suffixes)
    assert _prefill_groups(suffixes, prefix, 0, dedup=True) == [list(range(7))]
    # 2 x 10 fit 25; the 30-token prompt is alone (split along its length); three identical
    # 4-token prompts cost 4; the 100-token one is alone.
    assert _prefill_groups(suffixes, prefix, 25, dedup=True) == [[0, 1], [2], [3, 4, 5], [6]]
    assert _prefill_groups(suffixes, prefix, 25, dedup=False) == [[0, 1], [2], [3, 4, 5], [6]]
    assert _prefill_groups(suffixes, prefix, 8, dedup=False) == [[0], [1], [2], [3, 4], [5], [6]]


def test_a_negative_budget_is_refused(model, tokenizer):
    with pytest.raises(ValueError, match="prefill_tokens"):
        TorchEngine(model, tokenizer, prefill_tokens=-1)


def test_make_engine_passes_rollout_options_prefill_tokens(model, tokenizer):
    from tiderl.config import ConfigError, load_config
    from tiderl.rollout import make_engine

    assert make_engine(load_config(None, []), model, tokenizer, seed=0).prefill_tokens == 4096
    cfg = load_config(None, ["rollout.options.prefill_tokens=0"])
    assert make_engine(cfg, model, tokenizer, seed=0).prefill_tokens == 0
    with pytest.raises(ConfigError, match="rollout.options.prefill_tokens: must be >= 0"):
        load_config(None, ["rollout.options.prefill_tokens=-5"])
    with pytest.raises(ConfigError, match="rollout.prefill_tokens: moved to rollout.options.prefill_tokens"):
        load_config(None, ["rollout.prefill_tokens=0"])
