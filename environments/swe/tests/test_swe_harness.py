"""What SWE-bench's harness decides for a row, checked against the swebench package itself (no Docker): the
image name and its override, the test command and directives from SWE-bench's specs, the parser by
repository, and grading of django's and sympy's own log formats."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from swe_env import SweBenchTask, SweEnvironment, harness, swebench
from swe_env.transcripts import PUBLISHED

from durable_rollouts.errors import TaskFileError

ROWS = [json.loads(line) for line in PUBLISHED.read_text().splitlines()]


def load(tmp_path: Path, rows: list[dict], pattern: str | None = None) -> list[SweBenchTask]:
    p = tmp_path / "rows.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [t for t in SweEnvironment(image_pattern=pattern).load_tasks(p) if isinstance(t, SweBenchTask)]


def test_a_row_without_an_image_gets_the_name_swebench_gives_its_instance(tmp_path: Path) -> None:
    from swebench.image_builder.image_spec import ImageSpec
    from swebench.task.checks import expected_image

    assert all(not {"image_name", "docker_image", "image"} & set(r) for r in ROWS)  # rows as published
    for task in load(tmp_path, ROWS):
        published = ImageSpec(instance_id=task.instance_id, dockerfile="x", namespace="swebench").name
        assert task.image == expected_image(task.instance_id) == published
        assert "_1776_" in task.image and "__" not in task.image
    # The name of an image the harness built locally (no namespace): a pattern gives it.
    local = load(tmp_path, ROWS[:1], pattern="sweb.eval.x86_64.{instance_id}:latest")[0]
    assert local.image == ImageSpec(instance_id=local.instance_id, dockerfile="x", namespace=None).name
    assert local.image == "sweb.eval.x86_64.django__django-99001:latest"


def test_the_operator_s_pattern_comes_from_the_environment_and_is_stored_with_the_task(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(harness.IMAGE_PATTERN_ENV, "registry.local:5000/{repo}/{instance_id}:v{version}")
    task = load(tmp_path, ROWS[:1])[0]
    assert task.image == "registry.local:5000/django/django/django__django-99001:v5.2"
    monkeypatch.delenv(harness.IMAGE_PATTERN_ENV)
    # What the run store keeps validates back to the same task, whatever the pattern is now.
    again = SweEnvironment().validate_task(json.loads(json.dumps(task.model_dump(mode="json"))))
    assert again == task and isinstance(again, SweBenchTask) and again.image == task.image
    # A row's own image still wins over any pattern.
    named = load(tmp_path, [{**ROWS[0], "docker_image": "mine:1"}], pattern="x/{instance_id}")[0]
    assert named.image == "mine:1" and named.harness_image is None


def test_a_bad_pattern_is_one_line_naming_the_file_line_and_setting(tmp_path: Path) -> None:
    with pytest.raises(TaskFileError) as e:
        load(tmp_path, ROWS, pattern="sweb.eval.{id}:latest")
    assert str(e.value).startswith(f"{tmp_path / 'rows.jsonl'}:1: {harness.IMAGE_PATTERN_ENV}: image pattern")
    assert "{instance_id}" in str(e.value) and "\n" not in str(e.value)
    bad = "field 'harness_image': 'bad name:5.2' is not an image tag"
    with pytest.raises(TaskFileError, match=re.escape(bad)):
        load(tmp_path, ROWS, pattern="bad name:{version}")


def test_commands_and_directives_follow_swebench_s_specs(tmp_path: Path) -> None:
    django, sympy = load(tmp_path, ROWS)
    runtests = "./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1"
    assert django.command == f"{runtests} utils_tests.test_text"
    assert sympy.command.endswith("bin/test -C --verbose sympy/utilities/tests/test_iterables.py")
    patch = "--- a/tests/a/test_b.py\n+++ b/tests/a/test_b.py\n@@ -1 +1 @@\n-x\n+y\n"
    data = patch.replace("tests/a/test_b.py", "tests/a/data.json")
    assert harness.test_directives("django/django", patch + data) == ["a.test_b"]
    assert harness.test_directives("pydata/xarray", patch) == ["tests/a/test_b.py"]
    own = load(tmp_path, [{**ROWS[0], "test_command": "python3 -m pytest {tests}"}])[0]
    assert own.command == "python3 -m pytest " + " ".join(f"'{t}'" for t in own.tests)


def test_the_parser_is_the_repository_s_in_swebench(tmp_path: Path) -> None:
    from swebench.harness.log_parsers import PARSER_REGISTRY
    from swebench.harness.log_parsers.python import MAP_REPO_TO_PARSER_PY

    for repo in ("django/django", "sympy/sympy", "astropy/astropy"):
        assert PARSER_REGISTRY[harness.parser_name(repo, None)] is MAP_REPO_TO_PARSER_PY[repo]
    assert harness.parser_name("someone/else", None) == "parse_log_pytest"
    assert harness.parser_name("django/django", "parse_log_pytest") == "parse_log_pytest"
    from swebench.harness.constants import END_TEST_OUTPUT, START_TEST_OUTPUT, TEST_EXIT_CODE

    assert harness.MARKERS == (START_TEST_OUTPUT, END_TEST_OUTPUT, TEST_EXIT_CODE)


def test_django_and_sympy_logs_are_graded_in_their_own_formats(tmp_path: Path) -> None:
    django, sympy = load(tmp_path, ROWS)
    f2p = django.FAIL_TO_PASS[0]
    ok = "\n".join(f"{t} ... ok" for t in django.tests)
    assert swebench.resolved(django, ok, exit_code=0) == 1.0
    assert swebench.resolved(django, ok.replace(f"{f2p} ... ok", f"{f2p} ... FAIL"), exit_code=1) == 0.0
    assert swebench.resolved(django, ok.replace(f"{f2p} ... ok", f"{f2p} ... ERROR"), exit_code=1) == 0.0
    p2p = django.PASS_TO_PASS[3]
    assert swebench.resolved(django, ok.replace(f"{p2p} ... ok", f"{p2p} ... FAIL"), exit_code=1) == 0.0
    # pytest's lines mean nothing to django's parser.
    assert swebench.resolved(django, "\n".join(f"PASSED {t}" for t in django.tests)) == 0.0
    lines = "\n".join(f"{t} ok" for t in sympy.tests)
    assert swebench.resolved(sympy, lines) == 1.0
    assert swebench.resolved(sympy, lines.replace("test_chunked ok", "test_chunked F"), exit_code=1) == 0.0
    # A log that says everything passed while the test command failed is no pass (swebench's cross-check).
    assert swebench.resolved(sympy, lines, exit_code=1) == 0.0


def test_appliers_are_read_from_the_scoring_output() -> None:
    out = "swe-apply-failed: git: error: patch failed: a.py:3\nswe-applied: patch\nswe-exit: 0\n"
    assert swebench.appliers(out) == ("patch", ["git: error: patch failed: a.py:3"])
    assert swebench.appliers("swe-exit: patch") == ("none", [])
