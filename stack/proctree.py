"""The process tree of one spawned component: started under a supervisor, found again from its pid file, and
signalled safely, whole, whatever its processes call themselves.

A component is started by a small supervisor (:func:`spawn` runs this module: ``python -m
durable_rollouts.stack.proctree``), a process of its own session that marks itself the *child subreaper* of
what it starts (``prctl(PR_SET_CHILD_SUBREAPER)``), starts the component's leader leading a session of its
own (so the leader's pid is its session and process group id, as before), reports the leader's pid and start
time, then only reaps until nothing it started is left, and exits. A process whose parent dies is handed to
its nearest subreaper ancestor instead of init, so every process the component ever starts (vLLM's
``VLLM::EngineCore`` and ``VLLM::Worker``, a daemon that forked twice and left the session) has the
supervisor as an ancestor for as long as it runs, its leader alive or not. The pid file records
``<pid> <start time> <marker> <supervisor pid> <supervisor start time>`` (start times: field 22 of
/proc/PID/stat).

Why a supervisor: the proof that a process is ours must survive what the process does to itself. The spawn's
marker in the environment (:data:`MARKER_ENV`, the only proof before) does not: vLLM renames its processes
with ``setproctitle``, which overwrites the memory ``/proc/PID/environ`` shows, so a SIGKILLed API server's
EngineCore could no longer be proven ours and outlived ``stack down``. Parentage does survive: the kernel
keeps it in /proc/PID/stat, which a process cannot rewrite. Recording the descendants while the leader lives
is not enough (a child forked just before the leader is SIGKILLed is never recorded, and pids are reused); a
subreaper makes every orphan the supervisor's child at the moment it is orphaned, with nothing to poll. A
cgroup per spawn would also hold the whole tree, but needs cgroup v2 with a delegated subtree (a systemd user
session, or root): this host has cgroup v1 (a tmpfs at /sys/fs/cgroup, per-controller mounts, as Docker sets
up), and neither containers nor CI runners nor hosts without systemd delegate one. A subreaper needs Linux
3.4 or later and no privilege; where ``prctl`` is refused the supervisor says so in the log and the tree's
orphans fall back to the marker proof below.

Invariants:
- The tree is every live descendant of the recorded supervisor while it runs with its recorded start time
  (the supervisor itself excluded). It starts nothing but the leader, so its descendants are exactly the
  spawn's processes. Each link of a parent chain is read twice around its parent's stat: a pid is reused only
  after its process is reaped, and a process's parent changes only when its parent exits, so a child that
  still names the same parent after the parent's stat was read proves that stat was its parent's.
- Also proven ours (pid files of older versions, a supervisor that was itself killed): a process of the
  session or process group with the recorded pid whose ``/proc/PID/environ`` carries the recorded marker,
  or any process of it while the recorded leader still exists with the recorded start time (then no other
  process can hold its session or group id). Ids are reused once a tree is gone, and a stranger's session or
  group that now has the recorded id (not descending from the supervisor, without the marker) is never
  signalled. A pid file without marker or supervisor (older versions) proves nothing once its leader is gone.
- Each signal goes through a pidfd opened before the check, so the process checked is the process signalled
  even if its pid is reused in between.
- A wait for the tree to be gone also waits for every process signalled before it (by pid and start time)
  and for the supervisor to leave (it leaves once it has no child left, so no process of the tree is left):
  an exiting process may lose its proof before it is gone. A process of the tree found during the wait that
  the signal has not reached yet (forked meanwhile) gets it then.

Standard library only: a leaf that both the stack (``stack.procs``) and the fault kit (``faults.process``)
import.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TypeGuard

MARKER_ENV = "ROLLOUTS_SPAWN_ID"
"""Environment variable holding a spawn's marker (inherited by all it starts)."""

SUPERVISOR_MODULE = "durable_rollouts.stack.proctree"
"""The module a supervisor runs (``python -m``); its command line is ``python -m MODULE FD -- ARGV...``."""

PR_SET_CHILD_SUBREAPER = 36
"""prctl option (linux/prctl.h): orphaned descendants are reparented to this process instead of init."""

_MAX_DEPTH = 256
"""How many parents a chain is followed up before it is taken not to reach the supervisor."""


class SpawnError(RuntimeError):
    """A supervisor could not start, or could not report the process it started (one-line message)."""


def new_marker() -> str:
    """A fresh marker for one spawn."""
    return secrets.token_hex(8)


def _field(value: str) -> str | None:
    return None if value == "-" else value


@dataclass(frozen=True)
class Record:
    """What a pid file records of one spawn."""

    pid: int
    start: str | None = None
    """Kernel start time of the leader (field 22 of /proc/PID/stat)."""
    marker: str | None = None
    supervisor: int | None = None
    """Pid of the spawn's supervisor (None: written by a version without one)."""
    supervisor_start: str | None = None
    """Kernel start time of the supervisor."""

    @classmethod
    def parse(cls, text: str) -> Record | None:
        fields = [*text.split(), "-", "-", "-", "-"]
        if not fields[0].isdigit():
            return None
        start, marker = (_field(f) for f in fields[1:3])
        if fields[3].isdigit() and fields[4].isdigit():  # both or neither: a supervisor without its start
            return cls(int(fields[0]), start, marker, int(fields[3]), fields[4])  # time proves nothing
        return cls(int(fields[0]), start, marker)

    @classmethod
    def read(cls, path: Path) -> Record | None:
        try:
            return cls.parse(path.read_text())
        except OSError:
            return None

    def line(self) -> str:
        """The pid file's text (``-`` for a field not known); versions before the supervisor read the first
        three fields and ignore the rest."""
        text = f"{self.pid} {self.start or '-'} {self.marker or '-'}"
        if self.supervisor is not None:
            text += f" {self.supervisor} {self.supervisor_start or '-'}"
        return text + "\n"


def stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name: state [0], ppid [1], pgrp [2], session [3],
    start time [19]; None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].decode().split()
    except (OSError, IndexError):
        return None


def _live(f: list[str] | None) -> TypeGuard[list[str]]:
    """Whether ``f`` (fields of /proc/PID/stat) describes a process that runs: exists, not a zombie."""
    return f is not None and f[0] not in ("Z", "X")


def reap(pid: int | None) -> None:
    """Collect ``pid`` if it is an exited child of this process, so it does not linger as a zombie."""
    if pid is not None:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)


def leader_alive(rec: Record) -> bool:
    """Whether the recorded leader still runs (not a zombie) with the recorded start time."""
    reap(rec.pid)
    f = stat(rec.pid)
    return _live(f) and (rec.start is None or f[19] == rec.start)


def supervisor_alive(rec: Record) -> bool:
    """Whether the recorded supervisor still runs (not a zombie) with the recorded start time."""
    if rec.supervisor is None or rec.supervisor_start is None:
        return False
    reap(rec.supervisor)
    f = stat(rec.supervisor)
    return _live(f) and f[19] == rec.supervisor_start


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


def _chain_reaches(pid: int, rec: Record) -> bool | None:
    """One walk up ``pid``'s parents: True if it reaches the live recorded supervisor, False if not, None if
    a link changed while it was read (a parent exited meanwhile: walk again)."""
    child, f = pid, stat(pid)
    for _ in range(_MAX_DEPTH):
        if not _live(f):
            return False
        ppid = int(f[1])
        if ppid <= 1:
            return False
        parent = stat(ppid)
        again = stat(child)
        if again is None or again[1] != f[1] or again[19] != f[19]:
            return None
        if ppid == rec.supervisor:
            return _live(parent) and parent[19] == rec.supervisor_start
        child, f = ppid, parent
    return False


def _descends(pid: int, rec: Record) -> bool:
    """Whether live process ``pid`` descends from the recorded supervisor, which runs with its recorded start
    time (the module docstring says why a parent chain read this way is the real one)."""
    if rec.supervisor is None or rec.supervisor_start is None or pid == rec.supervisor:
        return False
    for _ in range(5):
        reached = _chain_reaches(pid, rec)
        if reached is not None:
            return reached
    return False


def _ours(pid: int, rec: Record, leader_holds: bool) -> bool:
    """Whether live process ``pid`` proves to be of the recorded spawn (see the module docstring)."""
    f = stat(pid)
    if not _live(f):
        return False
    if _descends(pid, rec):
        return True
    if str(rec.pid) not in (f[2], f[3]):
        return False
    if rec.marker is not None and _has_marker(pid, rec.marker):
        return True
    return leader_holds and _leader_holds_ids(rec)


def _candidates(rec: Record) -> list[int]:
    """Processes that may be of the tree, from one pass over /proc: descendants of the recorded supervisor
    (if it runs as recorded) and processes of the session or group with the recorded id."""
    table = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (f := stat(pid := int(name))) is not None:
            table[pid] = f
    found = {pid for pid, f in table.items() if str(rec.pid) in (f[2], f[3])}
    sup = rec.supervisor
    if sup is not None and sup in table and table[sup][19] == rec.supervisor_start:
        children: dict[int, list[int]] = {}
        for pid, f in table.items():
            children.setdefault(int(f[1]), []).append(pid)
        todo = list(children.get(sup, []))
        while todo:
            pid = todo.pop()
            if pid not in found and pid != sup:
                found.add(pid)
                todo += children.get(pid, [])
    return sorted(found)


def members(rec: Record) -> list[int]:
    """Live processes of the recorded tree that prove to be ours, the leader (if alive) first."""
    reap(rec.pid)
    reap(rec.supervisor)
    leader_holds = _leader_holds_ids(rec)
    found = [pid for pid in _candidates(rec) if _ours(pid, rec, leader_holds)]
    return sorted(found, key=lambda p: p != rec.pid)


Signalled = dict[int, str]
"""Processes a signal reached: pid -> kernel start time (so a reused pid is not waited for)."""


def _send(pid: int, rec: Record, sigs: Iterable[int], sent: Signalled | None) -> bool:
    """Send ``sigs`` to ``pid`` if it is still ours, through a pidfd opened before the check; note it in
    ``sent``."""
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
        for sig in sigs:
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
    return sum(_send(pid, rec, (sig,), sent) for pid in members(rec))


def _runs(pid: int, start: str) -> bool:
    """Whether ``pid`` still runs (not a zombie) as the process that started at ``start``."""
    reap(pid)
    f = stat(pid)
    return _live(f) and f[19] == start


def wait_gone(
    rec: Record, timeout_s: float, sent: Signalled | None = None, resend: Sequence[int] = ()
) -> bool:
    """Wait until no process of the tree is left, nor any process in ``sent`` (what the signals reached:
    a process that is exiting may no longer prove ours, yet still runs), and the supervisor has left; False
    if some still are after ``timeout_s``. A process of the tree not in ``sent`` (started since) is sent
    ``resend`` (and added to ``sent``)."""
    sent = {} if sent is None else sent
    deadline = time.monotonic() + timeout_s
    while True:
        left = members(rec)
        for pid in left:
            if resend and not (pid in sent and _runs(pid, sent[pid])):
                _send(pid, rec, resend, sent)
        if not left and not supervisor_alive(rec) and not any(_runs(p, start) for p, start in sent.items()):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def kill_tree(rec: Record, timeout_s: float) -> bool | None:
    """SIGKILL the whole recorded tree and wait up to ``timeout_s`` for it to be gone.

    Returns:
        None if nothing of the tree was running, True once it is gone, False if some survive the wait.
    """
    sent: Signalled = {}
    if not signal_tree(rec, signal.SIGKILL, sent):
        return None
    return wait_gone(rec, timeout_s, sent, (signal.SIGKILL,))


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
    if wait_gone(rec, timeout_s, sent, (signal.SIGTERM, signal.SIGCONT)):
        return True
    signal_tree(rec, signal.SIGKILL, sent)
    return wait_gone(rec, kill_wait_s, sent, (signal.SIGKILL,))


def command(rec: Record) -> tuple[list[str], dict[str, str], str] | None:
    """The command line, environment and working directory the recorded spawn was started with, as its
    supervisor holds them (it never renames itself), or, for a spawn without one, as its leader shows them
    now; None if neither can be read."""
    argv: list[str] | None = None
    if supervisor_alive(rec):
        sup = _cmdline(rec.supervisor)  # type: ignore[arg-type]
        if sup is not None and sup[1:3] == ["-m", SUPERVISOR_MODULE] and "--" in sup:
            argv, pid = sup[sup.index("--") + 1 :], rec.supervisor
    if argv is None:
        argv, pid = _cmdline(rec.pid), rec.pid
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return None
    if argv is None:
        return None
    env = dict(kv.decode(errors="surrogateescape").split("=", 1) for kv in raw if b"=" in kv)
    return argv, env, cwd


def _cmdline(pid: int) -> list[str] | None:
    """The arguments of ``pid`` (an empty one kept), or None if they cannot be read."""
    try:
        data = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    args = data.removesuffix(b"\0").split(b"\0") if data else []
    return [a.decode(errors="surrogateescape") for a in args]


def spawn(
    argv: Sequence[str],
    env: Mapping[str, str],
    out: IO[bytes],
    cwd: str | None = None,
    report_timeout_s: float = 120.0,
) -> Record:
    """Start ``argv`` under a fresh supervisor (see the module docstring): the leader leads its own session,
    with ``env`` and a fresh marker (:data:`MARKER_ENV`) in its environment, stdin from /dev/null, stdout and
    stderr to ``out``, in ``cwd``.

    Returns:
        The record to write to its pid file.

    Raises:
        OSError: ``argv`` could not be started (the error the supervisor got: FileNotFoundError, ...).
        SpawnError: The supervisor did not report the leader within ``report_timeout_s`` (it is killed).
    """
    marker = new_marker()
    read_fd, write_fd = os.pipe()
    try:
        sup = subprocess.Popen(
            [sys.executable, "-m", SUPERVISOR_MODULE, str(write_fd), "--", *argv],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**env, MARKER_ENV: marker},
            cwd=cwd,
            start_new_session=True,
            pass_fds=(write_fd,),
        )
    except BaseException:
        os.close(read_fd)
        raise
    finally:
        os.close(write_fd)
    sup_stat = stat(sup.pid)  # our unwaited child: there until we reap it
    with os.fdopen(read_fd, "rb") as report:
        ready, _, _ = select.select([report], [], [], report_timeout_s)
        words = report.readline().decode(errors="replace").split(maxsplit=2) if ready else []
    if words[:1] == ["ok"] and len(words) == 3 and words[1].isdigit() and sup_stat is not None:
        return Record(int(words[1]), words[2].strip(), marker, sup.pid, sup_stat[19])
    if not ready:
        sup.kill()
    sup.wait()
    if words[:1] == ["error"] and len(words) == 3 and words[1].isdigit():
        raise OSError(int(words[1]), words[2].strip(), argv[0])
    raise SpawnError(f"the supervisor of {argv[0]} exited ({sup.returncode}) before reporting it started")


def _set_subreaper() -> str | None:
    """Make this process the child subreaper of its descendants; the reason why not, if it cannot."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0:
            return None
        return os.strerror(ctypes.get_errno())
    except (OSError, AttributeError) as e:
        return str(e)


def supervise(report_fd: int, argv: Sequence[str]) -> int:
    """A supervisor's life: become the subreaper, start ``argv`` leading its own session, write
    ``ok <pid> <start time>`` (or ``error <errno> <message>``) to ``report_fd``, then reap until no child is
    left. Returns the leader's exit status (128 + the signal that ended it)."""
    if (why := _set_subreaper()) is not None:
        print(f"durable_rollouts supervisor: not a subreaper ({why}); orphans go to init", file=sys.stderr)
    with os.fdopen(report_fd, "wb") as report:
        try:
            leader = subprocess.Popen(list(argv), start_new_session=True)
        except OSError as e:
            report.write(f"error {e.errno or 0} {e.strerror or e}\n".encode())
            return 127
        f = stat(leader.pid)  # our unwaited child: there until we reap it
        report.write(f"ok {leader.pid} {f[19] if f else '-'}\n".encode())
    status = 0
    while True:
        try:
            pid, wait_status = os.wait()
        except ChildProcessError:
            return status
        if pid == leader.pid:
            code = os.waitstatus_to_exitcode(wait_status)
            status = code if code >= 0 else 128 - code


if __name__ == "__main__":
    if len(sys.argv) < 4 or not sys.argv[1].isdigit() or sys.argv[2] != "--":
        sys.exit(f"usage: python -m {SUPERVISOR_MODULE} REPORT_FD -- COMMAND [ARG...]")
    sys.exit(supervise(int(sys.argv[1]), sys.argv[3:]))
