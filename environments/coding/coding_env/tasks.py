"""Coding task files: JSONL, one task per line (the bundled set is ``coding_env/data/coding.jsonl``).

Invariant: a bad task file is reported in one line naming the file, the line number and the field; nothing
downstream ever sees a half-valid task.

Schema of a line (every field required, no others)::

    {"id": "code-fizzbuzz",
     "prompt": "Implement `fizzbuzz(n: int) -> list[str]` in solution.py ...",
     "files": {"solution.py": "<stub the agent starts from>"},
     "tests": {"test_hidden.py": "<pytest tests that import from solution>"},
     "reference": {"solution.py": "<a correct solution: passes every hidden test>"},
     "wrong": {"solution.py": "<a plausible wrong solution: fails at least one hidden test>"}}

``files`` are written into the sandbox before the first turn; ``tests`` are copied in only when the episode
is verified, and the reward is the fraction of them that pass. ``reference`` and ``wrong`` overwrite files
of the workspace; the scripted policy of the simulated engine writes one of them, and a unit test checks
both against the hidden tests. Paths are relative, use ``/`` and never leave the workspace.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from pydantic import ConfigDict, Field, ValidationInfo, field_validator

from durable_rollouts.environments.base import Task

FileMap = dict[str, str]
"""Relative path -> file content."""


class CodingTask(Task):
    """One coding task (``id``: the harness writes it as ``Task id: <id>`` in the first user message)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    prompt: str = Field(min_length=1)
    """The task statement shown to the model."""
    files: FileMap
    """Workspace files the agent starts from (usually stubs)."""
    tests: FileMap = Field(min_length=1)
    """Hidden pytest files, named ``test_*.py``; copied in only to verify."""
    reference: FileMap = Field(min_length=1)
    """Files that solve the task."""
    wrong: FileMap = Field(min_length=1)
    """Files of a plausible but wrong solution."""

    @field_validator("files", "tests", "reference", "wrong")
    @classmethod
    def _safe_paths(cls, value: FileMap) -> FileMap:
        for path in value:
            _check_path(path)
        return value

    @field_validator("tests")
    @classmethod
    def _tests_are_hidden_pytest_files(cls, value: FileMap, info: ValidationInfo) -> FileMap:
        for path in value:
            name = PurePosixPath(path).name
            if not (name.startswith("test_") and name.endswith(".py")):
                raise ValueError(f"{path!r} is not named test_*.py")
            if path in (info.data.get("files") or {}):
                raise ValueError(f"hidden test {path!r} is also a workspace file")
        return value

    @field_validator("reference", "wrong")
    @classmethod
    def _solutions_leave_tests_alone(cls, value: FileMap, info: ValidationInfo) -> FileMap:
        for path in value:
            if path in (info.data.get("tests") or {}):
                raise ValueError(f"{path!r} would overwrite a hidden test")
        return value


def load_task_file(path: str | Path) -> list[CodingTask]:
    """Read and validate a coding task file.

    Raises:
        TaskFileError: one line naming the file, line and field at fault.
    """
    from coding_env import CodingEnvironment

    return [t for t in CodingEnvironment().load_tasks(path) if isinstance(t, CodingTask)]


def _check_path(path: str) -> None:
    parts = PurePosixPath(path).parts
    if not path or "\\" in path or "\x00" in path or path.startswith("/") or not parts:
        raise ValueError(f"path {path!r} must be relative and use '/'")
    if any(part in ("..", ".") for part in path.split("/")) or "" in path.split("/"):
        raise ValueError(f"path {path!r} must not contain empty, '.' or '..' parts")
