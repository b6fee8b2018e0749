"""The ledger on disk: one JSON line per task attempt event, appended as it happens, so a run
killed with SIGKILL still has its ledger (`system.json` summarises it at the end). The line format
and how a resume cuts the file back (one `lost` line per attempt started after the checkpoint)
are in docs/architecture.md, "Checkpoints and resume".
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
