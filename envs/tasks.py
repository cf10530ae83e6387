"""Task files: JSONL, one task per line.

Invariant: a bad task file is reported in one line naming the file, the line number and the field;
nothing downstream ever sees a half-valid task.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from activities.errors import TaskFileError

REQUIRED_FIELDS: dict[str, tuple[str, ...]] = {"math": ("id", "prompt", "answer")}


def load_tasks(path: str | Path, env: str) -> list[dict[str, Any]]:
    """Read and validate a task file for an environment.

    Raises:
        TaskFileError: one line naming the file, line and field at fault.
    """
    p = Path(path)
    if env == "coding":
        from envs.coding_tasks import load_coding_tasks

        return [t.model_dump(mode="json") for t in load_coding_tasks(p)]
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise TaskFileError(f"{p}: cannot read task file: {e.strerror or e}") from e
    required = REQUIRED_FIELDS.get(env, ("id", "prompt"))
    tasks: list[dict[str, Any]] = []
    seen: set[str] = set()
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            task = json.loads(line)
        except json.JSONDecodeError as e:
            raise TaskFileError(f"{p}:{n}: not valid JSON ({e.msg})") from e
        if not isinstance(task, dict):
            raise TaskFileError(f"{p}:{n}: a task must be a JSON object")
        for field in required:
            if field not in task:
                raise TaskFileError(f"{p}:{n}: missing field {field!r}")
            if not isinstance(task[field], str) or not task[field]:
                raise TaskFileError(f"{p}:{n}: field {field!r} must be a non-empty string")
        if task["id"] in seen:
            raise TaskFileError(f"{p}:{n}: duplicate task id {task['id']!r}")
        seen.add(task["id"])
        tasks.append(task)
    if not tasks:
        raise TaskFileError(f"{p}: no tasks")
    return tasks
