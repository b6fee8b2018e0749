"""The elastic capacity policy as a pure function: its votes, its hysteresis and its bounds
against the staleness gate and the batch size (the Ray pool that follows it is tested in
tests/test_elastic_ray.py)."""

from __future__ import annotations

import pytest

from tiderl.system.elastic import (
    Bounds,
    LoadSignals,
    Memory,
    Policy,
    capacity_bounds,
    decide,
    vote,
)

B = 8
STARVED = LoadSignals(trainer_idle_frac=0.6, ready=1, gate_blocked_frac=0.0, batch_size=B)
PILED = LoadSignals(trainer_idle_frac=0.0, ready=2 * B, gate_blocked_frac=0.0, batch_size=B)
GATED_BUSY = LoadSignals(trainer_idle_frac=0.0, ready=3, gate_blocked_frac=0.8, batch_size=B)
GATED_STARVED = LoadSignals(trainer_idle_frac=0.7, ready=0, gate_blocked_frac=0.8, batch_size=B)
BALANCED = LoadSignals(trainer_idle_frac=0.1, ready=B, gate_blocked_frac=0.1, batch_size=B)


def span(bounds: Bounds) -> tuple[int, int]:
    return bounds.low, bounds.high


def test_votes_follow_who_waits_on_whom():
    assert vote(STARVED)[0] == 1  # the trainer waits on rollout
    assert vote(PILED)[0] == -1  # finished work waits on the trainer
    assert vote(GATED_BUSY)[0] == -1  # rollout waits on the gate while the trainer works
    # The trainer waits but the gate holds rollout back: more capacity would wait at the gate,
    # and less would starve the trainer further.
    assert vote(GATED_STARVED) == (0, "")
    assert vote(BALANCED) == (0, "")  # the dead band


def test_bounds_respect_the_batch_and_the_gate():
    # 4 slots per worker, batch 8: one batch needs 2 workers; N=1 admits 16 trajectories = 4 workers.
    b = capacity_bounds(batch_size=8, max_staleness=1, slots_per_unit=4, min_units=1, max_units=16)
    assert (b.low, b.high) == (2, 4)
    assert "batch" in b.low_why and "staleness gate" in b.high_why
    # Slots as units (the local backend): [B, (N+1)B] within the configured range.
    assert span(capacity_bounds(16, 4, 1, 16, 192)) == (16, 80)
    assert span(capacity_bounds(16, 4, 1, 4, 40)) == (16, 40)
    assert span(capacity_bounds(16, 4, 1, 24, 40)) == (24, 40)
    # A configured max smaller than one batch needs is the resource limit: it wins.
    small = capacity_bounds(16, 1, 4, 1, 3)
    assert (small.low, small.high) == (3, 3) and "configured max" in small.low_why
    # Synchronous training (N=0): the gate admits exactly one batch, so the range is one point.
    assert span(capacity_bounds(8, 0, 4, 1, 10)) == (2, 2)
    with pytest.raises(ValueError, match="slots_per_unit"):
        capacity_bounds(8, 1, 0, 1, 4)
    with pytest.raises(ValueError, match="min_units"):
        capacity_bounds(8, 1, 4, 5, 4)


def test_hysteresis_needs_votes_in_a_row_then_cools_down():
    bounds = Bounds(2, 8)
    policy = Policy(patience=2, cooldown=2)
    d = decide(4, bounds, STARVED, Memory(), policy)
    assert d.units == 4 and d.reason == "" and d.memory.streak == 1  # one vote is not enough
    d = decide(3, bounds, STARVED, d.memory, policy)
    # Idle 60 %: rollout delivered 40 % of what the trainer needed -> 3 / 0.4 = 7.5 -> 8.
    assert d.units == 8 and d.reason.startswith("grow 3->8: the trainer waited 60%") and "2 intervals" in d.reason
    # Cooldown: two intervals in which even a strong vote changes nothing.
    d = decide(5, bounds, PILED, d.memory, policy)
    assert (d.units, d.memory) == (5, Memory(0, 1))
    d = decide(5, bounds, PILED, d.memory, policy)
    assert (d.units, d.memory) == (5, Memory(0, 0))
    # An alternating load (grow, shrink, grow, ...) never builds a streak: no oscillation.
    memory = d.memory
    for load in [STARVED, PILED] * 5:
        d = decide(5, bounds, load, memory, policy)
        assert d.units == 5
        memory = d.memory
    # A dead-band interval breaks a streak.
    d = decide(5, bounds, PILED, Memory(), policy)
    d = decide(5, bounds, BALANCED, d.memory, policy)
    d = decide(5, bounds, PILED, d.memory, policy)
    assert d.units == 5
    d = decide(5, bounds, PILED, d.memory, policy)
    assert d.units == 4 and d.reason.startswith("shrink 5->4: 16 finished trajectories wait")


def test_decisions_never_leave_the_bounds():
    bounds = capacity_bounds(batch_size=8, max_staleness=1, slots_per_unit=4, min_units=1, max_units=16)
    policy = Policy(patience=1, cooldown=0, step_frac=1.0)  # as eager as possible
    units, memory = 3, Memory()
    seen = set()
    for load in [STARVED] * 5 + [PILED] * 5 + [GATED_BUSY] * 3 + [STARVED] * 4:
        d = decide(units, bounds, load, memory, policy)
        units, memory = d.units, d.memory
        seen.add(units)
        assert bounds.low <= units <= bounds.high
    assert seen == {2, 4}  # it reached both ends and stayed within them
    # At a bound, a vote towards it is dropped (no streak waiting to fire).
    d = decide(4, bounds, STARVED, Memory(), policy)
    assert (d.units, d.reason, d.memory) == (4, "", Memory())
    # Units outside the bounds (e.g. the initial configuration) are brought inside at once.
    d = decide(1, bounds, BALANCED, Memory(), policy)
    assert d.units == 2 and "below the lower bound" in d.reason and "one batch" in d.reason
    d = decide(9, bounds, BALANCED, Memory(), policy)
    assert d.units == 4 and "above the upper bound" in d.reason and "staleness gate" in d.reason


def test_grow_fast_in_proportion_to_the_starvation_shrink_slowly():
    bounds = Bounds(16, 192)
    policy = Policy(patience=1)
    slightly = LoadSignals(trainer_idle_frac=0.25, ready=0, gate_blocked_frac=0.0, batch_size=B)
    assert decide(64, bounds, slightly, Memory(), policy).units == 86  # 64 / 0.75 = 85.3, rounded up
    assert decide(32, bounds, STARVED, Memory(), policy).units == 80  # 32 / 0.4
    starving = LoadSignals(trainer_idle_frac=0.95, ready=0, gate_blocked_frac=0.0, batch_size=B)
    assert decide(32, bounds, starving, Memory(), policy).units == 128  # at most x4
    assert decide(64, bounds, STARVED, Memory(), policy).units == 160
    assert decide(190, bounds, STARVED, Memory(), policy).units == 192  # never past the bound
    assert decide(64, bounds, PILED, Memory(), policy).units == 48  # a quarter
    assert decide(17, bounds, PILED, Memory(), policy).units == 16
    assert decide(1, Bounds(1, 8), slightly, Memory(), policy).units == 2  # at least one


def test_no_grow_while_added_capacity_is_booting():
    policy = Policy(patience=1, cooldown=0)
    booting = LoadSignals(trainer_idle_frac=0.9, ready=0, gate_blocked_frac=0.0, batch_size=B, booting=1)
    d = decide(3, Bounds(2, 8), booting, Memory(streak=1), policy)
    assert (d.units, d.reason, d.memory) == (3, "", Memory(streak=1))
    # A shrink vote still counts (the load turned while the worker started: the pool stops it).
    piled = LoadSignals(trainer_idle_frac=0.0, ready=2 * B, gate_blocked_frac=0.0, batch_size=B, booting=1)
    assert decide(4, Bounds(2, 8), piled, Memory(), policy).units == 3


def test_an_episode_cut_by_a_shrink_is_requeued_without_using_a_retry():
    from pool_fakes import FakeRollout, FakeTrainer, check_ledger, run_pool
    from tiderl.system.elastic import CapacityRemoved
    from tiderl.system.pool import PoolSettings

    class CutOnce(FakeRollout):
        async def run_episode(self, task, group_id):
            if task.task_id == "t0" and self.attempts.get("t0", 0) == 0:
                self.attempts["t0"] = 1
                raise CapacityRemoved("rollout worker 1 was removed by an elastic shrink")
            return await super().run_episode(task, group_id)

    rollout, trainer = CutOnce(), FakeTrainer()
    # max_task_retries=0: a fault would fail the task at once; a cut must not.
    pool, _ = run_pool(PoolSettings(batch_size=2, max_staleness=1, max_task_retries=0), rollout, trainer, steps=3)
    ledger = pool.summary()["ledger"]
    assert ledger["requeued"] == 1 and ledger["retried"] == 0 and ledger["failed"] == 0, ledger
    check_ledger(pool)
    trained = [t.task_id for _, batch, _, _ in trainer.batches for t in batch]
    assert rollout.attempts["t0"] == 2 and "t0" in trained  # played again, then trained


def test_the_worker_range_config_is_checked():
    from tiderl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="system.options.min_workers: .*only system.backend=ray reads it"):
        load_config(None, ["system.options.min_workers=1"])
    with pytest.raises(ConfigError, match=r"system.options.workers: 1 is outside .* = \[2, 4\]"):
        load_config(None, ["system.backend=ray", "system.options.min_workers=2", "system.options.max_workers=4"])
    with pytest.raises(ConfigError, match="system.options.slots_per_worker: .*the Ray workers are fixed"):
        load_config(None, ["system.backend=ray", "system.options.slots_per_worker=4"])
    with pytest.raises(ConfigError, match="system.min_workers: moved to system.options.min_workers"):
        load_config(None, ["system.backend=ray", "system.min_workers=1"])
    cfg = load_config(None, ["system.backend=ray", "system.options.workers=2", "system.options.max_workers=4",
                             "system.options.slots_per_worker=4", "system.elastic_interval_s=1"])
    assert (cfg.system.options.min_workers, cfg.system.options.max_workers) == (0, 4)
