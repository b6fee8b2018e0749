"""The staleness rule, in one place: which tasks may start (`StalenessGate.may_start`: admission
and the drain of the run's end) and which trajectories may train (`too_stale`: drop or mask). The
rule, its formulas and why both halves are needed: docs/architecture.md, "The staleness rule" and
"Stale policies"."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from tiderl.options import need, opt
from tiderl.types import NO_VERSION, Trajectory

STALE_POLICIES = ("drop", "mask")


@dataclass
class StaleOptions:
    """`system.stale`: what trains of an episode with sampled tokens more than `system.max_staleness
    + slack` versions old (docs/architecture.md, "The staleness rule"; measured in docs/simulate.md
    and docs/benchmarks.md, "Stale policies")."""

    replaced_keys: ClassVar[dict[str, str]] = {"bound": "was replaced by system.stale.slack, the versions beyond "
        "system.max_staleness a trained token may lag. Fix: slack = bound - max_staleness, e.g. system.stale.slack=2"}

    policy: str = opt("mask", "mask: the episode trains with its sampled tokens older than the bound masked out "
                      "(loss_mask 0), so long episodes are not thrown away; dropped only when every sampled token is "
                      "too old. drop: an episode with any token older than the bound is dropped (and counted).",
                      STALE_POLICIES)
    slack: int = opt(2, "Versions beyond system.max_staleness (which bounds admission) a trained token may lag: a long "
                     "episode admitted at the bound keeps its tokens that much longer. drop with 0 is the former rule.")
    drain: bool = opt(True, "Near the end of the run, start a task only if the steps left (train.steps) can "
                      "train it: the run ends without episodes in flight that no step would train (their tokens "
                      "would be waste). The last steps overlap less rollout with training.")

    def check(self, cfg: Any) -> None:
        need(self.slack >= 0, "slack", f"is {self.slack}", "use 0 or more, e.g. 2")

    def unread(self, cfg: Any) -> dict[str, str]:
        why = "at system.max_staleness=0 no trajectory mixes versions (episodes on old weights restart)"
        unread = {} if cfg.system.max_staleness > 0 else {"policy": why, "slack": why}
        if cfg.system.max_staleness == 0 and not cfg.system.admission:
            unread["drain"] = "at staleness 0 without system.admission no more than a batch is ever in flight"
        return unread


def too_stale(counts: Mapping[int, int], trainer_version: int, bound: int, policy: str = "drop") -> int | None:
    """The rule (docs/architecture.md) for a trajectory whose sampled tokens are `counts` (version ->
    tokens), taken by the step from `trainer_version`: how many of its tokens to mask (0: it trains
    whole), or None: drop it. The pool and the simulator (`tiderl/lab/simulate.py`) both call it."""
    oldest = trainer_version - bound
    if min(counts, default=oldest) >= oldest:
        return 0
    stale = sum(n for v, n in counts.items() if v < oldest)
    return stale if policy == "mask" and stale < sum(counts.values()) else None


def trajectory_staleness(policy_versions: Iterable[int], trainer_version: int) -> int:
    """`trainer_version - min(sampled token versions)`; 0 when no token was sampled."""
    sampled = [v for v in policy_versions if v != NO_VERSION]
    if not sampled:
        return 0
    return trainer_version - min(sampled)


class StalenessGate:
    """Admission control for a bound of `max_staleness` versions, and the rule for what trains
    (`bound` versions, 0 = `max_staleness`; under `policy`).

    The gate holds no clock and no threads: the pool tells it what happened (`started`,
    `settled`) and asks it questions (`may_start`, `judge`). Versions come from the
    caller, so tests can drive it with a fake version source.
    """

    def __init__(self, max_staleness: int, batch_size: int, admission: int = 0, policy: str = "drop",
                 bound: int = 0, run_steps: int = 0):
        if max_staleness < 0:
            raise ValueError(f"max_staleness={max_staleness} must be >= 0 (0 = synchronous)")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        self.max_staleness = max_staleness
        self.batch_size = batch_size
        self.admission = admission  # 0 = (N + 1) * B; more over-provisions (the drop rule still holds)
        if policy not in STALE_POLICIES:
            raise ValueError(f"stale policy {policy!r}: use one of {', '.join(STALE_POLICIES)}")
        self.policy = policy
        self.bound = bound or max_staleness
        if self.bound < max_staleness:
            raise ValueError(f"stale bound {bound} is below max_staleness={max_staleness}")
        self.run_steps = run_steps  # > 0: admission drains the run's end (system.stale.drain)
        self.outstanding = 0
        self.histogram: Counter[int] = Counter()  # staleness of every trajectory judged
        self.dropped = 0

    @property
    def capacity(self) -> int:
        """Most trajectories that may be unsettled at once: (N + 1) * B unless `admission` is set."""
        return self.admission or (self.max_staleness + 1) * self.batch_size

    def may_start(self, trainer_version: int, engine_version: int, group_size: int = 1) -> bool:
        """True iff a new task may start now (docs/architecture.md, "The staleness rule"); `group_size`
        is 0 for an attempt of a group already started (or a retry), which the drain rule never holds."""
        return (self.outstanding < self.capacity
                and trainer_version - engine_version <= self.max_staleness
                and self._steps_left_can_train(trainer_version, group_size))

    def _steps_left_can_train(self, trainer_version: int, group_size: int) -> bool:
        return (not self.run_steps or not group_size
                or self.outstanding + group_size <= (self.run_steps - trainer_version) * self.batch_size)

    def blocker(self, trainer_version: int, engine_version: int, group_size: int = 1) -> str:
        """Why `may_start` is False ('' when it is True), for logs and timeout messages."""
        if not self._steps_left_can_train(trainer_version, group_size):
            return (f"{self.outstanding} trajectories unsettled fill the {self.run_steps - trainer_version} "
                    "steps left of the run (system.stale.drain)")
        if self.outstanding >= self.capacity:
            return (f"{self.outstanding} trajectories unsettled, the bound allows "
                    + (f"system.admission = {self.capacity}" if self.admission
                       else f"(max_staleness+1) x batch = {self.capacity}"))
        if trainer_version - engine_version > self.max_staleness:
            return (f"engine weights are version {engine_version}, the trainer is at "
                    f"{trainer_version}: more than max_staleness={self.max_staleness} behind")
        return ""

    def started(self, n: int = 1) -> None:
        """`n` tasks started."""
        self.outstanding += n

    def settled(self, n: int = 1) -> None:
        """`n` started tasks left the pipeline (trained, dropped, failed or cancelled)."""
        if n > self.outstanding:
            raise RuntimeError(f"settling {n} trajectories but only {self.outstanding} are outstanding")
        self.outstanding -= n

    def judge(self, trajectory: Trajectory, trainer_version: int) -> int | None:
        """`too_stale` for a trajectory taken by the step from `trainer_version`; records its
        staleness in `histogram` and counts it in `dropped` when it is dropped (None)."""
        counts = Counter(v for v, m in zip(trajectory.policy_version, trajectory.loss_mask) if m and v != NO_VERSION)
        self.histogram[trainer_version - min(counts, default=trainer_version)] += 1
        masked = too_stale(counts, trainer_version, self.bound, self.policy)
        self.dropped += masked is None
        return masked


def mask_older(trajectory: Trajectory, oldest: int) -> None:
    """Take the sampled tokens of `trajectory` older than version `oldest` out of the loss."""
    trajectory.loss_mask = [0 if m and NO_VERSION < v < oldest else m
                           for m, v in zip(trajectory.loss_mask, trajectory.policy_version)]
