"""Scripted agent turns for coding tasks: (task, mode) -> the text of every turn, in order.

Invariant: pure and deterministic. The same task, mode and turn always give the same text, so a rollout
replayed or retried against the simulated engine produces the same tokens. Every well-formed action is
rendered by `environments.tool_calls.render_call`, the same format the harness parses; the malformed ones are
fixed
strings that `environments.tool_calls.parse_tool_call` rejects.

The tasks come from a coding task file (the coding plug-in's ``coding_env/data/coding.jsonl``, or any JSONL
file whose lines carry an ``id`` and the ``reference`` and ``wrong`` file maps): the script reads only those
(`ScriptedTask`); the environment that runs the rollouts validates the rest.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from durable_rollouts.environments.tool_calls import ToolCall, render_call
from durable_rollouts.errors import TaskFileError
from durable_rollouts.simengine.settings import Mode

FileMap = dict[str, str]
"""Relative path -> file content."""


class ScriptedTask(BaseModel):
    """What the script needs of one line of a coding task file; its other keys are ignored."""

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    id: str = Field(min_length=1)
    """The task's id, as the environment writes it in the ``Task id: <id>`` line of the prompt."""
    reference: FileMap = Field(min_length=1)
    """Files that solve the task (written in modes other than ``wrong``)."""
    wrong: FileMap = Field(min_length=1)
    """Files of a plausible but wrong solution (written in mode ``wrong``)."""


def load_scripted_tasks(path: str | Path) -> list[ScriptedTask]:
    """Read the tasks the script plays from a coding task file (JSONL, ids unique).

    Raises:
        TaskFileError: one line naming the file, the line and the field at fault.
    """
    from durable_rollouts.environments.tasks import json_objects

    p = Path(path)
    tasks: dict[str, ScriptedTask] = {}
    for n, obj in json_objects(p):
        try:
            task = ScriptedTask.model_validate(obj)
        except ValidationError as e:
            err = e.errors()[0]
            field = str(err["loc"][0]) if err["loc"] else "task"
            raise TaskFileError(f"{p}:{n}: field {field!r}: {err['msg']}") from None
        if task.id in tasks:
            raise TaskFileError(f"{p}:{n}: field 'id': duplicate task id {task.id!r}")
        tasks[task.id] = task
    if not tasks:
        raise TaskFileError(f"{p}: no tasks")
    return list(tasks.values())


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


def script(task: ScriptedTask, mode: Mode) -> list[str]:
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
