"""Core budgets per component (`system.cores`, tiderl.system.cores), and over-provisioned
on-policy training (`system.admission` at max_staleness=0)."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from pool_fakes import FakeRollout, FakeTrainer, check_ledger, run_pool
from support import versions
from tiderl.config import ConfigError, load_config
from tiderl.lab.cpu import thread_cpu
from tiderl.system.cores import (
    CorePlan,
    parse_plan,
    pinned_thread,
    resolve_cores,
)
from tiderl.system.pool import PoolSettings
from tiderl.system.staleness import StalenessGate

MULTICORE = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                               reason="pinning needs sched_setaffinity and at least 2 cores")


@pytest.mark.parametrize("available, trainer, rollout", [
    ([0, 1], (0,), (1,)),
    ([0, 1, 2], (0, 1), (2,)),
    ([4, 5, 6, 7], (4, 5), (6, 7)),
    (list(range(16)), tuple(range(8)), tuple(range(8, 16))),
])
def test_auto_splits_the_available_cores_between_trainer_and_rollout(available, trainer, rollout):
    plan = resolve_cores("auto", available, synchronous=False)
    assert (plan.trainer, plan.rollout, plan.prep) == (trainer, rollout, rollout)
    assert plan.threads_for("trainer", 0, default=99) == len(trainer)
    assert plan.threads_for("rollout", 3, default=99) == 3  # an explicit count wins


def test_auto_keeps_every_core_for_synchronous_training_and_on_one_core():
    for plan in (resolve_cores("auto", [0, 1], synchronous=True), resolve_cores("auto", [3], synchronous=False),
                 resolve_cores("shared", [0, 1, 2, 3], synchronous=False)):
        assert plan.describe() == {}  # nothing pinned
        assert plan.threads_for("trainer", 0, default=7) == 7  # the unpinned defaults stay


def test_explicit_plans_parse_and_synchronous_training_runs_on_their_union():
    assert parse_plan("trainer=0-2;rollout=3,5") == {"trainer": (0, 1, 2), "rollout": (3, 5)}
    plan = resolve_cores("trainer=0;rollout=1-2;prep=0", [0, 1, 2], synchronous=False)
    assert (plan.trainer, plan.rollout, plan.prep) == ((0,), (1, 2), (0,))
    sync = resolve_cores("trainer=0;rollout=2", [0, 1, 2], synchronous=True)
    assert sync.trainer == sync.rollout == sync.prep == (0, 2)
    assert resolve_cores("trainer=0;rollout=1", [0, 1], synchronous=False).prep == (1,)


@pytest.mark.parametrize("spec, message", [
    ("trainer=0", "gives no cores to rollout"),
    ("trainer=0;decoder=1", "'decoder=1' names no component"),
    ("trainer=a;rollout=1", "trainer='a' is not a core list"),
    ("trainer=0;rollout=9", "cores [9] are not available"),
    ("trainer=0;trainer=1;rollout=1", "trainer is given twice"),
])
def test_bad_plans_are_rejected_with_the_field_and_a_fix(spec, message):
    with pytest.raises(ValueError) as e:
        resolve_cores(spec, [0, 1], synchronous=False)
    assert str(e.value).startswith("system.cores") and message in str(e.value) and "Fix:" in str(e.value)


def test_config_checks_the_plan_and_the_admission():
    assert load_config(None, ["system.cores=trainer=0;rollout=1"]).system.cores == "trainer=0;rollout=1"
    with pytest.raises(ConfigError, match="system.cores"):
        load_config(None, ["system.cores=trainer=0"])
    with pytest.raises(ConfigError, match="system.admission.*below rollout.batch_size"):
        load_config(None, ["rollout.batch_size=8", "system.admission=4"])


@MULTICORE
def test_each_component_thread_runs_on_its_own_cores():
    a, b = sorted(os.sched_getaffinity(0))[:2]
    plan = resolve_cores(f"trainer={a};rollout={b}", sorted(os.sched_getaffinity(0)), synchronous=False)
    seen = {}
    pools = {c: ThreadPoolExecutor(1, initializer=plan.thread_init(c, 1)) for c in ("trainer", "rollout", "prep")}
    try:
        for component, pool in pools.items():
            tid = pool.submit(threading.get_native_id).result()
            seen[component] = os.sched_getaffinity(tid)  # read from this thread: the kernel's mask
            cpu = thread_cpu(tid)
            assert cpu is not None and cpu[0] in seen[component]
    finally:
        for pool in pools.values():
            pool.shutdown()
    assert seen == {"trainer": {a}, "rollout": {b}, "prep": {b}}
    assert {c: len(t) for c, t in plan.pinned_threads.items()} == {"trainer": 1, "rollout": 1, "prep": 1}
    # The calling thread is untouched, and pinned_thread restores what it changes.
    before = os.sched_getaffinity(0)
    with pinned_thread([b]):
        assert os.sched_getaffinity(0) == {b}
    assert os.sched_getaffinity(0) == before


def test_an_unpinned_plan_sets_only_the_thread_count():
    plan = CorePlan()
    before = os.sched_getaffinity(0)
    with ThreadPoolExecutor(1, initializer=plan.thread_init("trainer", 1)) as pool:
        assert pool.submit(lambda: os.sched_getaffinity(0)).result() == before
    assert plan.describe() == {}


def test_gate_admission_overrides_the_capacity():
    gate = StalenessGate(max_staleness=0, batch_size=4, admission=8)
    assert gate.capacity == 8
    gate.started(8)
    assert "system.admission = 8" in gate.blocker(0, 0)


def test_over_provisioned_sync_trains_the_first_finishers_on_policy_and_restarts_the_rest():
    # Twice the batch runs at once; the slow tasks (every third) are overtaken by fast ones.
    rollout = FakeRollout(lambda tid: 0.08 if int(tid[1:]) % 3 == 0 else 0.005)
    trainer = FakeTrainer(lambda: 0.01)
    settings = PoolSettings(batch_size=4, max_staleness=0, admission=8)
    assert settings.initial_slots() == 8
    s, _ = run_pool(settings, rollout, trainer, steps=6)
    for version, batch, _, _ in trainer.batches:
        for t in batch:
            assert versions(t) == {version}  # on-policy: sampled by the weights it trains
    summary = s.summary()
    assert summary["staleness_histogram"].get(0, 0) == 24
    assert s.ledger.restarted + s.ledger.dropped_stale >= 1  # the stragglers were not trained late
    check_ledger(s)
