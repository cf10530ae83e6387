"""faults/process.py across network namespaces: a component killed and started again by the fault kit comes
back in the namespace it ran in (read before the kill), never in the machine's own; a command line that
enters its namespace itself is not wrapped twice; a process of an unnamed namespace is not restarted."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from durable_rollouts.faults import process
from durable_rollouts.faults.netns import UNNAMED, Network, available, enter, namespaces, netns_of
from durable_rollouts.stack import proctree
from durable_rollouts.stack.proctree import Record


@pytest.fixture
def net() -> Iterator[Network]:
    if why := available():
        pytest.skip(why)
    n = Network()
    made = n.made
    try:
        n.add_host("comp")
        yield n
    finally:
        made = n.made
        assert n.close() == [] and not set(made) & set(namespaces())


def _exec_done(pid: int) -> None:
    """Wait until ``nsenter`` has entered the namespace and exec'd ``sleep`` (same pid)."""
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}/comm").read_text().strip() != "sleep":
        assert time.monotonic() < deadline, f"pid {pid}: nsenter did not exec sleep within 10 s"
        time.sleep(0.01)


def _leader_in(net: Network, home: Path) -> int:
    """``sleep`` started inside host ``comp`` by ``nsenter`` (which execs it: the leader's own command line
    no longer names the namespace), recorded in ``home``'s pid file as a launcher without a supervisor
    writes it (pid, start time, marker in its environment)."""
    marker = proctree.new_marker()
    proc = subprocess.Popen(
        [*enter(net.hosts["comp"].netns), "sleep", "600"], env={**os.environ, proctree.MARKER_ENV: marker},
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    _exec_done(proc.pid)
    stat = proctree.stat(proc.pid)
    assert stat is not None
    process.pid_file(home, "worker").parent.mkdir(parents=True)
    process.pid_file(home, "worker").write_text(Record(proc.pid, stat[19], marker).line())
    return proc.pid


def test_a_killed_process_is_started_again_in_its_own_network_namespace(net: Network, tmp_path: Path) -> None:
    pid = _leader_in(net, tmp_path)
    ns = net.hosts["comp"].netns
    assert netns_of(pid) == ns
    (t,) = process.targets(tmp_path, "worker")
    assert t.netns == ns and t.argv[0] == "sleep"  # read before the kill; the argv does not name it
    process.kill(t)
    new = process.start(t)
    try:
        assert new.pid != pid
        _exec_done(new.pid)
        assert netns_of(new.pid) == ns  # not the machine's own (None)
        again = process.find(tmp_path, "worker")
        assert again is not None and again.netns == ns
    finally:
        process.kill(new)


def test_a_command_line_that_enters_its_namespace_is_not_wrapped_twice(net: Network, tmp_path: Path) -> None:
    ns = net.hosts["comp"].netns
    t = process.Target(tmp_path, "engine", 1, (*enter(ns), "vllm"), {}, "/", Record(1), ns)
    assert process.restart_argv(t) == [*enter(ns), "vllm"]
    bare = process.Target(tmp_path, "engine", 1, ("vllm",), {}, "/", Record(1), ns)
    assert process.restart_argv(bare) == [*enter(ns), "vllm"]
    here = process.Target(tmp_path, "engine", 1, ("vllm",), {}, "/", Record(1), None)
    assert process.restart_argv(here) == ["vllm"]


def test_a_process_of_an_unnamed_namespace_is_not_started_again(tmp_path: Path) -> None:
    t = process.Target(tmp_path, "worker", 1, ("sleep", "1"), {}, "/", Record(1), UNNAMED)
    with pytest.raises(process.ProcessFaultError, match="unnamed network namespace"):
        process.restart_argv(t)


def test_this_process_is_in_no_named_namespace_of_a_test_network(net: Network) -> None:
    assert netns_of(os.getpid()) not in net.made
