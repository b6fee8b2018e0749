"""The ledger on disk: one JSON line per task attempt event, appended as it happens.

`system.json` summarises the ledger at the end of a run; this file is the ledger *while* the run
goes, so a run killed with SIGKILL still has one. Each line is one event:

    {"ev": "started", "task": id, "group": group id, "attempt": n, "version": v}
    {"ev": "trained" | "dropped_stale" | "filtered", "task": id, "group": group id, "version": v}
    {"ev": "retried" | "failed" | "restarted" | "requeued", "task": id, "group": ..., "attempt": n,
     "reason": why}
    {"ev": "lost", "task": id, "group": ..., "attempt": n, "reason": why}
    {"ev": "checkpoint", "step": k, "path": dir}
    {"ev": "resume", "step": k, "checkpoint": dir, "counts": {...}}

A `lost` line stands for an attempt that started and was lost: a resume cuts the file back to
its checkpoint (the killed run's later lines describe work whose weights were never saved) and
writes one `lost` line, with the reason, per attempt the cut removed a `started` line of. A
`resume` line carries the counts the checkpoint restored, so replaying the file gives the same
counts as the pool's ledger (`tests/test_checkpoint_resume.py` checks both).
"""

from __future__ import annotations

import json
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
