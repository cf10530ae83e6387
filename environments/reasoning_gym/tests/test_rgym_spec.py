"""Task specs of the reasoning-gym plug-in: parsing, generation, and a bad spec as one line naming the file
and the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rgym_env import ReasoningGymEnvironment, RgTask
from rgym_env.datasets import dataset
from rgym_env.transcripts import SPEC

from durable_rollouts.errors import TaskFileError

GOOD = """
[[generators]]
name = "basic_arithmetic"
seed = 1
size = 3

[[generators]]
name = "spell_backward"
seed = 2
size = 2
"""


def load(tmp_path: Path, text: str, name: str = "spec.toml") -> list[RgTask]:
    p = tmp_path / name
    p.write_text(text)
    return [t for t in ReasoningGymEnvironment().load_tasks(p) if isinstance(t, RgTask)]


def error(tmp_path: Path, text: str, name: str = "spec.toml") -> str:
    with pytest.raises(TaskFileError) as e:
        load(tmp_path, text, name)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(str(tmp_path / name) + ": "), msg
    return msg.removeprefix(str(tmp_path / name) + ": ")


def test_the_bundled_spec_yields_three_generators_interleaved() -> None:
    tasks = [t for t in ReasoningGymEnvironment().load_tasks(SPEC) if isinstance(t, RgTask)]
    assert len(tasks) == 12 and len({t.id for t in tasks}) == 12
    assert [t.generator for t in tasks[:3]] == ["basic_arithmetic", "spell_backward", "number_sorting"]
    assert [t.index for t in tasks[:6]] == [0, 0, 0, 1, 1, 1]


def test_tasks_carry_the_entry_and_what_recreates_its_dataset(tmp_path: Path) -> None:
    tasks = load(tmp_path, GOOD)
    for t in tasks:
        entry = dataset(t.generator, t.seed, t.size, t.config)[t.index]
        assert t.id == f"{t.generator}-{t.seed}-{t.index}"
        assert (t.question, t.answer) == (entry["question"], entry["answer"])
        assert t.metadata == json.loads(json.dumps(entry["metadata"]))
    # What the run store keeps (JSON) validates back to the same task.
    env = ReasoningGymEnvironment()
    assert [env.validate_task(json.loads(json.dumps(t.model_dump(mode="json")))) for t in tasks] == tasks


def test_interleave_is_the_default_and_concat_keeps_generator_order(tmp_path: Path) -> None:
    mixed = [t.generator[:5] for t in load(tmp_path, GOOD)]
    assert mixed == ["basic", "spell", "basic", "spell", "basic"]
    concat = [t.generator[:5] for t in load(tmp_path, 'order = "concat"\n' + GOOD)]
    assert concat == ["basic"] * 3 + ["spell"] * 2


def test_a_json_spec_and_generator_config(tmp_path: Path) -> None:
    spec = {"generators": [{"name": "number_sorting", "seed": 5, "size": 2, "config": {"min_numbers": 6}}]}
    tasks = load(tmp_path, json.dumps(spec), "spec.json")
    assert [t.config for t in tasks] == [{"min_numbers": 6}] * 2
    assert all(len(json.loads(t.answer.replace("'", '"'))) >= 6 for t in tasks if isinstance(t.answer, str))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[[generators]\nname = 1", "not valid TOML ("),
        ("system_prompt = 'default'", "field 'generators': Field required"),
        ("generators = []", "field 'generators': List should have at least 1 item"),
        (
            GOOD.replace("seed = 2", 'seed = "2"'),
            "field 'generators[1].seed': Input should be a valid integer",
        ),
        (GOOD.replace("size = 3", "size = 0"), "field 'generators[0].size': Input should be greater than"),
        ("sizes = 3\n" + GOOD, "field 'sizes': Extra inputs are not permitted"),
        (GOOD.replace("size = 2", "size = 2\nsead = 2"), "field 'generators[1].sead': Extra inputs"),
        (
            GOOD.replace("size = 2", "size = 2\nconfig = { seed = 3 }"),
            "field 'generators[1].config': set 'seed'",
        ),
        (
            GOOD.replace("spell_backward", "no_such_generator"),
            "field 'generators[1].name': 'no_such_generator'",
        ),
        (
            GOOD.replace("spell_backward", "basic arithmetic"),
            "field 'generators[1].name': String should match",
        ),
        (GOOD.replace("size = 2", "size = 2\nconfig = { bogus = 1 }"), "field 'generators[1].config': "),
        (
            GOOD.replace("spell_backward", "basic_arithmetic").replace("seed = 2", "seed = 1"),
            "field 'generators[1]': 'basic_arithmetic' with seed 1 is already generators[0]",
        ),
        ("system_prompt = 'nope'\n" + GOOD, "field 'system_prompt': 'nope' is not one of "),
        ('order = "random"\n' + GOOD, "field 'order': Input should be 'interleave' or 'concat'"),
    ],
)
def test_a_bad_spec_is_one_line_naming_the_file_and_field(tmp_path: Path, text: str, expected: str) -> None:
    assert error(tmp_path, text).startswith(expected)


def test_a_bad_json_spec_and_a_missing_file(tmp_path: Path) -> None:
    assert error(tmp_path, "[1, 2]", "spec.json") == "a task spec must be an object with 'generators'"
    assert error(tmp_path, "{", "spec.json").startswith("not valid JSON (")
    with pytest.raises(TaskFileError, match=r"missing\.toml: cannot read task spec"):
        ReasoningGymEnvironment().load_tasks(tmp_path / "missing.toml")


def test_a_stored_task_missing_a_field_names_it() -> None:
    env = ReasoningGymEnvironment()
    row = next(iter(env.load_tasks(SPEC))).model_dump(mode="json")
    del row["question"]
    with pytest.raises(TaskFileError, match=r"^run r task t: field 'question': Field required$"):
        env.validate_task(row, where="run r task t")
