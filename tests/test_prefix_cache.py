"""TorchEngine's prefix reuse across turns and token-level continuous batching: exact against a
full re-encode, evicted on episode end, weight updates and the memory bound."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from support import kept_sessions, peaky_model
from tiderl.rollout.base import SamplingParams
from tiderl.rollout.client import BatchingEngine
from tiderl.rollout.torch_engine import TorchEngine


@pytest.fixture(scope="module")
def model(tokenizer):
    """conftest.py's peaky model with room for 1,024 positions (multi-turn episodes grow long)."""
    return peaky_model(len(tokenizer), seed=0, max_positions=1024)


def _full_logprobs(model, prompt: list[int], completion: list[int], temperature: float = 1.0) -> torch.Tensor:
    """Log-probs of `completion` after `prompt` from one forward over the whole sequence."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1].float()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    return logprobs.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


def _play(engine: TorchEngine, episodes: int, turns: int, sessions: bool, seed: int = 0,
          temperature: float = 0.0, update_after: tuple[int, dict] | None = None):
    """Multi-turn episodes driven through `submit`/`serve`: each finished turn appends an
    observation of random length and submits the next turn from its `on_done`, so it joins the
    batch while the other rows are still decoding. Returns (episode, prompt, completion) per turn
    in finishing order."""
    rng = random.Random(seed)
    done_turns = {e: 0 for e in range(episodes)}
    out = []

    def ask(e: int, prompt: list[int]) -> None:
        params = SamplingParams(temperature=temperature, max_new_tokens=rng.randrange(2, 16))

        def on_done(completion, e=e, prompt=prompt):
            out.append((e, prompt, completion))
            done_turns[e] += 1
            if update_after is not None and len(out) == update_after[0]:
                engine.update_weights(update_after[1], version=engine.version + 1)
            if done_turns[e] < turns:
                observation = [rng.randrange(3, 300) for _ in range(rng.randrange(1, 25))]
                ask(e, prompt + completion.token_ids + observation)
            else:
                engine.end_session(e)

        engine.submit(prompt, params, session=e if sessions else None, on_done=on_done)

    for e in range(episodes):
        ask(e, [rng.randrange(3, 300) for _ in range(rng.randrange(4, 40))])
    engine.serve()
    return out


@pytest.mark.slow
def test_prefix_reuse_gives_the_same_tokens_and_logprobs_as_a_full_re_encode(model, tokenizer):
    reused_engine = TorchEngine(model, tokenizer, max_batch_size=4)
    plain_engine = TorchEngine(model, tokenizer, max_batch_size=4, prefix_cache_mb=0)
    reused = _play(reused_engine, episodes=5, turns=3, sessions=True)
    plain = _play(plain_engine, episodes=5, turns=3, sessions=True)
    assert len(reused) == len(plain) == 15
    for (e1, prompt1, c1), (e2, prompt2, c2) in zip(reused, plain):
        assert (e1, prompt1) == (e2, prompt2)
        assert c1.token_ids == c2.token_ids, "greedy tokens must not depend on prefix reuse"
        expected = _full_logprobs(model, prompt1, c1.token_ids)
        assert torch.allclose(torch.tensor(c1.logprobs), expected, atol=1e-5)
        assert torch.allclose(torch.tensor(c2.logprobs), expected, atol=1e-5)
    # Every later turn reused its episode's previous turn: only the new tokens were encoded.
    stats, plain_stats = reused_engine.stats, plain_engine.stats
    assert stats["reused_tokens"] > 0 and plain_stats["reused_tokens"] == 0
    assert stats["encoded_tokens"] + stats["reused_tokens"] == plain_stats["encoded_tokens"]
    assert stats["encoded_tokens"] < plain_stats["encoded_tokens"] / 2
    assert kept_sessions(reused_engine) == 0, "every episode ended: nothing is kept"


@pytest.mark.slow
def test_sampled_logprobs_with_reuse_match_a_full_re_encode(model, tokenizer):
    engine = TorchEngine(model, tokenizer, max_batch_size=3, seed=7)
    turns = _play(engine, episodes=4, turns=3, sessions=True, temperature=0.8, seed=1)
    assert engine.stats["reused_tokens"] > 0
    for _, prompt, completion in turns:
        expected = _full_logprobs(model, prompt, completion.token_ids, temperature=0.8)
        assert torch.allclose(torch.tensor(completion.logprobs), expected, atol=1e-5)


def test_a_weight_update_drops_kept_caches_and_later_turns_match_the_new_weights(model, tokenizer):
    new_model = peaky_model(len(tokenizer), seed=3, max_positions=1024)
    engine = TorchEngine(model, tokenizer, max_batch_size=2)
    turns = _play(engine, episodes=4, turns=3, sessions=True, update_after=(5, new_model.state_dict()))
    assert engine.version == 1
    # Turns sampled entirely after the update: exact under the new weights, although their
    # episodes had caches from the old ones.
    later = [(prompt, c) for _, prompt, c in turns[5:] if set(c.policy_version) == {1}]
    assert later, "test setup: some turns must start after the update"
    for prompt, completion in later:
        expected = _full_logprobs(new_model, prompt, completion.token_ids)
        assert torch.allclose(torch.tensor(completion.logprobs), expected, atol=1e-5)


def test_kept_caches_respect_the_memory_bound_and_end_with_their_session(model, tokenizer):
    engine = TorchEngine(model, tokenizer)
    prompts = [[5 + i] * 40 for i in range(4)]
    engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=4), sessions=[0, 1, 2, 3])
    assert kept_sessions(engine) == 4
    per_session = engine._kept_bytes / 4
    engine.end_session(2)
    assert kept_sessions(engine) == 3
    engine.update_weights(model.state_dict(), version=1)
    assert kept_sessions(engine) == 0, "a weight update drops every kept cache"

    bounded = TorchEngine(model, tokenizer, prefix_cache_mb=2.5 * per_session / 2**20)
    bounded.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=4), sessions=[0, 1, 2, 3])
    assert kept_sessions(bounded) == 2 and bounded._kept_bytes <= bounded.prefix_cache_bytes
    # The least recently kept went first: sessions 2 and 3 remain, and reusing one is exact.
    assert list(bounded._kept) == [2, 3]


def test_a_prompt_that_diverges_from_the_kept_tokens_reuses_only_the_common_prefix(model, tokenizer):
    engine = TorchEngine(model, tokenizer)
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    prompt = list(range(10, 50))
    first = engine.generate([prompt], params, sessions=["s"])[0]
    # The caller kept only part of the completion and edited a prompt token: 20 shared tokens.
    edited = prompt[:20] + [7] + prompt[21:] + first.token_ids[:2] + [9, 9]
    second = engine.generate([edited], params, sessions=["s"])[0]
    assert engine.stats["reused_tokens"] == 20
    fresh = TorchEngine(model, tokenizer).generate([edited], params)[0]
    assert second.token_ids == fresh.token_ids
    assert torch.allclose(torch.tensor(second.logprobs), _full_logprobs(model, edited, second.token_ids), atol=1e-5)


def test_waiting_requests_take_freed_slots_and_rows_keep_their_own_settings(model, tokenizer):
    prompts = [list(range(3 + i, 3 + i + n)) for i, n in enumerate([5, 30, 12, 1, 22, 9])]
    budgets = [3, 11, 6, 9, 2, 7]
    singles = [TorchEngine(model, tokenizer).generate([p], SamplingParams(temperature=0.0, max_new_tokens=b))[0]
               for p, b in zip(prompts, budgets)]
    engine = TorchEngine(model, tokenizer, max_batch_size=2)
    results = {}
    for i, (p, b) in enumerate(zip(prompts, budgets)):
        engine.submit(p, SamplingParams(temperature=0.0, max_new_tokens=b), on_done=lambda c, i=i: results.__setitem__(i, c))
    engine.serve()
    assert [results[i].token_ids for i in range(6)] == [c.token_ids for c in singles]
    assert [len(results[i].token_ids) for i in range(6)] == budgets
    # Two slots: 6 requests of at most 11 tokens take far fewer steps than 3 batches of 11.
    assert engine.stats["decode_steps"] < sum(budgets)

    # A greedy row and a sampled row decode in one batch, each with its own settings.
    mixed = TorchEngine(model, tokenizer, seed=2)
    out = {}
    mixed.submit(prompts[1], SamplingParams(temperature=0.0, max_new_tokens=8), on_done=lambda c: out.__setitem__("g", c))
    mixed.submit(prompts[2], SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=8), on_done=lambda c: out.__setitem__("s", c))
    mixed.serve()
    alone = TorchEngine(model, tokenizer).generate([prompts[1]], SamplingParams(temperature=0.0, max_new_tokens=8))[0]
    assert out["g"].token_ids == alone.token_ids
    assert len(out["s"].token_ids) == 8
    expected = _full_logprobs(model, prompts[2], out["s"].token_ids)  # top-p renormalises: <= 0 gap
    assert all(lp >= float(e) - 1e-5 for lp, e in zip(out["s"].logprobs, expected))


def test_a_cancelled_request_leaves_without_an_answer(model, tokenizer):
    engine = TorchEngine(model, tokenizer)
    answers = []
    first = engine.submit([5, 6, 7], SamplingParams(temperature=0.0, max_new_tokens=20), on_done=answers.append)
    engine.submit([8, 9], SamplingParams(temperature=0.0, max_new_tokens=5), on_done=answers.append)
    first.cancelled = True
    engine.serve()
    assert len(answers) == 1 and len(answers[0].token_ids) == 5


@pytest.mark.slow
def test_the_client_passes_episodes_as_sessions_and_ends_them(model, tokenizer):
    engine = TorchEngine(model, tokenizer, max_batch_size=4)
    params = SamplingParams(temperature=0.0, max_new_tokens=6)

    async def episode(client: BatchingEngine, start: int) -> list[list[int]]:
        with client.episode():
            prompt, turns = list(range(start, start + 30)), []
            for _ in range(3):
                completion = await client.generate(prompt, params)
                turns.append(completion.token_ids)
                with client.in_env():
                    await asyncio.sleep(0.001)
                prompt = prompt + completion.token_ids + [11, 12, 13]
            return turns

    async def main() -> list[list[list[int]]]:
        client = BatchingEngine(engine, max_batch_size=4)
        client.start()
        try:
            return list(await asyncio.gather(*(episode(client, s) for s in (3, 40, 90))))
        finally:
            await client.close()

    played = asyncio.run(main())
    assert engine.stats["reused_tokens"] > 0, "later turns reused their episode's cache"
    assert kept_sessions(engine) == 0, "ended episodes leave nothing behind"
    # Same tokens as a fresh engine that re-encodes each turn from scratch.
    fresh = TorchEngine(model, tokenizer, prefix_cache_mb=0)
    for start, turns in zip((3, 40, 90), played):
        prompt = list(range(start, start + 30))
        for expected in turns:
            got = fresh.generate([prompt], params)[0].token_ids
            assert got == expected
            prompt = prompt + got + [11, 12, 13]


def test_an_engine_error_reaches_every_request_and_the_engine_stays_usable(model, tokenizer):
    engine = TorchEngine(model, tokenizer)
    params = SamplingParams(temperature=0.0, max_new_tokens=4)
    expected = engine.generate([[5, 6, 7], [8, 9]], params)
    forward = engine._forward
    engine._forward = lambda *args: (_ for _ in ()).throw(RuntimeError("out of memory"))
    with pytest.raises(RuntimeError, match="out of memory"):
        engine.generate([[5, 6, 7], [8, 9]], params)
    engine._forward = forward
    assert engine.generate([[5, 6, 7], [8, 9]], params) == expected


def test_generate_from_two_threads_at_once(model, tokenizer):
    from concurrent.futures import ThreadPoolExecutor

    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    prompts = [[list(range(5 + i, 15 + i + 3 * j)) for j in range(3)] for i in range(4)]
    expected = [TorchEngine(model, tokenizer).generate(p, params) for p in prompts]
    engine = TorchEngine(model, tokenizer, max_batch_size=4)
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda p: engine.generate(p, params), prompts))
    assert [[c.token_ids for c in g] for g in got] == [[c.token_ids for c in e] for e in expected]
