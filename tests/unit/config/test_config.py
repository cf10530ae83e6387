"""Config files: every committed TOML parses; bad files give one line naming file and field, exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from durable_rollouts.cli.rollouts import app
from durable_rollouts.config.load import ConfigError, load_config
from tests import REPO_ROOT

EXAMPLES = sorted((REPO_ROOT / "config" / "examples").glob("*.toml"))


def test_examples_exist() -> None:
    assert len(EXAMPLES) >= 2


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_committed_toml_parses(path: Path) -> None:
    if "[trainer]" in path.read_text():  # a closed-loop config: run sections plus the trainer's
        from durable_rollouts.trainer.settings import load_loop_config

        cfg, trainer = load_loop_config(path)
        assert trainer.lr > 0
    else:
        cfg = load_config(path)
    assert cfg.run.num_groups >= 1


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "bad.toml"
    p.write_text(text)
    return p


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("[run]\nnum_groups = 0\n", "run.num_groups"),
        ("[run]\nbogus = 1\n", "run.bogus"),
        ("[sampling]\ntemperature = 'hot'\n", "sampling.temperature"),
        ("[nonsense]\nx = 1\n", "nonsense"),
        ("[engine]\nurls = []\n", "engine.urls"),
    ],
)
def test_bad_field_is_one_line_naming_file_and_field(tmp_path: Path, text: str, field: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    msg = str(e.value)
    assert "\n" not in msg
    assert str(path) in msg and field in msg


def test_invalid_toml_names_the_file(tmp_path: Path) -> None:
    path = _write(tmp_path, "[run\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(path)


def test_cross_field_check(tmp_path: Path) -> None:
    path = _write(tmp_path, "[sampling]\nmax_tokens = 100\n[rollout]\nmax_total_tokens = 10\n")
    with pytest.raises(ConfigError, match="max_tokens"):
        load_config(path)


def test_inline_rollouts_need_local_model_calls(tmp_path: Path) -> None:
    path = _write(tmp_path, "[group]\ninline_rollouts = true\n")
    with pytest.raises(ConfigError, match=r"group\.inline_rollouts needs rollout\.local_model_calls") as e:
        load_config(path)
    assert "\n" not in str(e.value) and str(path) in str(e.value)
    cfg = load_config(path, ["rollout.local_model_calls=true"])
    assert cfg.group.inline_rollouts and cfg.rollout.local_model_calls


def test_overrides_apply_and_are_validated() -> None:
    cfg = load_config(None, ["run.num_groups=3", "sampling.temperature=0.5", "engine.model=other"])
    assert (cfg.run.num_groups, cfg.sampling.temperature, cfg.engine.model) == (3, 0.5, "other")
    with pytest.raises(ConfigError, match=r"run\.group_size"):
        load_config(None, ["run.group_size=-1"])


def test_cli_bad_config_exits_2_with_one_line(tmp_path: Path) -> None:
    path = _write(tmp_path, "[run]\ngroup_size = 0\n")
    result = CliRunner().invoke(app, ["run", str(path)])
    assert result.exit_code == 2
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "run.group_size" in lines[0]


def test_cli_bad_task_file_exits_2_with_one_line(tmp_path: Path) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"id": "a", "prompt": "1+1=", "answer": "2"}\n{"id": "b", "prompt": "2+2="}\n')
    result = CliRunner().invoke(app, ["run", "--task-file", str(tasks)])
    assert result.exit_code == 2
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and f"{tasks}:2" in lines[0] and "answer" in lines[0]
