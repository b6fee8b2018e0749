"""The staleness rule, in one place: which tasks may start and which trajectories may train.

Versions: the trainer's version `v` is the number of optimizer steps it has taken (its weights
are version `v`); the engine's version is the version of the weights it samples with; every
sampled token carries the engine version that sampled it (`Trajectory.policy_version`).

With N = `max_staleness` and B = the batch size (trajectories per optimizer step):

- **Staleness of a trajectory** taken into the batch of the step that turns version `v` into
  `v + 1`:  `s = v - min(version of its sampled tokens)`. It trains iff `s <= N`; otherwise
  it is dropped and counted. A trajectory with no sampled token has staleness 0.
- **Admission** of a new task: allowed iff
      `outstanding < (N + 1) * B`   and   `v - engine_version <= N`,
  where `outstanding` counts the trajectories started and not yet settled (in flight, finished
  and waiting, or in the batch being trained). Settling = trained (after the step and the
  weight sync), dropped as stale, or failed.

The drop rule is the guarantee, admission keeps drops rare (why both: docs/architecture.md,
"The staleness rule"). N = 0 is synchronous on-policy training.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from tiderl.types import NO_VERSION, Trajectory


def trajectory_staleness(policy_versions: Iterable[int], trainer_version: int) -> int:
    """`trainer_version - min(sampled token versions)`; 0 when no token was sampled."""
    sampled = [v for v in policy_versions if v != NO_VERSION]
    if not sampled:
        return 0
    return trainer_version - min(sampled)


class StalenessGate:
    """Admission control and the drop rule for a bound of `max_staleness` versions.

    The gate holds no clock and no threads: the pool tells it what happened (`started`,
    `settled`) and asks it questions (`may_start`, `is_fresh`). Versions come from the
    caller, so tests can drive it with a fake version source.
    """

    def __init__(self, max_staleness: int, batch_size: int, admission: int = 0):
        if max_staleness < 0:
            raise ValueError(f"max_staleness={max_staleness} must be >= 0 (0 = synchronous)")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        self.max_staleness = max_staleness
        self.batch_size = batch_size
        self.admission = admission  # 0 = (N + 1) * B; more over-provisions (the drop rule still holds)
        self.outstanding = 0
        self.histogram: Counter[int] = Counter()  # staleness of every trajectory judged
        self.dropped = 0

    @property
    def capacity(self) -> int:
        """Most trajectories that may be unsettled at once: (N + 1) * B unless `admission` is set."""
        return self.admission or (self.max_staleness + 1) * self.batch_size

    def may_start(self, trainer_version: int, engine_version: int) -> bool:
        """True iff a new task may start now (see the module docstring for the rule)."""
        return (self.outstanding < self.capacity
                and trainer_version - engine_version <= self.max_staleness)

    def blocker(self, trainer_version: int, engine_version: int) -> str:
        """Why `may_start` is False ('' when it is True), for logs and timeout messages."""
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

    def is_fresh(self, trajectory: Trajectory, trainer_version: int) -> bool:
        """Judge a trajectory for the step that starts from `trainer_version`; records its
        staleness in `histogram` and counts it in `dropped` when it is too old."""
        s = trajectory_staleness(
            (v for v, m in zip(trajectory.policy_version, trajectory.loss_mask) if m), trainer_version
        )
        self.histogram[s] += 1
        if s > self.max_staleness:
            self.dropped += 1
            return False
        return True
