"""The ledger per kind of rollout: violations classed as lost, duplicated or leaked (gateway sockets and
image builds left by a run's rollouts included) and summed per kind, each kind apart from the others."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from durable_rollouts.faults.ledger import check_builds, check_sockets, check_store, tally, violation_class
from durable_rollouts.gateway.server import SOCKET_NAME
from durable_rollouts.sandboxes.base import GATEWAY_ROOT_ENV, gateway_dir
from durable_rollouts.sandboxes.images import ImageBuilds
from durable_rollouts.store import RunStore


def _run(store: RunStore, run: str, records: list[tuple[int, str, float | None]], groups: int = 1) -> None:
    """A run of ``groups`` groups of two; ``records`` are (slot, outcome, reward) rows of group 0."""
    store.register_run(run, json.dumps({"run": {"num_groups": groups, "group_size": 2}}), "h")
    for i, outcome, reward in records:
        store.put_rollout({
            "rollout_id": f"{run}/g000000/{i}", "run_id": run, "group_id": "g000000", "task_id": "t",
            "sample_index": i % 2, "env": "math", "outcome": outcome, "reason": None, "reward": reward,
            "scorable": int(reward is not None), "advantage": None, "prompt_length": 1, "num_tokens": 2,
            "sampling_json": "{}", "extra_json": "{}",
        })  # fmt: skip
    scorable = sum(1 for i, _, r in records if r is not None and i < 2)
    rec = {"run_id": run, "group_id": "g000000", "task_id": "t", "size": 2, "scorable": scorable, "failed": 0}
    store.put_group(run, "g000000", "t", rec)


def test_violations_are_classed_and_summed_per_kind(tmp_path: Path) -> None:
    store = RunStore(tmp_path)
    _run(store, "soak-math-000", [(0, "completed", 1.0), (1, "completed", 0.0)])  # clean
    _run(store, "soak-math-001", [(0, "completed", 1.0)], groups=2)  # slot 1, group 1 and its 2 slots: 4 lost
    _run(store, "soak-harbor-000", [(0, "completed", 1.0), (1, "completed", 1.0), (2, "completed", 1.0)])
    reports = [check_store(store, r) for r in ("soak-math-000", "soak-math-001", "soak-harbor-000")]
    assert [v.rule for v in reports[2].violations] == ["unknown-rollout"]  # slot 2 of a group of 2
    by_kind = tally(reports, lambda run_id: run_id.split("-")[1])
    assert list(by_kind) == ["harbor", "math"]
    assert by_kind["math"].as_dict() == {
        "runs": 2, "rollouts": 3, "successes": 3, "lost": 4, "duplicated": 0, "leaked": 0, "other": 0,
    }  # fmt: skip
    assert by_kind["harbor"].as_dict() == {
        "runs": 1, "rollouts": 3, "successes": 3, "lost": 0, "duplicated": 1, "leaked": 0, "other": 0,
    }  # fmt: skip
    assert [violation_class(r) for r in ("leaked-socket", "leaked-build", "feed-books")] == [
        "leaked",
        "leaked",
        "other",
    ]


def test_a_build_left_building_by_a_rollout_of_the_run_is_a_leak(tmp_path: Path) -> None:
    store = RunStore(tmp_path)
    builds = ImageBuilds(store.db)
    assert builds.claim("local", "img:a", "run-a/g000000/0", "task a", 0.0)[0] == "build"
    assert builds.claim("local", "img:b", "run-a/g000000/1", "task b", 0.0)[0] == "build"
    builds.finish("local", "img:b", "run-a/g000000/1", True, "ok", None)
    assert builds.claim("local", "img:c", "run-b/g000000/0", "task c", 0.0)[0] == "build"  # another run's
    lines = [v.line for v in check_builds(store, ["run-a/g000000/0", "run-a/g000000/1"])]
    assert lines == ["leaked-build: image img:a on local still building for run-a/g000000/0"]
    builds.finish("local", "img:a", "run-a/g000000/0", False, "log", "failed")
    assert check_builds(store, ["run-a/g000000/0", "run-a/g000000/1"]) == []


def test_a_gateway_socket_left_in_its_folder_is_a_leak(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(GATEWAY_ROOT_ENV, str(tmp_path / "gw"))
    ids = ["run-a/g000000/0", "run-a/g000000/1"]
    folder = Path(gateway_dir(ids[1]))
    folder.mkdir(parents=True)
    assert check_sockets(ids) == []  # a folder without a socket: the gateway stopped
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(str(folder / SOCKET_NAME))
        (v,) = check_sockets(ids)
        assert v.rule == "leaked-socket" and ids[1] in v.detail
    finally:
        sock.close()
