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


class Answers:
    """A sandbox whose probes answer in turn (the harness watcher's exec calls)."""

    def __init__(self, *outputs: str) -> None:
        self.outputs = list(outputs)
        self.commands: list[str] = []

    async def exec(self, command: str, timeout: float) -> object:
        from durable_rollouts.sandboxes.base import ExecResult

        self.commands.append(command)
        return ExecResult(exit_code=0, output=self.outputs.pop(0), duration_s=0.01)


KILLED = "\n[no exit status: the command's supervisor was killed, probably by the command itself]"


async def test_a_probe_that_said_nothing_is_asked_again_and_three_in_a_row_mean_gone() -> None:
    from durable_rollouts.errors import SandboxGone
    from durable_rollouts.gateway.harness import PROBE_TRIES, poll

    box = Answers(KILLED, "RUNNING\n")
    assert await poll(box, pause_s=0) is None and len(box.commands) == 2  # type: ignore[arg-type]
    box = Answers(KILLED, KILLED, "0\n")
    assert await poll(box, pause_s=0) == 0  # type: ignore[arg-type]
    with pytest.raises(SandboxGone, match=f"unreadable harness exit code.*{PROBE_TRIES} probes"):
        await poll(Answers(*[KILLED] * PROBE_TRIES), pause_s=0)  # type: ignore[arg-type]
    box = Answers("VANISHED\n")  # the launcher gone without an exit code: no second probe
    with pytest.raises(SandboxGone, match="vanished"):
        await poll(box, pause_s=0)  # type: ignore[arg-type]
    assert len(box.commands) == 1
    # the code is read again after the launcher is found gone (it writes the code, then exits)
    assert box.commands[0].count("/rc 2>/dev/null") == 2
