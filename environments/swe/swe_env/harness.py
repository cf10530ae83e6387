"""What SWE-bench's harness decides for an instance row, as the `swebench` package (5.0.x) decides it.

- **Image name.** A row that names no image (SWE-bench's own rows do not) gets the name the harness gives
  the instance's image: ``sweb.eval.x86_64.<instance_id>:latest``, lowercased, with the registry namespace
  ``swebench/`` in front and ``__`` written ``_1776_`` (Docker Hub allows no ``__``):
  ``swebench/sweb.eval.x86_64.django_1776_django-11099:latest`` (`swebench.task.checks.expected_image`,
  `swebench.image_builder.image_spec.ImageSpec.name`). The operator overrides the pattern with
  ``DURABLE_ROLLOUTS_SWE_IMAGE_PATTERN`` (`image_pattern`), read where the task file is read (at submit):
  the name is stored with the task.
- **Test command.** A row's own ``test_command`` wins; else the repository's command from SWE-bench's
  published specs (`TEST_COMMANDS`: swebench 5 keeps them in per-instance eval scripts that its wheel does
  not ship, so the commands of its earlier ``MAP_REPO_VERSION_TO_SPECS`` are kept here), run on the test
  files the ``test_patch`` touches (`test_directives`, SWE-bench's rule); else pytest ``-rA`` on the
  FAIL_TO_PASS and PASS_TO_PASS ids.
- **Grading.** The log is graded by the package itself: its per-repository parser (the row's
  ``log_parser``, else the repository's entry in its ``MAP_REPO_TO_PARSER_*`` tables, else pytest's) and
  `swebench.harness.grading.get_eval_report`; the reward is 1.0 when it says ``resolved``.

Invariant: the package is imported only when a log is graded or a parser name is checked (it pulls in
docker, modal and more: seconds), never when a row is read.
"""

from __future__ import annotations

import functools
import os
import tempfile
from collections.abc import Callable
from typing import Any

from swe_env import unidiff

IMAGE_PATTERN_ENV = "DURABLE_ROLLOUTS_SWE_IMAGE_PATTERN"
"""Environment variable with the operator's image name pattern (read when the task file is read)."""
DEFAULT_IMAGE_PATTERN = "swebench/sweb.eval.x86_64.{instance_id_1776}:latest"
"""The name SWE-bench's published images carry (`swebench.task.checks.expected_image`)."""
PATTERN_FIELDS = ("instance_id", "instance_id_1776", "repo", "version")
"""What a pattern may use: the instance id lowercased (as the harness lowercases names), the same with
``__`` written ``_1776_``, the repository (``owner/name``) and the version."""

PYTEST = "pytest -rA {test_files}"
"""SWE-bench's ``TEST_PYTEST``: pytest's summary of every outcome, on the test files."""
TEST_COMMANDS: dict[str, str] = {
    "django/django": "./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1 {test_files}",
    "sympy/sympy": (
        "PYTHONWARNINGS='ignore::UserWarning,ignore::SyntaxWarning' bin/test -C --verbose {test_files}"
    ),
    "astropy/astropy": "pytest -rA -vv -o console_output_style=classic --tb=no {test_files}",
    "sphinx-doc/sphinx": "tox --current-env -epy39 -v -- {test_files}",
    **{
        repo: PYTEST
        for repo in (
            "marshmallow-code/marshmallow",
            "matplotlib/matplotlib",
            "mwaskom/seaborn",
            "pallets/flask",
            "psf/requests",
            "pvlib/pvlib-python",
            "pydata/xarray",
            "pydicom/pydicom",
            "pylint-dev/astroid",
            "pylint-dev/pylint",
            "pytest-dev/pytest",
            "pyvista/pyvista",
            "scikit-learn/scikit-learn",
            "sqlfluff/sqlfluff",
        )
    },
}
"""Test command by repository (SWE-bench's specs give each of these repositories one command across its
versions); ``{test_files}`` becomes `test_directives`. Commands a row gives itself may use ``{tests}`` (the
FAIL_TO_PASS and PASS_TO_PASS ids) instead."""
NON_TEST_EXTS = (".json", ".png", "csv", ".txt", ".md", ".jpg", ".jpeg", ".pkl", ".yml", ".yaml", ".toml")
"""Files of a test patch that are not tests (swebench.harness.constants.NON_TEST_EXTS)."""
DEFAULT_PARSER = "parse_log_pytest"


def image_name(pattern: str, instance_id: str, repo: str, version: str) -> str:
    """The instance's image by ``pattern`` (see `PATTERN_FIELDS`).

    Raises:
        ValueError: the pattern uses another field or is malformed.
    """
    low = instance_id.lower()
    try:
        return pattern.format(
            instance_id=low, instance_id_1776=low.replace("__", "_1776_"), repo=repo, version=version
        )
    except (KeyError, IndexError, ValueError) as e:
        fields = ", ".join("{" + f + "}" for f in PATTERN_FIELDS)
        raise ValueError(f"image pattern {pattern!r} is not a pattern of {fields}: {e}") from None


def image_pattern() -> str:
    """The operator's pattern (`IMAGE_PATTERN_ENV`), else `DEFAULT_IMAGE_PATTERN`."""
    return os.environ.get(IMAGE_PATTERN_ENV) or DEFAULT_IMAGE_PATTERN


def test_command(repo: str, own: str | None) -> str | None:
    """The row's own command, else its repository's (`TEST_COMMANDS`); None: neither (pytest on the ids)."""
    return own or TEST_COMMANDS.get(repo)


def test_directives(repo: str, test_patch: str) -> list[str]:
    """What SWE-bench's test command runs: the files the test patch touches, less non-test files; for
    django, as test labels (``tests/a/b.py`` -> ``a.b``)."""
    out = []
    for path in unidiff.touched(test_patch):
        if path.endswith(NON_TEST_EXTS):
            continue
        if repo == "django/django":
            path = path.removesuffix(".py").removeprefix("tests/").replace("/", ".")
        out.append(path)
    return out


@functools.cache
def _parsers() -> tuple[dict[str, Callable[..., Any]], dict[str, Callable[..., Any]]]:
    """swebench's parsers by name (PARSER_REGISTRY) and by repository (its MAP_REPO_TO_PARSER_* tables)."""
    from swebench.harness import log_parsers  # type: ignore[import-untyped]
    from swebench.harness.log_parsers import c, go, java, javascript, php, python, ruby, rust  # type: ignore[import-untyped]

    by_repo: dict[str, Callable[..., Any]] = {}
    for module in (python, javascript, c, go, java, php, ruby, rust):
        for name, table in vars(module).items():
            if name.startswith("MAP_REPO_TO_PARSER") and isinstance(table, dict):
                by_repo.update(table)
    return dict(log_parsers.PARSER_REGISTRY), by_repo


def check_parser(name: str) -> str:
    """``name`` when swebench has a parser of that name.

    Raises:
        ValueError: it has none.
    """
    if name not in _parsers()[0]:
        raise ValueError(f"{name!r} is not a log parser of the swebench package")
    return name


def parser_name(repo: str, own: str | None) -> str:
    """The row's parser, else its repository's (swebench's MAP_REPO_TO_PARSER_* tables), else pytest's."""
    if own:
        return own
    registry, by_repo = _parsers()
    parser = by_repo.get(repo)
    if parser is None:
        return DEFAULT_PARSER
    # The registry's first name of the repository's parser function (aliases grade alike).
    return next(n for n, f in registry.items() if f is parser)


def eval_type(repo: str, own: str | None) -> str:
    """``fail_only`` for the repositories swebench grades on failures only (FAIL_ONLY_REPOS), else
    ``pass_and_fail``; a row's own wins."""
    from swebench.harness.constants import FAIL_ONLY_REPOS, EvalType  # type: ignore[import-untyped]

    if own:
        return EvalType(own).value
    return (EvalType.FAIL_ONLY if repo in FAIL_ONLY_REPOS else EvalType.PASS_AND_FAIL).value


def grade(
    *,
    instance_id: str,
    repo: str,
    version: str,
    fail_to_pass: list[str],
    pass_to_pass: list[str],
    log: str,
    log_parser: str | None = None,
    eval_kind: str | None = None,
) -> dict[str, Any]:
    """swebench's report of one instance from its test log (the harness's markers around the test output,
    its exit code after them): ``resolved``, ``tests_status`` (FAIL_TO_PASS/PASS_TO_PASS successes and
    failures) and ``parser``."""
    from swebench.harness.grading import get_eval_report  # type: ignore[import-untyped]
    from swebench.types import TestSpec  # type: ignore[import-untyped]

    name = parser_name(repo, log_parser)
    spec = TestSpec(
        instance_id=instance_id,
        image="",
        eval_script_list=[],
        repo=repo,
        version=version,
        FAIL_TO_PASS=fail_to_pass,
        PASS_TO_PASS=pass_to_pass,
        log_parser=name,
        eval_type=eval_type(repo, eval_kind),
    )
    with tempfile.NamedTemporaryFile("w", suffix=".log", encoding="utf-8") as f:
        f.write(log)
        f.flush()
        prediction = {"instance_id": instance_id, "model_name_or_path": "rollout", "model_patch": ""}
        report = get_eval_report(spec, prediction, f.name, include_tests_status=True)[instance_id]
    return {**report, "parser": name}


def log_with_markers(test_output: str, exit_code: int) -> str:
    """A test run's output as the harness's log has it (what `grade` reads)."""
    from swebench.harness.constants import END_TEST_OUTPUT, START_TEST_OUTPUT, TEST_EXIT_CODE

    return f"{START_TEST_OUTPUT}\n{test_output}\n{END_TEST_OUTPUT}\n{TEST_EXIT_CODE}: {exit_code}\n"


MARKERS = (">>>>> Start Test Output", ">>>>> End Test Output", ">>>>> Test Exit Code")
"""swebench.harness.constants' START_TEST_OUTPUT, END_TEST_OUTPUT and TEST_EXIT_CODE, which the scoring
command writes into the sandbox's log without importing the package (a test checks they agree)."""
