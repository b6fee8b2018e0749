"""Answer checking with math-verify, bounded in time and memory.

math-verify parses LaTeX or plain answers into SymPy and compares them (numbers, fractions,
intervals, tuples, sets, expressions, text). Parsing or comparing hostile input can take
unbounded time (`2^{2^{2^{2^{2^{2}}}}}` is a short string) and math-verify's own timeout uses
`signal.alarm`, which works only in a process's main thread, while tiderl runs environment
steps in threads. So verification runs in worker processes (fresh Python interpreters that
import only math-verify and talk JSON lines over pipes), where math-verify's alarm works as an
inner bound, and the parent waits at most `timeout_s` for the reply: a worker that does not answer in
time is killed and replaced, and the answer counts as not verified. Each worker's address space
is capped (`MEMORY_LIMIT_BYTES`), so a giant number fails instead of exhausting the machine.

Both answers are wrapped in `\\boxed{...}` before parsing, so gold and prediction go through
the same extraction path.
"""

from __future__ import annotations

import json
import math
import os
import queue
import select
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MEMORY_LIMIT_BYTES = 4 << 30
# Longest answer (characters) that is verified; a longer one is not an answer to a math problem.
MAX_ANSWER_CHARS = 1000
_CACHE_SIZE = 4096


@dataclass(frozen=True)
class Verdict:
    """correct: math-verify found the answers equal. error: why it could not decide ('' when
    it did): a timeout, a dead worker, an answer too long, a parse failure."""

    correct: bool
    error: str = ""


def compare(gold: str, predicted: str, timeout_s: float) -> tuple[bool, str]:
    """math-verify's verdict on two answer strings, in this process (its alarm-based timeout
    needs the main thread; `worker_main` runs it there)."""
    from math_verify import parse, verify

    seconds = max(1, math.ceil(timeout_s))
    gold_parsed = parse("\\boxed{" + gold + "}", parsing_timeout=seconds)
    if not gold_parsed:
        return False, f"math-verify cannot parse the gold answer {gold[:80]!r}"
    pred_parsed = parse("\\boxed{" + predicted + "}", parsing_timeout=seconds)
    if not pred_parsed:
        return False, "math-verify cannot parse the answer"
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=seconds)), ""


def worker_main() -> None:
    """A verification worker (a separate Python process): answer JSON-line requests
    [gold, predicted, timeout_s] on stdin with JSON lines [correct, error] on stdout until
    stdin closes."""
    try:
        import resource

        limit = int(sys.argv[1]) if len(sys.argv) > 1 else MEMORY_LIMIT_BYTES
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    except (ImportError, ValueError, OSError):
        pass  # no address-space limit on this platform; the parent's timeout still bounds it
    # No PR_SET_PDEATHSIG: it fires when the *thread* that started the worker exits, and workers
    # are started from whichever episode thread needs one. A worker ends when its stdin closes.
    import logging

    logging.disable(logging.WARNING)  # math-verify logs every parse failure
    compare("1", "1", 5)  # import and warm math-verify and SymPy before the first timed request

    out = sys.stdout
    out.write('"ready"\n')
    out.flush()
    for line in sys.stdin:
        try:
            gold, predicted, timeout_s = json.loads(line)
            reply = list(compare(str(gold), str(predicted), float(timeout_s)))
        except BaseException as exc:  # noqa: BLE001 - any failure is a verdict, never a crash
            reply = [False, f"math-verify raised {type(exc).__name__}"]
        out.write(json.dumps(reply) + "\n")
        out.flush()


_WORKER_CODE = ("import sys; sys.path.insert(0, {root!r}); "
                "from tiderl.envs.math.verify import worker_main; worker_main()")


class _Worker:
    """One worker process and its line-oriented pipes."""

    def __init__(self, memory_limit: int, start_timeout_s: float) -> None:
        root = str(Path(__file__).resolve().parents[3])
        self.process = subprocess.Popen(
            [sys.executable, "-c", _WORKER_CODE.format(root=root), str(memory_limit)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self._buffer = b""
        if self.read_line(start_timeout_s) != "ready":
            self.kill()
            raise RuntimeError(f"the math-verify worker did not start within {start_timeout_s:.0f}s")

    def send(self, request: list[Any]) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write((json.dumps(request) + "\n").encode())
        self.process.stdin.flush()

    def read_line(self, timeout_s: float) -> Any:
        """The next JSON line from the worker, or None if none came within `timeout_s` (or
        the worker died)."""
        assert self.process.stdout is not None
        fd = self.process.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=5)
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                pipe.close()


class AnswerVerifier:
    """Checks answers with math-verify in up to `workers` worker processes (started on first
    use), each check bounded by `timeout_s` seconds. Thread-safe: concurrent episodes share it.
    Verdicts are cached by (gold, predicted)."""

    def __init__(self, timeout_s: float = 5.0, workers: int = 2, memory_limit: int = MEMORY_LIMIT_BYTES,
                 start_timeout_s: float = 120.0) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s, self.memory_limit, self.start_timeout_s = timeout_s, memory_limit, start_timeout_s
        self._idle: queue.LifoQueue[_Worker] = queue.LifoQueue()
        self._slots = threading.BoundedSemaphore(max(1, workers))
        self._cache: dict[tuple[str, str], Verdict] = {}
        self._lock = threading.Lock()
        self._closed = False
        self.timeouts = 0

    def verify(self, gold: str, predicted: str) -> Verdict:
        """Whether `predicted` is mathematically the `gold` answer (both as text)."""
        if len(predicted) > MAX_ANSWER_CHARS:
            return Verdict(False, f"the answer has {len(predicted)} characters (at most {MAX_ANSWER_CHARS} are checked)")
        if not predicted.strip():
            return Verdict(False, "the answer is empty")
        key = (gold, predicted)
        with self._lock:
            if key in self._cache:
                return self._cache[key]
        verdict = self._ask(gold, predicted)
        if not verdict.error.startswith(("verification timed out", "the math-verify worker")):
            with self._lock:
                if len(self._cache) >= _CACHE_SIZE:
                    self._cache.pop(next(iter(self._cache)))
                self._cache[key] = verdict
        return verdict

    def _ask(self, gold: str, predicted: str) -> Verdict:
        with self._slots:
            if self._closed:
                raise RuntimeError("AnswerVerifier.verify called after close()")
            try:
                worker = self._idle.get_nowait()
            except queue.Empty:
                worker = _Worker(self.memory_limit, self.start_timeout_s)
            started = time.perf_counter()
            try:
                worker.send([gold, predicted, self.timeout_s])
                reply = worker.read_line(self.timeout_s + 0.5)
            except (OSError, ValueError):
                reply = None
            if reply is None:
                worker.kill()
                if worker.process.returncode not in (None, -9):
                    return Verdict(False, "the math-verify worker died (memory limit?)")
                self.timeouts += 1
                return Verdict(False, f"verification timed out after {time.perf_counter() - started:.1f}s")
            self._idle.put(worker)
            return Verdict(bool(reply[0]), str(reply[1]))

    def close(self) -> None:
        """Stop the idle worker processes (a worker also ends when this process does: its stdin
        closes; one busy with a request ends after it, bounded by math-verify's own alarm)."""
        self._closed = True
        while True:
            try:
                self._idle.get_nowait().kill()
            except queue.Empty:
                return

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
