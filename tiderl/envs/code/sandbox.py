"""Run untrusted code: one process per execution, in its own temporary directory, under limits.

    sandbox = Sandbox(Limits(cpu_s=5, wall_s=10))
    result = await sandbox.run_python("print(1 + 1)")        # ExecResult(status="ok", stdout="2\\n")

Every execution is a fresh process (`python -E -s` by default) started with
`asyncio.create_subprocess_exec`, so executions run concurrently without blocking the event
loop; at most `concurrency` run at once per event loop (the others wait their turn).
docs/env_code.md states exactly what holds and what does not; in short:

- always: a new session (process group), a temporary working directory that is deleted
  afterwards, a clean environment (only PATH, HOME, TMPDIR, LANG and PYTHONHASHSEED), resource
  limits on CPU time, address space, file size, open files and processes, a wall-clock limit
  (the process group is killed), stdout and stderr each capped at `max_output_bytes` (the
  program is killed when it writes more), output decoded as UTF-8 with replacement characters;
- as root (`features["own_uid"]`): the program runs as a user id of its own (one per
  concurrent execution, reserved across processes with a lock file), with no supplementary
  groups; the process limit then binds, and it can signal no process but its own; after the
  execution every process of that user id is killed;
- with user namespaces (`features["namespaces"]`): no network (a network namespace with no
  interface up), its own PID namespace (every process it started dies with it), and
  (`features["readonly"]`) every mount read-only but the working directory, with private tmpfs
  over /tmp, /var/tmp and /dev/shm and a /proc that shows only its own processes.

The features are probed once per process (`probe_features`); `Sandbox(require=...)` raises
when a feature it needs is missing instead of running with less.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import json
import os
import resource
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tiderl.envs.code import sandbox_init

BOOTSTRAP = Path(sandbox_init.__file__).read_text()
FEATURES = ("own_uid", "namespaces", "readonly")
# User ids handed to executions when the caller is root: UID_BASE, UID_BASE + 1, ...
UID_BASE = 61000
UID_POOL = 128


class SandboxError(RuntimeError):
    """The sandbox could not run the program at all (setup failed, a required feature is missing)."""


@dataclass(frozen=True)
class Limits:
    """Per-execution limits. cpu_s: CPU seconds (RLIMIT_CPU, whole seconds, rounded up);
    wall_s: wall-clock seconds before the process group is killed; memory_mb: address space
    (RLIMIT_AS); file_size_mb: largest file it may write (RLIMIT_FSIZE); max_procs: processes
    and threads (RLIMIT_NPROC: binds only under an own uid); max_open_files: RLIMIT_NOFILE;
    max_output_bytes: kept of stdout and of stderr each (more kills the program);
    tmpfs_mb: size of each private tmpfs (/tmp, /var/tmp, /dev/shm) with `readonly`."""

    cpu_s: float = 5.0
    wall_s: float = 10.0
    memory_mb: int = 1024
    file_size_mb: int = 16
    max_procs: int = 32
    max_open_files: int = 256
    max_output_bytes: int = 64_000
    tmpfs_mb: int = 64

    def __post_init__(self) -> None:
        for name in ("cpu_s", "wall_s", "memory_mb", "file_size_mb", "max_procs", "max_open_files",
                     "max_output_bytes", "tmpfs_mb"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Limits.{name}={getattr(self, name)!r} must be > 0")


@dataclass
class ExecResult:
    """What one execution did.

    status: "ok" (exit 0), "error" (non-zero exit), "timeout" (wall-clock limit), "cpu_limit"
        (killed by SIGXCPU/SIGKILL after the CPU limit), "output_limit" (wrote more than the
        cap), "signal" (another signal ended it; e.g. SIGKILL, SIGSEGV).
    exit_code: the exit status (negative: killed by that signal; with namespaces a program
        killed by signal N reports 128 + N; None after a timeout or the output limit, when the
        sandbox killed it).
    stdout, stderr: decoded UTF-8 (invalid bytes become U+FFFD), each at most
        `max_output_bytes` bytes of output; truncated says whether any was cut.
    """

    status: str
    exit_code: int | None
    stdout: str
    stderr: str
    wall_s: float
    truncated: bool = False

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass
class _Pipe:
    data: bytearray = field(default_factory=bytearray)
    over: bool = False


def _own_process_count(uid: int) -> int:
    """Processes (and threads count too, for RLIMIT_NPROC) of `uid` now."""
    count = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    count += len(os.listdir(f"/proc/{entry}/task"))
            except OSError:
                continue
    return count


def _descendants(root: int) -> list[int]:
    """The pids whose parent chain reaches `root` (read from /proc; empty where it is missing)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    parents[int(entry)] = int(f.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    found, frontier = [], [root]
    while frontier:
        pid = frontier.pop()
        children = [p for p, pp in parents.items() if pp == pid]
        found += children
        frontier += children
    return found


def _stat(pid: int) -> tuple[str, int, int, int] | None:
    """(state, parent pid, session id, start time) of `pid` from /proc; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return fields[0].decode(), int(fields[1]), int(fields[3]), int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def _reap(victims: dict[int, int], session: int, bound_s: float = 2.0) -> None:
    """Collect the killed processes (pid: start time) that come back to this process as zombies.

    A process whose parent dies goes to the nearest child subreaper, else to PID 1; when this
    process is either (a trainer running as PID 1), nothing else would ever wait for them. Waits
    at most `bound_s` until each victim is gone or a zombie another parent will collect; then
    collects any zombie child of ours still in the execution's session (forked during the kill)."""
    me, deadline = os.getpid(), time.monotonic() + bound_s
    pending = dict(victims)
    while pending and time.monotonic() < deadline:
        for pid, start in list(pending.items()):
            info = _stat(pid)
            if info is None or info[3] != start:  # gone (collected), or the pid reused since
                del pending[pid]
            elif info[0] == "Z" and info[1] == me:
                _wait_zombie(pid)
            elif info[0] == "Z" and info[1] not in pending:  # another parent (init) collects it
                del pending[pid]
        if pending:
            time.sleep(0.01)
    for entry in filter(str.isdigit, os.listdir("/proc") if os.path.isdir("/proc") else []):
        info = _stat(int(entry))
        if info is not None and info[0] == "Z" and info[1] == me and info[2] == session != int(entry):
            _wait_zombie(int(entry))


def _wait_zombie(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


class _UidLease:
    """A user id reserved for one execution: an exclusive lock on a file per uid, so executions
    in other processes on this machine never share one (their cleanup kills every process of the
    uid)."""

    def __init__(self, lock_dir: Path) -> None:
        self.lock_dir = lock_dir
        self.uid: int | None = None
        self._fd: int | None = None

    def try_acquire(self) -> bool:
        self.lock_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        for uid in range(UID_BASE, UID_BASE + UID_POOL):
            fd = os.open(self.lock_dir / f"uid-{uid}.lock", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                continue
            self.uid, self._fd = uid, fd
            return True
        return False

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the lock
            self._fd = self.uid = None


def kill_uid(uid: int) -> None:
    """SIGKILL every process of `uid`: kill(-1) sent as that uid reaches exactly its processes
    (the killer itself excepted)."""
    import subprocess

    killer = shutil.which("kill", path="/usr/bin:/bin")
    argv = [killer, "-9", "-1"] if killer else [sys.executable, "-c", "import os; os.kill(-1, 9)"]
    subprocess.run(argv, user=uid, group=uid, extra_groups=[], env={}, cwd="/",
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)


_PROBED: dict[str, tuple[str, dict[str, bool]]] = {}
_PROBE_LOCK = threading.Lock()
# Interpreters tried, in order, when the requested one cannot run as the sandbox's user (a
# virtual environment under root's 0700 home, say).
FALLBACK_PYTHONS = ("/usr/local/bin/python3", "/usr/bin/python3")


def probe_features(python: str = sys.executable) -> tuple[str, dict[str, bool]]:
    """(the interpreter the sandbox runs, which isolation features work on this machine), probed
    once per process and requested interpreter. Features: own_uid (we are root and may switch to
    another uid), namespaces (unprivileged user, network, PID, mount and IPC namespaces),
    readonly (read-only mounts, private tmpfs and /proc inside them). The interpreter is
    `python`, or the first of `FALLBACK_PYTHONS` that runs as the sandbox's user with the most
    isolation when `python` does not (raises SandboxError when none runs at all)."""
    with _PROBE_LOCK:
        if python not in _PROBED:
            _PROBED[python] = _probe(python)
        found, features = _PROBED[python]
        return found, dict(features)


def _probe(python: str) -> tuple[str, dict[str, bool]]:
    import subprocess

    own_uid = os.geteuid() == 0
    user = UID_BASE + UID_POOL if own_uid else None  # one past the pool: never leased, never killed
    features = {"own_uid": own_uid, "namespaces": False, "readonly": False}

    def works(interpreter: str, namespaces: bool, readonly: bool) -> bool:
        with tempfile.TemporaryDirectory(prefix="tiderl-probe-") as workdir:
            if user is not None:
                os.chown(workdir, user, user)
            spec = {"rlimits": {}, "namespaces": namespaces, "readonly": readonly, "workdir": workdir,
                    "tmpfs_mb": 1, "env": {"PATH": "/usr/bin:/bin"},
                    "argv": [interpreter, "-E", "-s", "-c", "import socket; socket.socket().close()"]}
            try:
                done = subprocess.run([interpreter, "-E", "-s", "-c", BOOTSTRAP, json.dumps(spec)],
                                      capture_output=True, timeout=30, user=user, group=user,
                                      extra_groups=[] if own_uid else None, env={}, cwd=workdir)
            except (OSError, subprocess.SubprocessError):
                return False
            return done.returncode == 0

    # The most isolation wins over the requested interpreter: one below /tmp, say, cannot run
    # once /tmp is a private tmpfs, and a fallback interpreter can.
    candidates = [python] + [p for p in FALLBACK_PYTHONS if p != python and os.path.exists(p)]
    for namespaces, readonly in ((True, True), (True, False), (False, False)):
        chosen = next((p for p in candidates if works(p, namespaces, readonly)), None)
        if chosen is not None:
            features.update(namespaces=namespaces, readonly=readonly)
            return chosen, features
    raise SandboxError(f"no Python interpreter runs as the sandbox's user (tried {candidates}); "
                       "pass Sandbox(python=...) an interpreter every user may read")


class Sandbox:
    """Runs programs in fresh sandboxed processes (module docstring; docs/env_code.md).

    limits: the per-execution `Limits`. concurrency: executions running at once in one event
    loop (0 = the number of cores); the rest wait. python: the interpreter `run_python` uses. require:
    features (of `FEATURES`) that must be available, else `SandboxError` at construction.
    isolation: "auto" (every feature that works here) or "process" (limits only: no uid
    switch, no namespaces; for a machine where the probes misbehave).
    """

    def __init__(self, limits: Limits = Limits(), concurrency: int = 0, python: str = sys.executable,
                 require: tuple[str, ...] = (), isolation: str = "auto") -> None:
        if isolation not in ("auto", "process"):
            raise ValueError(f"isolation={isolation!r}: use 'auto' or 'process'")
        unknown = [f for f in require if f not in FEATURES]
        if unknown:
            raise ValueError(f"require={unknown}: known features are {', '.join(FEATURES)}")
        self.limits = limits
        self.concurrency = concurrency if concurrency > 0 else (os.cpu_count() or 1)
        self.python, found = probe_features(python)
        if isolation == "process":
            found = dict.fromkeys(FEATURES, False)
        missing = [f for f in require if not found[f]]
        if missing:
            raise SandboxError(f"the sandbox needs {', '.join(missing)}, which this machine does not allow "
                               f"(features: {found}); docs/env_code.md says what each needs")
        self.features = found
        self._lock = threading.Lock()
        # Executions in flight per event loop (keyed by id of the loop). Slots are counted per loop, not
        # per sandbox: a loop blocked while another loop runs episodes (a held-out evaluation inside a
        # training observer, `play_episodes` on a helper thread) keeps its slots until it resumes, and
        # a shared count would make the other loop wait for them forever (the deadlock of the first
        # code-environment training run with held-out evaluations). The blocked loop's programs have
        # finished or run out their limits meanwhile, so the cores are not oversubscribed for long.
        self._running: dict[int, int] = {}
        self._lock_dir = Path(tempfile.gettempdir()) / "tiderl-sandbox-locks"

    # -- public ---------------------------------------------------------------------------

    async def run_python(self, code: str, files: dict[str, str | bytes] | None = None,
                         stdin: str = "", limits: Limits | None = None) -> ExecResult:
        """Run `code` as main.py (with `files` beside it) under the sandbox's interpreter."""
        return await self.run({**(files or {}), "main.py": code}, [self.python, "-E", "-s", "-B", "main.py"],
                              stdin=stdin, limits=limits)

    async def run(self, files: dict[str, str | bytes], argv: list[str], stdin: str = "",
                  limits: Limits | None = None) -> ExecResult:
        """Write `files` (relative paths) into a fresh directory and run `argv` there (argv[0]:
        an absolute path or a name found on /usr/bin:/bin). Raises SandboxError only when the
        sandbox itself could not start the program; whatever the program does is in the result."""
        limits = limits or self.limits
        loop = id(asyncio.get_running_loop())
        await self._enter(loop)
        lease = _UidLease(self._lock_dir)
        try:
            if self.features["own_uid"]:
                while not lease.try_acquire():
                    await asyncio.sleep(0.05)
            workdir = tempfile.mkdtemp(prefix="tiderl-sbx-")
            try:
                # File work and the clean-up block for milliseconds: off the event loop.
                await asyncio.to_thread(self._write_files, workdir, files, lease.uid)
                return await self._execute(workdir, argv, stdin, limits, lease.uid)
            finally:
                await asyncio.to_thread(_clean_up, workdir, lease.uid)
        finally:
            lease.release()
            with self._lock:
                self._running[loop] -= 1
                if not self._running[loop]:
                    del self._running[loop]

    # -- internals ------------------------------------------------------------------------

    async def _enter(self, loop: int) -> None:
        """Wait for a free execution slot of event loop `loop` (`concurrency` per loop; see __init__)."""
        delay = 0.002
        while True:
            with self._lock:
                if self._running.get(loop, 0) < self.concurrency:
                    self._running[loop] = self._running.get(loop, 0) + 1
                    return
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)

    @staticmethod
    def _write_files(workdir: str, files: dict[str, str | bytes], uid: int | None) -> None:
        root = Path(workdir)
        for name, content in files.items():
            path = (root / name).resolve()
            if root.resolve() not in path.parents:
                raise ValueError(f"file name {name!r} leaves the working directory")
            path.parent.mkdir(parents=True, exist_ok=True)
            data = content.encode("utf-8", "surrogatepass") if isinstance(content, str) else content
            path.write_bytes(data)
        if uid is not None:
            for dirpath, dirnames, filenames in os.walk(workdir):
                for name in [dirpath] + [os.path.join(dirpath, n) for n in dirnames + filenames]:
                    os.chown(name, uid, uid)
            os.chmod(workdir, 0o700)

    def _spec(self, workdir: str, argv: list[str], limits: Limits, uid: int | None) -> dict[str, Any]:
        procs = limits.max_procs
        if uid is None and not os.geteuid() == 0:
            # Without an own uid the process limit counts every process of our user.
            procs += _own_process_count(os.getuid())
        mb = 1024 * 1024
        return {
            "rlimits": {"RLIMIT_CORE": 0, "RLIMIT_CPU": max(1, int(-(-limits.cpu_s // 1))),
                        "RLIMIT_AS": limits.memory_mb * mb, "RLIMIT_FSIZE": limits.file_size_mb * mb,
                        "RLIMIT_NOFILE": limits.max_open_files,
                        **({"RLIMIT_NPROC": procs} if os.geteuid() != 0 or uid is not None else {})},
            "namespaces": self.features["namespaces"], "readonly": self.features["readonly"],
            "workdir": workdir, "tmpfs_mb": limits.tmpfs_mb,
            "env": {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": "/tmp", "LANG": "C.UTF-8",
                    "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1"},
            "argv": [argv[0] if os.path.isabs(argv[0]) else (shutil.which(argv[0], path="/usr/bin:/bin") or argv[0]),
                     *argv[1:]],
        }

    async def _execute(self, workdir: str, argv: list[str], stdin: str, limits: Limits, uid: int | None) -> ExecResult:
        spec = self._spec(workdir, argv, limits, uid)
        start = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            self.python, "-E", "-s", "-c", BOOTSTRAP, json.dumps(spec),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            cwd=workdir, env={}, start_new_session=True, close_fds=True,
            user=uid, group=uid, extra_groups=[] if uid is not None else None)
        out, err = _Pipe(), _Pipe()
        over_limit = asyncio.Event()

        async def pump(stream: asyncio.StreamReader, pipe: _Pipe) -> None:
            while chunk := await stream.read(65536):
                room = limits.max_output_bytes - len(pipe.data)
                pipe.data += chunk[:max(0, room)]
                if len(chunk) > room:
                    pipe.over = True
                    over_limit.set()
                    return

        async def feed() -> None:
            assert proc.stdin is not None
            try:
                if stdin:
                    proc.stdin.write(stdin.encode("utf-8", "replace"))
                    await proc.stdin.drain()
                proc.stdin.close()
            except (BrokenPipeError, ConnectionResetError):
                pass

        assert proc.stdout is not None and proc.stderr is not None
        work = asyncio.gather(pump(proc.stdout, out), pump(proc.stderr, err), feed(), proc.wait())
        watch = asyncio.ensure_future(over_limit.wait())
        status, victims = "", {}
        try:
            done, _ = await asyncio.wait({work, watch}, timeout=limits.wall_s, return_when=asyncio.FIRST_COMPLETED)
            if work not in done:
                status = "output_limit" if watch in done else "timeout"
        finally:
            watch.cancel()
            if proc.returncode is None:
                victims = self._kill(proc.pid)
            # The pipes close once every process holding them is gone.
            try:
                await asyncio.wait_for(asyncio.shield(work), timeout=5)
            except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - the result is what was read
                work.cancel()
            if proc.returncode is None:
                await proc.wait()
        if victims:
            await asyncio.to_thread(_reap, victims, proc.pid)
        wall = time.monotonic() - start
        code = proc.returncode
        stderr_text = bytes(err.data).decode("utf-8", "replace")
        if code == sandbox_init.SETUP_EXIT and sandbox_init.SETUP_FAILED in stderr_text:
            raise SandboxError(stderr_text.strip())
        if not status:
            status = _status(code, limits, wall)
        if status in ("timeout", "output_limit"):
            code = None
        return ExecResult(status, code, bytes(out.data).decode("utf-8", "replace"), stderr_text, wall,
                          truncated=out.over or err.over)

    @staticmethod
    def _kill(pid: int) -> dict[int, int]:
        """SIGKILL the bootstrap, everything below it and its process group; returns the
        processes below the bootstrap (pid: start time) for `_reap`."""
        below = _descendants(pid)
        victims = {p: info[3] for p in below if (info := _stat(p)) is not None}
        for victim in below + [pid]:
            try:
                os.kill(victim, signal.SIGKILL)
            except OSError:
                pass
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError as exc:
            if exc.errno not in (errno.ESRCH, errno.EPERM):
                raise
        return victims


def _clean_up(workdir: str, uid: int | None) -> None:
    """Kill what is left of an execution's uid (when it had its own) and delete its directory."""
    if uid is not None:
        kill_uid(uid)
    shutil.rmtree(workdir, ignore_errors=True)


def _status(code: int | None, limits: Limits, wall: float) -> str:
    """The status of a program that ended by itself (its exit code, or 128 + signal from the
    namespace bootstrap, or -signal)."""
    if code == 0:
        return "ok"
    sig = -code if code is not None and code < 0 else (code - 128 if code is not None and code > 128 else 0)
    if sig == signal.SIGXCPU or (sig == signal.SIGKILL and wall >= 0.9 * limits.cpu_s):
        return "cpu_limit"
    if sig:
        return "signal"
    return "error"


def run_sync(coro: Any) -> Any:
    """Run a coroutine to completion from synchronous code (a fresh event loop; from inside a
    running loop, on a helper thread)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def rlimit_names() -> list[str]:
    """The resource limits the sandbox sets (for docs and tests)."""
    return [n for n in ("RLIMIT_CORE", "RLIMIT_CPU", "RLIMIT_AS", "RLIMIT_FSIZE", "RLIMIT_NOFILE", "RLIMIT_NPROC")
            if hasattr(resource, n)]
