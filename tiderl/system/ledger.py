"""The ledger on disk (one JSON line per task attempt event, appended as it happens; how a resume
cuts it back: docs/architecture.md, "Checkpoints and resume"), and `Lengths`, the tally of finished
and trained episode lengths (docs/metrics.md, "Waste and length bias").
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any


class LedgerLog:
    """Appends ledger events to `path`, one flushed JSON line each (a SIGKILL loses none that
    were appended; the OS holds the written bytes)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a")
        self.offset = self._file.tell()

    def append(self, event: dict[str, Any]) -> None:
        closed = self._file.closed  # e.g. the final checkpoint, after the pool stopped
        if closed:
            self._file = self.path.open("a")
        self._file.write(json.dumps(event) + "\n")
        self._file.flush()
        self.offset = self._file.tell()
        if closed:
            self._file.close()

    def close(self) -> None:
        self._file.close()


def cut_back(path: str | Path, offset: int, step: int, checkpoint: str) -> list[dict[str, Any]]:
    """Cut a ledger file back to `offset` (its length when checkpoint `step` was written) and
    return one `lost` event per attempt that started after it. The cut lines are kept beside it
    in `ledger.cut_at_step_<step>.jsonl`."""
    p = Path(path)
    if not p.is_file() or offset > p.stat().st_size:
        return []
    with p.open("rb") as f:
        f.seek(offset)
        tail = f.read()
    if tail:
        p.with_name(f"ledger.cut_at_step_{step}.jsonl").write_bytes(tail)
    with p.open("r+b") as f:
        f.truncate(offset)
    lost = []
    for line in tail.decode("utf-8", "replace").splitlines():
        try:
            e = json.loads(line)
        except json.JSONDecodeError:
            continue
        if e.get("ev") == "started":
            lost.append({"ev": "lost", "task": e.get("task"), "group": e.get("group"),
                         "attempt": e.get("attempt"),
                         "reason": f"started after checkpoint {checkpoint} (step {step}) and the run stopped "
                                   "before the next one: its work was not saved; the resumed run draws its "
                                   "tasks again from the checkpointed task stream"})
    return lost



class Lengths:
    """Sampled tokens per episode -> episodes, of the episodes that finished (trained or not) and
    of those trained; `metrics()` compares them (docs/metrics.md, "Waste and length bias")."""

    def __init__(self, finished: dict[int, int] | None = None, trained: dict[int, int] | None = None):
        self.finished = Counter({int(k): v for k, v in (finished or {}).items()})
        self.trained = Counter({int(k): v for k, v in (trained or {}).items()})

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, tally in (("trained", self.trained), ("finished", self.finished)):
            out[f"length/{name}_mean"] = sum(k * v for k, v in tally.items()) / max(1, sum(tally.values()))
            out[f"length/{name}_p50"], out[f"length/{name}_p90"] = quantile(tally, 0.5), quantile(tally, 0.9)
        out["length/ks_d"], out["length/ks_p"] = ks_two_sample(self.trained, self.finished)
        return out


def quantile(tally: Counter[int], q: float) -> float:
    """The nearest-rank `q` quantile of a tally (value -> count); 0 when empty."""
    rank, seen = max(1, math.ceil(q * sum(tally.values()))), 0
    for value in sorted(tally):
        seen += tally[value]
        if seen >= rank:
            return float(value)
    return 0.0


def ks_two_sample(a: Counter[int], b: Counter[int]) -> tuple[float, float]:
    """Kolmogorov-Smirnov's two-sample D (the largest gap between the empirical CDFs of tallies
    `a` and `b`) and its asymptotic p-value Q((sqrt(e) + 0.12 + 0.11 / sqrt(e)) D), e = nm/(n+m),
    Q(x) = 2 sum_{j>=1} (-1)^(j-1) exp(-2 j^2 x^2) (Numerical Recipes' `kstwo`); (0, 1) if one is empty."""
    n, m = sum(a.values()), sum(b.values())
    d = ca = cb = 0.0
    for value in sorted(a.keys() | b.keys()) if n and m else ():
        ca, cb = ca + a[value], cb + b[value]
        d = max(d, abs(ca / n - cb / m))
    x = d and (math.sqrt(n * m / (n + m)) + 0.12 + 0.11 / math.sqrt(n * m / (n + m))) * d
    if x < 0.05:  # Q is 1 to many digits there (and the series converges slowly)
        return d, 1.0
    return d, min(1.0, max(0.0, sum(2 * (-1) ** (j - 1) * math.exp(-2 * j * j * x * x) for j in range(1, 101))))
