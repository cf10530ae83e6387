"""Scripted agent turns for the SWE tasks, as a transcripts file for the simulated engine.

``python -m swe_env.transcripts -o transcripts.jsonl [--tasks FILE]`` (or ``swe-transcripts``) writes one
line ``{"task_id", "mode", "turns"}`` per task and mode, which ``SimSettings(transcripts=...)`` (or
``python -m durable_rollouts.simengine --transcripts ...``) plays through its scripted policy:

- ``reference``: look at the first file of the fix (bash ``cat``), write every file of ``reference``,
  submit. Scores 1.0.
- ``wrong``: the same with ``wrong``. Scores below 1.0.

For a SWE-bench row (`swe_env.swebench`) the agent applies a diff through the tools: it writes the diff
applier (`swe_env.unidiff`) and the diff into the workdir, runs ``python3 .swe_apply.py . < .swe_fix.patch``
with bash, removes both and submits. ``reference`` applies the row's ``patch`` (scores 1.0); ``wrong``
applies the instance's entry of a breaking-patches file (``{instance_id: diff}``, default
``data/swebench_breaking.json``): a diff that makes FAIL_TO_PASS pass but breaks a PASS_TO_PASS test
(scores 0.0). A row without an entry gets no ``wrong`` transcript.

Invariant: deterministic (same tasks, same file), and every turn is rendered by
``environments.tool_calls.render_call``, the format ``SweEnvironment.parse`` reads.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from durable_rollouts.environments.tool_calls import ToolCall, render_call
from swe_env import SweBenchTask, SweEnvironment, SweTask
from swe_env.swebench import APPLIER

TASKS = Path(__file__).parent / "data" / "tasks.jsonl"
"""The bundled task file."""
SWEBENCH = Path(__file__).parent / "data" / "swebench.jsonl"
"""The bundled SWE-bench-style rows (two instances, two images)."""
BREAKING = Path(__file__).parent / "data" / "swebench_breaking.json"
"""For each bundled row, a diff that fixes its FAIL_TO_PASS tests but breaks a PASS_TO_PASS test."""
PUBLISHED = Path(__file__).parent / "data" / "swebench_published.jsonl"
"""Two SWE-bench rows as published (no image field): django and sympy, in images built from their sdists."""
PUBLISHED_BREAKING = Path(__file__).parent / "data" / "swebench_published_breaking.json"
"""For each row of `PUBLISHED`, a broken fix (its FAIL_TO_PASS test still fails)."""
MODES = ("reference", "wrong")


def turns(task: SweTask | SweBenchTask, mode: str, breaking: dict[str, str] | None = None) -> list[str]:
    """The model turns of the scripted agent on ``task`` in ``mode`` (``reference`` or ``wrong``);
    ``breaking``: the wrong diffs of SWE-bench rows by instance id (default: the bundled file's)."""
    if isinstance(task, SweBenchTask):
        diff = task.patch if mode == "reference" else (breaking or load_breaking())[task.instance_id]
        return apply_patch_turns(diff)
    files = task.reference if mode == "reference" else task.wrong
    first = next(iter(files))
    out = [_call("bash", cmd=f"cat {shlex.quote(first)}")]
    out += [_call("write_file", path=path, content=content) for path, content in files.items()]
    out.append(_call("submit"))
    return out


def apply_patch_turns(diff: str) -> list[str]:
    """Apply ``diff`` to the workdir through the tools, then submit."""
    cmd = "python3 .swe_apply.py . < .swe_fix.patch; s=$?; rm -f .swe_apply.py .swe_fix.patch; exit $s"
    return [
        _call("write_file", path=".swe_apply.py", content=APPLIER),
        _call("write_file", path=".swe_fix.patch", content=diff),
        _call("bash", cmd=cmd),
        _call("submit"),
    ]


def load_breaking(path: str | Path = BREAKING) -> dict[str, str]:
    """A breaking-patches file: ``{instance_id: diff}``."""
    return {str(k): str(v) for k, v in json.loads(Path(path).read_text(encoding="utf-8")).items()}


def transcripts(
    tasks: Sequence[SweTask | SweBenchTask], breaking: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """Every transcript line of ``tasks``, task by task, in `MODES` order (rows without a breaking diff:
    ``reference`` only)."""
    wrong = load_breaking() if breaking is None else breaking
    return [
        {"task_id": t.id, "mode": mode, "turns": turns(t, mode, wrong)}
        for t in tasks
        for mode in MODES
        if mode == "reference" or not isinstance(t, SweBenchTask) or t.instance_id in wrong
    ]


def write(path: str | Path, tasks_file: str | Path = TASKS, breaking: str | Path | None = None) -> Path:
    """Write the transcripts of the tasks in ``tasks_file`` to ``path``; returns it."""
    tasks = [t for t in SweEnvironment().load_tasks(tasks_file) if isinstance(t, SweTask | SweBenchTask)]
    wrong = load_breaking(breaking) if breaking is not None else None
    out = Path(path)
    out.write_text("".join(json.dumps(line) + "\n" for line in transcripts(tasks, wrong)), encoding="utf-8")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="swe-transcripts", description=__doc__.splitlines()[0])
    p.add_argument("-o", "--output", required=True, help="transcripts file to write (JSONL)")
    p.add_argument("--tasks", default=str(TASKS), help="SWE task file (default: the bundled tasks)")
    p.add_argument("--breaking", default=None, help="SWE-bench rows' wrong diffs, {instance_id: diff}")
    args = p.parse_args(argv)
    out = write(args.output, args.tasks, args.breaking)
    print(f"wrote {out}")
    return 0


def _call(name: str, **arguments: str) -> str:
    return render_call(ToolCall(name=name, arguments=arguments))


if __name__ == "__main__":
    sys.exit(main())
