"""A throwaway PostgreSQL cluster in a temporary directory, for tests and benchmarks (Debian's
``postgresql`` package: its binaries live under /usr/lib/postgresql/<major>/bin, not on PATH).

Invariants: the server is started by this process and stopped by its pid (``postgres`` itself, not a
wrapper); its directory is removed after it stops. PostgreSQL refuses to run as root, so under root it
runs as the ``postgres`` system user (or ``nobody``), owning the directory.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit


def postgres_bin() -> Path | None:
    """The directory holding ``initdb`` and ``postgres`` (PATH first, then Debian's layout), or None."""
    found = shutil.which("initdb")
    if found:
        return Path(found).parent
    dirs = sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=lambda p: int(p.parent.name), reverse=True)
    return next((d for d in dirs if (d / "initdb").exists()), None)


def database_url(server: str, name: str) -> str:
    """``server``'s URL naming database ``name`` instead."""
    return urlunsplit(urlsplit(server)._replace(path=f"/{name}"))


def _run_as() -> tuple[int, int] | None:
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            user = pwd.getpwnam(name)
            return user.pw_uid, user.pw_gid
    raise RuntimeError("running as root and neither a postgres nor a nobody user exists to run PostgreSQL")


@contextlib.contextmanager
def local_postgres(port: int, settings: dict[str, str] | None = None) -> Iterator[str]:
    """Start a cluster on 127.0.0.1:``port``; yields the URL of its ``postgres`` database (user postgres,
    trust auth). ``settings``: extra ``-c name=value`` server settings."""
    import psycopg

    bindir = postgres_bin()
    if bindir is None:
        raise RuntimeError("PostgreSQL is not installed (apt-get install postgresql)")
    root = Path(tempfile.mkdtemp(prefix="rollouts-pg-"))
    who = _run_as()
    uid, gid = who if who else (None, None)
    extra: list[int] | None = [] if who else None
    if who:
        os.chown(root, *who)
    data, log = root / "data", root / "server.log"
    proc: subprocess.Popen[bytes] | None = None
    try:
        initdb = [str(bindir / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust", "-EUTF8"]
        subprocess.run(
            [*initdb, "--no-locale"],
            check=True,
            capture_output=True,
            cwd=root,
            user=uid,
            group=gid,
            extra_groups=extra,
        )
        conf = {"listen_addresses": "127.0.0.1", "max_connections": "400", **(settings or {})}
        argv = [str(bindir / "postgres"), "-D", str(data), "-p", str(port), "-k", str(root)]
        for k, v in conf.items():
            argv += ["-c", f"{k}={v}"]
        with log.open("wb") as out:
            proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, cwd=root, user=uid, group=gid, extra_groups=extra
            )
        url = f"postgresql://postgres@127.0.0.1:{port}/postgres"
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"postgres exited with {proc.returncode}: {log.read_text()[-2000:]}")
            try:
                psycopg.connect(url, connect_timeout=2).close()
                break
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    tail = log.read_text()[-2000:]
                    raise RuntimeError(f"postgres did not answer on port {port}: {tail}") from None
                time.sleep(0.2)
        yield url
    finally:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # fast shutdown: disconnect clients, checkpoint, exit
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(root, ignore_errors=True)
