"""The asynchronous scheduler: rollout slots and the trainer, each waiting only where the
staleness bound says so.

Three coroutines share one event loop:

- **fill**: keeps up to `slots` episodes running. The moment one finishes, its slot takes the
  next task (a retried task first) if the `StalenessGate` admits it: no batch barrier on the
  rollout side.
- **train**: takes `batch_size` ready trajectories from the `ReadyBuffer` (dropping and
  counting the ones the gate judges too stale), runs the trainer's step on a worker thread,
  bumps the version, hands the weights to the rollout side, verifies them by checksum, and
  settles the batch. In `restart` mode (and always at staleness 0) it then cancels the episodes
  that started on older weights and queues their tasks again.
- **elastic**: every `elastic_interval_s`, measures readiness (did the trainer wait on rollout,
  or rollout on the trainer and the gate?) and resizes the rollout capacity with
  `elastic.decide`: the backend's workers when it can add and remove them (the Ray backend with
  `system.min_workers` < `max_workers`; the slots then follow the live workers), else `slots`
  within [min_slots, max_slots]; each change is logged with its reason.

Everything the scheduler needs from the outside is injected: a task source, a rollout backend
(`run_episode`, `update_weights`, `version`), and a trainer (`step`, `state_dict`). The local
and Ray backends plug in the same way, and the tests drive it with fakes.

Every task attempt ends in exactly one ledger bucket: trained, dropped as stale, failed (its
retries used up), retried (it faulted and went back to the queue), restarted (cancelled by new
weights in restart mode), filtered (its complete group carried no signal, with dynamic
sampling), re-queued (in flight at a checkpoint a run resumed from), lost (started after the
checkpoint a run resumed from: its work was not saved), or still unsettled when the run stops.
Every event is also appended to the ledger file as it happens (`tiderl.system.ledger`), and
`state_dict` / `load_state_dict` carry the schedule through a checkpoint.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from tiderl.envs.protocol import Task
from tiderl.system.buffer import ReadyBuffer
from tiderl.system.elastic import (
    CapacityRemoved,
    LoadSignals,
    Memory,
    capacity_bounds,
    decide,
)
from tiderl.system.staleness import StalenessGate, trajectory_staleness
from tiderl.system.timing import TimeWeighted
from tiderl.types import Trajectory

logger = logging.getLogger(__name__)


class RolloutBackend(Protocol):
    """Where episodes run. `version` is the weight version new tokens are sampled with."""

    @property
    def version(self) -> int: ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def run_episode(self, task: Task, group_id: str) -> Trajectory:
        """Play one episode. Raising means the worker failed (the task is retried)."""
        ...

    async def update_weights(self, state_dict: dict[str, Any], version: int) -> Any:
        """Load weights `version`; returns the checksum of what the workers now hold."""
        ...

    def report(self) -> dict[str, Any]:
        """The backend's part of the run summary (`system.json`)."""
        ...


class TrainerSide(Protocol):
    """The learning side, as the scheduler sees it."""

    def step(self, batch: list[Trajectory], version: int) -> dict[str, float]:
        """One optimizer step on `batch` (the trainer's weights are `version`); blocking."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """The policy weights to hand to the rollout side."""
        ...

    def checksum(self, state_dict: dict[str, Any]) -> Any:
        """What `RolloutBackend.update_weights` must return for these weights."""
        ...


@dataclass
class SchedulerSettings:
    batch_size: int
    max_staleness: int = 0
    partial_rollout: str = "continue"  # or "restart"
    slots: int = 0  # 0 = (max_staleness + 1) * batch_size
    min_slots: int = 0  # 0 = slots
    max_slots: int = 0  # 0 = slots
    elastic_interval_s: float = 2.0
    max_task_retries: int = 2
    wait_timeout_s: float = 600.0
    group_size: int = 1
    env_name: str = ""  # named in the error when every task keeps failing
    resource_units: float = 1.0  # devices the run holds: goodput per resource unit divides by it
    admission: int = 0  # most unsettled trajectories; 0 = (max_staleness + 1) * batch_size

    def initial_slots(self) -> int:
        return self.slots or self.admission or (self.max_staleness + 1) * self.batch_size

    def most_slots(self) -> int:
        """The largest number of episodes that may ever run at once."""
        return max(self.initial_slots(), self.max_slots)

    @classmethod
    def from_config(cls, cfg: Any) -> "SchedulerSettings":
        """The settings a RunConfig gives (`system.*`, the batch size, the algorithm's group size)."""
        s = cfg.system
        return cls(batch_size=cfg.rollout.batch_size, max_staleness=s.max_staleness,
                   partial_rollout=s.partial_rollout, slots=s.slots, min_slots=s.min_slots,
                   max_slots=s.max_slots, elastic_interval_s=s.elastic_interval_s,
                   max_task_retries=s.max_task_retries, wait_timeout_s=s.wait_timeout_s,
                   group_size=cfg.algo.group_size, env_name=cfg.env.name,
                   resource_units=s.resource_units, admission=s.admission)


@dataclass
class Ledger:
    """Where every task attempt went (see the module docstring)."""

    started: int = 0
    trained: int = 0
    dropped_stale: int = 0
    failed: int = 0
    retried: int = 0
    restarted: int = 0
    filtered: int = 0  # complete groups set aside as uninformative (dynamic sampling)
    requeued: int = 0  # in flight at the checkpoint a run resumed from; queued again
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


class Scheduler:
    """Runs rollout and training concurrently for a number of optimizer steps."""

    def __init__(
        self,
        settings: SchedulerSettings,
        next_task: Callable[[], Task],
        rollout: RolloutBackend,
        trainer: TrainerSide,
        buffer: ReadyBuffer,
        on_step: Callable[[int, dict[str, float], list[Trajectory]], None] = lambda *_: None,
        start_version: int = 0,
        shape: Callable[[Trajectory], Trajectory] = lambda t: t,
        trainer_thread_init: Callable[[], None] | None = None,
        trainer_executor: Executor | None = None,
        ledger_log: Any = None,
    ):
        s = settings
        if s.batch_size % s.group_size:
            raise ValueError(f"batch_size={s.batch_size} must be a multiple of group_size={s.group_size}")
        if s.partial_rollout not in ("continue", "restart"):
            raise ValueError(f"partial_rollout={s.partial_rollout!r}: use 'continue' or 'restart'")
        self.settings = s
        self.next_task = next_task
        self.rollout = rollout
        self.trainer = trainer
        self.buffer = buffer
        buffer.on_reject = self._filtered
        self.on_step = on_step
        self.shape = shape  # reward shaping of each finished episode (curiosity), before the buffer
        self.version = start_version
        self.gate = StalenessGate(s.max_staleness, s.batch_size, s.admission)
        self.ledger = Ledger()
        self.slots = s.initial_slots()
        self.min_slots = s.min_slots or self.slots
        self.max_slots = s.max_slots or self.slots
        self.slot_events: list[dict[str, Any]] = []
        self.worker_events: list[dict[str, Any]] = []  # elastic worker-pool decisions
        self._queue: deque[_Attempt] = deque()  # retried/restarted attempts and pending group members
        self._group_serial = 0
        self._inflight: dict[asyncio.Task[None], _Attempt] = {}
        self._stopped: list[_Attempt] = []  # in flight when the run stopped (unsettled)
        self._failed_in_a_row = 0  # tasks failed after their retries, no clean episode between
        self.ledger_log = ledger_log  # LedgerLog (or None): every ledger event, appended as it happens
        self._changed = asyncio.Event()
        # The trainer steps on its own thread (`trainer_thread_init` runs there first, e.g. its torch
        # thread budget), or on a compute thread the caller shares with decoding and preparation.
        self._own_trainer_exec = trainer_executor is None
        self._trainer_exec = trainer_executor or ThreadPoolExecutor(
            1, thread_name_prefix="tiderl-train", initializer=trainer_thread_init)
        # Time accounting (monotonic seconds).
        self._active = TimeWeighted(0.0)
        self._slots_tw = TimeWeighted(float(self.slots))
        self._blocked = TimeWeighted(0.0)
        self._idle = TimeWeighted(0.0)
        self.train_busy: list[tuple[float, float]] = []
        self.generated_tokens = 0
        # Goodput counts the sampled (action) tokens of trained trajectories; the sequence count
        # (prompt and observations included) is what the trainer's passes read, not goodput.
        self.trained_tokens = 0  # action tokens of trained trajectories
        self.trained_sequence_tokens = 0
        self.critic_lag_histogram: dict[int, int] = {}  # run totals of `critic_value_lags`
        self._prep_seen = 0  # preparation intervals already counted in `time/prep_s`
        self._start_version = start_version  # the critic snapshot counts its refreshes from here
        self._t0 = self._last_end = 0.0
        self._stopping = False

    # ------------------------------------------------------------------ public

    async def run(self, steps: int, stop: Callable[[dict[str, float]], bool] | None = None
                  ) -> list[dict[str, float]]:
        """Train `steps` optimizer steps (fewer if `stop(metrics)` says so after a step); returns
        each step's metrics. Cancels what is still in flight at the end (counted as unsettled,
        never silently lost)."""
        self._t0 = self._last_end = time.monotonic()
        self._start_version = self.version  # a resumed schedule's version is set by now
        history: list[dict[str, float]] = []
        self._attach_worker_pool()
        self.buffer.start()
        fill = asyncio.create_task(self._fill_loop(), name="tiderl-fill")
        elastic = asyncio.create_task(self._elastic_loop(), name="tiderl-elastic")
        try:
            for _ in range(steps):
                history.append(await self._train_one())
                if stop is not None and stop(history[-1]):
                    break
                if fill.done():  # a bug in the fill loop must not turn into a timeout
                    fill.result()
        finally:
            self._stopping = True
            for task in (fill, elastic):
                task.cancel()
            await asyncio.gather(fill, elastic, return_exceptions=True)
            inflight = list(self._inflight)
            self._stopped = [a for a in self._inflight.values() if not a.over]
            for task in inflight:
                task.cancel()
            await asyncio.gather(*inflight, return_exceptions=True)
            await self.buffer.close()
            if self._own_trainer_exec:
                self._trainer_exec.shutdown(wait=True)
        return history

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs to continue this schedule: the version, the ledger, the
        queue (retried attempts, pending group members), the attempts in flight (as task ids with
        their attempt counts, to queue again), the finished trajectories in the buffer, the
        staleness gate's counts and the throughput counters. Call it between steps."""
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
            "ledger_offset": self.ledger_log.offset if self.ledger_log is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any], task_of: Callable[[str], Task],
                        lost: list[dict[str, Any]] = ()) -> None:
        """Continue from `state_dict()`'s output: the attempts that were in flight go to the
        front of the queue with their attempt counts (counted `requeued`), the buffered
        trajectories back into the buffer, and each of `lost` (attempts the stop lost, see
        `tiderl.system.ledger.cut_back`) is counted. Call before `run`."""
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

    def unsettled(self) -> int:
        """Attempts started but not in any ledger bucket (in flight or waiting in the buffer)."""
        return self.ledger.started - self.ledger.settled()

    def summary(self) -> dict[str, Any]:
        """Run totals: the ledger, the staleness histogram, the slot changes."""
        wall = time.monotonic() - self._t0
        return {
            "ledger": {**self.ledger.counts(), "unsettled": self.unsettled()},
            "failures": self.ledger.failures,
            "staleness_histogram": dict(sorted(self.gate.histogram.items())),
            "slot_events": self.slot_events,
            "worker_events": self.worker_events,
            "wall_s": wall,
            "trainer_idle_frac": self._idle.integral() / max(wall, 1e-9),
            "rollout_idle_frac": self._rollout_idle(self._slots_tw.integral(), self._active.integral()),
            "goodput_trajectories_per_s": self.ledger.trained / max(wall, 1e-9),
            "goodput_tokens_per_s": self.trained_tokens / max(wall, 1e-9),
            "goodput_tokens_per_s_per_unit": self.trained_tokens / max(wall, 1e-9) / self.settings.resource_units,
            "trained_sequence_tokens_per_s": self.trained_sequence_tokens / max(wall, 1e-9),
            "generated_tokens_per_s": self.generated_tokens / max(wall, 1e-9),
            "trained_action_tokens": self.trained_tokens,
            "trained_sequence_tokens": self.trained_sequence_tokens,
            "critic_lag_histogram": dict(sorted(self.critic_lag_histogram.items())),
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
        self._blocked.set(float(free and not self.gate.may_start(self.version, self.rollout.version)))

    async def _fill_loop(self) -> None:
        while True:
            while len(self._inflight) < self.slots and self.gate.may_start(self.version, self.rollout.version):
                attempt = self._next_attempt()
                attempt.start_version = self.rollout.version
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
            trajectory = await self.rollout.run_episode(attempt.task, attempt.group_id)
        except asyncio.CancelledError:
            raise
        except CapacityRemoved as exc:  # an elastic shrink removed its worker: queued again, no retry used
            attempt.over = True
            self._requeue(attempt, str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - a worker failure costs one attempt, not the run
            attempt.over = True
            self._fault(attempt, f"rollout worker: {exc!r}")
            return
        attempt.over = True
        self.generated_tokens += trajectory.num_action_tokens
        if trajectory.stop_reason == "error":
            where = trajectory.env_info.get("error_in", "")
            self._fault(attempt, f"environment{' ' + where if where else ''}: {trajectory.env_info.get('error', '?')}")
            return
        self._failed_in_a_row = 0
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
        self.gate.settled()
        if attempt.attempt < self.settings.max_task_retries:
            self.ledger.retried += 1
            self._event("retried", **attempt.record(), reason=reason)
            self._queue.appendleft(_Attempt(attempt.task, attempt.group_id, attempt.attempt + 1))
            logger.warning("task %s attempt %d failed (%s); retrying", attempt.task.task_id, attempt.attempt, reason)
        else:
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

    def _requeue(self, attempt: _Attempt, reason: str) -> None:
        """Queue an attempt's task again with the same attempt count (counted `requeued`)."""
        self.gate.settled()
        self.ledger.requeued += 1
        self._event("requeued", **attempt.record(), reason=reason)
        self._queue.appendleft(_Attempt(attempt.task, attempt.group_id, attempt.attempt))
        self._changed.set()

    def _filtered(self, group: list[Trajectory]) -> None:
        self.gate.settled(len(group))
        self.ledger.filtered += len(group)
        for t in group:
            self._event("filtered", task=t.task_id, group=t.group_id, version=self.version)
        self._changed.set()

    def _episode_done(self, task: asyncio.Task[None]) -> None:
        attempt = self._inflight.pop(task, None)
        if task.cancelled() and attempt is not None and not self._stopping:
            self.gate.settled()
            self.ledger.restarted += 1
            self._event("restarted", **attempt.record(), reason=f"new weights (version {self.version})")
            self._queue.appendleft(_Attempt(attempt.task, attempt.group_id, attempt.attempt))
        self._changed.set()

    # ------------------------------------------------------------------ training side

    def _describe(self) -> str:
        blocker = self.gate.blocker(self.version, self.rollout.version)
        return (f"In flight {len(self._inflight)} of {self.slots} slots; trainer version {self.version}, "
                f"engine version {self.rollout.version}"
                + (f"; the staleness gate holds new tasks: {blocker}" if blocker else ""))

    async def _take_fresh_batch(self) -> list[Trajectory]:
        """`batch_size` trajectories the gate judges fresh; stale ones (whole groups) are dropped."""
        size, g = self.settings.batch_size, self.settings.group_size
        fresh: list[Trajectory] = []
        while len(fresh) < size:
            got = await self.buffer.take(size - len(fresh), self.settings.wait_timeout_s, self._describe)
            for start in range(0, len(got), g):
                group = got[start:start + g]
                verdicts = [self.gate.is_fresh(t, self.version) for t in group]
                if all(verdicts):
                    fresh.extend(group)
                else:
                    # A group's advantages depend on every member: a stale member spoils it.
                    self.gate.dropped += verdicts.count(True)
                    self.gate.settled(len(group))
                    self.ledger.dropped_stale += len(group)
                    for t in group:
                        self._event("dropped_stale", task=t.task_id, group=t.group_id, version=self.version)
                    self._changed.set()
        return fresh

    async def _train_one(self) -> dict[str, float]:
        loop = asyncio.get_running_loop()
        timeout = self.settings.wait_timeout_s
        t_wait = time.monotonic()
        self._idle.set(1.0)
        batch = await self._take_fresh_batch()
        self._idle.set(0.0)
        # Read before the step: the snapshot has been refreshed once per step since the start.
        lags = critic_value_lags(batch, self.version - self._start_version)
        t_train = time.monotonic()
        metrics = dict(await loop.run_in_executor(self._trainer_exec, self.trainer.step, batch, self.version))
        t_sync = time.monotonic()
        self.train_busy.append((t_train, t_sync))
        self.version += 1
        state = self.trainer.state_dict()
        try:
            held = await asyncio.wait_for(self.rollout.update_weights(state, self.version), timeout)
        except TimeoutError:
            raise TimeoutError(f"weight sync to version {self.version} took longer than "
                               f"system.wait_timeout_s={timeout}s") from None
        sent = self.trainer.checksum(state)
        if held != sent:
            raise RuntimeError(f"weight sync to version {self.version} failed: the rollout side holds "
                               f"checksum {held!r}, the trainer sent {sent!r}")
        self.gate.settled(len(batch))
        self.ledger.trained += len(batch)
        for t in batch:
            self._event("trained", task=t.task_id, group=t.group_id, version=self.version)
        if not _skipped(metrics):
            self.trained_tokens += sum(t.num_action_tokens for t in batch)
            self.trained_sequence_tokens += sum(len(t.tokens) for t in batch)
        for lag in lags:
            self.critic_lag_histogram[lag] = self.critic_lag_histogram.get(lag, 0) + 1
        # At max_staleness=0 an episode still running on the old weights could never train: restart
        # it now (only an over-provisioned admission leaves any in flight there).
        if self.settings.partial_rollout == "restart" or self.settings.max_staleness == 0:
            self._restart_older_than(self.version)
        self._changed.set()
        t_end = time.monotonic()
        metrics.update(self._step_metrics(batch, t_wait, t_train, t_sync, t_end))
        metrics.update(lag_metrics(lags))
        self._last_end = t_end
        self.on_step(self.version, metrics, batch)
        return metrics

    def _prep_seconds_since_last_step(self) -> float:
        """Seconds the buffer spent on preparations that finished since the previous step."""
        busy = self.buffer.prep_busy
        seconds = sum(end - start for start, end in busy[self._prep_seen:])
        self._prep_seen = len(busy)
        return seconds

    def _restart_older_than(self, version: int) -> None:
        """Cancel the episodes that started on weights older than `version` (they are queued
        again by `_episode_done`)."""
        for task, attempt in list(self._inflight.items()):
            if attempt.start_version < version:
                task.cancel()

    def _rollout_idle(self, slot_area: float, active_area: float) -> float:
        return max(0.0, 1.0 - active_area / slot_area) if slot_area > 0 else 0.0

    def _step_metrics(self, batch: list[Trajectory], t_wait: float, t_train: float, t_sync: float,
                      t_end: float) -> dict[str, float]:
        wall = t_end - self._t0
        # The batch was trained from version - 1: the same measure the gate judged it by.
        staleness = [trajectory_staleness(t.policy_version, self.version - 1) for t in batch]
        return {
            "policy_version": self.version,
            "step_s": t_end - self._last_end,
            "time/wait_batch_s": t_train - t_wait,
            "time/train_s": t_sync - t_train,
            "time/sync_s": t_end - t_sync,
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
            "system/trainer_idle_frac": self._idle.integral() / max(wall, 1e-9),
            "system/rollout_idle_frac": self._rollout_idle(self._slots_tw.integral(), self._active.integral()),
            "throughput/goodput_trajectories_per_s": self.ledger.trained / max(wall, 1e-9),
            "throughput/goodput_tokens_per_s": self.trained_tokens / max(wall, 1e-9),
            "throughput/goodput_tokens_per_s_per_unit":
                self.trained_tokens / max(wall, 1e-9) / self.settings.resource_units,
            "throughput/trained_sequence_tokens_per_s": self.trained_sequence_tokens / max(wall, 1e-9),
            "throughput/generated_tokens_per_s": self.generated_tokens / max(wall, 1e-9),
            "system/generated_tokens": self.generated_tokens,
            "system/trained_action_tokens": self.trained_tokens,
            "system/trained_sequence_tokens": self.trained_sequence_tokens,
            "time/prep_s": self._prep_seconds_since_last_step(),
        }

    # ------------------------------------------------------------------ elastic capacity

    def _worker_pool(self) -> Any:
        """The rollout backend when it can add and remove workers over a range (min < max)."""
        low, high = getattr(self.rollout, "worker_range", (1, 1))
        return self.rollout if low < high else None

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


# Trainer metrics that mean the step changed no weights: its trajectories are not goodput.
_SKIP_KEYS = ("nonfinite/skipped_step", "skipped_no_signal", "skipped_no_action_tokens")


def _skipped(metrics: dict[str, float]) -> bool:
    return any(metrics.get(k) for k in _SKIP_KEYS)


def critic_value_lags(batch: list[Trajectory], refreshes: int) -> list[int]:
    """How many critic versions behind the critic this step trains the precomputed values of each
    trajectory are. `refreshes` is the number of steps (one critic update and one snapshot refresh
    each) since the critic snapshot was made; the snapshot stamps the values it computes with its
    refresh count then (`annotations["values_version"]`, see
    `tiderl.train.annotate.CriticSnapshot`), so the lag is the difference: 0 = the values came from
    the very weights the step starts from. Trajectories without a stamp (values computed in the
    step itself, or by a remote critic) are left out."""
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
