"""Coding task files: the loader's one-line errors, and the bundled tasks checked against their hidden tests.

The bundled reference, wrong and stub solutions are our own trusted code, so they run here on the host with
pytest (one subprocess for all of them), not in a sandbox.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from coding_env.tasks import CodingTask, load_task_file

from durable_rollouts.environments.tool_calls import ToolCall, render_call
from durable_rollouts.errors import TaskFileError

BUNDLED = Path(__file__).resolve().parents[1] / "coding_env" / "data" / "coding.jsonl"

# Runs pytest once per task directory inside one interpreter and prints {dir: [passed, collected]}.
_DRIVER = r"""
import json, os, sys
import pytest

class Count:
    def __init__(self):
        self.passed = 0
        self.collected = 0
    def pytest_collection_modifyitems(self, items):
        self.collected = len(items)
    def pytest_runtest_logreport(self, report):
        if report.when == "call" and report.passed:
            self.passed += 1

root = sys.argv[1]
results = {}
for variant in sorted(os.listdir(root)):
    for task in sorted(os.listdir(os.path.join(root, variant))):
        d = os.path.join(root, variant, task)
        for name in [m for m in sys.modules if m == "solution" or m.startswith("test_")]:
            del sys.modules[name]
        os.chdir(d)
        count = Count()
        pytest.main([d, "-q", "-p", "no:cacheprovider", "-c", os.path.join(d, "pytest.ini"), "--rootdir", d],
                    plugins=[count])
        results[f"{variant}/{task}"] = [count.passed, count.collected]
print("RESULTS " + json.dumps(results))
"""


def _line(**overrides: object) -> dict[str, object]:
    task: dict[str, object] = {
        "id": "code-x",
        "prompt": "Implement f.",
        "files": {"solution.py": "def f(): ...\n"},
        "tests": {"test_hidden.py": "from solution import f\n"},
        "reference": {"solution.py": "def f(): return 1\n"},
        "wrong": {"solution.py": "def f(): return 2\n"},
    }
    task.update(overrides)
    return task


def _write(tmp_path: Path, *tasks: dict[str, object] | str) -> Path:
    p = tmp_path / "tasks.jsonl"
    p.write_text("".join((t if isinstance(t, str) else json.dumps(t)) + "\n" for t in tasks))
    return p


def _hidden_test_count(task: CodingTask) -> int:
    return sum(len(re.findall(r"^def test_", src, flags=re.M)) for src in task.tests.values())


def _lay_out(root: Path, variant: str, task: CodingTask, solution: dict[str, str]) -> None:
    d = root / variant / task.id
    d.mkdir(parents=True)
    (d / "pytest.ini").write_text("[pytest]\n")
    for rel, content in {**task.files, **solution, **task.tests}.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_text(content)


def test_bundled_tasks_load() -> None:
    tasks = load_task_file(BUNDLED)
    assert len(tasks) >= 20
    for t in tasks:
        assert 4 <= _hidden_test_count(t) <= 8, t.id
        assert t.id.startswith("code-")
        # The scripted policy writes these files through the tool-call format.
        for path, content in {**t.reference, **t.wrong}.items():
            render_call(ToolCall(name="write_file", arguments={"path": path, "content": content}))


@pytest.mark.timeout(180)
def test_reference_passes_all_and_wrong_fails_some(tmp_path: Path) -> None:
    tasks = load_task_file(BUNDLED)
    for t in tasks:
        _lay_out(tmp_path, "reference", t, t.reference)
        _lay_out(tmp_path, "wrong", t, t.wrong)
        _lay_out(tmp_path, "stub", t, {})
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _DRIVER, str(tmp_path)], capture_output=True, text=True, timeout=170, env=env
    )
    marker = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert marker, proc.stdout[-2000:] + proc.stderr[-2000:]
    results = json.loads(marker[0].removeprefix("RESULTS "))
    partially_right = 0
    for t in tasks:
        n = _hidden_test_count(t)
        assert results[f"reference/{t.id}"] == [n, n], t.id
        wrong_passed, collected = results[f"wrong/{t.id}"]
        assert collected == n and wrong_passed < n, t.id
        partially_right += wrong_passed > 0
        assert results[f"stub/{t.id}"] == [0, n], t.id
    assert partially_right >= len(tasks) // 2


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("not json", r":1: not valid JSON"),
        ("[1]", r":1: a task must be a JSON object"),
        (_line(id=""), r":1: field 'id': String should have at least 1 character"),
        (_line(id="a b"), r":1: field 'id': must not contain whitespace"),
        (_line(prompt=3), r":1: field 'prompt': Input should be a valid string"),
        (_line(tests={}), r":1: field 'tests': Dictionary should have at least 1 item"),
        (_line(tests={"hidden.py": "x"}), r":1: field 'tests': 'hidden.py' is not named test_\*\.py"),
        (_line(files={"../x.py": ""}), r":1: field 'files': path '../x.py' must not contain"),
        (_line(files={"/etc/x": ""}), r":1: field 'files': path '/etc/x' must be relative"),
        (_line(files={"a.py": 3}), r":1: field 'files' at 'a.py': Input should be a valid string"),
        (_line(wrong={"test_hidden.py": ""}), r":1: field 'wrong': 'test_hidden.py' would overwrite"),
        (_line(files={"test_hidden.py": ""}), r":1: field 'tests': hidden test 'test_hidden.py' is also"),
        (_line(extra=1), r":1: field 'extra': Extra inputs are not permitted"),
        ({k: v for k, v in _line().items() if k != "wrong"}, r":1: field 'wrong': Field required"),
    ],
)
def test_bad_line_names_file_line_and_field(
    tmp_path: Path, content: dict[str, object] | str, match: str
) -> None:
    p = _write(tmp_path, content)
    with pytest.raises(TaskFileError, match=match) as e:
        load_task_file(p)
    assert str(p) in str(e.value)
    assert len(str(e.value).splitlines()) == 1


def test_duplicate_ids_and_empty_files(tmp_path: Path) -> None:
    with pytest.raises(TaskFileError, match=r":2: field 'id': duplicate task id 'code-x'"):
        load_task_file(_write(tmp_path, _line(), _line()))
    with pytest.raises(TaskFileError, match=r"no tasks"):
        load_task_file(_write(tmp_path, ""))
    with pytest.raises(TaskFileError, match=r"cannot read task file"):
        load_task_file(tmp_path / "missing.jsonl")
