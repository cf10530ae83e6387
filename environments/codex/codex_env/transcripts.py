"""Scripted Codex CLI turns of Harbor tasks, as a transcripts file for the simulated engine.

``python -m codex_env.transcripts -o transcripts.jsonl DATASET`` writes one line ``{"task_id", "mode",
"turns"}`` per task and mode: the harbor plug-in's oracle turns (``harbor_env.transcripts``: upload
``solution/``, run ``solve.sh`` or ``wrong.sh``), each written as a call of the ``exec_command`` tool Codex
declares (argument ``cmd``; ``yield_time_ms`` at Codex's most, 30 s, so a command's output comes back in
its call), and the submit as a plain answer (no tool call: Codex ends its turn and ``codex exec`` exits).
Played through Codex unchanged, ``reference`` scores 1.0 on a task whose solution is right.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from harbor_env import transcripts as harbor_transcripts
from harbor_env.tasks import HarborTask

YIELD_MS = 30_000
DONE = "Done."


def exec_command(cmd: str) -> str:
    """One Codex action in the model's tool-call format."""
    call = {"name": "exec_command", "arguments": {"cmd": cmd, "yield_time_ms": YIELD_MS}}
    return "<tool_call>" + json.dumps(call) + "</tool_call>"


def turns(task: HarborTask, mode: str) -> list[str]:
    return harbor_transcripts.rewritten(task, mode, exec_command, DONE)


def write(path: str | Path, dataset: str | Path) -> Path:
    """Write the Codex transcripts of every task of ``dataset`` to ``path``; returns it."""
    return harbor_transcripts.write(path, dataset, turns)


def main(argv: list[str] | None = None) -> int:
    return harbor_transcripts.main(argv, "codex-transcripts", turns, __doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
