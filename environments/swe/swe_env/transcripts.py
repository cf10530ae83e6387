"""Scripted agent turns for the SWE tasks, as a transcripts file for the simulated engine.

``python -m swe_env.transcripts -o transcripts.jsonl [--tasks FILE]`` (or ``swe-transcripts``) writes one
line ``{"task_id", "mode", "turns"}`` per task and mode, which ``SimSettings(transcripts=...)`` (or
``python -m simengine --transcripts ...``) plays through its scripted policy:

- ``reference``: look at the first file of the fix (bash ``cat``), write every file of ``reference``,
  submit. Scores 1.0.
- ``wrong``: the same with ``wrong``. Scores below 1.0.

Invariant: deterministic (same tasks, same file), and every turn is rendered by
``envs.tool_calls.render_call``, the format ``SweEnvironment.parse`` reads.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from envs.tool_calls import ToolCall, render_call
from swe_env import SweEnvironment, SweTask

TASKS = Path(__file__).parent / "data" / "tasks.jsonl"
"""The bundled task file."""
MODES = ("reference", "wrong")


def turns(task: SweTask, mode: str) -> list[str]:
    """The model turns of the scripted agent on ``task`` in ``mode`` (``reference`` or ``wrong``)."""
    files = task.reference if mode == "reference" else task.wrong
    first = next(iter(files))
    out = [_call("bash", cmd=f"cat {shlex.quote(first)}")]
    out += [_call("write_file", path=path, content=content) for path, content in files.items()]
    out.append(_call("submit"))
    return out


def transcripts(tasks: list[SweTask]) -> list[dict[str, Any]]:
    """Every transcript line of ``tasks``, task by task, in `MODES` order."""
    return [{"task_id": t.id, "mode": mode, "turns": turns(t, mode)} for t in tasks for mode in MODES]


def write(path: str | Path, tasks_file: str | Path = TASKS) -> Path:
    """Write the transcripts of the tasks in ``tasks_file`` to ``path``; returns it."""
    tasks = [t for t in SweEnvironment().load_tasks(tasks_file) if isinstance(t, SweTask)]
    out = Path(path)
    out.write_text("".join(json.dumps(line) + "\n" for line in transcripts(tasks)), encoding="utf-8")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="swe-transcripts", description=__doc__.splitlines()[0])
    p.add_argument("-o", "--output", required=True, help="transcripts file to write (JSONL)")
    p.add_argument("--tasks", default=str(TASKS), help="SWE task file (default: the bundled tasks)")
    args = p.parse_args(argv)
    out = write(args.output, args.tasks)
    print(f"wrote {out}")
    return 0


def _call(name: str, **arguments: str) -> str:
    return render_call(ToolCall(name=name, arguments=arguments))


if __name__ == "__main__":
    sys.exit(main())
