"""SamplingParams.seed: a request's own random stream, so that sampled episodes (and the
evaluations built on them) do not depend on batching, order or timing."""

from __future__ import annotations

import dataclasses

import pytest

from tiderl.agent.loop import play_episodes
from tiderl.rollout.base import SamplingParams, episode_seed, stream_seed, stream_uniform
from tiderl.rollout.torch_engine import TorchEngine
from support import small_config


def test_the_stream_is_a_function_of_seed_and_position_only():
    draws = [stream_uniform(7, i) for i in range(2000)]
    assert draws == [stream_uniform(7, i) for i in range(2000)]
    assert all(0.0 <= u < 1.0 for u in draws)
    assert 0.45 < sum(draws) / len(draws) < 0.55 and len(set(draws)) == len(draws)
    assert stream_uniform(8, 0) != stream_uniform(7, 0)
    assert episode_seed(1, "t#0") == episode_seed(1, "t#0") != episode_seed(1, "t#1") != episode_seed(2, "t#0")
    assert 0 <= episode_seed(1, "t#0") < 2**63 and 0 <= stream_seed(5, 100) < 2**62


def test_a_seeded_row_samples_the_same_alone_or_batched_and_whatever_the_engine_seed(model, tokenizer, prompts):
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=1234)
    [alone] = TorchEngine(model, tokenizer, seed=0).generate([prompts[1]], params)
    engine = TorchEngine(model, tokenizer, seed=99)
    engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=5))  # move the engine's stream on
    batched = engine.generate([prompts[3], prompts[1], prompts[0]], params)[1]
    assert batched.token_ids == alone.token_ids
    assert batched.logprobs == pytest.approx(alone.logprobs, abs=1e-5)
    # Another seed draws another completion; no seed draws from the engine's own stream.
    other = TorchEngine(model, tokenizer, seed=0).generate([prompts[1]], dataclasses.replace(params, seed=4321))[0]
    assert other.token_ids != alone.token_ids
    unseeded = dataclasses.replace(params, seed=None)
    assert TorchEngine(model, tokenizer, seed=5).generate([prompts[1]], unseeded)[0].token_ids != \
        TorchEngine(model, tokenizer, seed=6).generate([prompts[1]], unseeded)[0].token_ids


@pytest.fixture(scope="module")
def run(cache, tmp_path_factory):
    from tiderl.run import build_run
    return build_run(small_config(cache, tmp_path_factory.mktemp("run")))


def _episodes(run, tasks, params, batch):
    cfg = run.cfg
    return play_episodes(run.engine, run.tokenizer, run.make_env, tasks, params, cfg.env.max_turns,
                         cfg.env.max_total_tokens, max_batch_size=batch)


@pytest.mark.slow
def test_seeded_episodes_do_not_depend_on_batch_size_or_task_order(run):
    distinct = run.setup.eval_tasks[:6]
    tasks = distinct + distinct[:2]  # two samples of the first two tasks: each gets its own stream
    params = SamplingParams(temperature=1.0, max_new_tokens=run.cfg.rollout.max_new_tokens,
                            stop_token_ids=[run.tokenizer.eos_token_id], seed=11)
    one_at_a_time = _episodes(run, tasks, params, batch=1)
    together = _episodes(run, tasks, params, batch=8)
    assert [t.tokens for t in together] == [t.tokens for t in one_at_a_time]
    assert [t.reward for t in together] == [t.reward for t in one_at_a_time]
    reordered = _episodes(run, list(reversed(distinct)), params, batch=4)[::-1]
    assert [t.tokens for t in reordered] == [t.tokens for t in one_at_a_time[:6]]
    # The second sample of a task is another episode, not a copy of the first.
    assert any(one_at_a_time[i].tokens != one_at_a_time[6 + i].tokens for i in range(2))
