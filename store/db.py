"""The store's connection layer: one SQL dialect for the store's queries, two databases under it.

The store's queries are written once, in the subset SQLite and PostgreSQL share (``?`` placeholders,
``INSERT ... ON CONFLICT DO NOTHING``, ``RETURNING``); this module runs them on either:

- `SqliteDatabase`: one file (WAL), a connection per thread, write transactions ``BEGIN IMMEDIATE`` (one
  writer at a time, so a read-modify-write inside one never races another process).
- `PostgresDatabase`: a server named by URL (psycopg 3), a connection per thread in autocommit mode,
  write transactions ``READ COMMITTED``; what must not interleave takes a lock (`Tx.lock`: a transaction
  advisory lock, or a row lock with `Database.for_update`).

Invariants:
- Schema changes are numbered migrations applied in order, each in the transaction that records its
  number (SQLite's ``user_version``; PostgreSQL's ``schema_migrations`` table), under a lock and after
  re-reading the version inside it: two processes opening an old store at once apply each migration once.
- The DDL is written in SQLite's types; `postgres_ddl` maps them (``REAL`` -> ``DOUBLE PRECISION``,
  ``BLOB`` -> ``BYTEA``, ``AUTOINCREMENT`` keys -> ``BIGSERIAL``, ``TEXT`` -> ``TEXT COLLATE "C"``, so text
  sorts bytewise as in SQLite and both backends list records in the same order).
"""

from __future__ import annotations

import contextlib
import re
import sqlite3
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from durable_rollouts.errors import ConfigError, StoreError

Migration = tuple[int, str]


class Tx:
    """The statements of one transaction (or of one autocommitted statement, outside a transaction)."""

    def __init__(self, conn: Any, dialect: str) -> None:
        self._conn = conn
        self.dialect = dialect

    def execute(self, sql: str, args: Sequence[Any] = ()) -> Any:
        """Run one statement; the cursor's rows index by position and by column name."""
        return self._conn.execute(_sql(sql, self.dialect), args)

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        if self.dialect == "sqlite":
            self._conn.executemany(sql, rows)
        else:
            with self._conn.cursor() as cur:
                cur.executemany(_sql(sql, self.dialect), list(rows))

    def lock(self, name: str) -> None:
        """Hold ``name`` until this transaction ends (PostgreSQL advisory lock; SQLite's write transaction
        is exclusive already)."""
        if self.dialect == "postgresql":
            self._conn.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (name,))


@lru_cache(maxsize=1024)
def _sql(sql: str, dialect: str) -> str:
    return sql if dialect == "sqlite" else sql.replace("%", "%%").replace("?", "%s")


def postgres_ddl(ddl: str) -> str:
    """SQLite DDL in PostgreSQL's types (see the module docstring)."""
    ddl = ddl.replace("INTEGER PRIMARY KEY AUTOINCREMENT", "BIGSERIAL PRIMARY KEY")
    ddl = re.sub(r"\bREAL\b", "DOUBLE PRECISION", ddl)
    ddl = re.sub(r"\bBLOB\b", "BYTEA", ddl)
    return re.sub(r"\bTEXT\b", 'TEXT COLLATE "C"', ddl)


class Database(ABC):
    """Connections to one store database, one per thread; safe to share between threads."""

    dialect: str
    for_update: str
    """Suffix of a SELECT that locks the rows it reads until the transaction ends ('' where the write
    transaction is exclusive anyway)."""
    location: str
    """Where the database is, for messages (a path, or a URL without its password)."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._all: list[Any] = []
        self._all_lock = threading.Lock()

    @abstractmethod
    def _connect(self) -> Any: ...

    def _conn(self) -> Any:
        conn = getattr(self._local, "conn", None)
        if conn is None or getattr(conn, "closed", False) or getattr(conn, "broken", False):
            conn = self._connect()
            self._local.conn = conn
            with self._all_lock:
                self._all.append(conn)
        return conn

    def execute(self, sql: str, args: Sequence[Any] = ()) -> Any:
        """One statement outside any transaction (a read, or a write that needs no other)."""
        return Tx(self._conn(), self.dialect).execute(sql, args)

    @abstractmethod
    def tx(self) -> Any:
        """A write transaction (a context manager yielding a `Tx`): committed at its end, rolled back on
        an error."""

    @abstractmethod
    def schema_version(self) -> int: ...

    @abstractmethod
    def migrate(self, base: str, migrations: list[Migration]) -> None:
        """Create the base schema if absent and apply the migrations the database has not had yet."""

    def close(self) -> None:
        """Close every connection this object opened (threads reconnect if they use it again)."""
        with self._all_lock:
            conns, self._all = self._all, []
        for conn in conns:
            with contextlib.suppress(Exception):  # one another thread broke is closed already
                conn.close()
        self._local = threading.local()


class SqliteDatabase(Database):
    """A SQLite file in WAL mode."""

    dialect = "sqlite"
    for_update = ""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.location = str(self.path.parent)

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=30, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.row_factory = sqlite3.Row
        return conn

    @contextmanager
    def tx(self) -> Iterator[Tx]:
        conn = self._conn()
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield Tx(conn, self.dialect)
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    def schema_version(self) -> int:
        return int(self._conn().execute("PRAGMA user_version").fetchone()[0])

    def migrate(self, base: str, migrations: list[Migration]) -> None:
        conn = self._conn()
        conn.executescript(base)
        if self.schema_version() >= migrations[-1][0]:
            return
        with self.tx():  # re-read under the write lock: another process may have migrated meanwhile
            current = self.schema_version()
            for version, ddl in migrations:
                if current < version:
                    for stmt in _statements(ddl):
                        if not self._has_column_added_by(conn, stmt):
                            conn.execute(stmt)
                    conn.execute(f"PRAGMA user_version={int(version)}")

    @staticmethod
    def _has_column_added_by(conn: sqlite3.Connection, stmt: str) -> bool:
        """Whether ``stmt`` adds a column the table already has. A 0.2.0 process read ``user_version``
        outside its write lock and wrote its own (1) after a newer one had migrated, so a store can carry
        a column its version says it lacks; SQLite has no ``ADD COLUMN IF NOT EXISTS``."""
        added = _ADD_COLUMN.match(stmt)
        if added is None:
            return False
        table, column = added.groups()
        return any(row[1] == column for row in conn.execute(f"PRAGMA table_info({table})"))


_ADD_COLUMN = re.compile(r"ALTER\s+TABLE\s+(\w+)\s+ADD\s+COLUMN\s+(\w+)", re.IGNORECASE)


def _statements(ddl: str) -> list[str]:
    return [s.strip() for s in ddl.split(";") if s.strip()]


class _Row(tuple[Any, ...]):
    """A PostgreSQL row read like `sqlite3.Row`: by position, by column name, and as ``dict(row)``."""

    _index: dict[str, int]

    def __new__(cls, values: Sequence[Any], index: dict[str, int]) -> _Row:
        row = super().__new__(cls, values)
        row._index = index
        return row

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):
            return tuple.__getitem__(self, self._index[key])
        return tuple.__getitem__(self, key)

    def keys(self) -> list[str]:
        return list(self._index)


def _row_factory(cursor: Any) -> Any:
    index = {c.name: i for i, c in enumerate(cursor.description or [])}
    return lambda values: _Row(values, index)


class PostgresDatabase(Database):
    """A PostgreSQL database named by a ``postgresql://`` URL (psycopg 3)."""

    dialect = "postgresql"
    for_update = " FOR UPDATE"

    def __init__(self, url: str, reconnect_s: float = 30.0) -> None:
        super().__init__()
        self.url = url
        self.location = redact(url)
        self.reconnect_s = reconnect_s
        """How long a new connection to a server this object has reached before is tried again (backoff up
        to 2 s) before the statement fails with a retryable `StoreError`: a server restart or a short
        partition is ridden out inside the statement, not spent from the caller's own retries (an engine
        call's, say). The first connection is never retried: a wrong URL fails at once."""
        self._reached = False

    def _connect(self) -> Any:
        """A new connection. The first one failing is a configuration error (a wrong URL, no server);
        a later one (a server restarting under a running worker) is a retryable `StoreError`."""
        import psycopg

        deadline = time.monotonic() + (self.reconnect_s if self._reached else 0.0)
        pause = 0.2
        while True:
            try:
                # text comes back as str whatever the database's encoding (a SQL_ASCII one hands back bytes)
                conn = psycopg.connect(self.url, autocommit=True, connect_timeout=10, client_encoding="utf8")
                break
            except psycopg.OperationalError as e:
                if time.monotonic() + pause < deadline:  # a server that was there: restarting, or cut off
                    time.sleep(pause)
                    pause = min(2 * pause, 2.0)
                    continue
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                error = StoreError if self._reached else ConfigError
                raise error(f"store {self.location}: cannot connect: {first}") from None
        self._reached = True
        conn.row_factory = _row_factory
        return conn

    @contextmanager
    def _lost(self) -> Iterator[None]:
        """A connection lost mid-statement (server restarted, connection killed) is a retryable
        `StoreError`; the thread reconnects on its next statement."""
        import psycopg

        try:
            yield
        except psycopg.OperationalError as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise StoreError(f"store {self.location}: {first}") from None

    def _stale(self, e: Exception) -> bool:
        """Whether ``e`` says the server ended the thread's connection (`_NEVER_RAN`: shut down or restarted,
        or the backend terminated); if so, the connection is dropped so the next statement reconnects."""
        if getattr(e, "sqlstate", None) not in _NEVER_RAN:
            return False
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()
            self._local.conn = None
        return True

    def execute(self, sql: str, args: Sequence[Any] = ()) -> Any:
        """One statement; once more on a new connection when the server ended the thread's connection
        (`_stale`)."""
        import psycopg

        with self._lost():
            try:
                return super().execute(sql, args)
            except psycopg.OperationalError as e:
                if not self._stale(e):
                    raise
            return super().execute(sql, args)

    @contextmanager
    def tx(self) -> Iterator[Tx]:
        """A transaction; its BEGIN once more on a new connection when the server had ended the thread's
        connection (`_stale`: nothing of the transaction has run then). An error inside the body is the
        caller's (a retryable `StoreError` for a lost connection)."""
        import psycopg

        with self._lost(), contextlib.ExitStack() as stack:
            try:
                conn = self._conn()
                stack.enter_context(conn.transaction())
            except psycopg.OperationalError as e:
                if not self._stale(e):
                    raise
                conn = self._conn()
                stack.enter_context(conn.transaction())
            yield Tx(conn, self.dialect)

    def schema_version(self) -> int:
        conn = self._conn()
        if conn.execute("SELECT to_regclass('schema_migrations')").fetchone()[0] is None:
            return 0
        return int(conn.execute("SELECT COALESCE(MAX(version), 0) FROM schema_migrations").fetchone()[0])

    def migrate(self, base: str, migrations: list[Migration]) -> None:
        if self.schema_version() >= migrations[-1][0]:
            return
        with self.tx() as tx:
            tx.lock("durable-rollouts schema")  # one process creates and migrates; the others wait
            conn = self._conn()
            conn.execute(postgres_ddl(base))
            conn.execute(
                "CREATE TABLE IF NOT EXISTS schema_migrations"
                " (version INTEGER PRIMARY KEY, applied_at DOUBLE PRECISION NOT NULL)"
            )
            current = int(
                conn.execute("SELECT COALESCE(MAX(version), 0) FROM schema_migrations").fetchone()[0]
            )
            for version, ddl in migrations:
                if current < version:
                    conn.execute(postgres_ddl(ddl))
                    conn.execute(
                        "INSERT INTO schema_migrations (version, applied_at) VALUES (%s, %s)",
                        (version, time.time()),
                    )


_NEVER_RAN = frozenset({"57P01", "57P02", "57P03"})
"""SQLSTATEs of a connection the server ended (admin_shutdown, crash_shutdown, cannot_connect_now): the
statement on it never ran, or ran and was rolled back with the server's shutdown, so it is run again. (The
store's record writes are keyed, ``ON CONFLICT DO NOTHING``, so even a statement that committed just before
the server's notice cannot double a record.)"""


def redact(url: str) -> str:
    """A URL without its password (for messages and logs)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))
