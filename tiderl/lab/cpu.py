"""Which core a thread of this process runs on, read from /proc (benchmarks/async_vs_sync.py
samples it to see where each component's threads ran)."""

from __future__ import annotations

import os


def thread_cpu(tid: int) -> tuple[int, float] | None:
    """(the core a thread of this process last ran on, its CPU seconds), from
    /proc/self/task/<tid>/stat; None when the thread is gone or /proc is missing."""
    try:
        with open(f"/proc/self/task/{tid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    # fields[0] is the state (stat field 3): utime/stime are fields 14/15, processor is field 39.
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[36]), (int(fields[11]) + int(fields[12])) / tick
