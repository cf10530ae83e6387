"""The process tree of one spawned component, found again from its pid file and signalled safely.

A component is spawned leading its own session (``start_new_session``), so its session id and process group
id are its pid; what it starts (vLLM's ``VLLM::EngineCore`` and ``VLLM::Worker``, ...) stays in that session.
Its pid file records ``<pid> <kernel start time> <marker>``, and the marker is also set in the environment it
starts with (:data:`MARKER_ENV`), which every descendant inherits.

Invariants:
- The tree is found even when its leader is already dead: the processes whose session or process group id
  is the recorded pid (an orphaned EngineCore keeps its session when its API server is SIGKILLed).
- A process found that way is signalled only when it proves to be ours: its ``/proc/PID/environ`` carries the
  recorded marker, or the recorded leader still exists with the recorded start time (then no other process
  can hold its session or group id). Ids are reused once a tree is gone, and a stranger's session or group
  that now has the recorded id (its processes lack the marker) is never signalled. A pid file without a
  marker (written by an older version) proves nothing once its leader is gone: nothing is signalled.
- Each signal goes through a pidfd opened before the check, so the process checked is the process signalled
  even if its pid is reused in between.
- A wait for the tree to be gone also waits for every process signalled before it (by pid and start time):
  an exiting process loses its environment (and so its proof) before it is gone, and a wait on the proof
  alone would return while it still runs.

Standard library only, and in ``config`` (like the home layout of ``config.paths``): a leaf that both the
stack (``stack.procs``) and the fault kit (``faults.process``) import.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import time
from dataclasses import dataclass
from pathlib import Path

MARKER_ENV = "ROLLOUTS_SPAWN_ID"
"""Environment variable holding a spawn's marker (inherited by all it starts)."""


def new_marker() -> str:
    """A fresh marker for one spawn."""
    return secrets.token_hex(8)


@dataclass(frozen=True)
class Record:
    """What a pid file records of one spawn."""

    pid: int
    start: str | None = None
    """Kernel start time of the leader (field 22 of /proc/PID/stat)."""
    marker: str | None = None

    @classmethod
    def parse(cls, text: str) -> Record | None:
        fields = [*text.split(), "-", "-"]
        if not fields[0].isdigit():
            return None
        start, marker = (None if f == "-" else f for f in fields[1:3])
        return cls(int(fields[0]), start, marker)

    @classmethod
    def read(cls, path: Path) -> Record | None:
        try:
            return cls.parse(path.read_text())
        except OSError:
            return None

    def line(self) -> str:
        """The pid file's text (``-`` for a field not known)."""
        return f"{self.pid} {self.start or '-'} {self.marker or '-'}\n"


def stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name: state [0], ppid [1], pgrp [2], session [3],
    start time [19]; None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].decode().split()
    except (OSError, IndexError):
        return None


def reap(pid: int) -> None:
    """Collect ``pid`` if it is an exited child of this process, so it does not linger as a zombie."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def leader_alive(rec: Record) -> bool:
    """Whether the recorded leader still runs (not a zombie) with the recorded start time."""
    reap(rec.pid)
    f = stat(rec.pid)
    return f is not None and f[0] not in ("Z", "X") and (rec.start is None or f[19] == rec.start)


def _leader_holds_ids(rec: Record) -> bool:
    """Whether the recorded leader exists (a zombie counts: its pid cannot be reused) with the recorded start
    time, so that the session and group with its id are certainly the ones it created."""
    f = stat(rec.pid)
    return f is not None and rec.start is not None and f[19] == rec.start


def _has_marker(pid: int, marker: str) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read()
    except OSError:
        return False
    return f"{MARKER_ENV}={marker}".encode() in env.split(b"\0")


def _ours(pid: int, rec: Record, leader_holds: bool) -> bool:
    """Whether live process ``pid`` is in the recorded tree and proves ours (see the module docstring)."""
    f = stat(pid)
    if f is None or f[0] in ("Z", "X") or str(rec.pid) not in (f[2], f[3]):
        return False
    if rec.marker is not None and _has_marker(pid, rec.marker):
        return True
    return leader_holds and _leader_holds_ids(rec)


def members(rec: Record) -> list[int]:
    """Live processes of the recorded tree that prove to be ours, the leader (if alive) first."""
    reap(rec.pid)
    leader_holds = _leader_holds_ids(rec)
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit() and _ours(pid := int(name), rec, leader_holds):
            found.append(pid)
    return sorted(found, key=lambda p: p != rec.pid)


Signalled = dict[int, str]
"""Processes a signal reached: pid -> kernel start time (so a reused pid is not waited for)."""


def _send(pid: int, rec: Record, sig: int, sent: Signalled | None) -> bool:
    """Signal ``pid`` if it is still ours, through a pidfd opened before the check; note it in ``sent``."""
    try:
        fd: int | None = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    except OSError:  # no pidfd on this kernel: check, then signal by pid
        fd = None
    try:
        if not _ours(pid, rec, _leader_holds_ids(rec)):
            return False
        f = stat(pid)
        if sent is not None and f is not None:
            sent[pid] = f[19]
        if fd is None:
            os.kill(pid, sig)
        else:
            signal.pidfd_send_signal(fd, sig)
        return True
    except ProcessLookupError:
        return False
    finally:
        if fd is not None:
            os.close(fd)


def signal_tree(rec: Record, sig: int, sent: Signalled | None = None) -> int:
    """Send ``sig`` to every process of the recorded tree that is ours; returns how many were signalled.
    Each one signalled is added to ``sent`` (for :func:`wait_gone`)."""
    return sum(_send(pid, rec, sig, sent) for pid in members(rec))


def _runs(pid: int, start: str) -> bool:
    """Whether ``pid`` still runs (not a zombie) as the process that started at ``start``."""
    reap(pid)
    f = stat(pid)
    return f is not None and f[0] not in ("Z", "X") and f[19] == start


def wait_gone(rec: Record, timeout_s: float, sent: Signalled | None = None) -> bool:
    """Wait until no process of the tree is left, nor any process in ``sent`` (what the signals reached:
    a process that is exiting no longer proves ours, yet still runs); False if some still are after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while members(rec) or any(_runs(pid, start) for pid, start in (sent or {}).items()):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def kill_tree(rec: Record, timeout_s: float) -> bool | None:
    """SIGKILL the whole recorded tree and wait up to ``timeout_s`` for it to be gone.

    Returns:
        None if nothing of the tree was running, True once it is gone, False if some survive the wait.
    """
    sent: Signalled = {}
    if not signal_tree(rec, signal.SIGKILL, sent):
        return None
    return wait_gone(rec, timeout_s, sent)


def stop_tree(rec: Record, timeout_s: float = 15.0, kill_wait_s: float = 5.0) -> bool | None:
    """Stop the whole recorded tree: SIGTERM (and SIGCONT, so a frozen one sees it), wait ``timeout_s``,
    then SIGKILL what is left and wait ``kill_wait_s``.

    Returns:
        None if nothing of the tree was running, True once it is gone, False if some survive SIGKILL.
    """
    sent: Signalled = {}
    if not signal_tree(rec, signal.SIGTERM, sent):
        return None
    signal_tree(rec, signal.SIGCONT)
    if wait_gone(rec, timeout_s, sent):
        return True
    signal_tree(rec, signal.SIGKILL, sent)
    return wait_gone(rec, kill_wait_s, sent)
