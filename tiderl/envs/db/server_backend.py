"""A user's PostgreSQL or MariaDB/MySQL database as a read-only question source.

    backend = ServerBackend("postgresql://reader@db.example/music")
    backend = ServerBackend("mysql://reader:pw@127.0.0.1:3306/music")   # MariaDB too
    tiderl eval --env db --db postgresql://reader@/music?host=/run/pg --questions q.jsonl --oracle

Needs a driver: `psycopg` (3) for PostgreSQL, `PyMySQL` for MariaDB/MySQL
(`pip install 'tiderl[db-server]'`). URL schemes: `postgresql`, `postgres`, `mysql`,
`mariadb`, each optionally with a SQLAlchemy-style driver suffix (`postgresql+psycopg://`),
which is ignored. PostgreSQL URLs go to libpq as they are (`?host=/socket/folder`,
`?sslmode=...`); MySQL URLs take `?unix_socket=` (or `socket=`) and `charset=`.

The database's own tables (of the URL's database; on PostgreSQL of `current_schema()`, or
`schema=`) are every task's tables, as with a database file. The source is never written:

1. The session checks each statement again, without the environment's help: one statement, a
   SELECT/WITH/VALUES (or, in write tasks, INSERT/UPDATE/DELETE/REPLACE), and none of the
   functions that act outside the transaction (`DENIED`, matched anywhere in the text: ending
   other sessions, advisory/named locks, reading server files, MySQL's executable comments
   and `INTO OUTFILE`). The statement then goes to the server alone: psycopg's extended
   protocol and PyMySQL without multi-statements, so the server's parser, not ours, refuses a
   second statement hidden in a quoting trick.
2. Every episode is one transaction that is rolled back when the session closes, opened
   REPEATABLE READ (one consistent snapshot for the episode) and READ ONLY before the agent's
   first statement; PostgreSQL cannot make it read-write again once a query ran, and the
   session's default access mode is read-only too, so even a transaction that ended would be
   followed by read-only ones. Each statement runs under a savepoint, so an error undoes only
   that statement and the episode goes on. After each statement the session checks that its
   transaction is still open and (MySQL, where `SET SESSION TRANSACTION READ WRITE` is possible)
   the session still read-only, and otherwise closes the connection and ends the episode.
3. Write tasks: before the transaction turns read-only, each table is copied into a TEMPORARY
   table of the same name, which hides the real one for the session (PostgreSQL searches its
   temporary schema first; MySQL resolves the name to the temporary table). Writes go to the
   copies, which read-only transactions allow, so they are visible to the episode's later
   statements and to nobody else, and vanish with the connection. Keys, defaults and
   identity/serial counters are copied (a serial column gets a temporary sequence that starts
   after the copied rows), so an INSERT that leaves the key out works as on the source.
4. The server's permissions: connect as a role that may only read (PostgreSQL: SELECT on the
   tables, TEMP on the database, PUBLIC's default; MySQL: SELECT and CREATE TEMPORARY TABLES).
   On PostgreSQL the layers above hold with any role (tested as the superuser, also with layer
   1 off); on MySQL a statement layer 1 refuses (a session setting, then DDL, whose implicit
   commit ends the transaction) could get past layers 2-3, so there the role is part of the
   guarantee. Everywhere it is what keeps the data safe from anything no test thought of.

Limits: the statement's time limit is set on the server before each statement
(`statement_timeout`; MariaDB `max_statement_time`, MySQL `max_execution_time`, which covers
SELECTs only), and by default (`isolate=True`) the session runs in a worker process killed when
no reply comes in time (`worker.py`): a killed worker's connection closes, and PostgreSQL stops
its statement (`client_connection_check_interval`). Rows: PostgreSQL reads through a server-side
cursor and MySQL through an unbuffered cursor with `sql_select_limit`, so a huge result is never
built in the client; at most `max_rows` are shown and the rest counted up to `ROW_COUNT_CAP`.
Values: results holding a value over `MAX_VALUE_BYTES` are refused; MySQL's
`max_allowed_packet` bounds what the server builds, and the worker's address space bounds the
client.

Concurrency: each session is one connection in its own transaction. A backend bounds its open
sessions (`max_sessions`); `open` waits up to `wait_s` for one to close, then raises
RuntimeError naming the fix. Connections are pooled (`pool_size`): at the end of an episode the
connection is rolled back and reset (`_Dialect.reset`: PostgreSQL `DISCARD ALL`, MySQL
`COM_RESET_CONNECTION`, then the session's settings again), so no session state, temporary table
or variable outlives its episode; one that cannot be reset, or whose episode escaped its
transaction, is closed. In worker processes each idle worker keeps its one connection
(`worker.py`).

MySQL 8 and MariaDB differ in the statement time limit (`mysql_time_limit`) and in the name of
the read-only variable; both are chosen from the server's `VERSION()` (`is_mariadb`).

Knowledge units come from `referenced_units` (a conservative reading of the SQL text).
"""

from __future__ import annotations

import re
import threading
from typing import Any, Sequence
from urllib.parse import parse_qs, unquote, urlsplit

from tiderl.envs.db.backend import (
    ROW_COUNT_CAP,
    QueryResult,
    SQLError,
    TableSpec,
    fetch_limited,
    rows_hash,
)
from tiderl.envs.db.sql_text import READ, WRITE, referenced_units, split_statements, statement_kind
from tiderl.envs.db.worker import BackendSpec, IsolatedSession, timeout_message

# URL scheme (before any "+driver") -> dialect.
SCHEMES = {"postgresql": "postgresql", "postgres": "postgresql", "mysql": "mysql", "mariadb": "mysql"}

# Words refused anywhere in a statement, per dialect (see the module docstring, layer 1).
DENIED = {
    "postgresql": re.compile(
        r"\b(pg_terminate_backend|pg_cancel_backend|pg_(try_)?advisory\w*|set_config|pg_read_(binary_)?file|"
        r"pg_ls_\w+|pg_stat_file|lo_\w+|dblink\w*|pg_reload_conf|pg_rotate_logfile|pg_promote|"
        r"pg_log_backend_memory_contexts|query_to_xml\w*|cursor_to_xml\w*|table_to_xml\w*|"
        r"pg_logical_emit_message|pg_notify)\b|\bu&", re.IGNORECASE),
    "mysql": re.compile(
        r"\b(get_lock|release_lock|release_all_locks|is_used_lock|is_free_lock|load_file|"
        r"master_pos_wait|master_gtid_wait|source_pos_wait)\b|\binto\s+(outfile|dumpfile)\b|/\*[!m]",
        re.IGNORECASE),
}

# A foreign key line of MySQL's SHOW CREATE TABLE (temporary tables cannot have them).
_FOREIGN_KEY = re.compile(r",\n\s*(CONSTRAINT\s+`(?:[^`]|``)*`\s+)?FOREIGN KEY[^\n]*")

# Added to the default system prompt (DBEnv): the dialect the agent writes.
PROMPT_NOTES = {
    "postgresql": "The database is PostgreSQL: quote names with double quotes (\"School Name\"); strings take "
                  "single quotes.",
    "mysql": "The database is MySQL/MariaDB: quote names with backticks (`School Name`); double quotes make "
             "strings, and table names are case-sensitive.",
}

# Seconds the backend's own queries (schema, copies, hashes) may run.
OWN_QUERY_TIMEOUT_S = 60.0
_SAVEPOINT = "tiderl_statement"


def server_dialect(url: str) -> str | None:
    """"postgresql" or "mysql" for a server URL this backend opens, else None."""
    scheme = url.split("://", 1)[0].split("+", 1)[0].lower() if "://" in url else ""
    return SCHEMES.get(scheme)


def redact_url(url: str) -> str:
    """The URL with its password replaced by ***, for logs and task metadata."""
    return re.sub(r"^([^:/]+://[^:/@]*):[^@/]*@", r"\1:***@", url)


def is_mariadb(version: str) -> bool:
    """Whether a MySQL-protocol server's `VERSION()` is MariaDB's ("10.11.6-MariaDB-0+deb12u1";
    MySQL says "8.0.36" or "8.4.0-log")."""
    return "mariadb" in version.lower()


def mysql_time_limit(mariadb: bool, timeout_s: float) -> str:
    """The session setting that stops a statement after `timeout_s`: MariaDB's
    `max_statement_time` (seconds, any statement) or MySQL 8's `max_execution_time`
    (milliseconds, SELECTs only: a write is bounded by the worker's kill instead)."""
    if mariadb:
        return f"max_statement_time = {max(0.001, float(timeout_s)):.3f}"
    return f"max_execution_time = {max(1, int(timeout_s * 1000))}"


def need_driver(module: str, package: str) -> Any:
    """The imported driver module, or an ImportError naming the package to install."""
    try:
        return __import__(module)
    except ImportError:
        raise ImportError(f"a {module} connection needs the {package} package: pip install '{package}' "
                          "(or pip install 'tiderl[db-server]')") from None


class _Dialect:
    """What differs between PostgreSQL and MySQL: connecting, the catalog, the transaction set-up,
    running one statement, and telling a time-out from other errors."""

    name = ""
    error: type = Exception

    def connect(self, url: str) -> Any: ...
    def quote(self, name: str) -> str: ...
    def read_tables(self, conn: Any, schema: str | None) -> list[TableSpec]: ...
    def begin(self, conn: Any, tables: Sequence[TableSpec], writable: bool) -> None: ...
    def run(self, conn: Any, sql: str, kind: str, max_rows: int, timeout_s: float) -> QueryResult: ...
    def in_transaction(self, conn: Any) -> bool: ...
    def explain(self, exc: Exception, timeout_s: float) -> str: ...
    def broken(self, conn: Any) -> bool: ...
    def reset(self, conn: Any) -> None: ...


class _Postgres(_Dialect):
    name = "postgresql"

    def __init__(self) -> None:
        self.psycopg = need_driver("psycopg", "psycopg[binary]")
        self.error = self.psycopg.Error

    def connect(self, url: str) -> Any:
        scheme, rest = url.split("://", 1)
        conn = self.psycopg.connect("postgresql://" + rest, autocommit=True, connect_timeout=10)
        try:
            self._session_defaults(conn)
        except BaseException:
            conn.close()
            raise
        return conn

    def _session_defaults(self, conn: Any) -> None:
        """The session's settings (on a connection in autocommit mode; leaves it out of it)."""
        conn.execute("SET default_transaction_read_only = on")
        try:  # PostgreSQL 14+: notice a client that went away while its statement runs
            conn.execute("SET client_connection_check_interval = 1000")
        except self.psycopg.Error:
            pass
        conn.autocommit = False

    def reset(self, conn: Any) -> None:
        """Make a used connection as a new one: roll back, then DISCARD ALL (session settings,
        temporary tables and sequences, prepared statements, cursors, locks, LISTENs; psycopg
        clears its own prepared-statement cache on seeing it), then the session's settings."""
        conn.rollback()
        conn.autocommit = True
        conn.execute("DISCARD ALL")
        self._session_defaults(conn)

    def quote(self, name: str) -> str:
        return '"' + name.replace('"', '""') + '"'

    def read_tables(self, conn: Any, schema: str | None) -> list[TableSpec]:
        schema = schema or conn.execute("SELECT current_schema()").fetchone()[0]
        if schema is None:
            raise ValueError("the connection has no current schema (search_path names none that exists). Fix: "
                             "add ?options=-csearch_path%3Dyour_schema to the URL.")
        self.schema = schema
        names = [r[0] for r in conn.execute(
            "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = %s AND c.relkind IN ('r', 'p') ORDER BY c.relname", (schema,))]
        tables = []
        for name in names:
            columns = conn.execute(
                "SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute "
                "WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped ORDER BY attnum",
                (f"{self.quote(schema)}.{self.quote(name)}",)).fetchall()
            tables.append(TableSpec(name, tuple((str(c), str(t)) for c, t in columns), ()))
        conn.rollback()
        return tables

    def begin(self, conn: Any, tables: Sequence[TableSpec], writable: bool) -> None:
        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ WRITE")
        conn.execute(f"SET LOCAL statement_timeout = {int(OWN_QUERY_TIMEOUT_S * 1000)}")
        if writable:
            for index, spec in enumerate(tables):
                self._copy(conn, spec.name, index)
        conn.execute("SET TRANSACTION READ ONLY")

    def _copy(self, conn: Any, name: str, index: int) -> None:
        """A temporary copy of one table under the same name (keys, defaults, counters)."""
        source = f"{self.quote(self.schema)}.{self.quote(name)}"
        copy = f"pg_temp.{self.quote(name)}"
        conn.execute(f"CREATE TEMP TABLE {self.quote(name)} (LIKE {source} INCLUDING ALL)")
        columns = [r[0] for r in conn.execute(
            "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped "
            "AND attgenerated = '' ORDER BY attnum", (copy,))]
        listed = ", ".join(self.quote(c) for c in columns)
        conn.execute(f"INSERT INTO {copy} ({listed}) OVERRIDING SYSTEM VALUE SELECT {listed} FROM {source}")
        counters = conn.execute(
            "SELECT a.attname, a.attidentity <> '', coalesce(pg_get_expr(d.adbin, d.adrelid), '') "
            "FROM pg_attribute a LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum "
            "WHERE a.attrelid = %s::regclass AND a.attnum > 0 AND NOT a.attisdropped", (copy,)).fetchall()
        for number, (column, identity, default) in enumerate(counters):
            if not identity and not default.startswith("nextval("):
                continue
            start = conn.execute(f"SELECT coalesce(max({self.quote(column)}), 0) + 1 FROM {copy}").fetchone()[0]
            if identity:
                conn.execute(f"ALTER TABLE {copy} ALTER COLUMN {self.quote(column)} RESTART WITH {int(start)}")
            else:
                sequence = f"pg_temp.tiderl_sequence_{index}_{number}"
                conn.execute(f"CREATE TEMP SEQUENCE tiderl_sequence_{index}_{number} START WITH {int(start)}")
                conn.execute(f"ALTER TABLE {copy} ALTER COLUMN {self.quote(column)} "
                             f"SET DEFAULT nextval('{sequence}'::regclass)")

    def run(self, conn: Any, sql: str, kind: str, max_rows: int, timeout_s: float) -> QueryResult:
        conn.execute(f"SET LOCAL statement_timeout = {max(1, int(timeout_s * 1000))}")
        conn.execute(f"SAVEPOINT {_SAVEPOINT}")
        try:
            if kind == READ:  # a server-side cursor: rows are made only as they are fetched
                cursor = conn.cursor(name="tiderl_result")
                cursor.execute(sql)
            else:  # prepare=True: the extended protocol, one statement only
                cursor = conn.cursor()
                cursor.execute(sql, prepare=True)
            try:
                if cursor.description is not None:
                    rows, more, capped = fetch_limited(cursor.fetchmany, max_rows)
                    result = QueryResult([d.name for d in cursor.description], rows, more, capped)
                else:
                    result = QueryResult([], [], rowcount=max(cursor.rowcount, 0))
            finally:
                cursor.close()
            conn.execute(f"RELEASE SAVEPOINT {_SAVEPOINT}")
        except BaseException:
            if not self.broken(conn):
                conn.execute(f"ROLLBACK TO SAVEPOINT {_SAVEPOINT}")
            raise
        return result

    def in_transaction(self, conn: Any) -> bool:
        return conn.info.transaction_status == self.psycopg.pq.TransactionStatus.INTRANS

    def broken(self, conn: Any) -> bool:
        return conn.closed or conn.info.transaction_status not in (
            self.psycopg.pq.TransactionStatus.INTRANS, self.psycopg.pq.TransactionStatus.INERROR)

    def explain(self, exc: Exception, timeout_s: float) -> str:
        if isinstance(exc, self.psycopg.errors.QueryCanceled) and "statement timeout" in str(exc):
            return timeout_message(timeout_s)
        return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


class _MySQL(_Dialect):
    name = "mysql"
    _TIMEOUT_CODES = (1969, 3024)  # MariaDB max_statement_time, MySQL max_execution_time

    def __init__(self) -> None:
        self.pymysql = need_driver("pymysql", "PyMySQL")
        self.error = self.pymysql.Error
        self.mariadb = True
        self.read_only_variable = "tx_read_only"

    def connect(self, url: str) -> Any:
        parts = urlsplit(url)
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        database = unquote(parts.path.lstrip("/"))
        if not database:
            raise ValueError(f"{redact_url(url)} names no database. Fix: end the URL with /your_database.")
        kwargs: dict[str, Any] = {
            "user": unquote(parts.username or ""), "password": unquote(parts.password or ""),
            "database": database, "charset": query.get("charset", "utf8mb4"), "autocommit": True,
            "connect_timeout": 10, "local_infile": False}
        socket = query.get("unix_socket") or query.get("socket")
        if socket:
            kwargs["unix_socket"] = socket
            kwargs["ssl_disabled"] = True  # nothing to encrypt on a local socket (and a TLS context costs 20 ms)
        else:
            kwargs["host"] = parts.hostname or "localhost"
            kwargs["port"] = parts.port or 3306
            if query.get("ssl", "").lower() in ("0", "false", "disabled"):
                kwargs["ssl_disabled"] = True
        conn = self.pymysql.connect(**kwargs)
        try:
            self.mariadb = is_mariadb(str(self._all(conn, "SELECT VERSION()")[0][0]))
            # MySQL 8 and MariaDB 11.1+ name it transaction_read_only; older ones tx_read_only.
            names = {r[0].lower() for r in self._all(conn, "SHOW VARIABLES WHERE Variable_name IN "
                                                           "('transaction_read_only', 'tx_read_only')")}
            self.read_only_variable = "transaction_read_only" if "transaction_read_only" in names else "tx_read_only"
        except BaseException:
            conn.close()
            raise
        return conn

    def quote(self, name: str) -> str:
        return "`" + name.replace("`", "``") + "`"

    def _all(self, conn: Any, sql: str, params: Sequence[Any] | None = None) -> list[tuple]:
        with conn.cursor() as cursor:
            cursor.execute(sql, params)
            return list(cursor.fetchall()) if cursor.description else []

    def read_tables(self, conn: Any, schema: str | None) -> list[TableSpec]:
        names = [r[0] for r in self._all(
            conn, "SELECT table_name FROM information_schema.tables WHERE table_schema = DATABASE() "
                  "AND table_type = 'BASE TABLE' ORDER BY table_name")]
        tables = []
        for name in names:
            columns = self._all(conn, "SELECT column_name, column_type FROM information_schema.columns "
                                      "WHERE table_schema = DATABASE() AND table_name = %s ORDER BY ordinal_position",
                                (name,))
            tables.append(TableSpec(str(name), tuple((str(c), str(t)) for c, t in columns), ()))
        return tables

    def _limit(self, conn: Any, timeout_s: float, select_limit: int | str = "DEFAULT") -> None:
        """The statement time limit, and the most rows a SELECT returns (`sql_select_limit`)."""
        self._all(conn, f"SET SESSION {mysql_time_limit(self.mariadb, timeout_s)}, sql_select_limit = {select_limit}")

    def begin(self, conn: Any, tables: Sequence[TableSpec], writable: bool) -> None:
        self._limit(conn, OWN_QUERY_TIMEOUT_S)
        if writable:
            for index, spec in enumerate(tables):
                self._copy(conn, spec.name, index)
        self._all(conn, "SET SESSION TRANSACTION READ ONLY")
        self._all(conn, "SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        self._all(conn, "START TRANSACTION WITH CONSISTENT SNAPSHOT, READ ONLY")

    def _copy(self, conn: Any, name: str, index: int) -> None:
        """A temporary copy of one table under the same name, made in one statement from the
        table's own definition (`SHOW CREATE TABLE`: keys, defaults, the AUTO_INCREMENT counter)
        without its foreign keys, filled by the SELECT of that statement. (`CREATE TEMPORARY
        TABLE t LIKE t` is refused, and renaming a copy needs write privileges on the table.)"""
        ddl = str(self._all(conn, f"SHOW CREATE TABLE {self.quote(name)}")[0][1])
        ddl = _FOREIGN_KEY.sub("", ddl)
        if not ddl.startswith("CREATE TABLE "):
            raise self.pymysql.err.ProgrammingError(0, f"unexpected definition of table {name!r}: {ddl[:80]}")
        columns = [r[0] for r in self._all(
            conn, "SELECT column_name FROM information_schema.columns WHERE table_schema = DATABASE() AND "
                  "table_name = %s AND extra NOT LIKE '%%GENERATED%%' ORDER BY ordinal_position", (name,))]
        listed = ", ".join(self.quote(c) for c in columns)
        self._all(conn, "CREATE TEMPORARY TABLE " + ddl[len("CREATE TABLE "):] +
                  f" SELECT {listed} FROM {self.quote(name)}")

    def run(self, conn: Any, sql: str, kind: str, max_rows: int, timeout_s: float) -> QueryResult:
        # A SELECT returns at most the rows shown plus the rows counted.
        self._limit(conn, timeout_s, max_rows + ROW_COUNT_CAP + 1 if kind == READ else "DEFAULT")
        self._all(conn, f"SAVEPOINT {_SAVEPOINT}")
        try:
            cursor = conn.cursor(self.pymysql.cursors.SSCursor if kind == READ else self.pymysql.cursors.Cursor)
            try:
                cursor.execute(sql)
                if cursor.description is not None:
                    rows, more, capped = fetch_limited(cursor.fetchmany, max_rows)
                    result = QueryResult([d[0] for d in cursor.description], rows, more, capped)
                else:
                    result = QueryResult([], [], rowcount=max(cursor.rowcount, 0))
            finally:
                cursor.close()
            self._all(conn, f"RELEASE SAVEPOINT {_SAVEPOINT}")
        except BaseException:
            if not self.broken(conn) and self.in_transaction(conn):
                self._all(conn, f"ROLLBACK TO SAVEPOINT {_SAVEPOINT}")
            raise
        return result

    def in_transaction(self, conn: Any) -> bool:
        """In the episode's transaction, and the session still read-only (a statement that
        changed the session's access mode must end the session before another one runs)."""
        if not conn.server_status & self.pymysql.constants.SERVER_STATUS.SERVER_STATUS_IN_TRANS:
            return False
        return self._all(conn, f"SELECT @@session.{self.read_only_variable}")[0][0] == 1

    def broken(self, conn: Any) -> bool:
        return not conn.open

    # COM_RESET_CONNECTION (MySQL 5.7.3+, MariaDB 10.2.4+); PyMySQL has no public call for it.
    _RESET_CONNECTION = 0x1F

    def reset(self, conn: Any) -> None:
        """Make a used connection as a new one: COM_RESET_CONNECTION rolls back and clears the
        session (temporary tables, user variables, session variables, prepared statements,
        named locks) without a new login; then the connection's character set and autocommit
        are set again."""
        conn.rollback()
        conn._execute_command(self._RESET_CONNECTION, b"")
        conn._read_ok_packet()
        conn.set_character_set(conn.charset)
        conn.autocommit(True)

    def explain(self, exc: Exception, timeout_s: float) -> str:
        args = getattr(exc, "args", ())
        if args and args[0] in self._TIMEOUT_CODES:
            return timeout_message(timeout_s)
        if len(args) >= 2 and isinstance(args[1], str):
            return args[1]
        return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _dialect(url: str) -> _Dialect:
    name = server_dialect(url)
    if name is None:
        raise ValueError(f"{redact_url(url)!r} is not a PostgreSQL or MySQL URL. Fix: postgresql://user@host/db "
                         "or mysql://user@host/db (mariadb:// works too).")
    return _Postgres() if name == "postgresql" else _MySQL()


class ServerBackend:
    """A PostgreSQL or MariaDB/MySQL database, read-only (see the module docstring).

    url: the server URL (its password never appears in messages).
    schema: PostgreSQL only: the schema whose tables are the task's (default: current_schema()).
    max_sessions: sessions open at once (one connection each); `open` waits up to `wait_s`.
    pool_size: idle connections kept for later episodes (None = max_sessions, 0 = a new
        connection per episode). A connection goes back to the pool only after a reset that
        leaves nothing of its episode (`_Dialect.reset`), and a session takes an idle one
        before it opens a new one, so the server sees at most `max_sessions` connections
        from one backend, in use and idle together.
    `open(tables, writable)` ignores `tables`: the database's own tables (`self.tables`, read
    once) are the task's.
    """

    name = "server"

    def __init__(self, url: str, isolate: bool = True, schema: str | None = None, max_sessions: int = 32,
                 wait_s: float = 60.0, pool_size: int | None = None) -> None:
        if max_sessions < 1:
            raise ValueError(f"max_sessions={max_sessions}: must be at least 1. Fix: use 32 (one connection each).")
        pool_size = max_sessions if pool_size is None else pool_size
        if not 0 <= pool_size <= max_sessions:
            raise ValueError(f"pool_size={pool_size}: must be between 0 and max_sessions ({max_sessions}). Fix: "
                             "leave it out (it follows max_sessions), or 0 for a new connection per episode.")
        self.url = url
        self.isolate = isolate
        self.schema = schema
        self.max_sessions = max_sessions
        self.pool_size = pool_size
        self.wait_s = wait_s
        self._dialect = _dialect(url)
        self.dialect = self._dialect.name
        self.prompt_note = PROMPT_NOTES[self.dialect]
        self._slots = threading.BoundedSemaphore(max_sessions)
        self._idle: list[Any] = []  # reset connections, ready for the next session
        self._idle_lock = threading.Lock()
        self._resetting = 0  # connections being reset for the pool
        self.connections_opened = 0  # new connections this backend (in this process) opened
        try:
            conn = self._connect()
        except self._dialect.error as exc:
            raise ValueError(f"cannot connect to {redact_url(url)}: {str(exc).strip()}. Fix: check the URL, the "
                             "user and that the server runs.") from None
        try:
            self.tables = self._dialect.read_tables(conn, schema)
        except BaseException:
            conn.close()
            raise
        if isolate:  # sessions run in worker processes, each with its own connection
            conn.close()
        else:
            self._give_back(conn)
        if not self.tables:
            raise ValueError(f"{redact_url(url)} has no tables{' in schema ' + schema if schema else ''}. Fix: "
                             "point the URL at the database (and schema) holding the tables to ask about.")

    def open(self, tables: Sequence[TableSpec] = (), writable: bool = False) -> Any:
        """A session on the database in its own read-only transaction (see the module docstring)."""
        if not self._slots.acquire(timeout=self.wait_s):
            raise RuntimeError(f"ServerBackend({redact_url(self.url)!r}): all {self.max_sessions} sessions stayed in "
                               f"use for {self.wait_s:g} s. Fix: close finished episodes (DBEnv.close), run fewer "
                               "episodes at once, or raise max_sessions (env.options.max_sessions; each is one server "
                               "connection).")
        try:
            if self.isolate:
                # The worker's own backend keeps at most its one connection between sessions; the
                # worker pool keeps at most pool_size such workers idle for this database.
                spec = BackendSpec(f"{__name__}:ServerBackend", (("pool_size", min(1, self.pool_size)),
                                                                 ("schema", self.schema), ("url", self.url)))
                session: Any = IsolatedSession(spec, self.tables, writable, keep_idle=self.pool_size)
            else:
                session = self._open_here(writable)
        except BaseException:
            self._slots.release()
            raise
        return _Slot(session, self._slots)

    def _connect(self) -> Any:
        conn = self._dialect.connect(self.url)
        self.connections_opened += 1
        return conn

    def _take(self) -> tuple[Any, bool]:
        """(a connection, whether it came from the pool)."""
        with self._idle_lock:
            if self._idle:
                return self._idle.pop(), True
        return self._connect(), False

    def _give_back(self, conn: Any) -> None:
        """Keep a used connection for a later session (reset first), or close it."""
        with self._idle_lock:  # a place in the pool is reserved before the (slow) reset
            keep = len(self._idle) + self._resetting < self.pool_size
            self._resetting += keep
        try:
            if keep:
                self._dialect.reset(conn)
        except Exception:  # a connection that cannot be reset is not reused
            keep = False
            with self._idle_lock:
                self._resetting -= 1
        if not keep:
            _close_quietly(conn)
            return
        with self._idle_lock:
            self._resetting -= 1
            self._idle.append(conn)

    def release_idle(self) -> None:
        """Close the pooled idle connections (the pool fills again as sessions close)."""
        with self._idle_lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            _close_quietly(conn)

    def _open_here(self, writable: bool) -> "ServerSession":
        conn, pooled = self._take()
        try:
            self._dialect.begin(conn, self.tables, writable)
        except self._dialect.error as exc:
            _close_quietly(conn)
            if pooled:  # an idle connection the server closed meanwhile: try a new one
                return self._open_here(writable)
            raise RuntimeError(f"the episode's transaction on {redact_url(self.url)} could not be set up: "
                               f"{self._dialect.explain(exc, 0)}. Fix: write tasks copy the tables into temporary "
                               "tables, so the user needs the TEMP privilege (PostgreSQL) or CREATE TEMPORARY "
                               "TABLES (MySQL).") from None
        except BaseException:
            _close_quietly(conn)
            raise
        return ServerSession(self._dialect, conn, self.tables, writable,
                             give_back=self._give_back if self.pool_size else None)

    def __del__(self) -> None:
        if getattr(self, "_idle", None):
            _off_this_thread(self.release_idle)


def _off_this_thread(fn: Any) -> None:
    """Run `fn` on a new daemon thread: what a finalizer does instead of calling it. A finalizer
    runs inside whatever allocation triggered the collection, even one made while this thread
    holds a lock `fn` takes again (the worker pool's, the idle connections'), and those locks are
    not re-entrant: called here, `fn` would deadlock (it did: the suite hung in `_keeps_room`).
    On another thread it waits for the lock instead."""
    threading.Thread(target=fn, daemon=True, name="tiderl-db-finalizer").start()


def _close_quietly(conn: Any) -> None:
    try:
        conn.close()
    except Exception:
        pass


class _Slot:
    """A session that gives its backend's slot back when it closes (once)."""

    def __init__(self, session: Any, slots: threading.BoundedSemaphore) -> None:
        self.session = session
        self._slots: threading.BoundedSemaphore | None = slots

    def __getattr__(self, name: str) -> Any:
        return getattr(self.session, name)

    def close(self) -> None:
        try:
            self.session.close()
        finally:
            slots, self._slots = self._slots, None
            if slots is not None:
                slots.release()

    def __del__(self) -> None:
        if getattr(self, "_slots", None) is not None:
            _off_this_thread(self.close)


class ServerSession:
    """One episode's connection: one transaction, rolled back on close (see the module docstring)."""

    def __init__(self, dialect: _Dialect, conn: Any, tables: Sequence[TableSpec], writable: bool,
                 give_back: Any = None) -> None:
        self._dialect = dialect
        self._conn = conn
        self._give_back = give_back  # the backend's pool, which resets the connection; None: close it
        self._tables = list(tables)
        self._writable = writable
        self._by_name = {t.name: t for t in tables}
        self.closed = False

    def _check(self, sql: str) -> str:
        """The statement's kind, or SQLError when this session refuses it (layer 1 again)."""
        if len(split_statements(sql)) != 1:
            raise SQLError("only one SQL statement per call")
        kind, keyword = statement_kind(sql)
        if kind == WRITE and not self._writable:
            raise SQLError("this task is read-only: only SELECT statements are allowed")
        if kind not in (READ, WRITE):
            raise SQLError(f"{keyword or 'this statement'} is not allowed: only SELECT (WITH, VALUES), and in write "
                           "tasks INSERT/UPDATE/DELETE, are allowed")
        denied = DENIED[self._dialect.name].search(sql)
        if denied:
            raise SQLError(f"{denied.group(0)!r} is not allowed here (it acts outside the episode's transaction)")
        return kind

    def _connection(self) -> Any:
        if self.closed:
            raise SQLError("the database session is closed")
        return self._conn

    def execute(self, sql: str, *, max_rows: int, timeout_s: float) -> QueryResult:
        kind = self._check(sql)
        conn = self._connection()
        try:
            result = self._dialect.run(conn, sql, kind, max_rows, timeout_s)
        except self._dialect.error as exc:
            message = self._dialect.explain(exc, timeout_s)
            self._check_transaction()
            raise SQLError(message) from None
        except SQLError:
            self._check_transaction()
            raise
        self._check_transaction()
        result.units = frozenset(referenced_units(sql, {t.name: t.column_names for t in self._tables}))
        return result

    def _check_transaction(self) -> None:
        """End the session when its transaction is gone (a lost connection, or a statement that
        ended it): nothing more may run outside the episode's transaction."""
        if self._dialect.broken(self._conn) or not self._dialect.in_transaction(self._conn):
            self._give_back = None  # a connection whose episode escaped its transaction is not reused
            self.close()
            raise SQLError("the episode's transaction ended (the connection was lost or the statement ended it); "
                           "the session is closed")

    def _own_query(self, sql: str) -> list[tuple]:
        conn = self._connection()
        try:
            result = self._dialect.run(conn, sql, READ, ROW_COUNT_CAP, OWN_QUERY_TIMEOUT_S)
        except self._dialect.error as exc:
            self._check_transaction()
            raise SQLError(self._dialect.explain(exc, OWN_QUERY_TIMEOUT_S)) from None
        if result.more_rows:
            raise SQLError(f"the table has more than {ROW_COUNT_CAP} rows")
        return result.rows

    def list_tables(self) -> list[str]:
        self._connection()
        return sorted(self._by_name)

    def describe_table(self, name: str) -> list[tuple[str, str]]:
        if name not in self._by_name:
            raise SQLError(f"no table named {name!r}")
        return list(self._by_name[name].columns)

    def table_hash(self, name: str) -> str:
        if name not in self._by_name:
            raise SQLError(f"no table named {name!r}")
        return rows_hash(self._own_query(f"SELECT * FROM {self._dialect.quote(name)}"))

    def close(self) -> None:
        """Roll the episode back and close the connection, or give it back to the backend's
        pool, which resets it (once; later calls do nothing)."""
        if self.closed:
            return
        self.closed = True
        if self._give_back is not None and not self._dialect.broken(self._conn):
            self._give_back(self._conn)
            return
        try:
            if not self._dialect.broken(self._conn):
                self._conn.rollback()
        except Exception:
            pass
        finally:
            self._conn.close()
