"""Task files and the math verifier."""

from __future__ import annotations

from pathlib import Path

import pytest
from math_env import verify

from durable_rollouts.environments.tasks import load_tasks
from durable_rollouts.errors import TaskFileError

BUNDLED = Path(__file__).resolve().parents[1] / "math_env" / "data" / "addition.jsonl"


def test_bundled_addition_tasks_load() -> None:
    tasks = load_tasks(BUNDLED, "math")
    assert len(tasks) >= 100
    for t in tasks:
        a, b = t["prompt"].rstrip("=").split("+")
        assert int(a) + int(b) == int(t["answer"])


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("not json\n", r":1: not valid JSON"),
        ('{"id": "a", "prompt": "x"}\n', r":1: missing field 'answer'"),
        ('{"id": "a", "prompt": "x", "answer": 3}\n', r":1: field 'answer' must be a non-empty string"),
        (
            '{"id": "a", "prompt": "x", "answer": "1"}\n{"id": "a", "prompt": "y", "answer": "2"}\n',
            r":2: dup",
        ),
        ("[1, 2]\n", r":1: a task must be a JSON object"),
        ("\n\n", r"no tasks"),
    ],
)
def test_bad_task_file_names_file_and_line(tmp_path: Path, content: str, match: str) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text(content)
    with pytest.raises(TaskFileError, match=match) as e:
        load_tasks(p, "math")
    assert str(p) in str(e.value) and "\n" not in str(e.value)


def test_missing_task_file(tmp_path: Path) -> None:
    with pytest.raises(TaskFileError, match="cannot read"):
        load_tasks(tmp_path / "nope.jsonl", "math")


@pytest.mark.parametrize(
    ("output", "answer", "reward"),
    [("82", "82", 1.0), (" 82\n", "82", 1.0), ("82.", "82", 1.0), ("83", "82", 0.0), ("", "82", 0.0)],
)
def test_verifier(output: str, answer: str, reward: float) -> None:
    assert verify(output, answer) == reward
