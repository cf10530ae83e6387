"""Process helpers for the embedded stack: start detached processes, find them again, stop them, probe health.
The components' command lines and environments are ``stack.commands``'s (re-exported here).

Invariant: we only ever signal processes we started. Each one is started by a supervisor of its own and
leads its own session (so its process group id is its pid), and its pid file records the kernel start time,
a per-spawn marker and the supervisor next to the pid; a pid whose start time no longer matches is treated
as gone, and a component is stopped as its whole tree (every descendant of its supervisor, whatever it calls
itself), each process proven ours first (``stack.proctree``), even when its leader is already dead. No
name-based killing (pkill, killall) anywhere.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from durable_rollouts.config.paths import venv_bin
from durable_rollouts.stack import proctree

# The components' command lines, re-exported: the stack, tests and benches reach them through this module.
from durable_rollouts.stack.commands import engine_argv as engine_argv
from durable_rollouts.stack.commands import engine_env as engine_env
from durable_rollouts.stack.commands import temporal_argv as temporal_argv
from durable_rollouts.stack.commands import worker_argv as worker_argv


class StackError(RuntimeError):
    """A stack process could not be started, stayed unhealthy, or a precondition failed (one-line message)."""


def exit_now(code: int | str | None = 0) -> NoReturn:
    """End this process with ``code`` (``SystemExit``'s meaning) without interpreter finalization.

    The Temporal SDK's runtime threads outlive ``asyncio.run``; when one calls into Python while the
    interpreter finalizes, CPython aborts the process (SIGABRT or SIGSEGV: a command that succeeded
    exits 134 or 139; about one in ten under load here). Every Python-side resource is closed by then, so
    the output is flushed, logging shut down, and the process left at once.
    """
    import logging

    with contextlib.suppress(ValueError):  # main thread only: no KeyboardInterrupt on the way out
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code or 0)


def run_main(main: Callable[[], object]) -> NoReturn:
    """Run a process's entry point, then leave through ``exit_now``: with its ``SystemExit`` code, 130 on
    Ctrl-C, 1 (and the traceback, as Python would print it) on any other exception.

    Once a SIGINT has arrived under ``stack.interrupt`` the status is 130 whatever the entry point did,
    and an exception it raised while unwinding prints no traceback."""
    from durable_rollouts.stack import interrupt

    code: int | str | None = 0
    interrupt.begin()
    try:
        main()
    except SystemExit as e:
        code = e.code
    except KeyboardInterrupt:
        code = 130
    except BaseException:
        if not interrupt.interrupted():
            import traceback

            traceback.print_exc()
        code = 1
    exit_now(130 if interrupt.interrupted() else code)


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports free right now (for tests and benchmarks that start their own servers), drawn
    below the OS's ephemeral range: outgoing connections take their local ports from that range, so a port
    picked there (``bind(0)``) could be taken by one before the server binds it ("address already in use")."""
    try:
        low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng, out = random.SystemRandom(), list[int]()
    for _ in range(100 * n):
        if len(out) == n or low <= 10_000:
            break
        port = rng.randrange(10_000, low)
        if port in out:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        out.append(port)
    while len(out) < n:  # no room below the ephemeral range: what the OS picks
        with socket.socket() as s:
            s.bind((host, 0))
            if (port := s.getsockname()[1]) not in out:
                out.append(port)
    return out


def free_port(host: str = "127.0.0.1") -> int:
    """One port as `free_ports` picks them."""
    return free_ports(1, host)[0]


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server could not bind ``host:port`` right now.

    Args:
        port: TCP port.
        host: Address the server would bind.

    Returns:
        True if something listens there or holds the address.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.settimeout(0.5)
        if probe.connect_ex((host, port)) == 0:
            return True
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        # Servers set SO_REUSEADDR, so a socket in TIME_WAIT does not block them and must not block us.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return True
    return False


def log_path(home: Path, name: str) -> Path:
    """Where component ``name`` writes stdout and stderr."""
    return home / "logs" / f"{name}.log"


def pid_path(home: Path, name: str) -> Path:
    """Where the pid of component ``name`` is recorded."""
    return home / "pids" / f"{name}.pid"


def _start_time(pid: int) -> str | None:
    """The kernel start time of ``pid`` (field 22 of /proc/PID/stat), or None if there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _state(pid: int) -> str | None:
    """The one-letter /proc state of ``pid`` (R, S, Z, ...), or None if unknown."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _reap(pid: int) -> None:
    """Collect ``pid`` if it is an exited child of this process, so it does not linger as a zombie."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` names a running (not zombie) process."""
    _reap(pid)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return _state(pid) != "Z"


def spawn(name: str, argv: list[str], home: Path, env: dict[str, str] | None = None) -> int:
    """Start ``argv`` detached under a supervisor of its own (``stack.proctree.spawn``): own session, output
    appended to its log, pid, start time, a fresh marker and the supervisor recorded (the marker also in its
    environment, ``proctree.MARKER_ENV``, which all it starts inherit).

    The process survives this one exiting; stop it (its whole tree) with :func:`stop_component`.

    Args:
        name: Component name; names the log file and the pid file.
        argv: Command line.
        home: State directory (``logs/`` and ``pids/`` are created under it).
        env: Variables added to this process's environment.

    Returns:
        The pid, which is also the process group id.

    Raises:
        OSError: ``argv`` could not be started (FileNotFoundError, PermissionError, ...).
        StackError: Its supervisor did not start it (the log's tail says why).
    """
    log = log_path(home, name)
    log.parent.mkdir(parents=True, exist_ok=True)
    pid_path(home, name).parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        out.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} start: {' '.join(argv)}\n".encode())
        out.flush()
        try:
            rec = proctree.spawn(argv, {**os.environ, **(env or {})}, out)
        except proctree.SpawnError as e:
            raise StackError(f"{name}: {e}; log {log}:\n{log_tail(log)}") from None
    pid_path(home, name).write_text(rec.line())
    return rec.pid


def read_record(home: Path, name: str) -> proctree.Record | None:
    """What the pid file of component ``name`` records (its leader may be dead), or None."""
    return proctree.Record.read(pid_path(home, name))


def stop_record(rec: proctree.Record, timeout: float = 15) -> bool:
    """Stop the whole process tree of a spawn (SIGTERM, ``timeout`` s, SIGKILL), its leader alive or not;
    only processes proven to be of that spawn are signalled (``stack.proctree``).

    Returns:
        Whether anything of it was running.

    Raises:
        StackError: Some of it survives SIGKILL for 5 s.
    """
    stopped = proctree.stop_tree(rec, timeout)
    proctree.reap(rec.pid)
    if stopped is False:
        raise StackError(f"processes of pid {rec.pid}'s tree survived SIGKILL")
    return stopped is not None


def stop_component(home: Path, name: str, timeout: float = 15) -> bool:
    """Stop the tree of component ``name`` as its pid file records it (see :func:`stop_record`)."""
    rec = read_record(home, name)
    return rec is not None and stop_record(rec, timeout)


def read_pid(home: Path, name: str) -> int | None:
    """The pid of component ``name`` if its pid file names a live process that we started.

    Returns:
        The pid, or None when there is no pid file, the process has exited, or the pid now belongs to a
        different process (its start time differs from the one recorded).
    """
    rec = read_record(home, name)
    return rec.pid if rec is not None and proctree.leader_alive(rec) else None


def _group_alive(pgid: int) -> bool:
    """Whether any non-zombie process is left in process group ``pgid``."""
    _reap(pgid)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def _wait_group(pgid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while _group_alive(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def stop_pid(pid: int, timeout: float = 15) -> None:
    """Stop the process group led by ``pid``: SIGTERM, wait up to ``timeout`` s, then SIGKILL.

    Already-exited processes are fine. Only call this with a pid we started (see :func:`read_pid`).

    Raises:
        StackError: If the group survives SIGKILL for 5 s.
    """
    for sig, wait_s in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            _reap(pid)
            return
        if _wait_group(pid, wait_s):
            return
    raise StackError(f"process group {pid} survived SIGKILL")


def log_tail(path: Path, lines: int = 20) -> str:
    """The last ``lines`` lines of a log file ('' if it does not exist)."""
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 64 * 1024))
            text = f.read().decode(errors="replace")
    except FileNotFoundError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def wait_until(
    check: Callable[[], bool],
    timeout: float,
    what: str,
    pid: int | None = None,
    log: Path | None = None,
) -> float:
    """Poll ``check`` until it returns True.

    Args:
        check: Health probe; exceptions count as "not yet".
        timeout: Seconds to wait.
        what: Name used in the error message.
        pid: If given, fail at once when this process exits.
        log: Log whose tail the error message includes.

    Returns:
        Seconds it took.

    Raises:
        StackError: On timeout or when ``pid`` exits first.
    """
    start = time.monotonic()
    while True:
        with contextlib.suppress(Exception):
            if check():
                return time.monotonic() - start
        if pid is not None and not pid_alive(pid):
            problem = f"{what} exited (pid {pid}) before becoming healthy"
            break
        if time.monotonic() - start > timeout:
            problem = f"{what} not healthy after {timeout:.0f} s"
            break
        time.sleep(0.25)
    tail = log_tail(log) if log else ""
    raise StackError(f"{problem}; log {log}:\n{tail}" if log else problem)


def http_ok(url: str, timeout: float = 2.0) -> bool:
    """Whether GET ``url`` answers 200."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def http_json(url: str, body: dict | None = None, timeout: float = 10.0) -> dict:
    """GET ``url`` (or POST ``body`` as JSON) and return the decoded JSON answer; raises on non-2xx."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read() or b"{}")


def temporal_cli(*args: str, timeout: float = 10.0) -> subprocess.CompletedProcess[str]:
    """Run the bundled ``temporal`` CLI with ``args``; output captured, never raises on a non-zero exit."""
    return subprocess.run(
        [str(venv_bin("temporal")), *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def temporal_healthy(address: str) -> bool:
    """Whether the Temporal frontend at ``address`` reports SERVING."""
    res = temporal_cli("operator", "cluster", "health", "--address", address, timeout=5.0)
    return res.returncode == 0 and "SERVING" in res.stdout


def check_logprob_mode(engine_url: str, declared: str) -> str | None:
    """The logprobs mode the engine serves, from vLLM's dev-mode ``/server_info`` (None when it has none);
    asked once at start-up so a run's first rollouts do not wait for it: vLLM gathers system information
    on its first ``/server_info`` (2.2 s for the stack's engine on this host, 5 ms afterwards), and every
    worker asks it before an engine's first model call.

    Raises:
        StackError: The engine serves another mode than the stack declares, or answered without JSON.
    """
    from durable_rollouts.engines.client import served_logprobs_mode  # the workers' reading of the answer

    try:
        info = http_json(f"{engine_url}/server_info?config_format=json", timeout=60.0)
    except urllib.error.HTTPError as e:
        if e.code in (404, 405):  # not in dev mode: the workers cannot ask either
            return None
        raise StackError(f"{engine_url}/server_info: HTTP {e.code}") from None
    except (urllib.error.URLError, OSError) as e:
        raise StackError(f"{engine_url}/server_info: {type(e).__name__}: {e}") from None
    except ValueError as e:
        raise StackError(f"{engine_url}/server_info: not JSON ({e})") from None
    mode = served_logprobs_mode(info)
    if mode is not None and mode != declared:
        raise StackError(
            f"engine {engine_url} serves logprobs mode {mode!r}; the stack declares {declared!r}"
        )
    return mode


def set_weight_version(engine_url: str, version: str) -> None:
    """Announce ``version`` as the engine's weight version (no launch flag exists; it starts as "default")."""
    http_json(f"{engine_url}/update_weight_version", {"new_version": version})
    got = http_json(f"{engine_url}/weight_info").get("weight_version")
    if got != version:
        raise StackError(f"engine reports weight version {got!r} after setting {version!r}")
