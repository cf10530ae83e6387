"""The container_pause fault always leaves its sandbox thawed, whatever Docker does: an unpause that hangs
or raises, and a pause that fails half-applied, are healed through the container's freezer cgroup (a fake
cgroup v1/v2 directory here) and Docker's state is brought back to running.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import docker.errors
import pytest
import requests

from durable_rollouts.faults import containers, freezer
from durable_rollouts.faults.chaos import Chaos
from durable_rollouts.faults.schedule import Planned

CID = "c0ffee" * 10 + "abcd"


class FakeContainer:
    """A paused sandbox as docker-py shows it; each Docker call does what its script says next.

    ``ok`` behaves as runc does: unpause thaws a FROZEN freezer (else "container not paused"), pause
    freezes it. ``hang`` blocks until the test ends, ``timeout`` raises the client's read timeout at once,
    ``unable`` fails a pause the way runc does, leaving the cgroup ``FREEZING``; ``gone``: removed.
    """

    def __init__(self, state_file: Path, release: threading.Event, unpauses: list[str], pauses=("ok",)):
        self.id, self.name, self.status, self.labels = CID, "dr-fake-sandbox", "running", {}
        self.attrs = {"State": {"Paused": False}}
        self.state_file, self.release = state_file, release
        self.scripts = {"unpause": list(unpauses), "pause": list(pauses)}
        self.calls: list[str] = []

    def _next(self, call: str) -> str:
        self.calls.append(call)
        how = self.scripts[call].pop(0) if self.scripts[call] else "ok"
        if how == "hang":
            self.release.wait()
            raise requests.exceptions.ReadTimeout("Read timed out. (read timeout=60)")
        if how == "timeout":
            raise requests.exceptions.ReadTimeout("Read timed out. (read timeout=60)")
        if how == "gone":
            raise docker.errors.NotFound("No such container")
        return how

    def pause(self) -> None:
        if self._next("pause") == "unable":
            self.state_file.write_text(freezer.FREEZING)
            raise docker.errors.APIError("OCI runtime pause failed: unable to freeze: unknown")
        self.state_file.write_text(freezer.FROZEN)
        self.attrs["State"]["Paused"] = True

    def unpause(self) -> None:
        self._next("unpause")
        if self.state_file.read_text().strip() != freezer.FROZEN:
            raise docker.errors.APIError("OCI runtime resume failed: container not paused: unknown")
        self.state_file.write_text(freezer.THAWED)
        self.attrs["State"]["Paused"] = False

    def reload(self) -> None:
        self.calls.append("reload")


@pytest.fixture
def cgroup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cgroup v1 mount with the container's freezer, THAWED; the kit's waits made short."""
    d = tmp_path / "freezer" / "docker" / CID
    d.mkdir(parents=True)
    (d / "freezer.state").write_text(freezer.THAWED)
    monkeypatch.setattr(freezer, "CGROUP_ROOT", tmp_path)
    monkeypatch.setattr(containers, "DOCKER_WAIT_S", 0.2, raising=False)
    return d / "freezer.state"


@pytest.fixture
def release() -> Iterator[threading.Event]:
    ev = threading.Event()
    yield ev
    ev.set()  # ends the threads a hung call left behind


@pytest.mark.timeout(10)
@pytest.mark.parametrize("first", ["hang", "timeout"])
def test_an_unpause_that_hangs_or_times_out_is_healed_through_the_freezer(
    cgroup: Path, release: threading.Event, first: str
) -> None:
    c = FakeContainer(cgroup, release, unpauses=[first])
    t0 = time.monotonic()
    with containers.paused(c):
        assert cgroup.read_text() == freezer.FROZEN
    assert cgroup.read_text() == freezer.THAWED
    assert time.monotonic() - t0 < 3.0  # bounded: the hung call is left behind, never waited on
    if first == "timeout":  # Docker still called it paused: frozen again and unpaused through Docker
        assert c.attrs["State"]["Paused"] is False and c.calls.count("unpause") == 2


@pytest.mark.timeout(10)
def test_unpause_says_how_it_healed(cgroup: Path, release: threading.Event) -> None:
    c = FakeContainer(cgroup, release, unpauses=["timeout"])
    containers.pause(c)
    how = containers.unpause(c)
    assert "thawed its freezer directly (FROZEN; docker unpause: ReadTimeout" in how
    assert how.endswith("Docker says running (frozen again and unpaused through Docker)")
    c2 = FakeContainer(cgroup, release, unpauses=[])
    containers.pause(c2)
    assert containers.unpause(c2) == "thawed by docker unpause"


@pytest.mark.timeout(10)
def test_a_hung_unpause_leaves_dockers_state_to_its_late_answer(cgroup: Path, release: threading.Event):
    c = FakeContainer(cgroup, release, unpauses=["hang"])
    containers.pause(c)
    how = containers.unpause(c)
    assert cgroup.read_text() == freezer.THAWED
    assert how.endswith("its docker unpause is still pending"), how
    assert "reload" not in c.calls  # never frozen again behind a call still in flight


@pytest.mark.timeout(10)
def test_a_pause_that_fails_to_freeze_is_left_thawed_and_reported(cgroup: Path, release: threading.Event):
    c = FakeContainer(cgroup, release, unpauses=[], pauses=["unable"])
    failed = pytest.raises(containers.ContainerFaultError, match=r"docker pause failed .*unable to freeze")
    with failed, containers.paused(c):
        pytest.fail("the body of a pause that failed ran")
    assert cgroup.read_text() == freezer.THAWED


@pytest.mark.timeout(10)
def test_a_freezer_that_never_thaws_is_an_error_not_a_silent_pass(
    cgroup: Path, release: threading.Event, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = FakeContainer(cgroup, release, unpauses=["timeout"])
    containers.pause(c)
    monkeypatch.setattr(freezer.Freezer, "state", lambda self: freezer.FREEZING)
    with pytest.raises(containers.ContainerFaultError, match=r"not THAWED after 0\.2 s"):
        containers.unpause(c)


def test_a_gone_container_needs_no_thaw(cgroup: Path, release: threading.Event) -> None:
    c = FakeContainer(cgroup, release, unpauses=["gone"])
    cgroup.parent.joinpath("freezer.state").unlink()
    cgroup.parent.rmdir()
    assert containers.unpause(c) == "the container is gone"


def test_the_freezer_is_found_for_each_layout(tmp_path: Path) -> None:
    v2 = tmp_path / "v2" / "system.slice" / f"docker-{CID}.scope"
    v2.mkdir(parents=True)
    (v2 / "cgroup.freeze").write_text("1")
    (v2 / "cgroup.events").write_text("populated 1\nfrozen 1\n")
    fz = freezer.find(CID, tmp_path / "v2")
    assert fz is not None and fz.v2 and fz.state() == freezer.FROZEN
    (v2 / "cgroup.events").write_text("populated 1\nfrozen 0\n")  # the kernel thaws at once here
    assert fz.set(freezer.THAWED, 0.1) and (v2 / "cgroup.freeze").read_text() == "0"
    assert freezer.find(CID, tmp_path / "none") is None
    (tmp_path / "v1" / "freezer").mkdir(parents=True)
    assert freezer.find(CID, tmp_path / "v1") is None  # v1 mount, no cgroup of that container


@pytest.mark.timeout(20)
async def test_the_injector_logs_how_each_pause_was_healed_and_a_failed_one_as_an_error(
    cgroup: Path, release: threading.Event, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    victims = [
        FakeContainer(cgroup, release, unpauses=["hang"]),
        FakeContainer(cgroup, release, unpauses=[], pauses=["unable"]),
    ]
    monkeypatch.setattr(containers, "run_containers", lambda run_id, dc=None: [victims.pop(0)])
    log = tmp_path / "chaos.jsonl"
    chaos = Chaos(tmp_path, ["run"], log, store=object(), echo=lambda line: None)
    chaos._docker = object()  # never the real daemon
    await chaos.run([Planned(0.0, "container_pause", 0.1), Planned(1.5, "container_pause", 0.1)])
    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert [e["event"] for e in events] == ["fired", "cleared", "error"]
    assert events[1]["healed"].startswith("thawed its freezer directly (FROZEN; docker unpause: no answer")
    assert "docker pause failed (APIError: OCI runtime pause failed: unable to freeze" in events[2]["error"]
    assert cgroup.read_text() == freezer.THAWED
