"""Process trees of spawned components (config.proctree): found and stopped whole when the leader is already
dead (an engine's API server SIGKILLed leaves its EngineCore and Workers), and never a process that cannot be
proven to be of the recorded spawn (a recycled session or group id)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from durable_rollouts.config.models import StackConfig
from durable_rollouts.faults import process
from durable_rollouts.stack import procs, proctree, stack
from durable_rollouts.stack.proctree import Record

PARENT = (
    "import subprocess, sys, time; "
    "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
    "print(c.pid, flush=True); time.sleep(120)"
)
"""A leader that starts one child (in its session) and prints the child's pid."""


@pytest.fixture
def strays() -> Iterator[list[int]]:
    """Pids a test leaves to check; each is SIGKILLed at teardown if it still runs (by pid, never by name)."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        proctree.reap(pid)


def _alive(pid: int) -> bool:
    proctree.reap(pid)
    f = proctree.stat(pid)
    return f is not None and f[0] not in ("Z", "X")


def _child_of(log: Path, leader: int) -> int:
    procs.wait_until(lambda: procs.log_tail(log, 1).strip().isdigit(), 20, "child pid", leader)
    return int(procs.log_tail(log, 1))


def _spawn_parent(home: Path, name: str, strays: list[int]) -> tuple[int, int]:
    leader = procs.spawn(name, [sys.executable, "-c", PARENT], home)
    strays.append(leader)
    child = _child_of(procs.log_path(home, name), leader)
    strays.append(child)
    return leader, child


def _kill_leader_only(leader: int) -> None:
    os.kill(leader, signal.SIGKILL)
    procs.wait_until(lambda: not procs.pid_alive(leader), 10, "leader gone")


@pytest.mark.timeout(60)
def test_down_stops_the_orphans_of_a_leader_that_was_sigkilled(tmp_path: Path, strays: list[int]) -> None:
    leader, child = _spawn_parent(tmp_path, "engine", strays)
    _kill_leader_only(leader)
    assert _alive(child) and os.getsid(child) == leader  # the orphan keeps the dead leader's session
    assert procs.read_pid(tmp_path, "engine") is None

    assert stack.down(tmp_path) == ["engine"]
    procs.wait_until(lambda: not _alive(child), 5, "orphan gone")
    assert not procs.pid_path(tmp_path, "engine").exists()
    assert stack.down(tmp_path) == []


@pytest.mark.timeout(60)
def test_a_recycled_session_id_is_never_signalled(tmp_path: Path, strays: list[int]) -> None:
    # A stranger's session (no marker of ours) whose leader exited, leaving a child: as if our engine's tree
    # had died and the kernel had given its pid to this stranger, who then started a session.
    log = tmp_path / "stranger.log"
    with log.open("wb") as out:
        stranger = subprocess.Popen([sys.executable, "-c", PARENT], stdout=out, start_new_session=True)
    strays.append(stranger.pid)
    child = _child_of(log, stranger.pid)
    strays.append(child)
    start = proctree.stat(stranger.pid)[19]  # type: ignore[index]
    stranger.kill()
    stranger.wait()
    assert os.getsid(child) == stranger.pid

    ours = Record(stranger.pid, start, proctree.new_marker())  # the same pid and start time, our marker
    assert proctree.members(ours) == []
    assert proctree.stop_tree(ours, timeout_s=1) is None
    legacy = Record(stranger.pid, start)  # no marker recorded: nothing can be proven once the leader is gone
    assert proctree.signal_tree(legacy, signal.SIGKILL) == 0
    (tmp_path / "pids").mkdir()
    procs.pid_path(tmp_path, "engine").write_text(ours.line())
    assert stack.down(tmp_path) == []
    time.sleep(0.3)
    assert _alive(child)


@pytest.mark.timeout(60)
def test_a_live_recycled_leader_with_another_start_time_is_never_signalled(
    tmp_path: Path, strays: list[int]
) -> None:
    with (tmp_path / "stranger.log").open("wb") as out:
        stranger = subprocess.Popen([sys.executable, "-c", PARENT], stdout=out, start_new_session=True)
    strays.append(stranger.pid)
    child = _child_of(tmp_path / "stranger.log", stranger.pid)
    strays.append(child)
    forged = Record(stranger.pid, "1", proctree.new_marker())
    assert not proctree.leader_alive(forged)
    assert proctree.signal_tree(forged, signal.SIGKILL) == 0
    time.sleep(0.3)
    assert _alive(stranger.pid) and _alive(child)


@pytest.mark.timeout(60)
def test_only_the_marked_members_of_a_dead_leaders_session_are_ours(
    tmp_path: Path, strays: list[int]
) -> None:
    # the leader starts one child with our environment and one with the marker removed (env cleared)
    code = (
        "import os, subprocess, sys, time; s = 'import time; time.sleep(120)'; "
        "a = subprocess.Popen([sys.executable, '-c', s]); "
        "b = subprocess.Popen([sys.executable, '-c', s], env={'PATH': os.environ['PATH']}); "
        "print(a.pid, b.pid, flush=True); time.sleep(120)"
    )
    leader = procs.spawn("engine", [sys.executable, "-c", code], tmp_path)
    strays.append(leader)
    log = procs.log_path(tmp_path, "engine")
    procs.wait_until(lambda: len(procs.log_tail(log, 1).split()) == 2, 20, "child pids", leader)
    marked, unmarked = map(int, procs.log_tail(log, 1).split())
    strays += [marked, unmarked]
    rec = procs.read_record(tmp_path, "engine")
    assert rec is not None and rec.marker is not None
    assert set(proctree.members(rec)) == {leader, marked, unmarked}  # a live leader vouches for its session

    _kill_leader_only(leader)
    assert proctree.members(rec) == [marked]
    assert procs.stop_record(rec, timeout=5)
    assert not _alive(marked) and _alive(unmarked)


SLOW_EXIT = (
    "import ctypes, signal, time\n"
    "def bye(*_):\n"
    "    f = open('/proc/self/stat').read().rsplit(')', 1)[1].split()\n"
    "    start, end = int(f[47]), int(f[48])\n"  # env_start, env_end (fields 50 and 51)
    "    ctypes.memset(start, 0, end - start)\n"  # /proc/PID/environ no longer shows the marker
    "    time.sleep(1.5)\n"
    "    raise SystemExit(0)\n"
    "signal.signal(signal.SIGTERM, bye)\n"
    "time.sleep(120)\n"
)
"""A child that, on SIGTERM, loses its proof (its environment reads empty, as an exiting process's does once
its memory is released) and only then exits, 1.5 s later."""


@pytest.mark.timeout(60)
def test_a_stop_waits_for_a_signalled_process_that_lost_its_proof_while_exiting(
    tmp_path: Path, strays: list[int]
) -> None:
    code = (
        f"import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', {SLOW_EXIT!r}]); "
        "print(c.pid, flush=True); time.sleep(120)"
    )
    leader = procs.spawn("engine", [sys.executable, "-c", code], tmp_path)
    strays.append(leader)
    child = _child_of(procs.log_path(tmp_path, "engine"), leader)
    strays.append(child)
    _kill_leader_only(leader)
    rec = procs.read_record(tmp_path, "engine")
    assert rec is not None and proctree.members(rec) == [child]

    assert procs.stop_record(rec, timeout=10)
    assert not _alive(child)  # the stop returned only once the child was gone, not once it lost its marker


@pytest.mark.timeout(60)
def test_the_fault_kit_kills_the_orphans_and_restarts_with_a_fresh_marker(
    tmp_path: Path, strays: list[int]
) -> None:
    leader, child = _spawn_parent(tmp_path, "engine", strays)
    (t,) = process.targets(tmp_path, "engine")
    assert process.tree(t) == [leader, child]
    _kill_leader_only(leader)
    assert process.targets(tmp_path, "engine") == [] and process.tree(t) == [child]

    new = process.start(t)  # what is left of the old tree goes first
    strays.append(new.pid)
    assert not _alive(child)
    assert new.record.marker not in (None, t.record.marker)
    new_child = _child_of(procs.log_path(tmp_path, "engine"), new.pid)
    strays.append(new_child)
    assert process.tree(new) == [new.pid, new_child]
    _kill_leader_only(new.pid)
    process.kill(new)  # the leader is dead: the kill still reaches its tree
    assert not _alive(new_child)


def test_pid_file_records_parse_old_and_new_formats() -> None:
    assert Record.parse("12 345 abc\n") == Record(12, "345", "abc")
    assert Record.parse("12 345\n") == Record(12, "345", None)
    assert Record.parse("12\n") == Record(12, None, None)
    assert Record.parse("") is None and Record.parse("x 1") is None
    assert Record.parse(Record(7, None, "m").line()) == Record(7, None, "m")


@pytest.mark.timeout(60)
def test_up_stops_what_is_left_of_a_dead_stack_before_starting(tmp_path: Path, strays: list[int]) -> None:
    leader, child = _spawn_parent(tmp_path, "engine", strays)
    _kill_leader_only(leader)
    assert _alive(child)

    stack.up(StackConfig(), tmp_path, detach=True, components=())  # starts nothing: only the clean-up
    assert not _alive(child)
    assert not procs.pid_path(tmp_path, "engine").exists()
