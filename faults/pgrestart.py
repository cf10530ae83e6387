"""A PostgreSQL server stopped and started again under a live run: the store's server, found by its own pid
file (``postmaster.pid`` in its data directory), stopped by that pid, down for a while, then started with the
same command line, user, working directory, environment, log and network namespace, on the same data
directory.

    server = pgrestart.find(data_dir)   # or find_for(store.db): the data directory the server reports
    with pgrestart.stopped(server):     # fast shutdown now; started again on leaving, whatever happens
        time.sleep(10)

Invariants: only the pid that the data directory's ``postmaster.pid`` names is signalled, and only while it
is a ``postgres`` process whose working directory or command line names that data directory (a stale pid
file of a reused pid is never acted on); the server is started again only once the old one has exited (the
pid file gone or its pid dead), so two servers never share the data directory.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["PgRestartError", "Server", "find", "find_for", "start", "stop", "stopped"]

STOP_S = 60.0
"""How long a fast shutdown may take before the server is SIGKILLed (the data directory survives both)."""
READY_S = 60.0


class PgRestartError(RuntimeError):
    """The server could not be found, stopped or started again (one line)."""


@dataclass(frozen=True)
class Server:
    """A running PostgreSQL server and what it takes to start it again."""

    data_dir: Path
    pid: int
    argv: tuple[str, ...]
    env: dict[str, str]
    cwd: str
    uid: int
    gid: int
    netns: str | None
    """The named network namespace it runs in (``/run/netns/NAME``); None for the machine's own."""
    log: str | None
    """The regular file its output went to (appended to again), else None."""

    def __str__(self) -> str:
        where = f" in netns {self.netns}" if self.netns else ""
        return f"postgres pid {self.pid} ({self.data_dir}{where})"


def _postmaster_pid(data_dir: Path) -> int | None:
    try:
        first = (data_dir / "postmaster.pid").read_text().splitlines()[0]
    except (OSError, IndexError):
        return None
    return int(first) if first.strip().isdigit() else None


def _netns_of(pid: int) -> str | None:
    """The named network namespace ``pid`` runs in; None when it is this process's own (unnamed) one."""
    theirs = os.stat(f"/proc/{pid}/ns/net").st_ino
    for ns in sorted(Path("/run/netns").glob("*")) if Path("/run/netns").is_dir() else []:
        with contextlib.suppress(OSError):
            if os.stat(ns).st_ino == theirs:
                return ns.name
    if theirs == os.stat("/proc/self/ns/net").st_ino:
        return None
    raise PgRestartError(
        f"postgres pid {pid} runs in an unnamed network namespace: cannot start it there again"
    )


def _ids(pid: int) -> tuple[int, int]:
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line
    )
    return int(fields["Uid"].split()[0]), int(fields["Gid"].split()[0])


def find(data_dir: Path) -> Server:
    """The server running on ``data_dir`` (by its ``postmaster.pid``).

    Raises:
        PgRestartError: no server runs there, or the pid file names a process that is not it.
    """
    data_dir = Path(data_dir)
    pid = _postmaster_pid(data_dir)
    if pid is None:
        raise PgRestartError(f"no running PostgreSQL on {data_dir} (no postmaster.pid)")
    try:
        argv = tuple(Path(f"/proc/{pid}/cmdline").read_bytes().decode().rstrip("\0").split("\0"))
        cwd = os.readlink(f"/proc/{pid}/cwd")
        environ = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
        out = os.readlink(f"/proc/{pid}/fd/2")
    except (FileNotFoundError, ProcessLookupError):
        raise PgRestartError(f"postmaster.pid of {data_dir} names pid {pid}, which is not running") from None
    if Path(argv[0]).name != "postgres" or not (str(data_dir) in argv or cwd == str(data_dir)):
        raise PgRestartError(
            f"pid {pid} of {data_dir}/postmaster.pid is not that server: {' '.join(argv)[:120]}"
        )
    uid, gid = _ids(pid)
    netns = _netns_of(pid)
    env = dict(kv.split("=", 1) for kv in environ.split("\0") if "=" in kv)
    log = out if Path(out).is_file() else None
    return Server(data_dir, pid, argv, env, cwd, uid, gid, netns, log)


def find_for(db: Any) -> Server:
    """The server of a store's PostgreSQL database (``store.db``), found by the data directory it reports
    (``SHOW data_directory``: a superuser's or a ``pg_read_all_settings`` member's query) on this machine."""
    if getattr(db, "dialect", None) != "postgresql":
        raise PgRestartError(f"the store at {getattr(db, 'location', db)} is not PostgreSQL")
    return find(Path(str(db.execute("SHOW data_directory").fetchone()[0])))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):  # a zombie (its parent has not reaped it yet) is gone too
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return False
    return True


def stop(server: Server, timeout_s: float = STOP_S) -> None:
    """Fast shutdown (SIGINT: clients disconnected, a checkpoint), SIGKILL after ``timeout_s``; returns once
    the server has exited."""
    if _postmaster_pid(server.data_dir) != server.pid:
        raise PgRestartError(f"{server}: its pid file names another process now")
    with contextlib.suppress(ProcessLookupError):
        os.kill(server.pid, signal.SIGINT)
    deadline = time.monotonic() + timeout_s
    while _alive(server.pid):
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(server.pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
        time.sleep(0.1)


def start(server: Server, ready_s: float = READY_S) -> Server:
    """Start ``server``'s command line again (same user, namespace, directory, environment, log); returns
    the new server once its pid file says it accepts connections (its status line ``ready``).

    The new process is not a child of any process of the stack: it runs in a session of its own, and
    whoever stops the cluster finds it by the data directory's pid file, as `find` does."""
    if _postmaster_pid(server.data_dir) is not None and _alive(_postmaster_pid(server.data_dir) or 0):
        raise PgRestartError(f"{server.data_dir}: a server is running there already")
    as_user = ["setpriv", f"--reuid={server.uid}", f"--regid={server.gid}", "--clear-groups", "--"]
    argv = [*as_user, *server.argv]
    if server.netns is not None:
        argv = ["nsenter", f"--net=/run/netns/{server.netns}", "--", *argv]
    out = open(server.log, "ab") if server.log else subprocess.DEVNULL  # noqa: SIM115 (closed below)
    try:
        proc = subprocess.Popen(argv, env=server.env, cwd=server.cwd, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    finally:
        if not isinstance(out, int):
            out.close()
    deadline = time.monotonic() + ready_s
    while not _ready(server.data_dir, proc.pid):
        if proc.poll() is not None:
            raise PgRestartError(
                f"postgres on {server.data_dir} exited with {proc.returncode} at its restart"
            )
        if time.monotonic() > deadline:
            raise PgRestartError(f"postgres on {server.data_dir} was not ready within {ready_s:.0f} s")
        time.sleep(0.1)
    return find(server.data_dir)


def _ready(data_dir: Path, pid: int) -> bool:
    try:
        lines = (data_dir / "postmaster.pid").read_text().splitlines()
    except OSError:
        return False
    return len(lines) >= 8 and lines[0].strip() == str(pid) and lines[7].strip() == "ready"


@contextlib.contextmanager
def stopped(server: Server, timeout_s: float = STOP_S) -> Iterator[Server]:
    """The server is down inside the block and started again on leaving it, whatever happens inside."""
    stop(server, timeout_s)
    try:
        yield server
    finally:
        start(server)
