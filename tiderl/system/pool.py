"""The rollout pool: episodes in flight, and the finished trajectories the trainer takes.

    await pool.start()
    batch = await pool.next_batch()          # `batch_size` fresh trajectories; waits only where needed
    await pool.publish(version, weights)     # rollout samples with these weights from now on
    metrics = pool.step_metrics(batch, trainer_metrics)
    await pool.close()

Behind that interface (the fill and elastic loops, the staleness gate, the ready buffer, the
ledger): docs/architecture.md, "System: the rollout pool".
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from tiderl.envs.protocol import Task
from tiderl.rollout.weights import published_checksum
from tiderl.system.buffer import ReadyBuffer
from tiderl.system.elastic import CapacityRemoved, LoadSignals, Memory, capacity_bounds, decide
from tiderl.system.ledger import Lengths
from tiderl.system.staleness import StalenessGate, mask_older, trajectory_staleness
from tiderl.system.timing import TimeWeighted
from tiderl.types import Trajectory

logger = logging.getLogger(__name__)


class RolloutBackend(Protocol):
    """Where episodes run. `version` is the weight version new tokens are sampled with.

    A backend named by `system.backend` is built as `Backend.from_run(run, preparations,
    executor)` (docs/extending.md)."""

    @property
    def version(self) -> int: ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def run_episode(self, task: Task, group_id: str) -> Trajectory | list[Trajectory]:
        """Play one attempt at `task`. Raising means the worker failed (the task is retried).
        An attempt may give several trajectories (an external agent's session with several
        segments); group algorithms need exactly one."""
        ...

    async def update_weights(self, weights: Any, version: int) -> Any:
        """Load weights `version`; returns the checksum of what the workers now hold."""
        ...

    # Optional: `cut_tokens`, sampled tokens of the completed turns of cancelled episodes (waste);
    # `async release_memory()`, called at staleness 0 once a batch is taken (nothing decodes until
    # the next publish): free what the engines hold on the trainer's device.

    def report(self) -> dict[str, Any]:
        """The backend's part of the run summary (`system.json`)."""
        ...


@dataclass
class PoolSettings:
    batch_size: int
    max_staleness: int = 0
    partial_rollout: str = "continue"  # or "restart"
    slots: int = 0  # 0 = admission, else (max_staleness + 1) * batch_size
    min_slots: int = 0  # 0 = slots
    max_slots: int = 0  # 0 = slots
    elastic_interval_s: float = 2.0
    max_task_retries: int = 2
    wait_timeout_s: float = 600.0
    group_size: int = 1
    env_name: str = ""  # named in the error when every task keeps failing
    resource_units: float = 1.0  # devices the run holds: goodput per resource unit divides by it
    admission: int = 0  # most unsettled trajectories; 0 = (max_staleness + 1) * batch_size
    stale_policy: str = "drop"  # or "mask" (system.stale.policy; tiderl.system.staleness)
    stale_bound: int = 0  # versions a trained token may lag; 0 = max_staleness (config: max_staleness + system.stale.slack)
    run_steps: int = 0  # with system.stale.drain: the run's step count (train.steps), else 0

    def initial_slots(self) -> int:
        return self.slots or self.admission or (self.max_staleness + 1) * self.batch_size

    def most_slots(self) -> int:
        """The largest number of episodes that may ever run at once."""
        return max(self.initial_slots(), self.max_slots)

    @classmethod
    def from_config(cls, cfg: Any) -> "PoolSettings":
        """The settings a RunConfig gives (`system.*`, the batch size, the algorithm's group size)."""
        s = cfg.system
        return cls(batch_size=cfg.rollout.batch_size, max_staleness=s.max_staleness,
                   partial_rollout=s.partial_rollout, slots=s.slots, min_slots=s.min_slots,
                   max_slots=s.max_slots, elastic_interval_s=s.elastic_interval_s,
                   max_task_retries=s.max_task_retries, wait_timeout_s=s.wait_timeout_s,
                   group_size=cfg.algo.group_size, env_name=cfg.env.name,
                   resource_units=s.resource_units, admission=s.admission,  # staleness 0: no slack, drop
                   stale_policy=s.stale.policy if s.max_staleness else "drop",
                   stale_bound=s.max_staleness and s.max_staleness + s.stale.slack,
                   run_steps=cfg.train.steps if s.stale.drain else 0)


@dataclass
class Ledger:
    """Where every task attempt went: each one started ends in exactly one bucket, or is still
    unsettled (in flight, or waiting in the buffer) when the run stops."""

    started: int = 0
    trained: int = 0
    dropped_stale: int = 0
    failed: int = 0
    retried: int = 0
    restarted: int = 0
    filtered: int = 0  # complete groups set aside as uninformative (dynamic sampling)
    requeued: int = 0  # queued again without using a retry (a resume, an elastic shrink)
    lost: int = 0  # started after the checkpoint a run resumed from (the stop lost their work)
    failures: list[dict[str, Any]] = field(default_factory=list)

    def settled(self) -> int:
        return (self.trained + self.dropped_stale + self.failed + self.retried + self.restarted
                + self.filtered + self.requeued + self.lost)

    def counts(self) -> dict[str, int]:
        return {k: v for k, v in self.__dict__.items() if k != "failures"}


@dataclass
class _Attempt:
    task: Task
    group_id: str
    attempt: int = 0
    start_version: int = 0
    over: bool = False  # its episode returned (buffered, or faulted and settled)

    def record(self) -> dict[str, Any]:
        return {"task": self.task.task_id, "group": self.group_id, "attempt": self.attempt}


class RolloutPool:
    """Rollout under the staleness bound, fed by `next_task()` and played by `backend`
    (docs/architecture.md). `shape(trajectory)` shapes each finished episode's reward before it
    enters the buffer; `ledger_log` (a `LedgerLog`, optional) gets every ledger event."""

    def __init__(self, settings: PoolSettings, next_task: Callable[[], Task], backend: RolloutBackend,
                 buffer: ReadyBuffer, shape: Callable[[Trajectory], Trajectory] = lambda t: t,
                 ledger_log: Any = None, start_version: int = 0):
        s = settings
        if s.batch_size % s.group_size:
            raise ValueError(f"batch_size={s.batch_size} must be a multiple of group_size={s.group_size}")
        if s.partial_rollout not in ("continue", "restart"):
            raise ValueError(f"partial_rollout={s.partial_rollout!r}: use 'continue' or 'restart'")
        self.settings = s
        self.next_task = next_task
        self.backend = backend
        self.buffer = buffer
        buffer.on_reject = lambda group: self._settle("filtered", group)
        self.shape = shape
        self.ledger_log = ledger_log
        self.version = start_version  # the trainer's: the weights last published
        self.gate = StalenessGate(s.max_staleness, s.batch_size, s.admission, s.stale_policy, s.stale_bound,
                                  s.run_steps)
        self.ledger = Ledger()
        self.slots = s.initial_slots()
        self.min_slots = s.min_slots or self.slots
        self.max_slots = s.max_slots or self.slots
        self.slot_events: list[dict[str, Any]] = []
        self.worker_events: list[dict[str, Any]] = []  # elastic worker-pool decisions
        self._queue: deque[_Attempt] = deque()  # retried/restarted attempts and pending group members
        self._group_serial = 0
        self._inflight: dict[asyncio.Task[None], _Attempt] = {}
        self._stopped: list[_Attempt] = []  # in flight when the pool closed (unsettled)
        self._failed_in_a_row = 0  # tasks failed after their retries, no clean episode between
        self._changed = asyncio.Event()
        self._loops: list[asyncio.Task[None]] = []  # fill and elastic
        self._closing = False
        self._taken: list[Trajectory] = []  # handed to the trainer, settled by the next publish
        self._lags: list[int] = []  # critic value lags of the batch taken last
        # Time accounting (monotonic seconds).
        self._active = TimeWeighted(0.0)
        self._slots_tw = TimeWeighted(float(self.slots))
        self._blocked = TimeWeighted(0.0)
        self._idle = TimeWeighted(0.0)  # 1 while the trainer waits in next_batch
        self.generated_tokens = 0
        # Goodput counts the sampled (action) tokens of trained trajectories; the sequence count
        # (prompt and observations included) is what the trainer's passes read, not goodput.
        self.trained_tokens = 0
        self.trained_sequence_tokens = 0
        self.critic_lag_histogram: dict[int, int] = {}  # run totals of `critic_value_lags`
        self.wasted: Counter[str] = Counter()  # cause -> sampled tokens that never train
        self.lengths = Lengths()
        self._prep_seen = 0  # preparation intervals already counted in `time/prep_s`
        self._start_version = start_version  # the critic snapshot counts its refreshes from here
        self._t0 = self._last_end = self._t_wait = self._t_got = self._t_publish = 0.0

    # ------------------------------------------------------------------ the trainer's interface

    async def start(self) -> None:
        """Start the backend, the preparations and the fill and elastic loops."""
        # Environments without `astep` step on the default executor: a thread per slot, so slow
        # tools do not queue behind each other.
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(self.settings.most_slots() + 4))
        await self.backend.start()
        self._t0 = self._last_end = time.monotonic()  # the run's clock starts once the backend is up
        self._start_version = self.version  # a resumed pool's version is set by now
        self._attach_worker_pool()
        self.buffer.start()
        self._loops = [asyncio.create_task(self._fill_loop(), name="tiderl-fill"),
                       asyncio.create_task(self._elastic_loop(), name="tiderl-elastic")]

    async def next_batch(self) -> list[Trajectory]:
        """`batch_size` ready trajectories that the gate judges fresh for the trainer's version
        (whole groups; stale ones are dropped and counted). Raises what stopped the rollout side:
        a bug in the fill loop, a run where every task keeps failing, a timeout naming what it
        waited for."""
        fill = self._loops[0]
        if fill.done():  # a bug in the fill loop must not turn into a timeout
            fill.result()
        self._t_wait = time.monotonic()
        self._idle.set(1.0)
        try:
            batch = await self._take_fresh_batch()
        finally:
            self._idle.set(0.0)
        self._t_got = time.monotonic()
        if self.settings.max_staleness == 0 and hasattr(self.backend, "release_memory"):
            await self.backend.release_memory()
        # Read before the step: the critic snapshot has been refreshed once per step since the start.
        self._lags = critic_value_lags(batch, self.version - self._start_version)
        self._taken.extend(batch)
        return batch

    async def publish(self, version: int, weights: Any) -> None:
        """Hand weights `version` to the backend and check that it holds them (by checksum); then
        the batches taken since the last publish count as trained, and at staleness 0 (or in
        restart mode) episodes still running on older weights restart."""
        self._t_publish = time.monotonic()
        timeout = self.settings.wait_timeout_s
        try:
            held = await asyncio.wait_for(self.backend.update_weights(weights, version), timeout)
        except TimeoutError:
            raise TimeoutError(f"weight sync to version {version} took longer than "
                               f"system.wait_timeout_s={timeout}s") from None
        sent = published_checksum(weights)
        if held != sent:
            raise RuntimeError(f"weight sync to version {version} failed: the rollout side holds "
                               f"checksum {held!r}, the trainer sent {sent!r}")
        self.version = version
        # At max_staleness=0 an episode still running on the old weights could never train: restart
        # it now (only an over-provisioned admission leaves any in flight there).
        if self.settings.partial_rollout == "restart" or self.settings.max_staleness == 0:
            self._restart_older_than(version)
        trained, self._taken = self._taken, []
        self._settle("trained", trained)  # wakes the fill loop, after the cancellations above

    def step_metrics(self, batch: list[Trajectory], trainer_metrics: dict[str, float]) -> dict[str, float]:
        """The step's system metrics (time, slots, staleness, ledger, throughput; docs/metrics.md),
        once per step after `publish`. A step whose trainer metrics say it changed no weights
        (skipped) adds nothing to goodput."""
        if not any(trainer_metrics.get(k) for k in _SKIP_KEYS):
            self.trained_tokens += sum(t.num_action_tokens for t in batch)
            self.trained_sequence_tokens += sum(len(t.tokens) for t in batch)
        for lag in self._lags:
            self.critic_lag_histogram[lag] = self.critic_lag_histogram.get(lag, 0) + 1
        t_end = time.monotonic()
        wall = max(t_end - self._t0, 1e-9)
        # The batch was trained from version - 1: the same measure the gate judged it by.
        staleness = [trajectory_staleness([v for v, m in zip(t.policy_version, t.loss_mask) if m], self.version - 1)
                     for t in batch]
        waste = self.waste()
        out = {
            "policy_version": self.version,
            "step_s": t_end - self._last_end,
            "time/wait_batch_s": self._t_got - self._t_wait,
            "time/train_s": self._t_publish - self._t_got,
            "time/sync_s": t_end - self._t_publish,
            "system/slots": self.slots,
            "system/active_slots": len(self._inflight),
            "system/queue_depth": self.buffer.ready_count,
            "system/preparing": self.buffer.waiting_count,
            "system/staleness_mean": sum(staleness) / len(staleness),
            "system/staleness_max": max(staleness),
            "system/dropped_stale": self.ledger.dropped_stale,
            "system/retried": self.ledger.retried,
            "system/failed": self.ledger.failed,
            "system/restarted": self.ledger.restarted,
            "system/filtered": self.ledger.filtered,
            "system/trainer_idle_frac": self._idle.integral() / wall,
            "system/rollout_idle_frac": self._rollout_idle(),
            "throughput/goodput_trajectories_per_s": self.ledger.trained / wall,
            "throughput/goodput_tokens_per_s": self.trained_tokens / wall,
            "throughput/goodput_tokens_per_s_per_unit": self.trained_tokens / wall / self.settings.resource_units,
            "throughput/trained_sequence_tokens_per_s": self.trained_sequence_tokens / wall,
            "throughput/generated_tokens_per_s": self.generated_tokens / wall,
            "system/generated_tokens": self.generated_tokens,
            "system/trained_action_tokens": self.trained_tokens,
            "system/trained_sequence_tokens": self.trained_sequence_tokens,
            "system/wasted_tokens": waste["wasted_tokens"],
            "system/waste_frac": waste["waste_frac"],
            **self.lengths.metrics(),
            "time/prep_s": self._prep_seconds_since_last_step(),
            **lag_metrics(self._lags),
        }
        self._last_end = t_end
        return out

    async def close(self) -> None:
        """Stop the loops and cancel what is still in flight (counted as unsettled, never
        silently lost), then stop the preparations and the backend."""
        self._closing = True
        for task in self._loops:
            task.cancel()
        await asyncio.gather(*self._loops, return_exceptions=True)
        inflight = list(self._inflight)
        self._stopped = [a for a in self._inflight.values() if not a.over]
        for task in inflight:
            task.cancel()
        await asyncio.gather(*inflight, return_exceptions=True)
        await self.buffer.close()
        await self.backend.close()

    # ------------------------------------------------------------------ checkpoints and summary

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs to continue: the version, the ledger, the queue (retried
        attempts, pending group members), the attempts in flight (as task ids with their attempt
        counts, to queue again), the finished trajectories in the buffer, the staleness gate's
        counts and the throughput counters. Call it between steps."""
        inflight = [a for a in self._inflight.values() if not a.over] + self._stopped
        return {
            "version": self.version,
            "ledger": self.ledger.counts(),
            "failures": list(self.ledger.failures),
            "queue": [a.record() for a in self._queue],
            "inflight": [a.record() for a in inflight],
            "buffered": self.buffer.contents(),
            "histogram": dict(self.gate.histogram),
            "gate_dropped": self.gate.dropped,
            "group_serial": self._group_serial,
            "generated_tokens": self.generated_tokens,
            "trained_action_tokens": self.trained_tokens,
            "trained_sequence_tokens": self.trained_sequence_tokens,
            "wasted": {**self.wasted, "cut": self.waste()["cut"]},
            "lengths": {"finished": dict(self.lengths.finished), "trained": dict(self.lengths.trained)},
            "ledger_offset": self.ledger_log.offset if self.ledger_log is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any], task_of: Callable[[str], Task],
                        lost: list[dict[str, Any]] = ()) -> None:
        """Continue from `state_dict()`'s output: the attempts that were in flight go to the
        front of the queue with their attempt counts (counted `requeued`), the buffered
        trajectories back into the buffer, and each of `lost` (attempts the stop lost, see
        `tiderl.system.ledger.cut_back`) is counted. Call before `start`."""
        self.version = state["version"]
        self.ledger = Ledger(**state["ledger"], failures=list(state["failures"]))
        self._event("resume", step=self.version, counts=self.ledger.counts())
        for e in lost:
            self.ledger.started += 1
            self.ledger.lost += 1
            self._event("lost", **{k: e.get(k) for k in ("task", "group", "attempt", "reason")})
        queue = []
        for r in state["inflight"]:
            self.ledger.requeued += 1
            self._event("requeued", **r, reason=f"in flight at the checkpoint of step {self.version}")
            queue.append(r)
        queue.extend(state["queue"])
        self._queue = deque(_Attempt(task_of(r["task"]), r["group"], r["attempt"]) for r in queue)
        self.buffer.restore(state["buffered"])
        self.gate.outstanding = len(state["buffered"])
        self.gate.histogram.update({int(k): v for k, v in state["histogram"].items()})
        self.gate.dropped = state["gate_dropped"]
        self._group_serial = state["group_serial"]
        self.generated_tokens = state["generated_tokens"]
        # Checkpoints from before the goodput fix hold one count of every token ("trained_tokens").
        self.trained_tokens = state.get("trained_action_tokens", 0)
        self.trained_sequence_tokens = state.get("trained_sequence_tokens", state.get("trained_tokens", 0))
        self.wasted = Counter(state.get("wasted", {}))  # checkpoints before the waste metrics: none
        self.lengths = Lengths(**state.get("lengths", {}))

    def unsettled(self) -> int:
        """Attempts started but not in any ledger bucket (in flight or waiting in the buffer)."""
        return self.ledger.started - self.ledger.settled()

    def summary(self) -> dict[str, Any]:
        """Run totals: the ledger, the staleness histogram, the capacity changes, the backend's
        report."""
        wall = max(time.monotonic() - self._t0, 1e-9)
        return {
            "ledger": {**self.ledger.counts(), "unsettled": self.unsettled()},
            "failures": self.ledger.failures,
            "staleness_histogram": dict(sorted(self.gate.histogram.items())),
            "slot_events": self.slot_events,
            "worker_events": self.worker_events,
            "wall_s": wall,
            "trainer_idle_frac": self._idle.integral() / wall,
            "rollout_idle_frac": self._rollout_idle(),
            "goodput_trajectories_per_s": self.ledger.trained / wall,
            "goodput_tokens_per_s": self.trained_tokens / wall,
            "goodput_tokens_per_s_per_unit": self.trained_tokens / wall / self.settings.resource_units,
            "trained_sequence_tokens_per_s": self.trained_sequence_tokens / wall,
            "generated_tokens_per_s": self.generated_tokens / wall,
            "trained_action_tokens": self.trained_tokens,
            "trained_sequence_tokens": self.trained_sequence_tokens,
            "critic_lag_histogram": dict(sorted(self.critic_lag_histogram.items())),
            "waste": self.waste(final=True),
            "lengths": self.lengths.metrics(),
            "backend": self.backend.report(),
        }

    # ------------------------------------------------------------------ rollout side

    def _next_attempt(self) -> _Attempt:
        if not self._queue:
            task = self.next_task()
            group = f"{task.task_id}#{self._group_serial}"
            self._group_serial += 1
            for _ in range(self.settings.group_size):
                self._queue.append(_Attempt(task, group))
        return self._queue.popleft()

    def _update_gauges(self) -> None:
        self._active.set(len(self._inflight))
        free = len(self._inflight) < self.slots
        self._blocked.set(float(free and not self.gate.may_start(self.version, self.backend.version, self._new_group())))

    def _new_group(self) -> int:
        """The size of the group the next attempt starts: 0 when it belongs to one already started."""
        return 0 if self._queue else self.settings.group_size

    async def _fill_loop(self) -> None:
        while True:
            while len(self._inflight) < self.slots and self.gate.may_start(self.version, self.backend.version,
                                                                           self._new_group()):
                attempt = self._next_attempt()
                attempt.start_version = self.backend.version
                self.gate.started()
                self.ledger.started += 1
                self._event("started", **attempt.record(), version=attempt.start_version)
                task = asyncio.create_task(self._play(attempt), name=f"episode {attempt.group_id}")
                self._inflight[task] = attempt
                task.add_done_callback(self._episode_done)
            self._update_gauges()
            self._changed.clear()
            await self._changed.wait()

    async def _play(self, attempt: _Attempt) -> None:
        try:
            result = await self.backend.run_episode(attempt.task, attempt.group_id)
        except asyncio.CancelledError:
            raise
        except CapacityRemoved as exc:  # an elastic shrink removed its worker: queued again, no retry used
            attempt.over = True
            self._requeue(attempt, "requeued", str(exc))
            self._changed.set()
            return
        except Exception as exc:  # noqa: BLE001 - a worker failure costs one attempt, not the run
            attempt.over = True
            self._fault(attempt, f"rollout worker: {exc!r}")
            return
        attempt.over = True
        trajectories = result if isinstance(result, list) else [result]
        self.generated_tokens += sum(t.num_action_tokens for t in trajectories)
        problem = _attempt_problem(trajectories, self.settings.group_size)
        if problem:
            self.wasted["faulted"] += sum(t.num_action_tokens for t in trajectories)
            self._fault(attempt, problem)
            return
        self.lengths.finished.update(t.num_action_tokens for t in trajectories)
        self._failed_in_a_row = 0
        for i, trajectory in enumerate(trajectories):
            if i:  # each further trajectory of the attempt is accounted for as one more start
                self.gate.started()
                self.ledger.started += 1
                self._event("started", **attempt.record(), version=attempt.start_version,
                            reason=f"trajectory {i + 1} of {len(trajectories)} of the attempt")
            try:
                shaped = self.shape(trajectory)
            except Exception as exc:  # noqa: BLE001 - a shaping bug must end the run with its cause, not a timeout
                self.buffer.abort(RuntimeError(f"shaping the reward of task {attempt.task.task_id} failed: {exc}"))
                raise
            self.buffer.put(shaped)

    def _event(self, ev: str, **fields: Any) -> None:
        if self.ledger_log is not None:
            self.ledger_log.append({"ev": ev, **fields})

    def _fault(self, attempt: _Attempt, reason: str) -> None:
        """Queue the task again, or count it as failed once its retries are used up."""
        if attempt.attempt < self.settings.max_task_retries:
            self._requeue(attempt, "retried", reason, retry=1)
            logger.warning("task %s attempt %d failed (%s); retrying", attempt.task.task_id, attempt.attempt, reason)
            return
        self.gate.settled()
        self.ledger.failed += 1
        self.ledger.failures.append({"task_id": attempt.task.task_id, "attempts": attempt.attempt + 1,
                                     "reason": reason})
        self._event("failed", **attempt.record(), reason=reason)
        logger.error("task %s failed after %d attempts: %s", attempt.task.task_id, attempt.attempt + 1, reason)
        self._failed_in_a_row += 1
        if self._failed_in_a_row >= self.settings.batch_size:
            env = f"env.name={self.settings.env_name}" if self.settings.env_name else "the environment"
            self.buffer.abort(RuntimeError(
                f"{self._failed_in_a_row} tasks in a row failed after {attempt.attempt + 1} attempts each "
                f"(system.max_task_retries={self.settings.max_task_retries}) and no episode finished "
                f"cleanly in between: {env} keeps failing. Last: task {attempt.task.task_id}: {reason}. "
                "Fix: the environment's error above (run `tiderl check-env` on it)"))
            self._changed.set()

    def _requeue(self, attempt: _Attempt, bucket: str, reason: str, retry: int = 0) -> None:
        """Queue an attempt's task again, first, counted in ledger `bucket` (retried, restarted or
        requeued); `retry` 1 uses one of its retries."""
        self.gate.settled()
        setattr(self.ledger, bucket, getattr(self.ledger, bucket) + 1)
        self._event(bucket, **attempt.record(), reason=reason)
        self._queue.appendleft(_Attempt(attempt.task, attempt.group_id, attempt.attempt + retry))

    def _settle(self, bucket: str, group: list[Trajectory]) -> None:
        """Count finished trajectories in ledger `bucket` (trained, filtered or dropped_stale)."""
        self.gate.settled(len(group))
        setattr(self.ledger, bucket, getattr(self.ledger, bucket) + len(group))
        if bucket != "trained":
            self.wasted[bucket] += sum(t.num_action_tokens for t in group)
        for t in group:
            self._event(bucket, task=t.task_id, group=t.group_id, version=self.version)
        self._changed.set()

    def _episode_done(self, task: asyncio.Task[None]) -> None:
        attempt = self._inflight.pop(task, None)
        if task.cancelled() and attempt is not None and not self._closing:
            self._requeue(attempt, "restarted", f"new weights (version {self.version})")
        self._changed.set()

    def _restart_older_than(self, version: int) -> None:
        """Cancel the episodes that started on weights older than `version` (they are queued
        again by `_episode_done`)."""
        for task, attempt in list(self._inflight.items()):
            if attempt.start_version < version:
                task.cancel()

    # ------------------------------------------------------------------ the trainer's side of a batch

    def _describe(self) -> str:
        blocker = self.gate.blocker(self.version, self.backend.version, self._new_group())
        return (f"In flight {len(self._inflight)} of {self.slots} slots; trainer version {self.version}, "
                f"engine version {self.backend.version}"
                + (f"; the staleness gate holds new tasks: {blocker}" if blocker else ""))

    async def _take_fresh_batch(self) -> list[Trajectory]:
        """`batch_size` trajectories the gate judges fresh enough (too-stale tokens masked under the
        mask policy); stale ones (whole groups) are dropped."""
        size, g = self.settings.batch_size, self.settings.group_size
        fresh: list[Trajectory] = []
        while len(fresh) < size:
            got = await self.buffer.take(size - len(fresh), self.settings.wait_timeout_s, self._describe)
            for start in range(0, len(got), g):
                group = got[start:start + g]
                masks = [self.gate.judge(t, self.version) for t in group]
                if None not in masks:
                    self.lengths.trained.update(t.num_action_tokens for t in group)
                    self.wasted["masked"] += sum(masks)
                    for t in (t for t, n in zip(group, masks) if n):
                        mask_older(t, self.version - self.gate.bound)
                    fresh.extend(group)
                    continue
                # A group's advantages depend on every member: a stale member spoils it.
                self.gate.dropped += len(masks) - masks.count(None)
                self._settle("dropped_stale", group)
        return fresh

    def _prep_seconds_since_last_step(self) -> float:
        """Seconds the buffer spent on preparations that finished since the previous step."""
        busy = self.buffer.prep_busy
        seconds = sum(end - start for start, end in busy[self._prep_seen:])
        self._prep_seen = len(busy)
        return seconds

    def waste(self, final: bool = False) -> dict[str, float]:
        """Sampled tokens that never train per cause, their sum and its fraction of the sampled
        tokens (docs/metrics.md); `final`: the run stopped, so the buffered ones count too."""
        w = {**self.wasted, "cut": self.wasted["cut"] + getattr(self.backend, "cut_tokens", 0)}
        if final:
            w["unsettled"] = sum(t.num_action_tokens for t in self.buffer.contents() + self._taken)
        total = sum(w.values())
        return {**w, "wasted_tokens": total, "waste_frac": total / max(1, self.generated_tokens + w["cut"])}

    def _rollout_idle(self) -> float:
        slot_area, active_area = self._slots_tw.integral(), self._active.integral()
        return max(0.0, 1.0 - active_area / slot_area) if slot_area > 0 else 0.0

    # ------------------------------------------------------------------ elastic capacity

    def _worker_pool(self) -> Any:
        """The backend when it can add and remove workers over a range (min < max)."""
        low, high = getattr(self.backend, "worker_range", (1, 1))
        return self.backend if low < high else None

    def _attach_worker_pool(self) -> None:
        """With an elastic worker pool, the slots follow the live workers (each serves
        `slots_per_worker` episodes): now, and whenever a worker joins or leaves."""
        pool = self._worker_pool()
        if pool is None:
            return
        spw = pool.slots_per_worker

        def follow(live: int) -> None:
            if live * spw != self.slots:
                self.set_slots(live * spw, f"{live} rollout workers live x {spw} slots each")

        pool.on_live_change = follow
        self.slots = pool.live_workers * spw
        self._slots_tw.set(float(self.slots))

    async def _elastic_loop(self) -> None:
        s = self.settings
        pool = self._worker_pool()
        if pool is not None:  # the unit is a worker
            bounds = capacity_bounds(s.batch_size, s.max_staleness, pool.slots_per_worker, *pool.worker_range)
        elif self.min_slots != self.max_slots:  # the unit is a slot
            bounds = capacity_bounds(s.batch_size, s.max_staleness, 1, max(1, self.min_slots), self.max_slots)
        else:
            return
        memory = Memory()
        t0, idle0, blocked0 = time.monotonic(), self._idle.integral(), self._blocked.integral()
        while True:
            await asyncio.sleep(s.elastic_interval_s)
            t1, idle1, blocked1 = time.monotonic(), self._idle.integral(), self._blocked.integral()
            elapsed = max(t1 - t0, 1e-9)  # the sleep may overrun on a loaded machine
            load = LoadSignals(
                trainer_idle_frac=(idle1 - idle0) / elapsed,
                ready=self.buffer.ready_count,
                gate_blocked_frac=(blocked1 - blocked0) / elapsed,
                batch_size=s.batch_size,
                booting=pool.booting if pool is not None else 0,
            )
            t0, idle0, blocked0 = t1, idle1, blocked1
            units = pool.units if pool is not None else self.slots
            decision = decide(units, bounds, load, memory)
            memory = decision.memory
            if not decision.reason:
                continue
            if pool is not None:
                self.worker_events.append({"t": round(time.monotonic() - self._t0, 3), "version": self.version,
                                           "from": units, "to": decision.units, "reason": decision.reason})
                logger.info("rollout workers %d -> %d: %s", units, decision.units, decision.reason)
                pool.resize(decision.units, decision.reason)
            else:
                self.set_slots(decision.units, decision.reason)

    def set_slots(self, slots: int, reason: str) -> None:
        """Resize the rollout capacity (running episodes above a smaller size finish normally)."""
        event = {"t": round(time.monotonic() - self._t0, 3), "version": self.version,
                 "from": self.slots, "to": slots, "reason": reason}
        self.slot_events.append(event)
        logger.info("rollout slots %d -> %d: %s", self.slots, slots, reason)
        self.slots = slots
        self._slots_tw.set(float(slots))
        self._changed.set()


def _attempt_problem(trajectories: list[Trajectory], group_size: int) -> str:
    """Why an attempt's trajectories cannot train ('' when they can): an environment error, no
    trajectory at all, or several for a group algorithm (whose groups need one per attempt)."""
    if not trajectories:
        return "the attempt gave no trajectory (an external agent that sent no request?)"
    for t in trajectories:
        if t.stop_reason == "error":
            where = t.env_info.get("error_in", "")
            return f"environment{' ' + where if where else ''}: {t.env_info.get('error', '?')}"
    if group_size > 1 and len(trajectories) > 1:
        return (f"the attempt gave {len(trajectories)} trajectories (a session with several segments); "
                f"algo.group_size={group_size} compares one trajectory per attempt")
    return ""


# Trainer metrics that mean the step changed no weights: its trajectories are not goodput.
_SKIP_KEYS = ("nonfinite/skipped_step", "skipped_no_signal", "skipped_no_action_tokens")


def critic_value_lags(batch: list[Trajectory], refreshes: int) -> list[int]:
    """Each trajectory's critic value lag (docs/metrics.md, `critic/lag_*`): `refreshes`, the steps
    since the critic snapshot was made, minus the refresh count the snapshot stamped its values with
    (`annotations["values_version"]`); trajectories without a stamp are left out."""
    return [refreshes - int(t.annotations["values_version"][0]) for t in batch
            if t.annotations.get("values_version")]


def lag_metrics(lags: list[int]) -> dict[str, float]:
    """`critic/lag_mean`, `critic/lag_max` and `critic/lag_<k>` (trajectories of the step whose
    values were k versions behind) for one step; nothing when no value was precomputed."""
    if not lags:
        return {}
    out: dict[str, float] = {"critic/lag_mean": sum(lags) / len(lags), "critic/lag_max": float(max(lags))}
    for lag in sorted(set(lags)):
        out[f"critic/lag_{lag}"] = float(lags.count(lag))
    return out
