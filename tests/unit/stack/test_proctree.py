"""Process trees of spawned components (stack.proctree): found and stopped whole when the leader is already
dead (an engine's API server SIGKILLed leaves its EngineCore and Workers), also when they renamed themselves
with setproctitle (which wipes the environment /proc shows) or left the leader's session, and never a process
that cannot be proven to be of the recorded spawn (a recycled session or group id, a forged supervisor)."""

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
    pid, start, child = _stranger_session(tmp_path, strays)

    ours = Record(pid, start, proctree.new_marker())  # the same pid and start time, our marker
    assert proctree.members(ours) == []
    assert proctree.stop_tree(ours, timeout_s=1) is None
    legacy = Record(pid, start)  # no marker recorded: nothing can be proven once the leader is gone
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


def _spawn_legacy(home: Path, name: str, code: str) -> int:
    """Start ``code`` as versions before the supervisor did: leading its own session, the marker in its
    environment, and a pid file of three fields (``<pid> <start time> <marker>``)."""
    marker = proctree.new_marker()
    log = procs.log_path(home, name)
    log.parent.mkdir(parents=True, exist_ok=True)
    procs.pid_path(home, name).parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", code],
            stdout=out,
            env={**os.environ, proctree.MARKER_ENV: marker},
            start_new_session=True,
        )
    procs.pid_path(home, name).write_text(f"{proc.pid} {procs._start_time(proc.pid)} {marker}\n")
    return proc.pid


TWO_CHILDREN = (
    "import os, subprocess, sys, time; s = 'import time; time.sleep(120)'; "
    "a = subprocess.Popen([sys.executable, '-c', s]); "
    "b = subprocess.Popen([sys.executable, '-c', s], env={'PATH': os.environ['PATH']}); "
    "print(a.pid, b.pid, flush=True); time.sleep(120)"
)
"""A leader that starts one child with its environment and one with the marker removed (env cleared)."""


def _two_children(home: Path, leader: int, strays: list[int]) -> tuple[int, int]:
    log = procs.log_path(home, "engine")
    procs.wait_until(lambda: len(procs.log_tail(log, 1).split()) == 2, 20, "child pids", leader)
    marked, unmarked = map(int, procs.log_tail(log, 1).split())
    strays += [marked, unmarked]
    return marked, unmarked


@pytest.mark.timeout(60)
def test_a_legacy_pid_file_proves_only_the_marked_members_of_a_dead_leaders_session(
    tmp_path: Path, strays: list[int]
) -> None:
    leader = _spawn_legacy(tmp_path, "engine", TWO_CHILDREN)
    strays.append(leader)
    marked, unmarked = _two_children(tmp_path, leader, strays)
    rec = procs.read_record(tmp_path, "engine")
    assert rec is not None and rec.marker is not None and rec.supervisor is None
    assert set(proctree.members(rec)) == {leader, marked, unmarked}  # a live leader vouches for its session

    _kill_leader_only(leader)
    assert proctree.members(rec) == [marked]
    assert stack.down(tmp_path) == ["engine"]  # the old format still stops what it can prove
    assert not _alive(marked) and _alive(unmarked)


@pytest.mark.timeout(60)
def test_every_descendant_of_a_supervised_spawn_is_ours_whatever_its_environment(
    tmp_path: Path, strays: list[int]
) -> None:
    leader = procs.spawn("engine", [sys.executable, "-c", TWO_CHILDREN], tmp_path)
    strays.append(leader)
    marked, unmarked = _two_children(tmp_path, leader, strays)
    rec = procs.read_record(tmp_path, "engine")
    assert rec is not None and rec.supervisor is not None
    _kill_leader_only(leader)
    assert set(proctree.members(rec)) == {marked, unmarked}  # both were reparented to the supervisor
    assert procs.stop_record(rec, timeout=5)
    assert not _alive(marked) and not _alive(unmarked)


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
    leader = _spawn_legacy(tmp_path, "engine", code)  # the marker is its child's only proof
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
    assert Record.parse("12 345 abc 10 344\n") == Record(12, "345", "abc", 10, "344")
    assert Record.parse(Record(12, "345", "abc", 10, "344").line()) == Record(12, "345", "abc", 10, "344")
    assert Record.parse("12 345 abc - -\n") == Record(12, "345", "abc")
    assert Record.parse("12 345 abc x 1\n") == Record(12, "345", "abc")  # a bad supervisor field: none
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


RETITLE = (
    "import os, time, setproctitle; setproctitle.setproctitle('VLLM::EngineCore'); "
    "print(os.getpid(), flush=True); time.sleep(120)"
)
RETITLED_CHILD = (
    f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {RETITLE!r}]); time.sleep(120)"
)
"""A leader whose child renames itself as vLLM's EngineCore does (``setproctitle``), then prints its pid."""


def _comm(pid: int) -> str:
    return Path(f"/proc/{pid}/comm").read_text().strip()


@pytest.mark.timeout(60)
def test_a_child_that_retitled_itself_is_stopped_whole_after_its_leader_was_sigkilled(
    tmp_path: Path, strays: list[int]
) -> None:
    leader = procs.spawn("engine", [sys.executable, "-c", RETITLED_CHILD], tmp_path)
    strays.append(leader)
    child = _child_of(procs.log_path(tmp_path, "engine"), leader)
    strays.append(child)
    rec = procs.read_record(tmp_path, "engine")
    assert rec is not None and rec.marker is not None
    assert _comm(child).startswith("VLLM::Engine")
    assert not proctree._has_marker(child, rec.marker)  # setproctitle wiped the environment /proc shows

    _kill_leader_only(leader)
    assert os.getsid(child) == leader and proctree.members(rec) == [child]
    assert stack.down(tmp_path) == ["engine"]
    assert not _alive(child)


DAEMON = (
    "import os, sys, time, setproctitle\n"
    "if os.fork():\n    os._exit(0)\n"
    "os.setsid()\n"
    "if os.fork():\n    os._exit(0)\n"
    "setproctitle.setproctitle('VLLM::Worker')\n"
    "print(os.getpid(), flush=True)\n"
    "time.sleep(120)\n"
)
"""A process that daemonizes (forks twice, a session of its own, its parent gone) and renames itself."""


@pytest.mark.timeout(60)
def test_a_descendant_that_left_the_session_and_retitled_itself_is_stopped(
    tmp_path: Path, strays: list[int]
) -> None:
    code = f"import subprocess, sys, time; subprocess.run([sys.executable, '-c', {DAEMON!r}]); time.sleep(99)"
    leader = procs.spawn("engine", [sys.executable, "-c", code], tmp_path)
    strays.append(leader)
    daemon = _child_of(procs.log_path(tmp_path, "engine"), leader)
    strays.append(daemon)
    rec = procs.read_record(tmp_path, "engine")
    assert rec is not None
    assert os.getsid(daemon) != leader and proctree.stat(daemon)[1] != str(leader)  # type: ignore[index]
    assert set(proctree.members(rec)) == {leader, daemon}

    _kill_leader_only(leader)
    assert procs.stop_component(tmp_path, "engine", timeout=5)
    assert not _alive(daemon)


def _stranger_session(tmp_path: Path, strays: list[int]) -> tuple[int, str, int]:
    """A session of a stranger whose leader exited, leaving a child: (leader pid, its start time, child)."""
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
    return stranger.pid, start, child


@pytest.mark.timeout(60)
def test_a_recycled_session_id_is_never_signalled_while_the_supervisor_lives(
    tmp_path: Path, strays: list[int]
) -> None:
    # Our engine's leader died (its retitled child lives on under the supervisor) and the kernel gave the
    # leader's pid to a stranger, who started a session: the record names the stranger's session.
    leader = procs.spawn("engine", [sys.executable, "-c", RETITLED_CHILD], tmp_path)
    strays.append(leader)
    ours = _child_of(procs.log_path(tmp_path, "engine"), leader)
    strays.append(ours)
    _kill_leader_only(leader)
    rec = procs.read_record(tmp_path, "engine")
    assert rec is not None and rec.supervisor is not None
    pid, start, stranger_child = _stranger_session(tmp_path, strays)
    recycled = Record(pid, start, rec.marker, rec.supervisor, rec.supervisor_start)

    assert proctree.members(recycled) == [ours]
    assert procs.stop_record(recycled, timeout=5)
    assert not _alive(ours)
    time.sleep(0.3)
    assert _alive(stranger_child)


@pytest.mark.timeout(60)
def test_a_supervisor_with_another_start_time_proves_nothing(tmp_path: Path, strays: list[int]) -> None:
    pid, start, stranger_child = _stranger_session(tmp_path, strays)
    with (tmp_path / "other.log").open("wb") as out:  # a live stranger with children, named as supervisor
        other = subprocess.Popen([sys.executable, "-c", PARENT], stdout=out, start_new_session=True)
    strays.append(other.pid)
    other_child = _child_of(tmp_path / "other.log", other.pid)
    strays.append(other_child)

    forged = Record(pid, start, proctree.new_marker(), other.pid, "1")
    assert proctree.members(forged) == []
    assert proctree.signal_tree(forged, signal.SIGKILL) == 0
    assert proctree.stop_tree(forged, timeout_s=1) is None
    time.sleep(0.3)
    assert _alive(stranger_child) and _alive(other.pid) and _alive(other_child)


@pytest.mark.timeout(60)
def test_the_supervisor_leaves_once_nothing_of_its_tree_is_left(tmp_path: Path, strays: list[int]) -> None:
    leader, child = _spawn_parent(tmp_path, "engine", strays)
    rec = procs.read_record(tmp_path, "engine")
    assert rec is not None and rec.supervisor is not None and rec.supervisor_start is not None
    strays.append(rec.supervisor)
    assert proctree.supervisor_alive(rec)
    assert rec.supervisor not in proctree.members(rec) and os.getsid(rec.supervisor) != leader
    _kill_leader_only(leader)
    assert proctree.supervisor_alive(rec)  # it holds the orphan
    assert stack.down(tmp_path) == ["engine"]
    assert not _alive(child) and not proctree.supervisor_alive(rec)

    quick = procs.spawn("quick", ["sh", "-c", "exit 3"], tmp_path)
    done = procs.read_record(tmp_path, "quick")
    assert done is not None and done.pid == quick
    procs.wait_until(lambda: not proctree.supervisor_alive(done), 10, "supervisor gone")


def test_spawn_reports_a_command_that_cannot_start(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        procs.spawn("nothing", [str(tmp_path / "no-such-program")], tmp_path)
    assert procs.read_record(tmp_path, "nothing") is None


@pytest.mark.timeout(60)
def test_the_fault_kit_restarts_a_leader_that_retitled_itself_with_its_own_command_line(
    tmp_path: Path, strays: list[int]
) -> None:
    code = (
        "import os, setproctitle, time; setproctitle.setproctitle('VLLM::APIServer'); "
        "print(os.getpid(), flush=True); time.sleep(120)"
    )
    argv = [sys.executable, "-c", code]
    leader = procs.spawn("engine", argv, tmp_path, {"CHAOS_MARK": "1"})
    strays.append(leader)
    assert _child_of(procs.log_path(tmp_path, "engine"), leader) == leader  # retitled by now
    assert _comm(leader).startswith("VLLM::API")

    (t,) = process.targets(tmp_path, "engine")
    assert list(t.argv) == argv and t.env["CHAOS_MARK"] == "1"
    new = process.restart(t)
    strays.append(new.pid)
    assert new.pid != leader and not _alive(leader)
    assert list(new.argv) == argv and new.env["CHAOS_MARK"] == "1"
    assert new.env[proctree.MARKER_ENV] == new.record.marker != t.record.marker
    assert _child_of(procs.log_path(tmp_path, "engine"), new.pid) == new.pid
    process.kill(new)
    assert not _alive(new.pid)
