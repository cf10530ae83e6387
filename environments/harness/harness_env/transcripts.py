"""Scripted mini-swe-agent trajectories of Harbor tasks, as a transcripts file for the simulated engine.

``python -m harness_env.transcripts -o transcripts.jsonl DATASET`` writes one line ``{"task_id", "mode",
"turns"}`` per task and mode: the harbor plug-in's oracle turns (``harbor_env.transcripts``: upload
``solution/``, run ``solve.sh`` or ``wrong.sh``), each written as the ``bash`` tool call mini-swe-agent
declares (argument ``command``), and the submit as mini-swe-agent's own end: ``echo
COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT``. Played through mini-swe-agent unchanged, ``reference`` scores
1.0 on a task whose solution is right.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from harbor_env import transcripts as harbor_transcripts
from harbor_env.tasks import HarborTask

SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


def bash(command: str) -> str:
    """One mini-swe-agent action in the model's tool-call format."""
    return "<tool_call>" + json.dumps({"name": "bash", "arguments": {"command": command}}) + "</tool_call>"


def turns(task: HarborTask, mode: str) -> list[str]:
    return harbor_transcripts.rewritten(task, mode, bash, bash(SUBMIT))


def write(path: str | Path, dataset: str | Path) -> Path:
    """Write the mini-swe-agent transcripts of every task of ``dataset`` to ``path``; returns it."""
    return harbor_transcripts.write(path, dataset, turns)


def main(argv: list[str] | None = None) -> int:
    return harbor_transcripts.main(argv, "harness-transcripts", turns, __doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
