"""The Ray backend's options (`system.options.*` with `system.backend=ray`), with their checks:
free of Ray and torch, so loading a config imports neither (`tiderl.registry.BACKEND_OPTIONS`;
`tiderl.system.ray_backend.RayRollout.Options`). docs/ray.md and docs/elastic.md."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from tiderl.options import need, opt


@dataclass
class RayOptions:
    """Rollout workers as Ray actors: the cluster, the workers and their elastic range."""

    former_keys: ClassVar[dict[str, str]] = {
        "system.ray_address": "address", "system.ray_workers": "workers", "system.ray_remote_critic": "remote_critic",
        "system.min_workers": "min_workers", "system.max_workers": "max_workers",
        "system.slots_per_worker": "slots_per_worker", "system.worker_drain_s": "worker_drain_s"}

    address: str = opt("", "Ray cluster to join ('' = start a local one; 'auto', 'ray://host:10001', 'host:6379').")
    workers: int = opt(1, "Rollout worker actors at start (each runs its own engine).")
    remote_critic: bool = opt(False, "Compute critic values in a Ray actor instead of the driver.")
    min_workers: int = opt(0, "Elastic: fewest rollout workers (0 = workers: no shrinking).")
    max_workers: int = opt(0, "Elastic: most rollout workers (0 = workers: no growing).")
    slots_per_worker: int = opt(0, "Elastic: episodes each worker serves at once; the slots follow the live workers "
                                "(0 = the starting slots / workers, rounded up).")
    worker_drain_s: float = opt(10.0, "Elastic: seconds a removed worker may finish its episodes before the rest are "
                                "cancelled and their tasks queued again (counted `requeued`).")

    @property
    def elastic(self) -> bool:
        """Whether the worker count may change (min_workers < max_workers)."""
        return (self.min_workers or self.workers) != (self.max_workers or self.workers)

    def check(self, cfg: Any) -> None:
        need(self.workers >= 1, "workers", "must be >= 1", "use 1")
        need(min(self.min_workers, self.max_workers, self.slots_per_worker) >= 0, "min_workers",
             "min_workers, max_workers and slots_per_worker must be >= 0", "use 0 for the defaults")
        low, high = self.min_workers or self.workers, self.max_workers or self.workers
        need(low <= self.workers <= high, "workers",
             f"{self.workers} is outside [min_workers, max_workers] = [{low}, {high}]", "start within the elastic range")
        need(self.worker_drain_s >= 0, "worker_drain_s", "must be >= 0", "use 10")

    def unread(self, cfg: Any) -> dict[str, str]:
        why = "the Ray workers are fixed (system.options.min_workers and max_workers give no range)"
        return {} if self.elastic else dict.fromkeys(("slots_per_worker", "worker_drain_s"), why)
