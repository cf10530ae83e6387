"""The chaos soak's cluster layout (bench/chaos_cluster.py), its pure parts: network faults' durations redrawn
(seeded, only theirs), a part's command line moved to its host's address, the driver's state file and
command line, and every default fault kind of the layout known to the kit and naming the cluster's parts.
The soak itself is not run here."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import chaos_cluster
from bench.chaos_cluster import DRIVER_ARGS, NETWORK_KINDS, NETWORK_S, State, at_host, driver_argv, stretch
from durable_rollouts.faults import netfaults
from durable_rollouts.faults.chaos import check_kind
from durable_rollouts.faults.schedule import Planned, schedule

PARTS = chaos_cluster.PARTS


def _state(tmp_path: Path) -> State:
    return State(
        home=str(tmp_path / "home"), network_file=str(tmp_path / "network.json"),
        netns={p: f"dr-abc-{p}" for p in PARTS},
        addresses={p: f"10.77.0.{i + 2}" for i, p in enumerate(PARTS)},
        store_url="postgresql://postgres@10.77.0.3:5432/postgres", docker_url="tcp://10.77.0.6:2375",
    )  # fmt: skip


def test_network_faults_last_within_the_span_and_the_rest_keep_the_schedules_durations() -> None:
    plan = [Planned(1.0, "worker_freeze", 4.0), Planned(2.0, "partition:worker/store", 3.0),
            Planned(3.0, "latency:worker=200", 2.5), Planned(4.0, "publish", 0.0)]  # fmt: skip
    out = stretch(plan, seed=7)
    assert [(p.at_s, p.kind) for p in out] == [(p.at_s, p.kind) for p in plan]
    assert out[0] == plan[0] and out[3] == plan[3]
    assert all(NETWORK_S[0] <= p.duration_s <= NETWORK_S[1] for p in out[1:3])
    assert stretch(plan, seed=7) == out  # seeded
    assert stretch(plan, seed=8) != out


def test_every_default_kind_of_the_cluster_layout_is_known_and_names_its_parts() -> None:
    for kind in NETWORK_KINDS:
        check_kind(kind)
        fault = netfaults.parse(kind)
        assert fault is not None
        assert {fault.a, fault.b} - {None} <= set(PARTS), kind
    assert {k.partition(":")[0] for k in NETWORK_KINDS} == set(netfaults.LINK_KINDS)
    partitions = {netfaults.parse(k).b for k in NETWORK_KINDS if k.startswith("partition:")}  # type: ignore[union-attr]
    assert partitions == {"temporal", "store", chaos_cluster.SANDBOX_HOST, "engine"}


def test_a_plan_of_the_cluster_kinds_caps_partitions_near_30_seconds() -> None:
    plan = stretch(schedule(0, list(NETWORK_KINDS), 1800), 0)
    assert plan and all(p.duration_s <= 30.0 for p in plan)


def test_a_part_is_moved_to_its_hosts_address() -> None:
    assert at_host(["vllm", "--host", "127.0.0.1", "--port", "8000"], "--host", "10.77.0.4") == [
        "vllm", "--host", "10.77.0.4", "--port", "8000"]  # fmt: skip
    with pytest.raises(ValueError, match="no --ip VALUE"):
        at_host(["temporal", "server", "--ip"], "--ip", "10.77.0.2")


def test_the_driver_reads_the_state_its_parent_wrote(tmp_path: Path) -> None:
    state = _state(tmp_path)
    state.save(tmp_path / "state.json")
    back = State.load(tmp_path / "state.json")
    assert back == state
    assert back.temporal_address == "10.77.0.2:7233" and back.engine_url == "http://10.77.0.4:8000"
    (tmp_path / "bad.json").write_text('{"home": "x"}')
    with pytest.raises(SystemExit, match=r"driver state .*bad.json: TypeError"):
        State.load(tmp_path / "bad.json")


def test_the_driver_runs_the_soak_again_inside_the_driver_namespace(tmp_path: Path) -> None:
    state = _state(tmp_path)
    given = ["--layout", "cluster", "--minutes", "4", "--out", "given.json"]
    argv = driver_argv(state, tmp_path / "state.json", tmp_path / "out.json", given)
    assert argv[:3] == ["nsenter", "--net=/run/netns/dr-abc-driver", "--"]
    assert argv[4].endswith("bench/chaos_soak.py")
    tail = argv[5:]
    assert tail[: len(given)] == given  # the user's command first (the result's "command" strips the rest)
    assert tail[len(given) :] == [DRIVER_ARGS[0], state.home, DRIVER_ARGS[1], str(tmp_path / "out.json"),
                                  DRIVER_ARGS[2], str(tmp_path / "state.json")]  # fmt: skip
    assert tail[: -2 * len(DRIVER_ARGS)] == given
