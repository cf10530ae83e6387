"""How the harness's watcher reads its exit code from the sandbox (gateway/harness.py `exit_code_of`): past
the notes the sandbox appends to a command's output."""

from __future__ import annotations

import pytest


def test_the_harness_exit_code_is_read_past_the_sandbox_notes() -> None:
    from durable_rollouts.errors import SandboxGone
    from durable_rollouts.gateway.harness import exit_code_of

    note = "\n[stopped reading output: a detached process still holds it open]"
    assert exit_code_of("RUNNING" + note) is None and exit_code_of("RUNNING\n") is None
    assert exit_code_of("0\n" + note) == 0 and exit_code_of("3") == 3
    for bad in ("VANISHED" + note, "" + note, "garbage"):
        with pytest.raises(SandboxGone):
            exit_code_of(bad)
