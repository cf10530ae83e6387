"""`rollouts runs`: the runs of a home's store, newest first, with their state, counts and start time, from
the store alone (no Temporal); ``--json`` for scripts."""

from __future__ import annotations

import json
import time
from datetime import datetime
from pathlib import Path

import pytest
from typer.testing import CliRunner

from durable_rollouts.cli.rollouts import app
from durable_rollouts.config.models import Config, RunConfig
from durable_rollouts.store import RunStore

T0 = 1_800_000_000.0


def _rollout(store: RunStore, run: str, group: str, i: int, outcome: str) -> None:
    store.put_rollout({
        "rollout_id": f"{run}/{group}/{i}", "run_id": run, "group_id": group, "task_id": "t",
        "sample_index": i, "env": "math", "outcome": outcome, "reason": None, "reward": None, "scorable": 0,
        "advantage": None, "prompt_length": 1, "num_tokens": 2, "sampling_json": "{}", "extra_json": "{}",
    })  # fmt: skip


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A home whose store holds three runs, registered oldest to newest in an order their ids do not sort
    in: ``b-old`` finished (2 groups x 2, all recorded), ``c-mid`` running (1 of 2 groups recorded, one
    rollout failed), ``a-new`` running with nothing recorded yet."""
    store = RunStore(tmp_path)
    runs = [("b-old", 2, 2, "math"), ("c-mid", 2, 2, "coding"), ("a-new", 3, 4, "math")]
    for k, (run, groups, size, env) in enumerate(runs):
        cfg = Config(run=RunConfig(num_groups=groups, group_size=size, env=env))
        with monkeypatch.context() as m:
            m.setattr(time, "time", lambda k=k: T0 + 60 * k)
            store.register_run(run, cfg.model_dump_json(), "h")
    for g in ("g0", "g1"):
        for i in range(2):
            _rollout(store, "b-old", g, i, "completed")
        store.put_group("b-old", g, "t", {"group_id": g})
    _rollout(store, "c-mid", "g0", 0, "completed")
    _rollout(store, "c-mid", "g0", 1, "failed")
    store.put_group("c-mid", "g0", "t", {"group_id": "g0"})
    _rollout(store, "c-mid", "g1", 0, "truncated")
    store.finish_run("b-old")
    store.close()
    monkeypatch.setenv("ROLLOUTS_HOME", str(tmp_path))
    monkeypatch.delenv("ROLLOUTS_STORE", raising=False)
    return tmp_path


def _invoke(*args: str) -> str:
    result = CliRunner().invoke(app, ["runs", *args], terminal_width=200)
    assert result.exit_code == 0, result.output
    return result.stdout


def test_json_lists_the_runs_newest_first_with_state_and_counts(home: Path) -> None:
    rows = json.loads(_invoke("--json"))
    assert [r["run_id"] for r in rows] == ["a-new", "c-mid", "b-old"]
    assert [r["state"] for r in rows] == ["running", "running", "finished"]
    new, mid, old = rows
    assert set(old) == {
        "run_id", "state", "env", "started_at", "finished_at", "outcomes",
        "rollouts_recorded", "rollouts_total", "groups_done", "total_groups",
    }  # fmt: skip
    assert (old["outcomes"], old["rollouts_recorded"], old["rollouts_total"]) == ({"completed": 4}, 4, 4)
    assert (old["groups_done"], old["total_groups"], old["env"]) == (2, 2, "math")
    assert old["finished_at"] is not None and mid["finished_at"] is None
    assert mid["outcomes"] == {"completed": 1, "failed": 1, "truncated": 1}
    assert (mid["rollouts_recorded"], mid["rollouts_total"], mid["groups_done"], mid["env"]) == (
        3,
        4,
        1,
        "coding",
    )
    assert (new["outcomes"], new["rollouts_recorded"], new["rollouts_total"], new["groups_done"]) == (
        {},
        0,
        12,
        0,
    )
    assert datetime.fromisoformat(new["started_at"]).timestamp() == T0 + 120
    assert datetime.fromisoformat(old["started_at"]).timestamp() == T0


def test_the_text_table_has_one_line_per_run_newest_first(home: Path) -> None:
    header, *lines = _invoke().splitlines()
    assert header.split()[:5] == ["run", "state", "env", "rollouts", "groups"]
    assert [line.split()[:5] for line in lines] == [
        ["a-new", "running", "math", "0/12", "0/3"],
        ["c-mid", "running", "coding", "3/4", "1/2"],
        ["b-old", "finished", "math", "4/4", "2/2"],
    ]
    started = datetime.fromtimestamp(T0).strftime("%Y-%m-%d %H:%M:%S")  # local time
    assert started in lines[2] and lines[2].endswith("completed=4")
    assert lines[1].endswith("completed=1 failed=1 truncated=1") and lines[0].endswith("-")


def test_a_home_without_a_store_has_no_runs_and_gets_none_created(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ROLLOUTS_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("ROLLOUTS_STORE", raising=False)
    assert json.loads(_invoke("--json")) == []
    result = CliRunner().invoke(app, ["runs"])
    assert result.exit_code == 0 and result.stdout == "" and "no runs" in result.stderr
    assert not (tmp_path / "home" / "store.sqlite").exists()


def test_help_says_what_each_state_means() -> None:
    text = " ".join(CliRunner().invoke(app, ["runs", "--help"], terminal_width=200).output.split())
    for state in ("running (", "finished (", "cancelled (", "stopped ("):
        assert state in text
