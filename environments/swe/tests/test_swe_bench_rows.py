"""SWE-bench-style rows (no Docker): validation (a bad row is one line naming file, line and field), the
diff applier, and SWE-bench's resolved rule (the swebench package's grading) on pytest's status lines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from swe_env import SweBenchTask, SweEnvironment
from swe_env.swebench import resolved
from swe_env.transcripts import BREAKING, SWEBENCH, load_breaking, transcripts
from swe_env.unidiff import PatchError, apply, touched

from durable_rollouts.errors import TaskFileError

ROWS = [json.loads(line) for line in SWEBENCH.read_text().splitlines()]


def load(tmp_path: Path, rows: list[dict]) -> list[SweBenchTask]:
    p = tmp_path / "rows.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [t for t in SweEnvironment().load_tasks(p) if isinstance(t, SweBenchTask)]


def test_the_bundled_rows_load_with_either_image_field_and_json_encoded_lists(tmp_path: Path) -> None:
    calc, words = load(tmp_path, ROWS)
    assert calc.id == calc.instance_id and calc.image == calc.image_name == "durable-rollouts-swe-calc:latest"
    assert words.image == words.docker_image == "durable-rollouts-swe-wordstat:latest"
    encoded = ROWS[0]["FAIL_TO_PASS"]
    assert isinstance(encoded, str) and json.loads(encoded) == calc.FAIL_TO_PASS
    assert words.repo_dir == "/testbed" and words.tests[:2] == words.FAIL_TO_PASS
    # What the run store keeps validates back to the same task.
    env = SweEnvironment()
    assert env.validate_task(json.loads(json.dumps(calc.model_dump(mode="json")))) == calc


def _bad(row: dict, **change: object) -> dict:
    out = {**row, **change}
    return {k: v for k, v in out.items() if v is not _DROP}


_DROP = object()


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"patch": _DROP}, "field 'patch': missing"),
        ({"FAIL_TO_PASS": _DROP}, "field 'FAIL_TO_PASS': missing"),
        ({"version": _DROP}, "field 'version': missing"),
        ({"log_parser": "parse_log_nothing"}, "field 'log_parser': 'parse_log_nothing' is not a log parser"),
        ({"test_command": "make test"}, "field 'test_command': must run the tests"),
        ({"docker_image": "other:latest"}, "field 'docker_image': differs from image_name"),
        ({"FAIL_TO_PASS": "tests/x.py::t"}, "field 'FAIL_TO_PASS': must be a list of test ids"),
        ({"FAIL_TO_PASS": "[]"}, "field 'FAIL_TO_PASS': List should have at least 1 item"),
        ({"PASS_TO_PASS": [1]}, "field 'PASS_TO_PASS' at '0': Input should be a valid string"),
        ({"base_commit": "HEAD"}, "field 'base_commit': String should match pattern"),
        ({"version": 0.1}, "field 'version': Input should be a valid string"),
        ({"patch": "fix the bug"}, "field 'patch': not a unified diff this environment can apply"),
        ({"test_patch": "--- a/../x\n+++ b/../x\n"}, "field 'test_patch': not a unified diff"),
        ({"image_name": "bad image"}, "field 'image_name': 'bad image' is not an image tag"),
        ({"instance_id": "has space"}, "field 'instance_id': must not contain whitespace"),
        ({"instance_id": "a;b"}, "field 'instance_id': String should match pattern"),
    ],
)
def test_a_bad_row_is_one_line_naming_file_line_and_field(
    tmp_path: Path, change: dict, expected: str
) -> None:
    with pytest.raises(TaskFileError) as e:
        load(tmp_path, [ROWS[1], _bad(ROWS[0], **change)])
    assert str(e.value).startswith(f"{tmp_path / 'rows.jsonl'}:2: {expected}"), str(e.value)
    assert "\n" not in str(e.value)


def test_rows_and_repository_tasks_share_a_file(tmp_path: Path) -> None:
    from swe_env.transcripts import TASKS

    p = tmp_path / "mixed.jsonl"
    p.write_text(TASKS.read_text().splitlines()[0] + "\n" + SWEBENCH.read_text())
    assert [type(t).__name__ for t in SweEnvironment().load_tasks(p)] == [
        "SweTask",
        "SweBenchTask",
        "SweBenchTask",
    ]


def test_the_applier_applies_the_bundled_diffs_and_refuses_a_mismatch(tmp_path: Path) -> None:
    images = SWEBENCH.parents[2] / "images"
    for row, image in zip(load(tmp_path, ROWS), ("calc", "wordstat"), strict=True):
        for diff in (row.patch, row.test_patch, load_breaking()[row.instance_id]):
            root = tmp_path / f"{image}-{abs(hash(diff))}"
            _copy(images / image / "repo", root)
            assert apply(str(root), diff) == touched(diff)
        with pytest.raises(PatchError, match="does not match"):
            apply(str(root), row.patch)  # the breaking diff is in: the reference no longer matches
    assert touched(ROWS[1]["test_patch"]) == ["tests/test_whitespace.py"]


def test_the_applier_handles_a_missing_final_newline(tmp_path: Path) -> None:
    (tmp_path / "f.txt").write_text("a\nb")
    diff = "--- a/f.txt\n+++ b/f.txt\n@@ -1,2 +1,2 @@\n a\n-b\n\\ No newline at end of file\n+c\n"
    apply(str(tmp_path), diff)
    assert (tmp_path / "f.txt").read_text() == "a\nc\n"


def test_resolved_needs_every_fail_to_pass_and_pass_to_pass_test_passed(tmp_path: Path) -> None:
    calc = load(tmp_path, ROWS)[0]
    lines = {t: "PASSED" for t in calc.tests}
    log = "\n".join(f"{s} {t}" for t, s in lines.items())
    assert resolved(calc, log) == 1.0
    assert (
        resolved(calc, log.replace(f"PASSED {calc.PASS_TO_PASS[0]}", f"FAILED {calc.PASS_TO_PASS[0]} - x"))
        == 0.0
    )
    assert (
        resolved(calc, log.replace(f"PASSED {calc.FAIL_TO_PASS[0]}", f"XFAIL {calc.FAIL_TO_PASS[0]}")) == 1.0
    )
    assert resolved(calc, "\n".join(log.splitlines()[1:])) == 0.0  # a test missing from the log


def test_transcripts_cover_every_row_in_both_modes(tmp_path: Path) -> None:
    rows = load(tmp_path, ROWS)
    lines = transcripts(list(rows))
    assert {(x["task_id"], x["mode"]) for x in lines} == {
        (r.id, m) for r in rows for m in ("reference", "wrong")
    }
    assert set(json.loads(BREAKING.read_text())) == {r.instance_id for r in rows}
    only_ref = transcripts(list(rows), breaking={})
    assert {x["mode"] for x in only_ref} == {"reference"}


def _copy(src: Path, dst: Path) -> None:
    for f in src.rglob("*"):
        if f.is_file():
            (dst / f.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
            (dst / f.relative_to(src)).write_bytes(f.read_bytes())
