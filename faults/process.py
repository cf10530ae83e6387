"""Process faults on the stack's components: SIGKILL (then a restart), a freeze (SIGSTOP for a while, then
SIGCONT), and a graceful restart, for workers, engines and the Temporal server.

Targets are named by the pid files of a stack home, as the embedded stack and ``stack.procs.spawn`` write
them: ``<home>/pids/<name>.pid`` holding ``<pid> <kernel start time> <marker> <supervisor pid> <its start
time>`` (``stack.proctree``). ``targets(home, "worker")`` finds ``worker`` and every ``worker-<n>`` spawned
there; a user's suite that spawns its own components the same way gets the same faults::

    from durable_rollouts.faults import process
    (w,) = process.targets(home, "worker")
    with process.frozen(w):            # SIGSTOP now, SIGCONT on leaving, whatever happens inside
        await asyncio.sleep(10)
    w = process.restart(w, down_s=3)   # SIGKILL, 3 s down, the same command line started again

Invariants:
- A target is found by a pid whose recorded start time still matches (a reused pid is never touched), and
  every signal goes to its whole process tree: each process proven to be of the same spawn first
  (``stack.proctree``: a descendant of the spawn's supervisor, or, for older pid files, the spawn's marker in
  its environment), so a kill also reaches the tree of a leader that died meanwhile, processes that renamed
  themselves (vLLM's) included, and a recycled session or group id is never signalled.
- A frozen group is stopped when ``frozen`` returns, and always thawed: SIGCONT on the way out, even on
  an exception.
- A restart starts the same command line, environment and working directory as the process it replaces
  (read from /proc before the kill, from its supervisor, which keeps them as they were even when the leader
  renamed itself; only the spawn marker and the supervisor are new), appends to the same log and rewrites the
  same pid file, so the stack's own ``status`` and ``down`` see the new process; it starts only once nothing
  of the old tree is left.
- A restart comes back in the network namespace its process ran in: the namespace is read when the target is
  found (before any kill; ``/run/netns/NAME`` whose inode is the process's, as ``ip netns identify`` reads
  it), and the command line is started through ``nsenter --net=/run/netns/NAME`` unless it already enters
  that namespace itself; a process of an unnamed namespace other than this one is never started again
  elsewhere (the restart is refused).

This module does not import ``stack`` (``cli`` imports both; no cycle): the pid-file format and the tree's
membership check live in ``stack.proctree``.
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from durable_rollouts.faults import netns
from durable_rollouts.stack import proctree
from durable_rollouts.stack.proctree import Record


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
    record: Record
    """What its pid file recorded (start time, spawn marker): how its tree is found and proven ours."""
    netns: str | None = None
    """The named network namespace its leader runs in; None for this process's own; `netns.UNNAMED` for
    another namespace without a name (it cannot be started there again)."""

    def __str__(self) -> str:
        return f"{self.name} pid {self.pid}"


def pid_file(home: Path, name: str) -> Path:
    return home / "pids" / f"{name}.pid"


def find(home: Path, name: str) -> Target | None:
    """The live process named by ``<home>/pids/<name>.pid``, or None (no file, exited, pid reused)."""
    rec = Record.read(pid_file(home, name))
    if rec is None or not proctree.leader_alive(rec):
        return None
    started = proctree.command(rec)
    if started is None:
        return None
    argv, env, cwd = started
    try:
        where = netns.netns_of(rec.pid)
    except OSError:  # exited meanwhile
        return None
    return Target(home, name, rec.pid, tuple(argv), env, cwd, rec, where)


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


def _not_running(t: Target) -> ProcessFaultError:
    return ProcessFaultError(f"{t}: no longer running (nothing of its process tree is left)")


def _signal(t: Target, sig: signal.Signals) -> None:
    """Send ``sig`` to every process of the target's tree (its leader alive or not)."""
    if not proctree.signal_tree(t.record, sig):
        raise _not_running(t)


def _gone(t: Target, stopped: bool | None) -> bool:
    """What a stop or kill of the tree returned, once the leader is reaped; raises if nothing ran."""
    proctree.reap(t.pid)
    if stopped is None:
        raise _not_running(t)
    return stopped


def tree(t: Target) -> list[int]:
    """The live processes of the target's tree (the leader first, if alive): what a kill reaches."""
    return proctree.members(t.record)


def kill(t: Target, timeout_s: float = 10.0) -> None:
    """SIGKILL the target's whole process tree and wait until it is gone.

    Raises:
        ProcessFaultError: nothing of the target is running, or some of it outlives the wait.
    """
    if not _gone(t, proctree.kill_tree(t.record, timeout_s)):
        raise ProcessFaultError(f"{t}: process tree still alive {timeout_s:.0f} s after SIGKILL")


def stop(t: Target, timeout_s: float = 30.0) -> None:
    """SIGTERM the tree (a graceful stop), SIGKILL what is left after ``timeout_s``."""
    _gone(t, proctree.stop_tree(t.record, timeout_s, kill_wait_s=10.0))


@contextlib.contextmanager
def frozen(t: Target) -> Iterator[Target]:
    """SIGSTOP the target's group on entry (returning once every process of it is stopped), SIGCONT on
    exit (always)."""
    _signal(t, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 5.0
        while any((f := proctree.stat(p)) and f[0] not in "Tt" for p in tree(t)):
            if time.monotonic() > deadline:
                raise ProcessFaultError(f"{t}: not stopped 5 s after SIGSTOP")
            time.sleep(0.01)
        yield t
    finally:
        proctree.signal_tree(t.record, signal.SIGCONT)


def freeze(t: Target, seconds: float) -> None:
    """Freeze the target for ``seconds`` (blocking), then thaw it."""
    with frozen(t):
        time.sleep(seconds)


def start(t: Target) -> Target:
    """Start ``t``'s command line again (same environment and directory, a fresh spawn marker and supervisor),
    appending to its log and rewriting its pid file; returns the new target. What is left of ``t``'s tree
    (an engine's EngineCore when only its API server died) is killed first.

    Raises:
        ProcessFaultError: the process exits at once (its log says why), or the old tree outlives SIGKILL.
    """
    if proctree.kill_tree(t.record, 10.0) is False:
        raise ProcessFaultError(f"{t}: process tree still alive 10 s after SIGKILL")
    proctree.reap(t.pid)
    argv = restart_argv(t)
    log = t.home / "logs" / f"{t.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in t.env.items() if k != proctree.MARKER_ENV}
    with log.open("ab") as out:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        out.write(f"\n=== {stamp} restart (fault kit): {' '.join(argv)}\n".encode())
        out.flush()
        try:
            rec = proctree.spawn(argv, env, out, cwd=t.cwd)
        except (OSError, proctree.SpawnError) as e:
            raise ProcessFaultError(f"{t.name}: could not start again ({e}); see {log}") from None
    pid_file(t.home, t.name).write_text(rec.line())
    new = find(t.home, t.name)
    if new is None:
        raise ProcessFaultError(f"{t.name}: exited at once after a restart; see {log}")
    return new


def restart_argv(t: Target) -> list[str]:
    """The command line that starts ``t`` again in the network namespace it ran in (module docstring).

    Raises:
        ProcessFaultError: it ran in an unnamed namespace other than this process's own.
    """
    if t.netns is None:
        return list(t.argv)
    if t.netns == netns.UNNAMED:
        raise ProcessFaultError(f"{t}: runs in an unnamed network namespace; cannot start it there again")
    prefix = netns.enter(t.netns)
    if list(t.argv[: len(prefix)]) == prefix:  # it enters its namespace itself (spawned through nsenter)
        return list(t.argv)
    return [*prefix, *t.argv]


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
