"""Scripted agent turns for Harbor tasks, as a transcripts file for the simulated engine.

``harbor-transcripts -o transcripts.jsonl DATASET`` (or ``python -m harbor_env.transcripts``) writes one line
``{"task_id", "mode", "turns"}`` per task and mode, which ``SimSettings(transcripts=...)`` (``python -m
durable_rollouts.simengine --transcripts ...``) plays through its scripted policy, as tool calls through the
harness:

- ``reference``: what Harbor's oracle agent does. ``solution/`` is uploaded to ``/solution`` (per file, a
  bash call writing its base64, in chunks when large, then one decoding it), ``/solution/solve.sh`` is made
  executable and run in the working directory with ``[solution].env``, then submit. Scores 1.0 on a task
  whose solution is right.
- ``wrong``: ``solution/wrong.sh`` the same way when the task has one (an extra file Harbor ignores), else
  nothing at all; then submit. Scores below 1.0 on a task that is not already solved.

Invariant: deterministic (same dataset, same file); every turn is rendered by
``environments.tool_calls.render_call``.
"""

from __future__ import annotations

import argparse
import base64
import json
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

from durable_rollouts.environments.tool_calls import ToolCall, parse_tool_call, render_call
from harbor_env.tasks import HarborTask, load_dataset

MODES = ("reference", "wrong")
CHUNK = 1_500
"""Base64 characters per upload turn (a turn must fit the run's sampling.max_tokens)."""


def turns(task: HarborTask, mode: str) -> list[str]:
    """The model turns of the scripted agent on ``task`` in ``mode``."""
    solution = task.tree("solution")
    script = "solve.sh" if mode == "reference" else "wrong.sh"
    if script not in solution:
        return [_call("submit")]
    out = []
    for path, data in sorted(solution.items()):
        blob = base64.b64encode(data).decode()
        target = shlex.quote(f"/solution/{path}")
        for n in range(0, max(len(blob), 1), CHUNK):
            op = ">" if n == 0 else ">>"
            out.append(_call("bash", cmd=f"printf %s {blob[n : n + CHUNK]} {op} /tmp/.upload.b64"))
        out.append(
            _call("bash", cmd=f"mkdir -p $(dirname {target}) && base64 -d /tmp/.upload.b64 > {target}")
        )
    exports = "".join(f"export {k}={shlex.quote(v)}; " for k, v in sorted(task.cfg.solution.env.items()))
    out.append(_call("bash", cmd=f"chmod +x /solution/{script}; {exports}/solution/{script}"))
    out.append(_call("submit"))
    return out


def rewritten(task: HarborTask, mode: str, bash: Callable[[str], str], submit: str) -> list[str]:
    """The oracle's `turns` as another harness's: each bash call as ``bash(cmd)``, the submit as
    ``submit``."""
    out = []
    for text in turns(task, mode):
        call = parse_tool_call(text)
        name = getattr(call, "name", None)
        if name == "bash":
            out.append(bash(call.arguments["cmd"]))  # type: ignore[union-attr]
        elif name == "submit":
            out.append(submit)
        else:
            raise ValueError(f"task {task.id}: unexpected oracle turn {text[:80]!r}")
    return out


Turns = Callable[[HarborTask, str], list[str]]
"""A scripted agent: its model turns on a task in a mode (`turns` here; the harness plug-ins' own)."""


def write(path: str | Path, dataset: str | Path, script: Turns | None = None) -> Path:
    """Write the transcripts of every task of ``dataset`` by ``script`` (default: `turns`) to ``path``;
    returns it."""
    script = script or turns
    out = Path(path)
    lines = [
        {"task_id": t.id, "mode": m, "turns": script(t, m)}
        for t in load_dataset(dataset, egress=None)  # the files only: no run's policy to check
        for m in MODES
    ]
    out.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return out


def main(argv: list[str] | None = None, prog: str = "harbor-transcripts", script: Turns | None = None,
         description: str | None = None) -> int:  # fmt: skip
    """The command line that writes ``script``'s transcripts (each plug-in's ``python -m`` calls it)."""
    p = argparse.ArgumentParser(prog=prog, description=description or __doc__.splitlines()[0])
    p.add_argument("dataset", help="a Harbor task directory, a folder of them, or a dataset file")
    p.add_argument("-o", "--output", required=True, help="transcripts file to write (JSONL)")
    args = p.parse_args(argv)
    print(f"wrote {write(args.output, args.dataset, script)}")
    return 0


def _call(name: str, **arguments: str) -> str:
    return render_call(ToolCall(name=name, arguments=arguments))


if __name__ == "__main__":
    sys.exit(main())
