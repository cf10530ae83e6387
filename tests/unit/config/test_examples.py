"""Every bundled example config (config/examples/*.toml, package data) parses and names an installed
environment; the examples of the sandboxed environments carry the limits their reference transcripts need."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from durable_rollouts.cli.stack import load_stack_config
from durable_rollouts.config.load import bundled_examples, load_config
from durable_rollouts.config.models import Config
from durable_rollouts.config.paths import resource_path
from durable_rollouts.environments import registry
from durable_rollouts.trainer.settings import load_loop_config


def example(name: str):
    return resource_path(f"durable_rollouts.config:examples/{name}.toml", "config")


def run_config(name: str) -> Config | None:
    """The example's run config (a loop config's run sections too), or None for a stack-only file."""
    path = example(name)
    data = tomllib.loads(path.read_text())
    if "run" not in data:
        load_stack_config(path)  # `rollouts stack up --config`: the [stack] table alone
        return None
    if "trainer" in data:
        return load_loop_config(path)[0]
    return load_config(path)


def test_the_examples_the_docs_name_are_bundled() -> None:
    names = set(bundled_examples())
    assert {"math", "coding", "harbor", "mini-swe-agent", "swe", "reasoning_gym"} <= names


@pytest.mark.parametrize("name", bundled_examples())
def test_every_bundled_example_parses_and_names_an_installed_environment(name: str) -> None:
    cfg = run_config(name)
    if cfg is None:
        return
    registry.get(cfg.run.env)  # raises unless the plug-in is installed


# (max_turns, max_tokens, max_total_tokens) at least: those the docs pass and the integration tests'
# reference transcripts finish within (tests/integration/test_example_configs.py runs them).
NEEDS = {
    "harbor": (30, 2048, 8000),
    "mini-swe-agent": (50, 2048, 60000),
    "swe": (8, 1024, 4000),
    "reasoning_gym": (1, 1024, 2048),
    "coding": (8, 1024, 3500),
}


@pytest.mark.parametrize("name", sorted(NEEDS))
def test_agent_examples_leave_room_for_a_reference_solution(name: str) -> None:
    cfg = run_config(name)
    assert cfg is not None
    turns, tokens, total = NEEDS[name]
    assert cfg.rollout.max_turns >= turns
    assert cfg.sampling.max_tokens >= tokens
    assert cfg.rollout.max_total_tokens >= total


def test_a_bundled_example_is_found_by_name_even_beside_a_folder_of_that_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from durable_rollouts.config.load import config_file
    from durable_rollouts.errors import ConfigError

    monkeypatch.chdir(tmp_path)
    (tmp_path / "stack").mkdir()  # a checkout has a stack/ folder; `rollouts run stack` means the example
    assert config_file("stack").name == "stack.toml" and config_file("stack").is_file()
    (tmp_path / "mine.toml").write_text("[run]\n")
    assert config_file("mine.toml") == Path("mine.toml")
    with pytest.raises(ConfigError, match="no bundled example of that name"):
        config_file("nosuch")
