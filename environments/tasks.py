"""Task files: JSONL, one task per line, read by the run's environment.

Invariant: a bad task file is reported in one line naming the file, the line number and the field;
nothing downstream ever sees a half-valid task.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from durable_rollouts.errors import TaskFileError
from durable_rollouts.sandboxes.base import SandboxSpec

if TYPE_CHECKING:
    from durable_rollouts.environments.base import Environment, Task


def json_objects(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for every non-blank line of a JSONL task file.

    Raises:
        TaskFileError: the file cannot be read, or a line is not a JSON object (names file and line).
    """
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise TaskFileError(f"{path}: cannot read task file: {getattr(e, 'strerror', None) or e}") from e
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise TaskFileError(f"{path}:{n}: not valid JSON ({e.msg})") from e
        if not isinstance(obj, dict):
            raise TaskFileError(f"{path}:{n}: a task must be a JSON object")
        yield n, obj


def load_tasks(path: str | Path, env: str, sandbox: SandboxSpec | None = None) -> list[dict[str, Any]]:
    """Read and validate a task file with the environment registered as ``env``; tasks as JSON objects.

    ``sandbox``: the run's ``[sandbox]``, passed on to an environment whose ``load_tasks`` takes a
    ``sandbox`` argument (e.g. Harbor's, which checks each task's network mode against its egress policy).

    Raises:
        TaskFileError: one line naming the file, line and field at fault.
        ConfigError: no environment of that name is installed.
        EnvironmentCodeError: the environment's own ``load_tasks`` raised (a bug in its code).
    """
    from durable_rollouts.config.paths import resolve_path
    from durable_rollouts.environments import registry
    from durable_rollouts.environments.base import calling

    environment = registry.get(env)
    found = resolve_path(path, "run.task_file")  # a file, or a package's bundled one (PACKAGE:RELATIVE)
    with calling(environment, "load_tasks", str(found)):
        return [t.model_dump(mode="json") for t in read_tasks(environment, found, sandbox)]


def read_tasks(environment: Environment, path: Path, sandbox: SandboxSpec | None = None) -> list[Task]:
    """``environment.load_tasks(path)``, given the run's ``[sandbox]`` when its ``load_tasks`` takes a
    ``sandbox`` argument."""
    takes = sandbox is not None and "sandbox" in inspect.signature(environment.load_tasks).parameters
    return environment.load_tasks(path, **({"sandbox": sandbox} if takes else {}))
