"""SWE task model: one line of a task file names an image, a repository in it, and how to score a fix.

Invariant: a task that validates can be set up and scored without guessing: its image is a local tag, its
repository directory is absolute, every path is relative and stays inside the repository, the hidden tests
are named ``test_*.py`` and are neither visible files nor touched by a patch, a JUnit-scored test command
writes its report to ``{junit}``, and the patches only touch visible files. A bad task file is reported in
one line naming the file, the line and the field (`environments.base.Environment.load_tasks`).

Schema of a line (see the package README for a full example)::

    {"id": "textkit-slug", "image": "durable-rollouts-swe-textkit:latest", "repo_dir": "/opt/repo",
     "problem": "slugify(...) leaves ...", "setup": ["python3 -c 'import textkit'"],
     "visible": ["README.md", "textkit", "tests"],
     "test_command": "python3 -I -m pytest -q -p no:cacheprovider --noconftest --junitxml={junit} {tests}",
     "reward": "junit",
     "hidden_tests": {"test_slug_hidden.py": "..."},
     "reference": {"textkit/slug.py": "..."}, "wrong": {"textkit/slug.py": "..."}}
"""

from __future__ import annotations

import posixpath
import re
from typing import Literal

from pydantic import ConfigDict, Field, ValidationInfo, field_validator, model_validator

from durable_rollouts.environments.base import Task

FileMap = dict[str, str]
"""Path relative to the repository -> file content."""

DEFAULT_TEST_COMMAND = "python3 -I -m pytest -q -p no:cacheprovider --noconftest --junitxml={junit} {tests}"
"""Runs only the hidden tests, isolated from the repository's conftest files, PYTHONPATH and user site."""


class SweTask(Task):
    """One repository task: the bug to fix, where the repository is, what the agent sees, how it is scored."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    image: str = Field(min_length=1, max_length=255)
    """Local image tag holding the repository (built by ``build_images.sh``; never pulled)."""
    repo_dir: str = "/opt/repo"
    """Absolute path of the repository inside the image (read-only at run time)."""
    problem: str = Field(min_length=1)
    """The problem statement shown to the model (an issue, as a user would file it)."""
    setup: list[str] = Field(default_factory=list)
    """Shell commands run in the workdir after the visible files are copied in (idempotent: a retried
    rollout runs them again); one that fails fails the rollout as an environment failure."""
    setup_timeout_s: float = Field(120.0, gt=0, le=3600)
    """Time limit of each setup command."""
    visible: list[str] = Field(min_length=1)
    """Files or folders of the repository copied into the workdir: the checkout the agent works on, and
    the only paths of its work that are scored (everything else is scored as the image has it)."""
    test_command: str = Field(DEFAULT_TEST_COMMAND, min_length=1)
    """Shell command run at scoring time in a fresh copy of the repository with the hidden tests in it;
    ``{tests}`` becomes the hidden test files, ``{junit}`` the report path (chosen at scoring time,
    unguessable). It should run only the hidden tests: a report counting other tests scores 0."""
    reward: Literal["junit", "exit_status"] = "junit"
    """``junit``: reward = fraction of the hidden tests passed in the report at ``{junit}`` (0 when the
    report is missing or counts another number of tests); ``exit_status``: 1.0 when the command exits 0."""
    test_timeout_s: float = Field(300.0, gt=0, le=3600)
    """Time limit of the test command; one that runs out scores 0."""
    hidden_tests: FileMap = Field(min_length=1)
    """Hidden pytest files (``test_*.py``, at most one folder deep); written into the sandbox only at scoring
    time, at a path the agent cannot know."""
    test_count: int | None = Field(None, ge=1)
    """Tests the report must count; None counts the module-level ``def test_...`` of ``hidden_tests``."""
    reference: FileMap = Field(min_length=1)
    """The fix: files (relative to the repository) whose content passes every hidden test; the scripted
    policy writes them in ``reference`` mode."""
    wrong: FileMap = Field(min_length=1)
    """A plausible wrong fix, failing at least one hidden test; played in ``wrong`` mode."""

    @field_validator("image")
    @classmethod
    def _image_is_a_tag(cls, value: str) -> str:
        if any(c.isspace() for c in value) or value.startswith("-"):
            raise ValueError(f"{value!r} is not an image tag")
        return value

    @field_validator("repo_dir")
    @classmethod
    def _repo_dir_is_absolute(cls, value: str) -> str:
        if not value.startswith("/") or posixpath.normpath(value) != value or value == "/":
            raise ValueError(f"{value!r} must be a normalised absolute path other than '/'")
        if not re.fullmatch(r"[A-Za-z0-9_./-]+", value):
            raise ValueError(f"{value!r} may only contain letters, digits and _ . / -")
        return value

    @field_validator("visible")
    @classmethod
    def _visible_paths(cls, value: list[str]) -> list[str]:
        for path in value:
            check_path(path)
        if len(set(value)) != len(value):
            raise ValueError("lists a path twice")
        return value

    @field_validator("hidden_tests")
    @classmethod
    def _hidden_tests(cls, value: FileMap, info: ValidationInfo) -> FileMap:
        for path in value:
            check_path(path)
            name = posixpath.basename(path)
            if not (name.startswith("test_") and name.endswith(".py")) or path.count("/") > 1:
                raise ValueError(f"{path!r} is not named test_*.py at most one folder deep")
            if any(_under(path, v) for v in info.data.get("visible") or []):
                raise ValueError(f"hidden test {path!r} is a visible path")
        return value

    @field_validator("reference", "wrong")
    @classmethod
    def _patches_touch_visible_files(cls, value: FileMap, info: ValidationInfo) -> FileMap:
        visible = info.data.get("visible") or []
        for path in value:
            check_path(path)
            if not any(_under(path, v) for v in visible):
                raise ValueError(f"{path!r} is not under a visible path (patches only touch visible files)")
            if path in (info.data.get("hidden_tests") or {}):
                raise ValueError(f"{path!r} would overwrite a hidden test")
        return value

    @model_validator(mode="after")
    def _command_writes_the_report(self) -> SweTask:
        if self.reward == "junit" and "{junit}" not in self.test_command:
            raise ValueError("test_command must write its JUnit report to {junit} when reward is 'junit'")
        if "{tests}" not in self.test_command:
            raise ValueError("test_command must run the hidden tests: it has no {tests}")
        return self

    @property
    def expected_tests(self) -> int:
        """How many tests a JUnit report of the hidden tests must count."""
        return self.test_count if self.test_count is not None else count_tests(self.hidden_tests)


def count_tests(files: FileMap) -> int:
    """Module-level test functions (``def test_...``) in test files."""
    return sum(
        len(re.findall(r"^(?:async )?def test_\w*\(", src, flags=re.MULTILINE)) for src in files.values()
    )


def check_path(path: str) -> None:
    """A path relative to the repository: non-empty parts, no ``.``/``..``, portable characters only.

    Raises:
        ValueError: the path is not one.
    """
    parts = path.split("/")
    if not path or path.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"path {path!r} must be relative, without empty, '.' or '..' parts")
    if not re.fullmatch(r"[A-Za-z0-9_.+=,@-]+(/[A-Za-z0-9_.+=,@-]+)*", path):
        raise ValueError(f"path {path!r} may only contain letters, digits and _ . + = , @ -")


def _under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder + "/")
