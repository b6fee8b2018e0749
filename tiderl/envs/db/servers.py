"""Throwaway PostgreSQL and MariaDB/MySQL servers for tests and trials: a fresh data directory
in a temporary folder, a server listening only on a unix socket inside it, stopped and removed
on exit.

    with ThrowawayPostgres() as pg:              # SkipServer when the binaries are missing
        pg.execute("CREATE TABLE t (a int)")
        url = pg.url()                           # postgresql://tiderl_admin@/postgres?host=...

Where the binaries come from (nothing is hard-coded to one machine):
- PostgreSQL: the folder in $TIDERL_PG_BIN, else `pg_config --bindir`, else the folder of
  `initdb` on PATH, else the newest `lib/postgresql/<version>/bin` under /usr (Debian and
  Ubuntu keep the server there, off PATH).
- MariaDB/MySQL: the folder in $TIDERL_MYSQL_BIN, else `mariadbd` / `mysqld` on PATH or in the
  usual sbin/libexec folders; `mariadb-install-db` / `mysql_install_db` next to it or on PATH
  (MySQL 8 initializes with `mysqld --initialize-insecure` instead).
`make db-servers` installs both from the distribution's packages.

Neither server runs as root: when this process is root, the server runs as the system user
the packages created (`postgres` / `mysql`), else `nobody`, and its folder is handed to it.
Servers are started as child processes of this one (no daemons), with durability off (they
hold test data), and stopped with a fast shutdown, then SIGKILL if they do not stop in time.
"""

from __future__ import annotations

import ctypes
import glob
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0


class SkipServer(RuntimeError):
    """The server cannot be started here (binaries or driver missing); the message says why
    and how to fix it (tests turn it into a skip)."""


def _executable(folder: str | Path, name: str) -> str | None:
    path = Path(folder) / name
    return str(path) if path.is_file() and os.access(path, os.X_OK) else None


def find_postgres_bin() -> Path:
    """The folder holding `initdb` and `postgres` (see the module docstring); SkipServer otherwise."""
    candidates: list[str] = []
    if os.environ.get("TIDERL_PG_BIN"):
        candidates.append(os.environ["TIDERL_PG_BIN"])
    pg_config = shutil.which("pg_config")
    if pg_config:
        try:
            candidates.append(subprocess.run([pg_config, "--bindir"], capture_output=True, text=True,
                                             timeout=10).stdout.strip())
        except (OSError, subprocess.SubprocessError):
            pass
    initdb = shutil.which("initdb")
    if initdb:
        candidates.append(str(Path(os.path.realpath(initdb)).parent))
    versions = glob.glob("/usr/lib/postgresql/*/bin") + glob.glob("/usr/pgsql-*/bin")
    candidates += sorted(versions, key=lambda p: [int(x) for x in "".join(
        c if c.isdigit() else " " for c in p).split()], reverse=True)
    for folder in candidates:
        if folder and _executable(folder, "initdb") and _executable(folder, "postgres"):
            return Path(folder)
    raise SkipServer("PostgreSQL server binaries (initdb, postgres) not found. Fix: `make db-servers` (installs "
                     "the distribution's postgresql package), or set TIDERL_PG_BIN to the folder holding initdb.")


def find_mysql_bin() -> tuple[str, str | None]:
    """(the server binary, the install-db script or None for MySQL 8's --initialize-insecure);
    SkipServer when no MariaDB/MySQL server is found."""
    folders = [os.environ["TIDERL_MYSQL_BIN"]] if os.environ.get("TIDERL_MYSQL_BIN") else []
    folders += os.environ.get("PATH", "").split(os.pathsep) + ["/usr/sbin", "/usr/local/sbin", "/usr/libexec",
                                                               "/usr/local/mysql/bin"]
    for name in ("mariadbd", "mysqld"):
        for folder in folders:
            server = _executable(folder, name) if folder else None
            if server is None:
                continue
            for script in ("mariadb-install-db", "mysql_install_db"):
                found = _executable(folder, script) or shutil.which(script)
                if found:
                    return server, found
            return server, None
    raise SkipServer("no MariaDB/MySQL server binary (mariadbd, mysqld) found. Fix: `make db-servers` (installs "
                     "the distribution's mariadb-server package), or set TIDERL_MYSQL_BIN to its folder.")


def _service_user(preferred: str) -> pwd.struct_passwd | None:
    """The user a server runs as when this process is root (None when it is not root)."""
    if os.geteuid() != 0:
        return None
    for name in (preferred, "nobody"):
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    raise SkipServer(f"running as root and neither a {preferred!r} nor a 'nobody' user exists to run the server")


def _chown_tree(path: Path, user: pwd.struct_passwd | None) -> None:
    if user is None:
        return
    for root, dirs, files in os.walk(path):
        os.chown(root, user.pw_uid, user.pw_gid)
        for name in dirs + files:
            os.chown(os.path.join(root, name), user.pw_uid, user.pw_gid, follow_symlinks=False)


def _die_with_parent(sig: int) -> Any:
    """A preexec_fn asking Linux to send `sig` to the server when this process dies (a test run
    that is killed leaves no server behind); None where prctl is not available. It runs in the
    child after the switch to the service user, which would clear an earlier setting."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def arm() -> None:
        prctl(1, int(sig), 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before the signal was armed
            os.kill(os.getpid(), int(sig))

    return arm


class _Server:
    """What both servers share: a private folder, a child process, start and stop."""

    kind = ""
    service_user = ""

    def __init__(self, folder: str | Path | None = None) -> None:
        self._own_folder = folder is None
        self.folder = Path(folder) if folder else Path(tempfile.mkdtemp(prefix=f"tiderl-{self.kind}-"))
        self.user = _service_user(self.service_user)
        self.process: subprocess.Popen | None = None
        self.log = self.folder / "server.log"

    def _run(self, argv: Sequence[str], timeout: float = 120.0) -> None:
        """Run a setup command as the service user; SkipServer with its output when it fails."""
        result = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, cwd=self.folder,
                                **self._as_user())
        if result.returncode != 0:
            raise SkipServer(f"{Path(argv[0]).name} failed (exit {result.returncode}): "
                             f"{(result.stderr or result.stdout)[-2000:]}")

    def _as_user(self) -> dict[str, Any]:
        if self.user is None:
            return {}
        return {"user": self.user.pw_uid, "group": self.user.pw_gid, "extra_groups": []}

    def _spawn(self, argv: Sequence[str]) -> None:
        log = open(self.log, "ab")
        try:
            self.process = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                            cwd=self.folder, start_new_session=True,
                                            preexec_fn=_die_with_parent(self._stop_signal), **self._as_user())
        finally:
            log.close()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                break
            try:
                self.connect().close()
                return
            except Exception as exc:  # not up yet
                last = exc
                time.sleep(0.1)
        tail = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
        self.stop()
        raise SkipServer(f"the {self.kind} server did not start ({last}); its log ends:\n{tail}")

    def connect(self, **kwargs: Any) -> Any:
        raise NotImplementedError

    def stop(self) -> None:
        """Stop the server (fast shutdown, then SIGKILL) and remove its folder (once)."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            try:
                process.send_signal(self._stop_signal)
                process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self._own_folder:
            shutil.rmtree(self.folder, ignore_errors=True)

    _stop_signal = signal.SIGTERM

    def __enter__(self) -> "_Server":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __del__(self) -> None:
        process = getattr(self, "process", None)
        if process is not None and process.poll() is None:
            process.kill()

    def execute(self, sql: str, params: Sequence[Any] | None = None, database: str | None = None,
                many: Sequence[Sequence[Any]] | None = None) -> list[tuple]:
        """Run one statement as the administrator (autocommit); its rows, if any."""
        conn = self.connect(database=database)
        try:
            cursor = conn.cursor()
            if many is not None:
                cursor.executemany(sql, many)
            else:
                cursor.execute(sql, params)
            rows = list(cursor.fetchall()) if cursor.description else []
            conn.commit()
            return rows
        finally:
            conn.close()


class ThrowawayPostgres(_Server):
    """A PostgreSQL server on a unix socket in a temporary folder (see the module docstring).
    The superuser is `tiderl_admin`, trusted without a password (only this machine's users who
    can reach the socket folder connect)."""

    kind = "postgres"
    service_user = "postgres"
    admin = "tiderl_admin"
    _stop_signal = signal.SIGINT  # PostgreSQL's fast shutdown

    def __init__(self, folder: str | Path | None = None) -> None:
        self.bindir = find_postgres_bin()
        _import("psycopg", "psycopg[binary]")
        super().__init__(folder)
        try:
            self.data = self.folder / "data"
            self.socket_dir = self.folder
            _chown_tree(self.folder, self.user)
            self._run([str(self.bindir / "initdb"), "-D", str(self.data), "-U", self.admin, "--auth=trust",
                       "-E", "UTF8", "--locale=C", "--no-sync"])
            self._spawn([str(self.bindir / "postgres"), "-D", str(self.data), "-k", str(self.socket_dir),
                         "-c", "listen_addresses=", "-c", "fsync=off", "-c", "synchronous_commit=off",
                         "-c", "full_page_writes=off", "-c", "max_connections=60",
                         "-c", "shared_buffers=16MB"])
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def url(self, user: str | None = None, database: str = "postgres") -> str:
        """A libpq URL of the server (`postgresql://user@/database?host=<socket folder>`)."""
        return f"postgresql://{user or self.admin}@/{database}?host={self.socket_dir}"

    def connect(self, user: str | None = None, database: str | None = None, **kwargs: Any) -> Any:
        import psycopg

        return psycopg.connect(host=str(self.socket_dir), user=user or self.admin, dbname=database or "postgres",
                               connect_timeout=5, **kwargs)

    def create_database(self, name: str) -> None:
        conn = self.connect(autocommit=True)
        try:
            conn.execute(f'CREATE DATABASE "{name}"')
        finally:
            conn.close()


class ThrowawayMariaDB(_Server):
    """A MariaDB (or MySQL) server on a unix socket in a temporary folder, networking off (see
    the module docstring). The administrator is `root` without a password, reachable only
    through the socket."""

    kind = "mariadb"
    service_user = "mysql"
    admin = "root"

    def __init__(self, folder: str | Path | None = None) -> None:
        self.server, install_db = find_mysql_bin()
        _import("pymysql", "PyMySQL")
        super().__init__(folder)
        try:
            self.data = self.folder / "data"
            self.socket = self.folder / "mysqld.sock"
            self.data.mkdir()
            _chown_tree(self.folder, self.user)
            common = ["--no-defaults", f"--datadir={self.data}"]
            if self.user is not None:
                common.append(f"--user={self.user.pw_name}")
            if install_db is not None:
                self._run([install_db, *common, "--auth-root-authentication-method=normal", "--skip-test-db",
                           "--skip-name-resolve"])
            else:
                self._run([self.server, *common, "--initialize-insecure"])
            self._spawn([self.server, *common, f"--socket={self.socket}", "--skip-networking",
                         f"--pid-file={self.folder / 'mysqld.pid'}", "--innodb-buffer-pool-size=32M",
                         "--skip-log-bin", "--innodb-flush-log-at-trx-commit=0", "--max-connections=60",
                         f"--log-error={self.log}"])
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def url(self, user: str | None = None, database: str = "mysql") -> str:
        """A URL of the server (`mysql://user@localhost/database?unix_socket=<socket>`)."""
        return f"mysql://{user or self.admin}@localhost/{database}?unix_socket={self.socket}"

    def connect(self, user: str | None = None, database: str | None = None, **kwargs: Any) -> Any:
        import pymysql

        return pymysql.connect(unix_socket=str(self.socket), user=user or self.admin, database=database,
                               connect_timeout=5, charset="utf8mb4", ssl_disabled=True, **kwargs)

    def create_database(self, name: str) -> None:
        self.execute(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4")


def _import(module: str, package: str) -> Any:
    """The driver, or a skip that names the package (`server_backend.need_driver`'s message)."""
    from tiderl.envs.db.server_backend import need_driver

    try:
        return need_driver(module, package)
    except ImportError as exc:
        raise SkipServer(str(exc)) from None
