"""Scripted agent turns for coding tasks: (task, mode) -> the text of every turn, in order.

Invariant: pure and deterministic. The same task, mode and turn always give the same text, so a rollout
replayed or retried against the simulated engine produces the same tokens. Every well-formed action is
rendered by `envs.tool_calls.render_call`, the same format the harness parses; the malformed ones are fixed
strings that `envs.tool_calls.parse_tool_call` rejects.
"""

from __future__ import annotations

from envs.coding_tasks import CodingTask
from envs.tool_calls import ToolCall, render_call
from simengine.settings import Mode

MALFORMED_TURNS: tuple[str, ...] = (
    # Bad JSON: the arguments object is not closed.
    '<tool_call>{"name": "bash", "arguments": {"cmd": "ls"}</tool_call>',
    # Unknown tool.
    '<tool_call>{"name": "rm", "arguments": {"path": "solution.py"}}</tool_call>',
    # Missing argument.
    '<tool_call>{"name": "write_file", "arguments": {"path": "solution.py"}}</tool_call>',
)
LOOP_CMD = "echo step"
SLEEP_CMD = "sleep 30"


def script(task: CodingTask, mode: Mode) -> list[str]:
    """Every turn of the scripted agent in ``mode`` on ``task``, in order (the last one repeats forever)."""
    if mode == Mode.LOOP:
        return [_call("bash", cmd=LOOP_CMD)]
    if mode == Mode.SLEEP:
        return [_call("bash", cmd=SLEEP_CMD)]
    files = task.wrong if mode == Mode.WRONG else task.reference
    steps = [_call("write_file", path=path, content=content) for path, content in files.items()]
    steps.append(_call("submit"))
    if mode == Mode.MALFORMED:
        return [*MALFORMED_TURNS, *steps]
    return steps


def _call(name: str, **arguments: str) -> str:
    return render_call(ToolCall(name=name, arguments=arguments))
