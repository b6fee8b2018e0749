"""The asynchronous scheduler with fake rollout and trainer sides (no model, no torch).

Episodes are asyncio sleeps whose length each test chooses; a fake episode's first sampled token
carries the weight version when it started and its last one the version when it ended, as a
partial rollout would.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Callable

import pytest

from tiderl.envs.protocol import Task
from tiderl.system.buffer import ReadyBuffer
from tiderl.system.scheduler import Scheduler, SchedulerSettings
from tiderl.system.staleness import StalenessGate, trajectory_staleness
from tiderl.types import NO_VERSION, Trajectory


def fake_trajectory(task: Task, group_id: str, v_start: int, v_end: int, reward: float = 0.0) -> Trajectory:
    return Trajectory(tokens=[5, 6, 7], loss_mask=[0, 1, 1], behavior_logprobs=[0.0, -1.0, -1.0],
                      policy_version=[NO_VERSION, v_start, v_end], reward=reward, task_id=task.task_id,
                      group_id=group_id, env_info={"success": reward}, stop_reason="answer")


class FakeRollout:
    """Episodes that sleep `duration(task_id)` seconds. `fail(task_id, attempt)` may return
    "worker" (raise) or "env" (stop_reason error) to simulate faults."""

    def __init__(self, duration: Callable[[str], float],
                 fail: Callable[[str, int], str] = lambda *_: "",
                 reward: Callable[[str], float] = lambda _: 0.0):
        self.duration = duration
        self.fail = fail
        self.reward = reward
        self.version = 0
        self.attempts: dict[str, int] = {}
        self.starts: list[tuple[str, int, float]] = []  # (task_id, version at start, time)
        self.finishes: list[tuple[str, float]] = []

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def run_episode(self, task: Task, group_id: str) -> Trajectory:
        attempt = self.attempts.get(task.task_id, 0)
        self.attempts[task.task_id] = attempt + 1
        v_start = self.version
        self.starts.append((task.task_id, v_start, time.monotonic()))
        await asyncio.sleep(self.duration(task.task_id))
        self.finishes.append((task.task_id, time.monotonic()))
        kind = self.fail(task.task_id, attempt)
        if kind == "worker":
            raise ConnectionError("rollout worker died")
        t = fake_trajectory(task, group_id, v_start, self.version, self.reward(task.task_id))
        if kind == "env":
            t.stop_reason = "error"
            t.env_info["error"] = "RuntimeError('tool crashed')"
        return t

    async def update_weights(self, state_dict, version: int) -> float:
        self.version = version
        return 0.0


class FakeTrainer:
    """Sleeps `step_s()` per step and records every batch with the version it trained from."""

    def __init__(self, step_s: Callable[[], float] = lambda: 0.0):
        self.step_s = step_s
        self.batches: list[tuple[int, list[Trajectory], float, float]] = []
        self.lock = threading.Lock()

    def step(self, batch: list[Trajectory], version: int) -> dict[str, float]:
        t0 = time.monotonic()
        time.sleep(self.step_s())
        with self.lock:
            self.batches.append((version, list(batch), t0, time.monotonic()))
        return {"loss": 0.0}

    def state_dict(self) -> dict:
        return {}

    def checksum(self, state_dict) -> float:
        return 0.0


def tasks() -> Callable[[], Task]:
    counter = itertools.count()

    def next_task() -> Task:
        i = next(counter)
        return Task(task_id=f"t{i}", prompt=f"q{i}", answer=None)

    return next_task


def run_scheduler(settings: SchedulerSettings, rollout: FakeRollout, trainer: FakeTrainer, steps: int,
                  buffer: ReadyBuffer | None = None) -> Scheduler:
    async def main() -> Scheduler:
        s = Scheduler(settings, tasks(), rollout, trainer, buffer or ReadyBuffer([], settings.group_size))
        await s.run(steps)
        return s

    return asyncio.run(main())


def check_ledger(s: Scheduler) -> None:
    """Every attempt is in exactly one bucket."""
    summary = s.summary()["ledger"]
    buckets = ("trained", "dropped_stale", "failed", "retried", "restarted", "filtered", "unsettled")
    assert summary["started"] == sum(summary[b] for b in buckets)
    assert s.unsettled() >= 0


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
    assert gate.is_fresh(fake_trajectory(task, "g", 4, 5), trainer_version=5)  # staleness 1
    assert not gate.is_fresh(fake_trajectory(task, "g", 3, 5), trainer_version=5)  # staleness 2
    assert gate.is_fresh(fake_trajectory(task, "g", 5, 5), trainer_version=5)
    assert gate.dropped == 1
    assert dict(gate.histogram) == {1: 1, 2: 1, 0: 1}


def test_synchronous_mode_trains_only_on_the_current_version():
    rollout = FakeRollout(lambda tid: 0.002 * (int(tid[1:]) % 5))
    trainer = FakeTrainer(lambda: 0.01)
    s = run_scheduler(SchedulerSettings(batch_size=4, max_staleness=0), rollout, trainer, steps=5)
    assert [v for v, *_ in trainer.batches] == [0, 1, 2, 3, 4]
    for version, batch, _, _ in trainer.batches:
        for t in batch:
            assert t.versions() == {version}  # every sampled token on the trainer's own weights
    assert s.summary()["staleness_histogram"] == {0: 20}
    # Rollout waits during training: no episode starts while a step runs.
    for _, _, t_start in rollout.starts:
        assert not any(t0 < t_start < t1 for _, _, t0, t1 in trainer.batches)
    check_ledger(s)


# --- continuous batching ---------------------------------------------------------------------------


def test_a_slow_task_does_not_hold_the_other_slots():
    # t0 takes 1.5 s; every other task 5 ms. With 4 slots and staleness 3, the other three
    # slots keep refilling while t0 runs.
    rollout = FakeRollout(lambda tid: 1.5 if tid == "t0" else 0.005)
    trainer = FakeTrainer()
    s = run_scheduler(SchedulerSettings(batch_size=2, max_staleness=3, slots=4), rollout, trainer, steps=8)
    t0_end = dict(rollout.finishes).get("t0", float("inf"))
    trained_before = sum(len(b) for _, b, start, _ in trainer.batches if start < t0_end)
    assert trained_before >= 12, f"only {trained_before} trajectories trained while the slow task ran"
    check_ledger(s)


def test_finished_trajectory_older_than_the_bound_is_dropped_and_counted():
    # t0 spans many versions: when it finishes, its first token is more than 1 version old.
    rollout = FakeRollout(lambda tid: 0.6 if tid == "t0" else 0.005)
    trainer = FakeTrainer(lambda: 0.02)
    s = run_scheduler(SchedulerSettings(batch_size=2, max_staleness=1, slots=4), rollout, trainer, steps=30)
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
    s = run_scheduler(SchedulerSettings(batch_size=4, max_staleness=2), rollout, trainer, steps=12)
    mixed = [t for _, b, _, _ in trainer.batches for t in b if len(t.versions()) > 1]
    assert mixed, "no trained trajectory spans two weight versions"
    assert s.ledger.restarted == 0
    check_ledger(s)


def test_restart_mode_interrupts_and_requeues_episodes_on_new_weights():
    rollout = FakeRollout(lambda tid: 0.05 + 0.02 * (int(tid[1:]) % 3))
    trainer = FakeTrainer(lambda: 0.02)
    s = run_scheduler(SchedulerSettings(batch_size=4, max_staleness=2, partial_rollout="restart"),
                      rollout, trainer, steps=12)
    assert s.ledger.restarted >= 1
    # A restarted task runs again from scratch: some task id was started more than once.
    assert max(rollout.attempts.values()) >= 2
    for _, batch, _, _ in trainer.batches:
        for t in batch:
            assert len(t.versions()) == 1  # nothing trained spans a weight update
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
    s = run_scheduler(SchedulerSettings(batch_size=4, max_staleness=1, max_task_retries=2),
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
    with pytest.raises(TimeoutError, match=r"4 ready trajectories.*In flight 4 of 4 slots"):
        run_scheduler(SchedulerSettings(batch_size=4, wait_timeout_s=0.3), rollout, FakeTrainer(), steps=1)


# --- groups ------------------------------------------------------------------------------------------


def test_group_algorithms_train_on_complete_groups_and_filter_uninformative_ones():
    # Rewards alternate by task draw: even tasks solve in some rollouts, odd tasks never.
    counter = itertools.count()

    def reward(tid: str) -> float:
        i = int(tid[1:])
        return float(next(counter) % 2) if i % 2 == 0 else 0.0

    rollout = FakeRollout(lambda tid: 0.002, reward=reward)
    trainer = FakeTrainer()
    settings = SchedulerSettings(batch_size=4, max_staleness=1, group_size=2)
    buffer = ReadyBuffer([], group_size=2, accept_group=lambda g: len({t.reward for t in g}) > 1)
    s = run_scheduler(settings, rollout, trainer, steps=3, buffer=buffer)
    for _, batch, _, _ in trainer.batches:
        ids = [t.group_id for t in batch]
        assert ids[0] == ids[1] and ids[2] == ids[3]  # complete groups, members together
        assert all(len({t.reward for t in batch[i:i + 2]}) == 2 for i in (0, 2))
    assert s.ledger.filtered >= 2
    check_ledger(s)


# --- elastic capacity -------------------------------------------------------------------------------


def test_elastic_slots_follow_a_synthetic_load_up_and_down():
    # Phase 1 (first ~1.5 s): slow episodes, instant training -> the trainer starves -> grow.
    # Phase 2: instant episodes, slow training -> finished work piles up -> shrink.
    t_start = time.monotonic()

    def phase2() -> bool:
        return time.monotonic() - t_start > 1.5

    rollout = FakeRollout(lambda tid: 0.002 if phase2() else 0.3)
    trainer = FakeTrainer(lambda: 0.15 if phase2() else 0.0)
    settings = SchedulerSettings(batch_size=4, max_staleness=8, slots=2, min_slots=2, max_slots=24,
                                 elastic_interval_s=0.1)
    s = run_scheduler(settings, rollout, trainer, steps=22)
    grows = [e for e in s.slot_events if e["to"] > e["from"]]
    shrinks = [e for e in s.slot_events if e["to"] < e["from"]]
    assert grows and shrinks, s.slot_events
    assert grows[0]["t"] < shrinks[-1]["t"]
    assert max(e["to"] for e in grows) > 2
    assert all(e["reason"] for e in s.slot_events)
    assert all(2 <= e["to"] <= 24 for e in s.slot_events)
    check_ledger(s)
