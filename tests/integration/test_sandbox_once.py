"""Keyed execs (``once_key``) against the real daemon: a command runs at most once per key in a sandbox.

A second exec with a key already used (a retried step whose worker died mid-command) runs nothing: it
waits for the first run to end and returns its output, exit status and duration, ``replayed``; keys of
another scope are forgotten when a new scope claims one.
"""

from __future__ import annotations

import threading

import pytest

from durable_rollouts.sandboxes import DockerBackend
from tests.integration.test_sandbox_docker import SMALL, backend, sandbox, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]
__all__ = ["backend", "sandbox"]  # fixtures, imported for their names

COUNTED = "echo run >> runs.txt; echo out; sleep 2; exit 5"


def runs(backend: DockerBackend, handle) -> int:
    """How many times the counted command ran in the sandbox."""
    return int(backend.exec(handle, "cat runs.txt 2>/dev/null | grep -c .").output.split()[0])


def test_a_keyed_command_runs_once_and_a_repeat_gets_its_result(backend, sandbox):
    h = sandbox()
    first = backend.exec(h, COUNTED, once_key="turn-1")
    again = backend.exec(h, COUNTED, once_key="turn-1")
    assert (first.exit_code, first.output, first.replayed) == (5, "out\n", False)
    assert (again.exit_code, again.output, again.replayed) == (5, "out\n", True)
    assert again.duration_s == pytest.approx(first.duration_s, abs=0.5)
    assert runs(backend, h) == 1
    unkeyed = backend.exec(h, COUNTED)
    assert not unkeyed.replayed and runs(backend, h) == 2


def test_a_repeat_while_the_first_run_goes_on_waits_for_it(backend, sandbox):
    h = sandbox()
    got = {}
    cmd = "echo run >> runs.txt; seq 1 3; sleep 3; echo end"
    first = threading.Thread(target=lambda: got.update(first=backend.exec(h, cmd, once_key="turn-2")))
    first.start()
    wait_for(lambda: runs(backend, h) == 1, what="the first run to start")
    got["again"] = backend.exec(h, cmd, once_key="turn-2")  # the first run has not ended yet
    first.join()
    assert got["again"].replayed and got["again"].output == got["first"].output == "1\n2\n3\nend\n"
    assert runs(backend, h) == 1


def test_a_timed_out_first_run_replays_as_timed_out(backend, sandbox):
    h = sandbox()
    first = backend.exec(h, "sleep 5", timeout_s=1, once_key="turn-3")
    again = backend.exec(h, "sleep 5", timeout_s=1, once_key="turn-3")
    assert first.timed_out and again.timed_out and again.replayed


def test_a_new_scope_forgets_the_older_keys_but_not_its_own(backend, sandbox):
    h = sandbox()
    backend.exec(h, COUNTED, once_key="score-4.prepare")
    backend.exec(h, COUNTED, once_key="score-4.run")
    assert backend.exec(h, COUNTED, once_key="score-4.prepare").replayed  # same scope: kept
    assert runs(backend, h) == 2
    backend.exec(h, COUNTED, once_key="turn-5")
    assert not backend.exec(h, COUNTED, once_key="score-4.prepare").replayed  # forgotten: runs again
    assert runs(backend, h) == 4


def test_a_bad_key_is_refused(backend, sandbox):
    h = sandbox(SMALL)
    with pytest.raises(ValueError, match="once_key"):
        backend.exec(h, "true", once_key="../x")
