"""The rollout pool, driven through the recipe's own loop with a fake backend and trainer (no
model, no torch work): the staleness gate, continuous batching, partial rollouts, faults, groups,
attempts with several trajectories, elastic slots, and the ledger that accounts for every attempt.
"""

from __future__ import annotations

import asyncio
import itertools

import pytest

from pool_fakes import FakeRollout, FakeTrainer, check_ledger, fake_trajectory, run_pool
from support import versions
from tiderl.envs.protocol import Task
from tiderl.system.buffer import ReadyBuffer
from tiderl.system.pool import PoolSettings
from tiderl.system.staleness import StalenessGate, trajectory_staleness
from tiderl.types import NO_VERSION


# --- the staleness rule --------------------------------------------------------------------------


def test_staleness_of_a_trajectory_is_trainer_minus_oldest_sampled_token():
    assert trajectory_staleness([NO_VERSION, 3, 5, 4], trainer_version=6) == 3
    assert trajectory_staleness([NO_VERSION, NO_VERSION], trainer_version=6) == 0
    assert trajectory_staleness([], trainer_version=0) == 0


def test_gate_admits_up_to_n_plus_one_batches_and_not_past_the_engine_lag():
    gate = StalenessGate(max_staleness=2, batch_size=4)
    assert gate.capacity == 12
    gate.started(11)
    assert gate.may_start(trainer_version=5, engine_version=5)
    gate.started()
    assert not gate.may_start(5, 5)
    assert "12 trajectories unsettled" in gate.blocker(5, 5)
    gate.settled(4)  # a batch trained
    assert gate.may_start(5, 3)  # engine 2 versions behind: allowed
    assert not gate.may_start(6, 3)  # 3 behind: refused
    assert "more than max_staleness=2 behind" in gate.blocker(6, 3)
    with pytest.raises(RuntimeError, match="only 8 are outstanding"):
        gate.settled(9)


def test_gate_drops_and_counts_what_is_older_than_the_bound():
    gate = StalenessGate(max_staleness=1, batch_size=2)
    task = Task("a", "q", None)
    assert gate.judge(fake_trajectory(task, "g", 4, 5), trainer_version=5) == 0  # staleness 1: trains whole
    assert gate.judge(fake_trajectory(task, "g", 3, 5), trainer_version=5) is None  # staleness 2: dropped
    assert gate.judge(fake_trajectory(task, "g", 5, 5), trainer_version=5) == 0
    assert gate.dropped == 1
    assert dict(gate.histogram) == {1: 1, 2: 1, 0: 1}


def test_synchronous_mode_trains_only_on_the_current_version():
    rollout = FakeRollout(lambda tid: 0.002 * (int(tid[1:]) % 5))
    trainer = FakeTrainer(lambda: 0.01)
    s, _ = run_pool(PoolSettings(batch_size=4, max_staleness=0), rollout, trainer, steps=5)
    assert [v for v, *_ in trainer.batches] == [0, 1, 2, 3, 4]
    for version, batch, _, _ in trainer.batches:
        for t in batch:
            assert versions(t) == {version}  # every sampled token on the trainer's own weights
    assert s.summary()["staleness_histogram"] == {0: 20}
    # Rollout waits during training: no episode starts while a step runs.
    for _, _, t_start in rollout.starts:
        assert not any(t0 < t_start < t1 for _, _, t0, t1 in trainer.batches)
    check_ledger(s)


# --- continuous batching ---------------------------------------------------------------------------


def test_a_slow_task_does_not_hold_the_other_slots():
    # t0 runs until the trainer has taken 6 steps; every other task finishes at once. With 4
    # slots and staleness 8, the three other slots keep refilling while t0 runs.
    t0_may_end = asyncio.Event()
    rollout = FakeRollout(wait=lambda tid: t0_may_end if tid == "t0" else None)
    trainer = FakeTrainer()
    trainer.after = lambda version: t0_may_end.set() if version >= 6 else None
    s, _ = run_pool(PoolSettings(batch_size=2, max_staleness=8, slots=4), rollout, trainer, steps=8)
    trained_first = [t.task_id for _, batch, _, _ in trainer.batches[:6] for t in batch]
    assert len(trained_first) == 12 and "t0" not in trained_first  # trained while t0 ran
    assert "t0" in dict(rollout.finishes)  # and t0 finished afterwards
    check_ledger(s)


def test_finished_trajectory_older_than_the_bound_is_dropped_and_counted():
    # t0 runs until the trainer is at version 4: when it finishes, its first token is 4 versions old.
    t0_may_end = asyncio.Event()
    rollout = FakeRollout(wait=lambda tid: t0_may_end if tid == "t0" else None)
    trainer = FakeTrainer()
    trainer.after = lambda version: t0_may_end.set() if version >= 4 else None
    s, _ = run_pool(PoolSettings(batch_size=2, max_staleness=1, slots=4), rollout, trainer, steps=30)
    summary = s.summary()
    assert summary["ledger"]["dropped_stale"] >= 1
    assert max(summary["staleness_histogram"]) > 1  # the dropped one was judged
    for version, batch, _, _ in trainer.batches:
        for t in batch:
            assert trajectory_staleness(t.policy_version, version) <= 1
            assert "t0" != t.task_id
    check_ledger(s)


def test_partial_rollouts_continue_across_versions():
    rollout = FakeRollout(lambda tid: 0.05 + 0.02 * (int(tid[1:]) % 3))
    trainer = FakeTrainer(lambda: 0.02)
    s, _ = run_pool(PoolSettings(batch_size=4, max_staleness=2), rollout, trainer, steps=12)
    mixed = [t for _, b, _, _ in trainer.batches for t in b if len(versions(t)) > 1]
    assert mixed, "no trained trajectory spans two weight versions"
    assert s.ledger.restarted == 0
    check_ledger(s)


def test_restart_mode_interrupts_and_requeues_episodes_on_new_weights():
    rollout = FakeRollout(lambda tid: 0.05 + 0.02 * (int(tid[1:]) % 3))
    trainer = FakeTrainer(lambda: 0.02)
    s, _ = run_pool(PoolSettings(batch_size=4, max_staleness=2, partial_rollout="restart"),
                      rollout, trainer, steps=12)
    assert s.ledger.restarted >= 1
    # A restarted task runs again from scratch: some task id was started more than once.
    assert max(rollout.attempts.values()) >= 2
    for _, batch, _, _ in trainer.batches:
        for t in batch:
            assert len(versions(t)) == 1  # nothing trained spans a weight update
    check_ledger(s)


# --- faults -----------------------------------------------------------------------------------------


def test_failed_workers_and_environments_are_retried_and_every_task_accounted_for():
    def fail(tid: str, attempt: int) -> str:
        i = int(tid[1:])
        if i == 3:
            return "worker"  # always: uses up its retries
        if i % 4 == 1 and attempt == 0:
            return "env"
        if i % 5 == 2 and attempt == 0:
            return "worker"
        return ""

    rollout = FakeRollout(lambda tid: 0.003, fail=fail)
    trainer = FakeTrainer()
    s, _ = run_pool(PoolSettings(batch_size=4, max_staleness=1, max_task_retries=2),
                      rollout, trainer, steps=6)
    assert s.ledger.retried >= 3
    assert s.ledger.failed == 1
    assert s.ledger.failures[0]["task_id"] == "t3" and s.ledger.failures[0]["attempts"] == 3
    assert "rollout worker died" in s.ledger.failures[0]["reason"]
    trained_ids = {t.task_id for _, b, _, _ in trainer.batches for t in b}
    assert "t1" in trained_ids and "t2" in trained_ids  # failed once, then trained
    assert len(trainer.batches) == 6
    check_ledger(s)


def test_waiting_for_a_batch_times_out_and_says_what_it_waited_for():
    rollout = FakeRollout(lambda tid: 30.0)
    with pytest.raises(TimeoutError, match=r"4 ready trajectories.*In flight 4 of 4 slots.*raise system.wait_timeout_s"):
        run_pool(PoolSettings(batch_size=4, wait_timeout_s=0.3), rollout, FakeTrainer(), steps=1)


# --- groups ------------------------------------------------------------------------------------------


def test_group_algorithms_train_on_complete_groups_and_filter_uninformative_ones():
    # Rewards alternate by task draw: even tasks solve in some rollouts, odd tasks never.
    counter = itertools.count()

    def reward(tid: str) -> float:
        i = int(tid[1:])
        return float(next(counter) % 2) if i % 2 == 0 else 0.0

    rollout = FakeRollout(lambda tid: 0.002, reward=reward)
    trainer = FakeTrainer()
    settings = PoolSettings(batch_size=4, max_staleness=1, group_size=2)
    buffer = ReadyBuffer([], group_size=2, accept_group=lambda g: len({t.reward for t in g}) > 1)
    s, _ = run_pool(settings, rollout, trainer, steps=3, buffer=buffer)
    for _, batch, _, _ in trainer.batches:
        ids = [t.group_id for t in batch]
        assert ids[0] == ids[1] and ids[2] == ids[3]  # complete groups, members together
        assert all(len({t.reward for t in batch[i:i + 2]}) == 2 for i in (0, 2))
    assert s.ledger.filtered >= 2
    check_ledger(s)


# --- elastic capacity -------------------------------------------------------------------------------


def test_elastic_slots_follow_a_synthetic_load_up_and_down():
    # Phase 1 (the first 8 steps): slow episodes, instant training -> the trainer starves -> grow.
    # Phase 2: instant episodes, slow training -> finished work piles up -> shrink. The phases
    # follow the steps taken, not the clock; the elastic loop measures readiness every 0.1 s.
    trainer = FakeTrainer(lambda: 0.15 if trainer.version >= 8 else 0.0)
    rollout = FakeRollout(lambda tid: 0.002 if trainer.version >= 8 else 0.3)
    settings = PoolSettings(batch_size=4, max_staleness=8, slots=2, min_slots=2, max_slots=24,
                            elastic_interval_s=0.1)
    s, _ = run_pool(settings, rollout, trainer, steps=22)
    grows = [e for e in s.slot_events if e["to"] > e["from"]]
    shrinks = [e for e in s.slot_events if e["to"] < e["from"]]
    assert grows and shrinks, s.slot_events
    assert grows[0]["version"] < 8 <= shrinks[-1]["version"]  # grown while starved, shrunk while piled up
    assert max(e["to"] for e in grows) > 2
    assert all(e["reason"] for e in s.slot_events)
    assert all(2 <= e["to"] <= 24 for e in s.slot_events)
    check_ledger(s)


# --- attempts with several trajectories (an external agent's session) --------------------------------


class SegmentedRollout(FakeRollout):
    """Every attempt gives `segments(task_id)` trajectories, as a session whose agent edited its
    history gives several segments."""

    def __init__(self, segments, **kwargs):
        super().__init__(**kwargs)
        self.segments = segments

    async def run_episode(self, task, group_id):
        one = await super().run_episode(task, group_id)
        return [fake_trajectory(task, group_id, one.policy_version[1], one.policy_version[2])
                for _ in range(self.segments(task.task_id))]


def test_each_trajectory_of_an_attempt_trains_and_is_accounted_for():
    rollout = SegmentedRollout(lambda tid: 2 if int(tid[1:]) % 2 else 1)
    trainer = FakeTrainer()
    s, _ = run_pool(PoolSettings(batch_size=4, max_staleness=1), rollout, trainer, steps=3)
    trained = [t.task_id for _, batch, _, _ in trainer.batches for t in batch]
    assert len(trained) == 12 and any(trained.count(tid) == 2 for tid in trained)  # both segments trained
    ledger = s.summary()["ledger"]
    assert ledger["trained"] == 12 and ledger["started"] > len(rollout.attempts)  # one start per trajectory
    check_ledger(s)


def test_an_attempt_without_trajectories_or_with_several_for_a_group_is_a_fault():
    # t0's attempts give nothing (an agent that sent no request); with groups, t1's give two.
    rollout = SegmentedRollout(lambda tid: {"t0": 0, "t1": 2}.get(tid, 1), reward=lambda tid: float(tid[1:]) % 2)
    trainer = FakeTrainer()
    settings = PoolSettings(batch_size=8, max_staleness=1, group_size=2, max_task_retries=1)
    s, _ = run_pool(settings, rollout, trainer, steps=2, buffer=ReadyBuffer([], group_size=2))
    reasons = [f["reason"] for f in s.ledger.failures]
    assert any("gave no trajectory" in r for r in reasons), reasons
    assert any("gave 2 trajectories" in r and "algo.group_size=2" in r for r in reasons), reasons
    assert all(t.task_id not in ("t0", "t1") for _, batch, _, _ in trainer.batches for t in batch)
    check_ledger(s)
