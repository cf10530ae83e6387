"""A dataset file's ``default_user``: the user of every task that names none (Terminal-Bench 2's tasks name
no user and are written to run as root)."""

from __future__ import annotations

from pathlib import Path

import pytest
from harbor_env import users
from harbor_env.tasks import load_dataset
from harbor_paths import MakeTask

from durable_rollouts.errors import TaskFileError
from durable_rollouts.sandboxes.base import SandboxSpec

OFFLINE = '[environment]\nnetwork_mode = "no-network"\n'


def test_default_user_fills_only_an_unnamed_agent_user(make_task: MakeTask, tmp_path: Path) -> None:
    make_task("plain", toml=OFFLINE)
    make_task("named", toml=OFFLINE + '[agent]\nuser = "agent"\n')
    listing = tmp_path / "dataset.toml"
    listing.write_text('tasks = ["plain", "named"]\n')
    spec = SandboxSpec()
    plain, named = load_dataset(listing)
    assert plain.cfg.agent.user is None and users(plain, spec) == {}  # without it: the sandbox's user
    listing.write_text('tasks = ["plain", "named"]\ndefault_user = "root"\n')
    plain, named = load_dataset(listing)
    assert plain.cfg.agent.user == "root" and named.cfg.agent.user == "agent"
    fields = users(plain, spec)
    assert fields["user"] == "root" and fields["allow_root"] is True
    assert "[agent].user = 'root'" in fields["user_source"]
    assert users(named, spec)["user"] == "agent"
    listing.write_text('tasks = ["plain"]\ndefault_user = 0\n')
    assert load_dataset(listing)[0].cfg.agent.user == "0"


@pytest.mark.parametrize("value", ['"bad user"', "-1", "true", "[1]"])
def test_a_bad_default_user_is_one_line(make_task: MakeTask, tmp_path: Path, value: str) -> None:
    make_task("plain", toml=OFFLINE)
    listing = tmp_path / "dataset.toml"
    listing.write_text(f'tasks = ["plain"]\ndefault_user = {value}\n')
    with pytest.raises(TaskFileError, match=r"dataset.toml: field 'default_user': .*a user name or uid") as e:
        load_dataset(listing)
    assert "\n" not in str(e.value)
