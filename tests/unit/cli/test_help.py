"""Every ``--help`` page of the ``rollouts`` command shows each option's and argument's help text as it is
written in the code: no word lost to rich markup (``TOML file with a [stack] table.`` once printed as
``TOML file with a  table.``)."""

from __future__ import annotations

from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from durable_rollouts.cli.rollouts import app


def _commands(command: Any, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    """``command`` (typer's click command) and every sub-command under it, each with the words that invoke
    it."""
    found = [(path, command)]
    for name, sub in sorted(getattr(command, "commands", {}).items()):
        found += _commands(sub, (*path, name))
    return found


COMMANDS = _commands(typer.main.get_command(app))


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_the_walk_reaches_the_sub_apps() -> None:
    paths = {" ".join(path) for path, _ in COMMANDS}
    assert {"run", "status", "runs", "stack up", "feed take", "policy publish"} <= paths


@pytest.mark.parametrize(("path", "command"), COMMANDS, ids=[" ".join(p) or "rollouts" for p, _ in COMMANDS])
def test_help_shows_every_help_text_as_written(path: tuple[str, ...], command: Any) -> None:
    result = CliRunner().invoke(app, [*path, "--help"], terminal_width=200, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    shown = _flat(result.output)
    texts = [getattr(p, "help", None) for p in command.params if not getattr(p, "hidden", False)]
    if command.help:
        texts.append(command.help.split("\f")[0])
    for text in filter(None, texts):
        where = f"rollouts {' '.join(path)} --help"
        assert _flat(text) in shown, f"{where} lost words of {text!r}:\n{result.output}"
