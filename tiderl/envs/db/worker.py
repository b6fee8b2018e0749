"""Database sessions in a worker process that is killed when a statement overruns: the hard
time limit of the SQL environment.

Why a process: SQLite checks its progress handler (and `interrupt()`) only between virtual
machine instructions, and DuckDB checks interrupts between vector batches, so one instruction
that loops inside a function (`printf('%.*c', 2000000000, 'x')`, a pathological `LIKE`)
runs to its end whatever the in-process limit says. A thread cannot be stopped; a process can.

How: `IsolatedSession` (what every backend's `open` returns unless built with
`isolate=False`) starts, or takes from a small pool, a worker process (`python -m
tiderl.envs.db.worker`) and asks it to build the backend from a picklable `BackendSpec` and
open the session there. Every session call goes over a pipe. The in-process limits still run
inside the worker (a statement past `timeout_s` normally stops there, cheaply); when no reply
comes within `timeout_s + KILL_GRACE_S` the worker is killed (SIGKILL) and the agent reads
the usual time-limit error. The next call starts a fresh worker, reopens the session and
replays the write statements that had succeeded (the killed statement itself never
committed: a scratch database is only ever changed by whole statements), so a write task's
scratch copy survives the kill. A worker also dies with its parent (its request pipe closes).

A worker keeps the backends it built, so a worker reused by the same backend reuses them; a
server backend's idle connection stays open in its worker only while the parent allows it
(`IsolatedSession(keep_idle=...)`: at most that many idle workers keep one per backend, and
`_take_worker` hands them to the same backend first), which is `ServerBackend`'s pool.

What is guaranteed: a session call returns within `timeout_s + KILL_GRACE_S` plus the time
to kill a process (milliseconds), for any statement; the worker's address space is capped at
`WORKER_MEMORY_BYTES` (`RLIMIT_AS`), so no statement can build values beyond that (the
backends' own value caps are far below it). Not guaranteed: statements replayed after a kill
that read the clock or `random()` may write other values than the first time.
"""

from __future__ import annotations

import atexit
import importlib
import os
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Sequence

from tiderl.envs.db.backend import QueryResult, SQLError, TableSpec
from tiderl.envs.db.sql_text import WRITE, statement_kind

# How long after its own time limit a statement may run before its worker is killed.
KILL_GRACE_S = 0.5
# Address-space cap of a worker process (Python, the database engine and its values).
WORKER_MEMORY_BYTES = 1 << 30
# Opening a session (building a task database) may take this long before the worker is killed.
OPEN_TIMEOUT_S = 120.0
# Idle workers kept for reuse (starting one costs 0.05-0.3 s; a kill costs a new one): about
# one per episode in flight, so a batch of episodes reuses the last batch's workers.
MAX_IDLE_WORKERS = 32

# Exceptions a worker reports by name and the parent raises again as the same type.
_RAISABLE = {"SQLError": SQLError, "ValueError": ValueError, "FileNotFoundError": FileNotFoundError,
             "RuntimeError": RuntimeError, "ImportError": ImportError, "PermissionError": PermissionError}


@dataclass(frozen=True)
class BackendSpec:
    """How a worker builds a backend: the class as "module:Name" and its keyword arguments
    (picklable; the backend is built with `isolate=False`, once per worker and spec)."""

    target: str
    kwargs: tuple[tuple[str, Any], ...] = field(default_factory=tuple)

    def build(self) -> Any:
        module, _, name = self.target.partition(":")
        cls = getattr(importlib.import_module(module), name)
        return cls(**dict(self.kwargs), isolate=False)


class WorkerTimeout(Exception):
    """No reply in time; the worker has been killed."""


class WorkerDied(Exception):
    """The worker process ended without replying (killed by the OS, crashed)."""


class _Worker:
    """One worker process and the two pipe ends the parent talks through."""

    def __init__(self) -> None:
        request_read, request_write = os.pipe()
        reply_read, reply_write = os.pipe()
        env = dict(os.environ)
        package_root = str(Path(__file__).resolve().parents[3])  # the folder holding tiderl/
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "tiderl.envs.db.worker", str(request_read), str(reply_write),
                 str(WORKER_MEMORY_BYTES)],
                pass_fds=(request_read, reply_write), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                env=env, close_fds=True)
        finally:
            os.close(request_read)
            os.close(reply_write)
        self._requests = Connection(request_write, readable=False)
        self._replies = Connection(reply_read, writable=False)
        # The backend whose idle server connection this (idle) worker keeps, if any.
        self.warm: BackendSpec | None = None
        # kill() runs once. Two threads can reach it for one worker (a dropped session's finalizer
        # and its slot's close on another thread), and closing a pipe twice at once closes a
        # descriptor number some other code has reused since (measured: EBADF in a new worker).
        # Re-entrant: a collection inside kill() may finalize the session that owns this worker.
        self._kill_lock = threading.RLock()
        self._killed = False

    def call(self, message: tuple[Any, ...], timeout_s: float) -> Any:
        """Send one request and return the reply's value (raising what the worker raised).
        WorkerTimeout / WorkerDied when there is no reply: the worker is then dead."""
        try:
            self._requests.send(message)
            if not self._replies.poll(timeout_s):
                self.kill()
                raise WorkerTimeout()
            status, value = self._replies.recv()
        except (EOFError, OSError, BrokenPipeError):
            code = self.kill()
            raise WorkerDied(f"the database worker process ended (exit code {code})") from None
        if status == "ok":
            return value
        kind, text = value
        raise _RAISABLE.get(kind, RuntimeError)(text)

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> int | None:
        """Kill the process (if still running), reap it and close the pipes (once); its exit code."""
        with self._kill_lock:
            if self._killed:
                return self.process.returncode
            self._killed = True
            if self.process.poll() is None:
                self.process.kill()
            code = self.process.wait()
            for end in (self._requests, self._replies):
                try:
                    end.close()
                except OSError:
                    pass
            return code


_IDLE: list[_Worker] = []
_IDLE_LOCK = threading.Lock()


def _take_worker(spec: BackendSpec | None = None) -> _Worker:
    """An idle worker: one that keeps a connection of `spec`'s backend first, then one that
    keeps none, then any (whose kept connection it closes on opening another backend)."""
    with _IDLE_LOCK:
        for worker in [w for w in _IDLE if not w.alive()]:
            _IDLE.remove(worker)
            worker.kill()
        for wanted in (spec, None):
            for index in range(len(_IDLE) - 1, -1, -1):
                if _IDLE[index].warm == wanted:
                    worker = _IDLE.pop(index)
                    worker.warm = None
                    return worker
        if _IDLE:
            worker = _IDLE.pop()
            worker.warm = None
            return worker
    return _Worker()


_WARMING: dict[BackendSpec, int] = {}  # workers on their way back to the pool with a kept connection


def _keeps_room(spec: BackendSpec, limit: int) -> bool:
    """Whether fewer than `limit` idle workers keep a connection of `spec`'s backend (counting
    those on their way back); if so, a place is reserved (`_return_worker` ends it)."""
    with _IDLE_LOCK:
        room = limit > 0 and sum(w.warm == spec for w in _IDLE) + _WARMING.get(spec, 0) < limit
        if room:
            _WARMING[spec] = _WARMING.get(spec, 0) + 1
        return room


def _return_worker(worker: _Worker, warm: BackendSpec | None = None, reserved: BackendSpec | None = None) -> None:
    """Put a worker back in the pool (keeping a connection of `warm`'s backend), or kill it when
    it died or the pool is full; `reserved`: the spec whose `_keeps_room` place this ends."""
    with _IDLE_LOCK:
        if reserved is not None:
            _WARMING[reserved] -= 1
        if worker.alive() and len(_IDLE) < MAX_IDLE_WORKERS:
            worker.warm = warm
            _IDLE.append(worker)
            return
    worker.kill()


@atexit.register
def _stop_idle_workers() -> None:
    with _IDLE_LOCK:
        while _IDLE:
            _IDLE.pop().kill()


def timeout_message(timeout_s: float) -> str:
    """The agent-facing text of a statement stopped at its time limit (every backend's)."""
    return f"the statement ran longer than the {timeout_s:g} s limit and was stopped"


class IsolatedSession:
    """A `DBSession` whose database lives in a worker process (see the module docstring)."""

    def __init__(self, spec: BackendSpec, tables: Sequence[TableSpec], writable: bool, keep_idle: int = 0) -> None:
        self._spec = spec
        # Idle workers that may keep this backend's connection open after a session (a server's
        # connection pool, `ServerBackend.pool_size`); 0: the worker closes it with the session.
        self._keep_idle = keep_idle
        self._tables = list(tables)
        self._writable = writable
        self._writes: list[tuple[str, float]] = []  # (statement, its time limit), to replay
        self._worker: _Worker | None = None
        self._lock = threading.Lock()
        self.closed = False
        self.kills = 0  # workers killed over time limits (for tests and logs)
        self._start()

    def _start(self) -> _Worker:
        """A worker with the session open (and the earlier writes replayed)."""
        worker = _take_worker(self._spec)
        try:
            worker.call(("open", self._spec, self._tables, self._writable), OPEN_TIMEOUT_S)
            for sql, timeout_s in self._writes:
                worker.call(("execute", sql, 0, timeout_s), timeout_s + KILL_GRACE_S)
        except (WorkerTimeout, WorkerDied) as exc:
            worker.kill()
            raise SQLError(f"the database could not be reopened after a stopped statement ({exc or 'timeout'})") from None
        except BaseException:
            worker.kill()
            raise
        self._worker = worker
        return worker

    def _call(self, message: tuple[Any, ...], timeout_s: float, limit_s: float) -> Any:
        if self.closed:
            raise SQLError("the database session is closed")
        worker = self._worker or self._start()
        try:
            return worker.call(message, timeout_s)
        except WorkerTimeout:
            self._worker = None
            self.kills += 1
            raise SQLError(timeout_message(limit_s)) from None
        except WorkerDied as exc:
            self._worker = None
            raise SQLError(f"{exc}; the statement was not applied") from None

    def execute(self, sql: str, *, max_rows: int, timeout_s: float) -> QueryResult:
        with self._lock:
            result = self._call(("execute", sql, max_rows, timeout_s), timeout_s + KILL_GRACE_S, timeout_s)
            if self._writable and statement_kind(sql)[0] == WRITE:
                self._writes.append((sql, timeout_s))
            return result

    def list_tables(self) -> list[str]:
        with self._lock:
            return self._call(("list_tables",), OPEN_TIMEOUT_S, OPEN_TIMEOUT_S)

    def describe_table(self, name: str) -> list[tuple[str, str]]:
        with self._lock:
            return self._call(("describe_table", name), OPEN_TIMEOUT_S, OPEN_TIMEOUT_S)

    def table_hash(self, name: str) -> str:
        with self._lock:
            return self._call(("table_hash", name), OPEN_TIMEOUT_S, OPEN_TIMEOUT_S)

    def __del__(self) -> None:
        # A session dropped without close() must not leave its worker process running.
        worker = getattr(self, "_worker", None)
        if worker is not None:
            try:
                worker.kill()
            except Exception:
                pass

    def close(self) -> None:
        """Close the session in the worker and return the worker to the pool (once)."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            worker, self._worker = self._worker, None
        if worker is None:
            return
        keep = _keeps_room(self._spec, self._keep_idle)
        reserved = self._spec if keep else None
        try:
            worker.call(("close", keep), OPEN_TIMEOUT_S)
        except Exception:  # a worker that cannot close cleanly is not reused
            worker.kill()
            _return_worker(worker, None, reserved)  # a dead worker: this only ends the reservation
            return
        _return_worker(worker, reserved, reserved)


# -- the worker process -----------------------------------------------------------------------


def _serve(requests: Connection, replies: Connection) -> None:
    """Answer requests until the parent closes the pipe: open a session, call its methods."""
    backends: dict[BackendSpec, Any] = {}
    session = None
    while True:
        try:
            message = requests.recv()
        except (EOFError, OSError):
            return
        op, args = message[0], message[1:]
        try:
            if op == "open":
                spec, tables, writable = args
                if session is not None:
                    session.close()
                    session = None
                _release_idle(backends, keep=spec)  # a worker keeps one backend's idle connection at most
                backend = backends.get(spec)
                if backend is None:
                    backend = backends[spec] = spec.build()
                session = backend.open(tables, writable)
                value = None
            elif op == "close":
                if session is not None:
                    session.close()
                if not (args and args[0]):  # the parent keeps no connection of this backend here
                    _release_idle(backends, keep=None)
                session, value = None, None
            elif session is None:
                raise RuntimeError("no session is open in this worker")
            elif op == "execute":
                sql, max_rows, timeout_s = args
                value = session.execute(sql, max_rows=max_rows, timeout_s=timeout_s)
            elif op in ("list_tables", "describe_table", "table_hash"):
                value = getattr(session, op)(*args)
            else:
                raise RuntimeError(f"unknown request {op!r}")
            reply: tuple[str, Any] = ("ok", value)
        except MemoryError:
            reply = ("error", ("SQLError", "out of memory: the statement needs more memory than the "
                                           f"database worker may use ({WORKER_MEMORY_BYTES >> 20} MiB)"))
        except Exception as exc:  # reported to the parent, which raises it again
            reply = ("error", (type(exc).__name__, str(exc)))
        try:
            replies.send(reply)
        except (OSError, ValueError):
            return
        except Exception as exc:  # a value that does not pickle
            replies.send(("error", ("SQLError", f"the result could not be sent back: {exc}")))


def _release_idle(backends: dict[BackendSpec, Any], keep: BackendSpec | None) -> None:
    """Close the idle connections the worker's backends keep (a server's pool), but `keep`'s."""
    for spec, backend in backends.items():
        if spec != keep and hasattr(backend, "release_idle"):
            backend.release_idle()


def main(argv: list[str]) -> None:
    import resource

    request_fd, reply_fd, memory = int(argv[0]), int(argv[1]), int(argv[2])
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    _serve(Connection(request_fd, writable=False), Connection(reply_fd, readable=False))


if __name__ == "__main__":
    main(sys.argv[1:])
