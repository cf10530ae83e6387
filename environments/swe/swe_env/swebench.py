"""SWE-bench instance rows as swe tasks: the instance's image, its FAIL_TO_PASS and PASS_TO_PASS tests.

A line of a swe task file that has ``instance_id`` is a SWE-bench row: SWE-bench's own fields
(``instance_id``, ``repo``, ``version``, ``base_commit``, ``patch``, ``test_patch``, ``FAIL_TO_PASS``,
``PASS_TO_PASS``, ``problem_statement``), optionally an image (SWE-smith's ``image_name`` or R2E-Gym's
``docker_image``); every other line is a `swe_env.tasks.SweTask`.

How such a rollout goes:

1. **Sandbox.** The instance's image (a local tag, never pulled): the row's, else the name SWE-bench's
   harness gives it (`swe_env.harness.image_name`); setup copies the repository at ``repo_dir`` (default
   ``/testbed``, where SWE-bench images keep it) into the workdir and, when the image has ``git`` and the
   copy a ``.git``, checks that HEAD is ``base_commit``.
2. **Prompt.** ``Task id: <instance_id>``, the repository's name and the ``problem_statement``.
3. **Turns.** The swe tools (bash, write_file, read_file, submit) on the checkout.
4. **Score** (SWE-bench's rule). A scoring copy of the agent's workdir is made under ``/tmp``; every file the
   ``test_patch`` touches is reset to the image's version and the ``test_patch`` applied (`APPLIERS`:
   ``git apply``, then ``patch``, then the stdlib applier); the tests run (`SweBenchTask.command`: the
   row's, else the repository's from SWE-bench's specs, else pytest ``-rA`` on the ids) and their log is
   graded by the swebench package (its per-repository parser and ``get_eval_report``). Reward 1.0 when it
   says resolved, else 0.0. A test patch that no applier applies is an environment failure.

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
from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator

from durable_rollouts.environments.base import Task
from durable_rollouts.errors import TaskFileError
from swe_env import harness, unidiff

DEFAULT_SWEBENCH_COMMAND = "python3 -m pytest -rA -p no:cacheprovider {tests}"
"""Runs the named tests with pytest's summary of every outcome (``-rA``: ``PASSED path::test`` lines), for a
row of a repository SWE-bench's specs do not know that gives no command."""
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
    harness_image: str | None = Field(None, min_length=1, max_length=255)
    """The name SWE-bench's harness gives the instance's image (`swe_env.harness.image_name`), set when the
    row names no image; stored with the task, so it is the name the submitter's pattern gave."""
    repo_dir: str = "/testbed"
    """Where the image holds the repository (SWE-bench's images: ``/testbed``)."""
    test_command: str | None = Field(None, min_length=1)
    """Run in the scoring copy (on ``PYTHONPATH``, as SWE-bench's images install the repository in
    development mode); ``{test_files}`` becomes the files the test patch touches (SWE-bench's test
    directives), ``{tests}`` the FAIL_TO_PASS and PASS_TO_PASS ids. None: the repository's command from
    SWE-bench's specs (`swe_env.harness.TEST_COMMANDS`), else pytest ``-rA`` on the ids."""
    log_parser: str | None = Field(None, min_length=1, max_length=100)
    """A log parser of the swebench package by name (swebench 5's rows carry one); None: the repository's
    (`swe_env.harness.parser_name`)."""
    eval_type: Literal["pass_and_fail", "fail_only"] | None = None
    """swebench's grading kind; None: ``fail_only`` for the repositories swebench grades so."""
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

    @field_validator("test_command")
    @classmethod
    def _runs_the_tests(cls, value: str | None) -> str | None:
        if value is not None and "{tests}" not in value and "{test_files}" not in value:
            raise ValueError("must run the tests: it has no {tests} or {test_files}")
        return value

    @field_validator("log_parser")
    @classmethod
    def _parser(cls, value: str | None) -> str | None:
        return None if value is None else harness.check_parser(value)

    @field_validator("image_name", "docker_image", "harness_image")
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
        if self.image_name is None and self.docker_image is None and self.harness_image is None:
            raise ValueError("no image: give image_name or docker_image, or let the pattern name it")
        return self

    @property
    def image(self) -> str:
        """The instance's image: ``image_name`` or ``docker_image`` where the row names one, else the
        harness's name for it."""
        return self.image_name or self.docker_image or self.harness_image or ""

    @property
    def command(self) -> str:
        """The test command with its placeholders filled in (run in the scoring copy)."""
        cmd = harness.test_command(self.repo, self.test_command) or DEFAULT_SWEBENCH_COMMAND
        files = " ".join(shlex.quote(p) for p in harness.test_directives(self.repo, self.test_patch))
        tests = " ".join(shlex.quote(t) for t in self.tests)
        return cmd.replace("{test_files}", files).replace("{tests}", tests)

    @property
    def tests(self) -> list[str]:
        """FAIL_TO_PASS then PASS_TO_PASS, each once."""
        return list(dict.fromkeys([*self.FAIL_TO_PASS, *self.PASS_TO_PASS]))


def validate_row(obj: dict[str, Any], where: str, pattern: str | None = None) -> SweBenchTask:
    """A row as a `SweBenchTask`; a row naming no image gets the harness's name for it by ``pattern``
    (default: `swe_env.harness.image_pattern`).

    Raises:
        TaskFileError: one line naming ``where`` (file and line) and the field.
    """
    check_row(obj, where)
    if all(obj.get(k) is None for k in ("image_name", "docker_image", "harness_image")):
        pattern = pattern or harness.image_pattern()
        try:
            name = harness.image_name(pattern, *(str(obj[k]) for k in ("instance_id", "repo", "version")))
        except ValueError as e:
            raise TaskFileError(f"{where}: {harness.IMAGE_PATTERN_ENV}: {e}") from None
        obj = {**obj, "harness_image": name}
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
    """What the model cannot say with a field name: a missing field, two different images.

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


APPLIERS = ("git", "patch", "stdlib")
"""How the test patch is applied, in this order: ``git apply`` (where the image has git), ``patch`` (where
it has patch; checked with ``--dry-run`` first, so a failed try leaves nothing half-applied), then the
stdlib applier (`swe_env.unidiff`, sent into the sandbox)."""
APPLIED = "swe-applied: "
"""Line the scoring command prints with the applier that applied the test patch (``none``: none did)."""
TRIED = "swe-apply-failed: "
"""Line the scoring command prints for each applier that failed: ``<applier>: <cause>``."""
LOG_LIMIT = 8 << 20
"""Bytes of test output graded (the rest is cut: the parsers read what came first)."""


def scoring_command(task: SweBenchTask, hidden: str, token: str) -> str:
    """Shell command (run in the workdir) that builds the scoring copy and runs the tests.

    ``hidden`` (a workdir path) holds ``apply.py`` and ``test.patch``; the command moves it out of the
    copy, applies the test patch (`APPLIERS`, printing `TRIED` lines and one `APPLIED` line), runs the test
    command and writes its output, between the harness's markers and with its exit code after them, to
    `log_name` in the workdir; it prints ``swe-exit: <status>`` last (``swe-exit: patch`` when no applier
    applied the patch).
    """
    run = f"/tmp/swe-score-{token}"
    keep = f"/tmp/swe-hidden-{token}"
    out = f"/tmp/swe-out-{token}"
    log = log_name(token)
    files = " ".join(shlex.quote(p) for p in unidiff.touched(task.test_patch))
    repo = shlex.quote(task.repo_dir)
    start, end, code = harness.MARKERS
    why = "2>&1 | tail -n 3 | tr '\\n' ' ' | sed 's/^ *//'"
    apply = (
        f"a=none; if command -v git >/dev/null 2>&1; then "
        f"if e=$(cd {run} && git apply -v {keep}/test.patch 2>&1); then a=git; "
        f'else echo "{TRIED}git: $(printf %s "$e" {why})"; fi; '
        f'else echo "{TRIED}git: not in the image"; fi; '
        f"if [ $a = none ]; then if command -v patch >/dev/null 2>&1; then "
        f"if e=$(cd {run} && patch --dry-run --batch --fuzz=5 -p1 -i {keep}/test.patch 2>&1) "
        f"&& e=$(cd {run} && patch --batch --fuzz=5 -p1 -i {keep}/test.patch 2>&1); then a=patch; "
        f'else echo "{TRIED}patch: $(printf %s "$e" {why})"; fi; '
        f'else echo "{TRIED}patch: not in the image"; fi; fi; '
        f"if [ $a = none ]; then if e=$(python3 -I {keep}/apply.py {run} < {keep}/test.patch 2>&1); "
        f'then a=stdlib; else echo "{TRIED}stdlib: $(printf %s "$e" {why})"; fi; fi; '
        f'echo "{APPLIED}$a"; rm -rf {keep}; if [ $a = none ]; then echo "swe-exit: patch"; exit 0; fi; '
    )
    test_cmd = f'export PYTHONPATH="{run}${{PYTHONPATH:+:$PYTHONPATH}}"; {task.command}'
    return (
        f"set -e; w=$(pwd); rm -rf {run} {keep} {out} {log}; mv {hidden} {keep}; mkdir -p {run}; "
        f"cp -a ./. {run}/; "
        f'for p in {files}; do rm -rf {run}/"$p"; '
        f'if [ -e {repo}/"$p" ]; then mkdir -p "$(dirname {run}/"$p")"; '
        f'cp -a {repo}/"$p" {run}/"$p"; fi; done; set +e; '
        f"{apply}cd {run}; "
        f"timeout -k 5 {task.test_timeout_s:g} bash -c {shlex.quote(test_cmd)} > {out} 2>&1 </dev/null; "
        f"rc=$?; {{ echo {shlex.quote(start)}; head -c {LOG_LIMIT} {out}; echo; echo {shlex.quote(end)}; "
        f'echo "{code}: $rc"; }} > "$w/{log}"; rm -f {out}; echo "swe-exit: $rc"; true'
    )


def log_name(token: str) -> str:
    """The scoring log's name in the workdir (read back by the scorer, then removed)."""
    return f".swe-log-{token}"


def appliers(output: str) -> tuple[str, list[str]]:
    """From the scoring command's output: the applier that applied the test patch (``none``: none did)
    and each failed try as ``<applier>: <cause>``."""
    tried = [line.removeprefix(TRIED).strip() for line in output.splitlines() if line.startswith(TRIED)]
    applied = next(
        (line.removeprefix(APPLIED).strip() for line in output.splitlines() if line.startswith(APPLIED)),
        "none",
    )
    return applied, tried


def grade(task: SweBenchTask, log: str) -> dict[str, Any]:
    """swebench's report of ``task`` from its scoring log (`swe_env.harness.grade`)."""
    return harness.grade(
        instance_id=task.instance_id,
        repo=task.repo,
        version=task.version,
        fail_to_pass=task.FAIL_TO_PASS,
        pass_to_pass=task.PASS_TO_PASS,
        log=log,
        log_parser=task.log_parser,
        eval_kind=task.eval_type,
    )


def resolved(task: SweBenchTask, test_output: str, exit_code: int = 0) -> float:
    """1.0 when swebench grades ``test_output`` (a test run's output) resolved, else 0.0."""
    return 1.0 if grade(task, harness.log_with_markers(test_output, exit_code))["resolved"] else 0.0


def hidden_files(task: SweBenchTask) -> tuple[str, dict[str, str]]:
    """A fresh hidden folder name (workdir-relative) and the files to write there before scoring."""
    return f".swe-hidden-{secrets.token_hex(8)}", {"apply.py": APPLIER, "test.patch": task.test_patch}
