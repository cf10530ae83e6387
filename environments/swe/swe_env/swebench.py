"""SWE-bench-style instance rows as swe tasks: the instance's image, its FAIL_TO_PASS and PASS_TO_PASS tests.

A line of a swe task file that has ``instance_id`` is a SWE-bench row (SWE-bench's fields, plus one image:
SWE-smith's ``image_name`` or R2E-Gym's ``docker_image``); every other line is a `swe_env.tasks.SweTask`.

How such a rollout goes:

1. **Sandbox.** The instance's image (a local tag, never pulled); setup copies the repository at
   ``repo_dir`` (default ``/testbed``, where SWE-bench images keep it) into the workdir and, when the
   image has ``git`` and the copy a ``.git``, checks that HEAD is ``base_commit``.
2. **Prompt.** ``Task id: <instance_id>``, the repository's name and the ``problem_statement``.
3. **Turns.** The swe tools (bash, write_file, read_file, submit) on the checkout.
4. **Score** (SWE-bench's rule). A scoring copy of the agent's workdir is made under ``/tmp``; every file the
   ``test_patch`` touches is reset to the image's version and the ``test_patch`` applied (with
   `swe_env.unidiff`, sent into the sandbox: the images need neither git nor patch); the ``FAIL_TO_PASS``
   and ``PASS_TO_PASS`` tests run (``test_command``, default ``python3 -m pytest -rA ... {tests}``) and their
   per-test statuses are read from pytest's ``-rA`` summary lines. Reward 1.0 when every FAIL_TO_PASS test
   passes and every PASS_TO_PASS test still passes (PASSED or XFAIL, as SWE-bench counts them), else 0.0;
   a test absent from the log has not passed. A test patch that does not apply is an environment failure.

Invariant: a row that validates names one local image, parses its ``patch`` and ``test_patch`` as unified
diffs touching only safe relative paths, and has at least one FAIL_TO_PASS test; a bad row is one line
naming the file, the line and the field.
"""

from __future__ import annotations

import json
import posixpath
import re
import secrets
import shlex
from pathlib import Path
from typing import Any

from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator

from durable_rollouts.environments.base import Task
from durable_rollouts.errors import TaskFileError
from swe_env import unidiff

DEFAULT_SWEBENCH_COMMAND = "python3 -m pytest -rA -p no:cacheprovider {tests}"
"""Runs the named tests with pytest's summary of every outcome (``-rA``: ``PASSED path::test`` lines)."""
PASSING = ("PASSED", "XFAIL")
"""Statuses that count as passed (SWE-bench's ``test_passed``)."""
STATUS_LINE = re.compile(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (\S+)", re.MULTILINE)
APPLIER = Path(unidiff.__file__).read_text(encoding="utf-8")
"""Source of the diff applier sent into sandboxes."""


class SweBenchTask(Task):
    """One SWE-bench-style instance row (its extra dataset fields are ignored)."""

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    instance_id: str = Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9_.+=,@/-]+$")
    repo: str = Field(min_length=1)
    base_commit: str = Field(pattern=r"^[0-9a-f]{7,64}$")
    problem_statement: str = Field(min_length=1)
    patch: str = Field(min_length=1)
    """The reference fix (a unified diff); the scripted agent applies it in ``reference`` mode."""
    test_patch: str = Field(min_length=1)
    """The tests, as a unified diff applied at scoring time only."""
    FAIL_TO_PASS: list[str] = Field(min_length=1)
    """Test ids (pytest node ids) that must pass after the fix; a JSON-encoded list is accepted."""
    PASS_TO_PASS: list[str] = Field(default_factory=list)
    """Test ids that passed before and must still pass."""
    version: str = Field(min_length=1)
    image_name: str | None = Field(None, min_length=1, max_length=255)
    """SWE-smith's name of the instance's image."""
    docker_image: str | None = Field(None, min_length=1, max_length=255)
    """R2E-Gym's name of the instance's image."""
    repo_dir: str = "/testbed"
    """Where the image holds the repository (SWE-bench's images: ``/testbed``)."""
    test_command: str = Field(DEFAULT_SWEBENCH_COMMAND, min_length=1)
    """Run in the scoring copy; ``{tests}`` becomes the FAIL_TO_PASS and PASS_TO_PASS ids. It must print
    pytest's ``-rA`` summary lines."""
    test_timeout_s: float = Field(300.0, gt=0, le=3600)
    setup_timeout_s: float = Field(120.0, gt=0, le=3600)

    @model_validator(mode="before")
    @classmethod
    def _id_is_the_instance_id(cls, data: Any) -> Any:
        if isinstance(data, dict) and "id" not in data and isinstance(data.get("instance_id"), str):
            return {**data, "id": data["instance_id"]}
        return data

    @field_validator("FAIL_TO_PASS", "PASS_TO_PASS", mode="before")
    @classmethod
    def _json_list(cls, value: Any) -> Any:
        """SWE-bench's datasets store these lists JSON-encoded."""
        if isinstance(value, str):
            try:
                return json.loads(value)
            except json.JSONDecodeError:
                raise ValueError("must be a list of test ids or its JSON encoding") from None
        return value

    @field_validator("FAIL_TO_PASS", "PASS_TO_PASS")
    @classmethod
    def _test_ids(cls, value: list[str]) -> list[str]:
        for test in value:
            if not test.strip() or any(c in test for c in "\n\r\0"):
                raise ValueError(f"{test!r} is not a test id")
        return value

    @field_validator("image_name", "docker_image")
    @classmethod
    def _image_is_a_tag(cls, value: str | None) -> str | None:
        if value is not None and (any(c.isspace() for c in value) or value.startswith("-")):
            raise ValueError(f"{value!r} is not an image tag")
        return value

    @field_validator("repo_dir")
    @classmethod
    def _repo_dir(cls, value: str) -> str:
        if not re.fullmatch(r"/[A-Za-z0-9_./-]+", value) or posixpath.normpath(value) != value:
            raise ValueError(f"{value!r} must be a normalised absolute path other than '/'")
        return value

    @field_validator("patch", "test_patch")
    @classmethod
    def _diff(cls, value: str) -> str:
        try:
            unidiff.parse(value)
        except unidiff.PatchError as e:
            raise ValueError(f"not a unified diff this environment can apply: {e}") from None
        return value

    @model_validator(mode="after")
    def _consistent(self) -> SweBenchTask:
        if self.id != self.instance_id:
            raise ValueError(f"id {self.id!r} is not the instance_id")
        if "{tests}" not in self.test_command:
            raise ValueError("test_command must run the tests: it has no {tests}")
        return self

    @property
    def image(self) -> str:
        """The instance's image (exactly one of ``image_name`` and ``docker_image`` is set)."""
        return self.image_name or self.docker_image or ""

    @property
    def tests(self) -> list[str]:
        """FAIL_TO_PASS then PASS_TO_PASS, each once."""
        return list(dict.fromkeys([*self.FAIL_TO_PASS, *self.PASS_TO_PASS]))


def validate_row(obj: dict[str, Any], where: str) -> SweBenchTask:
    """A row as a `SweBenchTask`.

    Raises:
        TaskFileError: one line naming ``where`` (file and line) and the field.
    """
    check_row(obj, where)
    try:
        return SweBenchTask.model_validate(obj)
    except ValidationError as e:
        err = e.errors()[0]
        loc = err["loc"]
        field = str(loc[0]) if loc else "row"
        if field == "id" and "id" not in obj:
            field = "instance_id"  # the id is the instance_id
        at = f" at {'/'.join(str(x) for x in loc[1:])!r}" if len(loc) > 1 else ""
        raise TaskFileError(
            f"{where}: field {field!r}{at}: {err['msg'].removeprefix('Value error, ')}"
        ) from None


def check_row(obj: dict[str, Any], where: str) -> None:
    """What the model cannot say with a field name: a missing field, the one image.

    Raises:
        TaskFileError: one line naming ``where`` and the field.
    """
    for name in ("instance_id", "repo", "base_commit", "problem_statement", "patch", "test_patch"):
        if name not in obj:
            raise TaskFileError(f"{where}: field {name!r}: missing")
    for name in ("FAIL_TO_PASS", "PASS_TO_PASS", "version"):
        if name not in obj:
            raise TaskFileError(f"{where}: field {name!r}: missing")
    images = [k for k in ("image_name", "docker_image") if obj.get(k) is not None]
    if not images:
        raise TaskFileError(f"{where}: field 'image_name': missing (or docker_image): the instance's image")
    if len(images) == 2 and obj["image_name"] != obj["docker_image"]:
        raise TaskFileError(f"{where}: field 'docker_image': differs from image_name; give one image")


def setup_commands(task: SweBenchTask, workdir: str) -> list[str]:
    """Copy the repository into the workdir; check HEAD against base_commit where git can tell."""
    copy = f"cp -a {shlex.quote(task.repo_dir)}/. {shlex.quote(workdir)}/"
    check = (
        "if command -v git >/dev/null 2>&1 && [ -d .git ]; then "
        "h=$(git rev-parse HEAD) || exit 1; "
        f'if [ "$h" != {task.base_commit} ] && [ "${{h#{task.base_commit}}}" = "$h" ]; then '
        f'echo "HEAD $h is not base_commit {task.base_commit}" >&2; exit 1; fi; fi'
    )
    return [copy, check]


def prompt_text(task: SweBenchTask) -> str:
    return (
        f"Task id: {task.id}\n\nRepository: {task.repo} (checked out in your working directory)\n\n"
        f"{task.problem_statement}"
    )


def scoring_command(task: SweBenchTask, hidden: str, token: str) -> str:
    """Shell command (run in the workdir) that builds the scoring copy and runs the tests.

    ``hidden`` (a workdir path) holds ``apply.py`` and ``test.patch``; the command moves it out of the
    copy, prints ``swe-exit: <status>`` (``swe-exit: patch`` when the test patch does not apply, after the
    applier's message) and then pytest's status lines.
    """
    run = f"/tmp/swe-score-{token}"
    keep = f"/tmp/swe-hidden-{token}"
    log = f"{run}/.log-{token}"
    files = " ".join(shlex.quote(p) for p in unidiff.touched(task.test_patch))
    tests = " ".join(shlex.quote(t) for t in task.tests)
    test_cmd = task.test_command.replace("{tests}", tests)
    repo = shlex.quote(task.repo_dir)
    return (
        f"set -e; rm -rf {run} {keep}; mv {hidden} {keep}; mkdir -p {run}; cp -a ./. {run}/; "
        f'for p in {files}; do rm -rf {run}/"$p"; '
        f'if [ -e {repo}/"$p" ]; then mkdir -p "$(dirname {run}/"$p")"; '
        f'cp -a {repo}/"$p" {run}/"$p"; fi; done; '
        f"set +e; if ! python3 -I {keep}/apply.py {run} < {keep}/test.patch >/dev/null; then "
        f'rm -rf {keep}; echo "swe-exit: patch"; exit 0; fi; rm -rf {keep}; cd {run}; '
        f"timeout -k 5 {task.test_timeout_s:g} bash -c {shlex.quote(test_cmd)} > {log} 2>&1 </dev/null; "
        f'echo "swe-exit: $?"; grep -E "^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) " {log}; true'
    )


def statuses(log: str) -> dict[str, str]:
    """Test id -> status from pytest ``-rA`` summary lines (the last status of an id wins)."""
    return {m.group(2): m.group(1) for m in STATUS_LINE.finditer(log)}


def resolved(task: SweBenchTask, log: str) -> float:
    """1.0 when every FAIL_TO_PASS and PASS_TO_PASS test passed in ``log``, else 0.0 (SWE-bench's rule)."""
    got = statuses(log)
    return 1.0 if all(got.get(t) in PASSING for t in task.tests) else 0.0


def hidden_files(task: SweBenchTask) -> tuple[str, dict[str, str]]:
    """A fresh hidden folder name (workdir-relative) and the files to write there before scoring."""
    return f".swe-hidden-{secrets.token_hex(8)}", {"apply.py": APPLIER, "test.patch": task.test_patch}
