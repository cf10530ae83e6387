"""Process faults on the stack's components: SIGKILL (then a restart), a freeze (SIGSTOP for a while, then
SIGCONT), and a graceful restart, for workers, engines and the Temporal server.

Targets are named by the pid files of a stack home, as the embedded stack and ``workers.procs.spawn`` write
them: ``<home>/pids/<name>.pid`` holding ``<pid> <kernel start time>``. ``targets(home, "worker")`` finds
``worker`` and every ``worker-<n>`` spawned there; a user's suite that spawns its own components the same
way gets the same faults::

    from faults import process
    (w,) = process.targets(home, "worker")
    with process.frozen(w):            # SIGSTOP now, SIGCONT on leaving, whatever happens inside
        await asyncio.sleep(10)
    w = process.restart(w, down_s=3)   # SIGKILL, 3 s down, the same command line started again

Invariants:
- Only a pid whose recorded start time still matches is signalled (a reused pid is never touched), and
  every signal goes to the process group it leads (each component leads its own session).
- A frozen group is stopped when ``frozen`` returns, and always thawed: SIGCONT on the way out, even on
  an exception.
- A restart starts the same command line, environment and working directory as the process it replaces
  (read from /proc before the kill), appends to the same log and rewrites the same pid file, so the stack's
  own ``status`` and ``down`` see the new process.

This module does not import ``workers`` (``workers`` imports ``faults``; no cycle): it reads the pid-file
format itself.
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


class ProcessFaultError(RuntimeError):
    """A target could not be found, signalled or started again (one-line message)."""


@dataclass(frozen=True)
class Target:
    """One live component: its pid-file name, pid, and what it takes to start it again."""

    home: Path
    name: str
    pid: int
    argv: tuple[str, ...]
    env: dict[str, str]
    cwd: str

    def __str__(self) -> str:
        return f"{self.name} pid {self.pid}"


def _stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (state is [0], pgid [2], start time [19])."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _alive(pid: int) -> bool:
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)  # reap our own exited children
    fields = _stat(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def _group(pgid: int) -> list[int]:
    """Non-zombie processes of process group ``pgid``."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (f := _stat(int(entry.name))) and int(f[2]) == pgid and f[0] != "Z":
            out.append(int(entry.name))
    return out


def pid_file(home: Path, name: str) -> Path:
    return home / "pids" / f"{name}.pid"


def find(home: Path, name: str) -> Target | None:
    """The live process named by ``<home>/pids/<name>.pid``, or None (no file, exited, pid reused)."""
    try:
        fields = pid_file(home, name).read_text().split()
    except FileNotFoundError:
        return None
    if not fields or not fields[0].isdigit():
        return None
    pid = int(fields[0])
    stat = _stat(pid)
    if stat is None or not _alive(pid) or (len(fields) > 1 and stat[19] != fields[1]):
        return None
    try:
        argv = tuple(a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a)
        raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return None
    env = dict(kv.decode(errors="replace").split("=", 1) for kv in raw if b"=" in kv)
    return Target(home, name, pid, argv, env, cwd)


def targets(home: Path, component: str) -> list[Target]:
    """Live processes of ``component`` in ``home``: the pid file ``<component>`` and ``<component>-*``."""
    found = []
    for f in sorted((home / "pids").glob("*.pid")):
        name = f.stem
        if name == component or name.startswith(f"{component}-"):
            t = find(home, name)
            if t is not None:
                found.append(t)
    return found


def _signal(t: Target, sig: signal.Signals) -> None:
    current = find(t.home, t.name)
    if current is None or current.pid != t.pid:
        raise ProcessFaultError(f"{t}: no longer running (its pid file names no live process of ours)")
    try:
        os.killpg(t.pid, sig)
    except ProcessLookupError:
        raise ProcessFaultError(f"{t}: exited before {sig.name}") from None


def _wait_gone(pgid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while _group(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pgid, os.WNOHANG)
    return True


def kill(t: Target, timeout_s: float = 10.0) -> None:
    """SIGKILL the target's process group and wait until it is gone.

    Raises:
        ProcessFaultError: the target is not running, or its group outlives the wait.
    """
    _signal(t, signal.SIGKILL)
    if not _wait_gone(t.pid, timeout_s):
        raise ProcessFaultError(f"{t}: process group still alive {timeout_s:.0f} s after SIGKILL")


def stop(t: Target, timeout_s: float = 30.0) -> None:
    """SIGTERM the group (a graceful stop), SIGKILL what is left after ``timeout_s``."""
    _signal(t, signal.SIGTERM)
    if not _wait_gone(t.pid, timeout_s):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(t.pid, signal.SIGKILL)
        _wait_gone(t.pid, 10.0)


@contextlib.contextmanager
def frozen(t: Target) -> Iterator[Target]:
    """SIGSTOP the target's group on entry (returning once every process of it is stopped), SIGCONT on
    exit (always)."""
    _signal(t, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 5.0
        while any((f := _stat(p)) and f[0] not in "Tt" for p in _group(t.pid)):
            if time.monotonic() > deadline:
                raise ProcessFaultError(f"{t}: not stopped 5 s after SIGSTOP")
            time.sleep(0.01)
        yield t
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(t.pid, signal.SIGCONT)


def freeze(t: Target, seconds: float) -> None:
    """Freeze the target for ``seconds`` (blocking), then thaw it."""
    with frozen(t):
        time.sleep(seconds)


def start(t: Target) -> Target:
    """Start ``t``'s command line again (same environment and directory, own session), appending to its log
    and rewriting its pid file; returns the new target.

    Raises:
        ProcessFaultError: the process exits at once (its log says why).
    """
    log = t.home / "logs" / f"{t.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        out.write(f"\n=== {stamp} restart (fault kit): {' '.join(t.argv)}\n".encode())
        out.flush()
        proc = subprocess.Popen(
            list(t.argv),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=t.env,
            cwd=t.cwd,
            start_new_session=True,
        )
    stat = _stat(proc.pid)
    pid_file(t.home, t.name).write_text(f"{proc.pid} {stat[19] if stat else ''}\n")
    new = find(t.home, t.name)
    if new is None:
        raise ProcessFaultError(f"{t.name}: exited at once after a restart; see {log}")
    return new


def restart(t: Target, down_s: float = 0.0, graceful: bool = False) -> Target:
    """Kill the target (SIGKILL, or SIGTERM when ``graceful``), stay down ``down_s``, start it again.

    Returns:
        The new target (new pid). Waiting until it serves again is the caller's business (it knows what
        "healthy" means for this component).
    """
    if graceful:
        stop(t)
    else:
        kill(t)
    time.sleep(down_s)
    return start(t)
