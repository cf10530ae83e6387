"""``rollouts run`` on bad Harbor task directories: exit 2, one line naming the directory and the field,
nothing started (no store written, Temporal never asked: its address here answers nothing)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from harbor_paths import MakeTask
from typer.testing import CliRunner

from durable_rollouts.cli.rollouts import app

BAD = [
    ("no-toml", {"drop": ("task.toml",)}, "task.toml: missing"),
    ("unknown-field", {"toml": '[environment]\nnetwork_mode = "no-network"\nmemory_gb = 2\n'},
     "[environment].memory_gb: unknown field"),
    ("mistyped", {"toml": '[verifier]\ntimeout_sec = "long"\n'}, "[verifier].timeout_sec"),
    ("network", {"toml": '[environment]\nnetwork_mode = "allowlist"\nallowed_hosts = ["pypi.org"]\n'},
     "[environment].network_mode: 'allowlist'"),
    ("no-tests", {"drop": ("tests/test.sh",)}, "tests/test.sh: missing"),
]  # fmt: skip


def _dead_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize(("name", "kw", "field"), BAD, ids=[b[0] for b in BAD])
def test_a_bad_task_directory_exits_2_in_one_line_and_starts_nothing(
    make_task: MakeTask, tmp_path: Path, name: str, kw: dict, field: str
) -> None:
    good = make_task("good")
    bad = make_task(name, **kw)
    store = tmp_path / "store"
    for dataset in (bad, tmp_path):  # the directory itself, and the folder holding it with a good one
        result = CliRunner().invoke(
            app,
            ["run", "--task-file", str(dataset), "--run-id", f"bad-{name}",
             "--set", 'run.env="harbor"', "--set", f"store.url={json.dumps(str(store))}",
             "--set", f"temporal.address={json.dumps(_dead_address())}"],
        )  # fmt: skip
        lines = [ln for ln in result.output.splitlines() if ln.strip()]
        assert result.exit_code == 2, result.output
        assert len(lines) == 1 and lines[0].startswith(f"error: {bad}: ") and field in lines[0], lines
        assert not store.exists()  # nothing uploaded, no run
    assert good.exists()
