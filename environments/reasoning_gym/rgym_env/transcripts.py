"""Scripted answers for reasoning-gym tasks, as a transcripts file for the simulated engine.

``python -m rgym_env.transcripts -o transcripts.jsonl --spec SPEC`` (or ``rgym-transcripts``) writes one
line ``{"task_id", "mode", "turns"}`` per task and mode, which ``SimSettings(transcripts=...)`` (or
``python -m durable_rollouts.simengine --transcripts ...``) plays through its scripted policy:

- ``reference``: a line of working, then the oracle answer as ``<answer>ANSWER</answer>``. Scores what
  ``score_answer`` gives the oracle answer (1.0 for the generators here).
- ``wrong``: the oracle answer reversed, in the same tags. Usually scores below 1.0, sometimes partly.

Invariant: deterministic (same spec, same file).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rgym_env import ReasoningGymEnvironment, RgTask

SPEC = Path(__file__).parent / "data" / "three.toml"
"""The bundled spec: three generators."""
MODES = ("reference", "wrong")


def turns(task: RgTask, mode: str) -> list[str]:
    """The one model turn of the scripted policy on ``task`` in ``mode`` (``reference`` or ``wrong``)."""
    oracle = "" if task.answer is None else str(task.answer)
    answer = oracle if mode == "reference" else oracle[::-1]
    return [f"Working it out step by step.\n<answer>{answer}</answer>"]


def transcripts(tasks: list[RgTask]) -> list[dict[str, Any]]:
    """Every transcript line of ``tasks``, task by task, in `MODES` order."""
    return [{"task_id": t.id, "mode": mode, "turns": turns(t, mode)} for t in tasks for mode in MODES]


def write(path: str | Path, spec: str | Path = SPEC) -> Path:
    """Write the transcripts of the tasks of ``spec`` to ``path``; returns it."""
    tasks = [t for t in ReasoningGymEnvironment().load_tasks(spec) if isinstance(t, RgTask)]
    out = Path(path)
    out.write_text("".join(json.dumps(line) + "\n" for line in transcripts(tasks)), encoding="utf-8")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rgym-transcripts", description=__doc__.splitlines()[0])
    p.add_argument("-o", "--output", required=True, help="transcripts file to write (JSONL)")
    p.add_argument("--spec", default=str(SPEC), help="task spec (default: the bundled three generators)")
    args = p.parse_args(argv)
    out = write(args.output, args.spec)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
