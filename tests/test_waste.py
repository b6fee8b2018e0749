"""Waste and length bias (issue 35; docs/metrics.md, "Waste and length bias"): the tally and the
two-sample statistic, the rollout pool's account of every sampled token (fake backend and
trainer, known episode lengths), and the simulator's, which tallies lengths the same way."""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from pathlib import Path

import pytest

from pool_fakes import FakeRollout, FakeTrainer, check_ledger, run_pool
from tiderl.lab.simulate import Cluster, Dist, Schedule, Workload, simulate
from tiderl.system.ledger import Lengths, ks_two_sample, quantile
from tiderl.system.pool import PoolSettings

DOCS = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"


# --- the statistics --------------------------------------------------------------------------------


def test_quantiles_are_nearest_rank_over_the_tally():
    tally = Counter({10: 8, 50: 2})  # 10 values: eight 10s, two 50s
    assert quantile(tally, 0.5) == 10 and quantile(tally, 0.8) == 10 and quantile(tally, 0.9) == 50
    assert quantile(Counter(), 0.5) == 0.0


def test_ks_two_sample_statistic_and_p_value():
    # D is the largest gap between the two empirical CDFs: {1,2,3} vs {2,3,4} differ by 1/3 at 1.
    d, p = ks_two_sample(Counter({1: 1, 2: 1, 3: 1}), Counter({2: 1, 3: 1, 4: 1}))
    assert d == pytest.approx(1 / 3) and p > 0.9
    assert ks_two_sample(Counter({5: 4}), Counter({5: 9})) == (0.0, 1.0)
    assert ks_two_sample(Counter(), Counter({5: 1})) == (0.0, 1.0)
    # Large samples: x = (sqrt(ne) + 0.12 + 0.11/sqrt(ne)) D; the Kolmogorov tail is 0.0494 at
    # x = 1.36 and 0.0100 at 1.628 (its tables).
    n = 5000
    for x, tail in ((1.36, 0.0494), (1.628, 0.0100)):
        k = x / (50 + 0.12 + 0.11 / 50) * n  # sqrt(ne) = sqrt(n / 2) = 50
        a, b = Counter({0: n}), Counter({0: n - round(k), 1: round(k)})
        d, p = ks_two_sample(a, b)
        assert d == pytest.approx(round(k) / n) and p == pytest.approx(tail, abs=0.002)
    d, p = ks_two_sample(Counter({0: 100}), Counter({1: 100}))
    assert d == 1.0 and p < 1e-20


def test_lengths_report_both_distributions_and_their_gap():
    m = Lengths(finished={10: 8, 50: 2}, trained={10: 8}).metrics()
    assert m["length/trained_mean"] == 10 and m["length/finished_mean"] == 18
    assert (m["length/trained_p50"], m["length/trained_p90"]) == (10, 10)
    assert (m["length/finished_p50"], m["length/finished_p90"]) == (10, 50)
    assert m["length/ks_d"] == pytest.approx(0.2)


# --- the rollout pool ------------------------------------------------------------------------------


def long_and_short(long_tasks: set[str], until: int, trainer: FakeTrainer) -> FakeRollout:
    """Tasks in `long_tasks` sample 50 tokens and run until the trainer has reached version
    `until`; every other task samples 10 tokens at once."""
    event = asyncio.Event()
    trainer.after = lambda version: event.set() if version >= until else None
    return FakeRollout(wait=lambda tid: event if tid in long_tasks else None,
                       length=lambda tid: 50 if tid in long_tasks else 10)


def test_dropping_the_long_episodes_shows_as_exact_waste_and_length_gap():
    # t0 and t1 start at version 0 and finish once the trainer is at version 4: judged 4 or
    # more versions old against a bound of 1, both are dropped. Everything else is 10 tokens.
    trainer = FakeTrainer()
    rollout = long_and_short({"t0", "t1"}, 4, trainer)
    pool, history = run_pool(PoolSettings(batch_size=2, max_staleness=1, slots=4), rollout, trainer, steps=12)
    assert pool.ledger.dropped_stale == 2
    last = history[-1]
    assert last["system/wasted_tokens"] == 100
    assert last["system/waste_frac"] == 100 / last["system/generated_tokens"]
    assert last["length/trained_mean"] == last["length/trained_p90"] == 10
    # After the run: every finished episode (what the fake finished) against the trained ones.
    finished = Counter(rollout.length(tid) for tid, _ in rollout.finishes)
    assert pool.lengths.finished == finished and finished[50] == 2
    assert pool.lengths.trained == {10: 24}
    n = sum(finished.values())
    m = pool.lengths.metrics()
    assert m["length/finished_mean"] == (10 * (n - 2) + 100) / n
    assert m["length/ks_d"] == pytest.approx(2 / n)  # the finished CDF at 10 is (n - 2) / n
    waste = pool.summary()["waste"]
    unsettled = 10 * (n - 2 - 24)  # finished, neither trained nor dropped: still buffered at the end
    assert (waste["dropped_stale"], waste["unsettled"], waste["cut"]) == (100, unsettled, rollout.cut_tokens)
    assert waste["waste_frac"] == (100 + unsettled + rollout.cut_tokens) / (pool.generated_tokens + rollout.cut_tokens)
    check_ledger(pool)


def test_every_sampled_token_is_trained_wasted_or_unsettled():
    # Over-provisioned on-policy training restarts what runs on old weights (cut tokens); faulted
    # episodes' tokens are wasted too.
    trainer = FakeTrainer(lambda: 0.01)
    rollout = FakeRollout(lambda tid: 0.006 * (int(tid[1:]) % 7), length=lambda tid: 3 + int(tid[1:]) % 5,
                          fail=lambda tid, attempt: "env" if int(tid[1:]) % 9 == 4 and attempt == 0 else "")
    pool, history = run_pool(PoolSettings(batch_size=4, max_staleness=0, admission=8), rollout, trainer, steps=8)
    waste = pool.summary()["waste"]
    assert pool.ledger.restarted > 0 and waste["cut"] == rollout.cut_tokens > 0 and waste["faulted"] > 0
    trained = history[-1]["system/trained_action_tokens"]
    assert pool.generated_tokens == trained + waste["dropped_stale"] + waste["faulted"] + waste["unsettled"]
    assert waste["wasted_tokens"] == sum(v for k, v in waste.items() if k not in ("wasted_tokens", "waste_frac"))
    check_ledger(pool)


def test_a_resumed_pool_keeps_counting_from_the_checkpoint():
    trainer = FakeTrainer()
    rollout = long_and_short({"t0"}, 4, trainer)
    pool, _ = run_pool(PoolSettings(batch_size=2, max_staleness=1, slots=4), rollout, trainer, steps=8)
    state = pool.state_dict()
    again, _ = run_pool(PoolSettings(batch_size=2, max_staleness=1, slots=4), FakeRollout(length=lambda _: 7),
                        FakeTrainer(), steps=0)
    again.load_state_dict(state, task_of=lambda tid: None)
    assert again.lengths.finished == pool.lengths.finished and again.lengths.trained == pool.lengths.trained
    assert again.wasted["dropped_stale"] == 50 and again.wasted["cut"] == state["wasted"]["cut"]


def test_every_pool_metric_is_defined_in_docs_metrics():
    trainer = FakeTrainer()
    _, history = run_pool(PoolSettings(batch_size=2, max_staleness=1), FakeRollout(), trainer, steps=2)
    documented = set(re.findall(r"`([a-z_]+/[a-z0-9_]+)`", DOCS.read_text()))
    missing = sorted(k for k in history[-1] if "/" in k and k not in documented)
    assert missing == [], missing


# --- the simulator ---------------------------------------------------------------------------------


def test_the_simulator_tallies_lengths_as_the_pool_does():
    # Episodes of 1 or 3 turns of 10 tokens with 1 s tools, a 0.5 s step: at staleness 1 the
    # 3-turn episodes span versions and are dropped; sync trains whatever it starts.
    two = Workload(episodes=((10,), (10, 10, 10)), tool_latency_s=Dist("const", 1.0))
    one = Cluster(engines=1, engine_max_seqs=64, decode_step_s=0.01, decode_step_per_seq_s=0.0,
                  train_step_s=0.5, sync_s=0.0)
    sync = simulate(two, one, Schedule(max_staleness=0, batch_size=8, steps=6), seed=1)
    assert sync.lengths["length/ks_d"] == 0.0 and sync.trained_length == sync.tokens_per_trajectory
    asynchronous = simulate(two, one, Schedule(max_staleness=1, batch_size=8, steps=6), seed=1)
    assert asynchronous.dropped > 0
    assert asynchronous.trained_length < asynchronous.finished_length and asynchronous.ks_d > 0
    assert asynchronous.trained_length == asynchronous.trained_tokens / asynchronous.trained
