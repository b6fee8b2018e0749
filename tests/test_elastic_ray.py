"""Elastic Ray rollout workers: the pool grows and shrinks with real actors under a shifting load,
a removed worker's episodes are requeued (never lost), and the ledger settles.

The workers are `benchmarks/elastic.py`'s `SimulatedEngineWorker` (Ray actors whose engine is
a timed simulation: no model, so an actor boots in about a second), the trainer sleeps."""

from __future__ import annotations

import asyncio
import importlib
import time

import pytest

ray = pytest.importorskip("ray")

import torch

from tiderl.config import load_config
from tiderl.envs.protocol import Task
from tiderl.system import ray_backend as rb
from tiderl.system.buffer import ReadyBuffer
from tiderl.system.elastic import CapacityRemoved
from tiderl.recipe import loop
from tiderl.system.pool import PoolSettings, RolloutPool

bench = importlib.import_module("benchmarks.elastic")
TIMEOUT_S = 300  # every wait on Ray here is bounded by this (a hang becomes a failure; 120 s was
# exceeded once on 2 cores shared with three training runs)


@pytest.fixture(scope="module")
def cluster():
    ray.cloudpickle.register_pickle_by_value(bench)  # Ray's workers import it by value
    ray.init(address="local", num_cpus=2, include_dashboard=False)  # our own cluster, not a running one
    yield
    ray.shutdown()


def elastic_config(*more: str):
    # Batch 4, staleness 1, 2 slots per worker: the bounds are [2, 4] workers (one batch; what
    # the gate admits), inside the configured 1-8.
    return load_config(None, ["system.backend=ray", "rollout.batch_size=4", "system.max_staleness=1",
                              "system.options.workers=2", "system.options.min_workers=1", "system.options.max_workers=8",
                              "system.options.slots_per_worker=2", f"system.wait_timeout_s={TIMEOUT_S}", *more])


def task(serial: int, tokens: int, tool_s: float = 0.0) -> Task:
    return Task(f"t{serial}", "", None, {"turn_tokens": [tokens, 1], "tool_s": [tool_s]})


def test_elastic_pool_grows_and_shrinks_with_the_load_and_loses_no_task(cluster):
    cfg = elastic_config("system.elastic_interval_s=0.3", "system.options.worker_drain_s=5")
    phase = {"now": "rollout-bound"}
    serial = [0]

    def next_task() -> Task:
        serial[0] += 1
        if phase["now"] == "rollout-bound":
            return task(serial[0], 200, 0.3)  # about 0.6 s an episode
        return task(serial[0], 2)  # instant episodes

    class ShiftingTrainer(bench.SleepTrainer):
        async def step(self, batch):
            self.train_s = 0.0 if phase["now"] == "rollout-bound" else 0.25
            return await super().step(batch)

    async def scenario():
        rollout = rb.RayRollout(cfg, torch.nn.Linear(2, 2), None, None, worker_cls=bench.SimulatedEngineWorker,
                                worker_options={"num_cpus": 0.25})
        pool = RolloutPool(PoolSettings.from_config(cfg), next_task, rollout, ReadyBuffer([], 1))
        live_seen = []

        def after_step(version, metrics, batch) -> bool:
            live_seen.append(rollout.live_workers)
            assert pool.slots == rollout.live_workers * 2  # the slots follow the live workers
            if phase["now"] == "rollout-bound" and rollout.live_workers == 4:
                phase["now"] = "trainer-bound"  # the pool reached the gate's bound: turn the load
                phase["steps"] = len(live_seen)
            return phase["now"] == "trainer-bound" and rollout.live_workers == 2 and len(live_seen) > phase["steps"] + 2

        await asyncio.wait_for(loop(pool, ShiftingTrainer(0.0), 400, after_step), TIMEOUT_S)
        return pool, rollout, live_seen

    t0 = time.monotonic()
    pool, rollout, live_seen = asyncio.run(scenario())
    print("pool events:", rollout.events, "\nworker decisions:", pool.worker_events,
          f"\n{time.monotonic() - t0:.1f} s, live workers per step: {live_seen}")
    kinds = [e["event"] for e in rollout.events]
    assert kinds.count("added") == 2 and kinds.count("removed") == 2, rollout.events
    assert max(live_seen) == 4 and live_seen[-1] == 2  # the gate's bound, then one batch's
    grows = [e for e in pool.worker_events if e["to"] > e["from"]]
    shrinks = [e for e in pool.worker_events if e["to"] < e["from"]]
    assert grows and "trainer waited" in grows[0]["reason"]
    assert shrinks and all("staleness gate" in e["reason"] or "wait" in e["reason"] for e in shrinks)
    assert all(2 <= e["to"] <= 4 for e in pool.worker_events)
    # No task lost: every attempt started is in one ledger bucket, nothing failed or was retried.
    ledger = pool.summary()["ledger"]
    assert ledger["started"] == sum(v for k, v in ledger.items() if k != "started"), ledger
    assert ledger["failed"] == 0 and ledger["retried"] == 0, ledger
    assert ledger["trained"] == 4 * len(live_seen)
    # Worker-seconds: the actors held, at least 2 workers for the whole run.
    assert rollout.worker_seconds() >= 2 * pool.summary()["wall_s"] * 0.9
    assert sum(s["episodes"] for s in rollout.worker_stats) >= ledger["trained"]


def test_a_removed_worker_drains_then_its_cut_episodes_raise_capacity_removed(cluster):
    cfg = elastic_config("system.options.worker_drain_s=0.3")

    async def scenario():
        rollout = rb.RayRollout(cfg, torch.nn.Linear(2, 2), None, None, worker_cls=bench.SimulatedEngineWorker,
                                worker_options={"num_cpus": 0.25})
        lives = []
        rollout.on_live_change = lives.append
        await rollout.start()
        try:
            assert rollout.units == 2 and rollout.worker_range == (1, 8)
            # One short and one long episode on each worker.
            # (Waits on the episodes and the loads, not on the clock: a loaded machine once left one short
            # episode running after a fixed 0.05 s, and both long ones went to the same worker.)
            short = [asyncio.ensure_future(rollout.run_episode(task(i, 1), f"g{i}")) for i in range(2)]
            await asyncio.wait_for(asyncio.gather(*short), TIMEOUT_S)
            long = [asyncio.ensure_future(rollout.run_episode(task(i, 800), f"g{i}")) for i in range(2, 4)]
            deadline = time.monotonic() + TIMEOUT_S
            while sum(w.load for w in rollout._workers.values()) < 2:
                assert time.monotonic() < deadline, "the long episodes were never dispatched"
                await asyncio.sleep(0.01)
            assert sorted(w.load for w in rollout._workers.values()) == [1, 1]
            rollout.resize(1, "test")  # one worker drains; its long episode outlives the 0.3 s drain
            assert rollout.live_workers == 1 and rollout.units == 1 and lives[-1] == 1
            done = await asyncio.wait_for(asyncio.gather(*short, *long, return_exceptions=True), TIMEOUT_S)
            assert [isinstance(r, CapacityRemoved) for r in done].count(True) == 1, done
            assert all(r.num_action_tokens > 0 for r in done if not isinstance(r, BaseException))
            assert [e["event"] for e in rollout.events] == ["draining", "removed"]
            assert rollout.events[1]["cut_episodes"] == 1
            # Growing again starts a fresh actor on the latest weights, counted from its spawn.
            state = {"w": torch.ones(4)}
            await rollout.update_weights(state, 1)
            rollout.resize(3, "test")
            assert rollout.units == 3 and rollout.booting == 2
            deadline = time.monotonic() + TIMEOUT_S
            while rollout.live_workers < 3:
                assert time.monotonic() < deadline, rollout.events
                await asyncio.sleep(0.1)
            assert rollout.version == 1 and lives[-1] == 3
            added = [e for e in rollout.events if e["event"] == "added"]
            assert len(added) == 2 and all(e["version"] == 1 for e in added)
            rollout.resize(99, "test")  # kept within the configured range
            assert rollout.units == 8
            rollout.resize(3, "test")  # cancels the boots first, retires no live worker
            assert rollout.units == 3 and rollout.live_workers == 3
        finally:
            await rollout.close()
        assert rollout.live_workers == 0 and rollout._held.value == 0  # every actor released

    asyncio.run(scenario())
