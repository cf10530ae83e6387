"""faults/netfaults.py and the chaos kit's network kinds: the kinds' syntax (pure), and on this machine (root,
iproute2) a network attached from its description by another `Network`, whose fault the `Chaos` injector
fires, logs and heals: at the fault's end, also when the schedule is cancelled mid-fault, and when
``rollouts chaos`` itself is sent SIGTERM mid-fault."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client

from durable_rollouts.faults.chaos import Chaos, check_kind
from durable_rollouts.faults.netfaults import NetFault, parse
from durable_rollouts.faults.netns import LinkFault, NetnsError, Network, available, namespaces
from durable_rollouts.faults.schedule import Planned


@pytest.mark.parametrize(
    ("kind", "fault"),
    [
        ("partition:worker-a/temporal", NetFault("partition", "worker-a", "temporal")),
        ("latency:engine", NetFault("latency", "engine")),
        ("latency:engine=50", NetFault("latency", "engine", None, 50.0)),
        ("loss:store=2.5", NetFault("loss", "store", None, 2.5)),
        ("bandwidth:sandbox=800", NetFault("bandwidth", "sandbox", None, 800.0)),
        ("worker_kill", None),
        ("pg_restart", None),
    ],
)
def test_a_network_kind_names_its_parts_and_size(kind: str, fault: NetFault | None) -> None:
    assert parse(kind) == fault
    check_kind(kind)


def test_a_link_kind_without_a_size_gets_the_default_and_each_maps_to_its_link_fault() -> None:
    assert NetFault("latency", "a").link() == LinkFault(delay_ms=200, jitter_ms=50)
    assert NetFault("loss", "a", None, 3).link() == LinkFault(loss_pct=3)
    assert NetFault("bandwidth", "a").link() == LinkFault(rate_kbit=1000)


@pytest.mark.parametrize(
    ("kind", "why"),
    [
        ("partition:worker-a", "two different parts"),
        ("partition:a/a", "two different parts"),
        ("partition:a/b=3", "two different parts"),
        ("latency:a/b", "one part's link"),
        ("latency:a=fast", "not a number"),
        ("loss:a=120", "at most 100"),
        ("bandwidth:a=0", "> 0"),
        ("latency:", "expected partition:A/B"),
    ],
)
def test_a_malformed_network_kind_is_refused_in_one_line(kind: str, why: str) -> None:
    with pytest.raises(ValueError, match=f"fault kind {kind!r}") as e:
        parse(kind)
    assert why in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError):
        check_kind(kind)


def test_an_unknown_kind_lists_the_kinds_and_the_network_forms() -> None:
    with pytest.raises(ValueError, match=r"^unknown worker_nap; kinds: ") as e:
        check_kind("worker_nap")
    assert "pg_restart" in str(e.value) and "partition:A/B" in str(e.value)


PORT = 7100
LISTEN = (
    "import socket; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
    f"s.bind(('0.0.0.0', {PORT})); s.listen(64)\n"
    "while True: s.accept()[0].close()"
)


@pytest.fixture
def net() -> Iterator[Network]:
    if why := available():
        pytest.skip(why)
    network = Network()
    try:
        for name in ("worker", "temporal"):
            network.add_host(name)
        network.spawn("temporal", [sys.executable, "-c", LISTEN])
        yield network
    finally:
        made = network.made
        assert network.close() == []
        assert not set(made) & set(namespaces())


def _reaches(net: Network) -> bool:
    """Whether the worker opens a connection to the temporal host's listener (retrying while it starts)."""
    probe = ["bash", "-c", f"exec 3<>/dev/tcp/{net.hosts['temporal'].address}/{PORT}"]
    for _ in range(30):
        if net.run("worker", ["timeout", "2", *probe]).returncode == 0:
            return True
        net.run("worker", ["sleep", "0.1"])
    return False


def _blackholes(net: Network, host: str) -> str:
    return net.run(host, ["ip", "route", "show", "type", "blackhole"]).stdout


def _chaos(tmp_path: Path, net: Network) -> Chaos:
    attached = Network.attach(json.loads(json.dumps(net.describe())))
    return Chaos(
        tmp_path, [], tmp_path / "chaos.jsonl", store=object(), network=attached, echo=lambda _: None
    )


def test_an_attached_network_faults_the_parts_of_another_and_deletes_nothing(net: Network) -> None:
    attached = Network.attach(net.describe())
    assert attached.hosts == net.hosts and attached.made == []
    attached.cut("worker", "temporal")
    assert net.hosts["temporal"].address in _blackholes(net, "worker")
    assert attached.close() == []  # heals what it injected; the namespaces stay the other network's
    assert _blackholes(net, "worker") == "" and set(net.made) <= set(namespaces())
    assert _reaches(net)
    with pytest.raises(NetnsError, match="does not exist"):
        Network.attach({**net.describe(), "tag": "nosuch"})


def test_chaos_fires_a_partition_logs_it_and_heals_it_at_its_end(net: Network, tmp_path: Path) -> None:
    assert _reaches(net)
    chaos = _chaos(tmp_path, net)
    seen: list[bool] = []

    async def go() -> None:
        run = asyncio.ensure_future(chaos.run([Planned(0.0, "partition:worker/temporal", 1.5)]))
        while not chaos.events:
            await asyncio.sleep(0.05)
        seen.append(await asyncio.to_thread(_reaches_once, net))
        await run

    asyncio.run(go())
    assert seen == [False]
    assert [(e["event"], e["target"]) for e in chaos.events] == [
        ("fired", "worker/temporal"),
        ("cleared", "worker/temporal"),
    ]
    assert chaos.events[1]["t"] - chaos.events[0]["t"] >= 1.5
    lines = [json.loads(line) for line in (tmp_path / "chaos.jsonl").read_text().splitlines()]
    assert [r["event"] for r in lines] == ["fired", "cleared"]
    assert _blackholes(net, "worker") == "" and _reaches(net)


def test_a_cancelled_schedule_heals_the_partition_in_flight(net: Network, tmp_path: Path) -> None:
    chaos = _chaos(tmp_path, net)

    async def go() -> None:
        run = asyncio.ensure_future(chaos.run([Planned(0.0, "partition:worker/temporal", 600.0)]))
        while not chaos.events:
            await asyncio.sleep(0.05)
        assert _blackholes(net, "worker") != ""
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run

    asyncio.run(go())
    assert _blackholes(net, "worker") == "" and _blackholes(net, "temporal") == ""
    assert [(e["event"], e.get("cut_short")) for e in chaos.events] == [("fired", None), ("cleared", True)]
    assert _reaches(net)


@pytest.mark.timeout(120)
async def test_rollouts_chaos_sigtermed_mid_fault_heals_it_before_it_exits(
    net: Network, tmp_path: Path, client: Client
) -> None:
    from durable_rollouts.store import RunStore

    home = tmp_path / "home"
    RunStore(home).register_run("victim", "{}", "h")
    described = tmp_path / "network.json"
    described.write_text(json.dumps(net.describe()))
    log = tmp_path / "chaos.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TEMPORAL_", "ROLLOUTS_"))}
    env |= {"ROLLOUTS_HOME": str(home), "TEMPORAL_ADDRESS": client.service_client.config.target_host,
            "TEMPORAL_CONFIG_FILE": str(tmp_path / "no-profile.toml")}  # fmt: skip
    argv = [sys.executable, "-m", "durable_rollouts.cli.rollouts", "chaos", "victim", "--kinds",
            "partition:worker/temporal", "--network", str(described), "--duration", "1.5", "--every", "1,1",
            "--fault-s", "600,600", "--no-docker", "--wait", "1", "--log", str(log)]  # fmt: skip
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not (log.exists() and '"fired"' in log.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0].decode()[-2000:]
            await asyncio.sleep(0.1)
        assert net.hosts["temporal"].address in _blackholes(net, "worker")
        proc.send_signal(signal.SIGTERM)
        out = (await asyncio.to_thread(proc.communicate, timeout=30))[0].decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0, out
    assert _blackholes(net, "worker") == "" and _blackholes(net, "temporal") == "", out
    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(e["event"], e.get("cut_short")) for e in events] == [("fired", None), ("cleared", True)], out


def _connect_s(net: Network) -> float:
    """Seconds the worker takes to open a connection to the temporal host's listener."""
    address = net.hosts["temporal"].address
    probe = (
        "import socket, time; t = time.monotonic(); "
        f"socket.create_connection(('{address}', {PORT}), timeout=5).close(); print(time.monotonic() - t)"
    )
    done = net.run("worker", [sys.executable, "-c", probe])
    assert done.returncode == 0, done.stderr
    return float(done.stdout)


def test_chaos_slows_and_caps_a_parts_link_and_restores_it(net: Network, tmp_path: Path) -> None:
    assert _reaches(net)
    chaos = _chaos(tmp_path, net)
    seen: dict[str, Any] = {}

    async def go() -> None:
        plan = [Planned(0.0, "latency:worker=150", 3.0), Planned(4.0, "bandwidth:worker=800", 1.5)]
        run = asyncio.ensure_future(chaos.run(plan))
        while not chaos.events:
            await asyncio.sleep(0.05)
        seen["slow"] = await asyncio.to_thread(_connect_s, net)
        while len(chaos.events) < 3:
            await asyncio.sleep(0.05)
        seen["capped"] = net.qdiscs("worker")
        await run

    asyncio.run(go())
    assert [(e["event"], e["kind"]) for e in chaos.events] == [
        ("fired", "latency:worker=150"),
        ("cleared", "latency:worker=150"),
        ("fired", "bandwidth:worker=800"),
        ("cleared", "bandwidth:worker=800"),
    ]
    assert seen["slow"] >= 0.3, seen  # the SYN out and the SYN-ACK back, 150 ms each
    assert "tbf" in str(seen["capped"]) and "rate 800Kbit" in str(seen["capped"]), seen
    assert "tbf" not in net.qdiscs("worker") and "netem" not in net.qdiscs("worker")
    assert _connect_s(net) < 0.3


def test_a_network_kind_without_a_network_is_skipped_with_why(tmp_path: Path) -> None:
    chaos = Chaos(tmp_path, [], tmp_path / "c.jsonl", store=object(), echo=lambda _: None)
    asyncio.run(chaos.run([Planned(0.0, "loss:engine", 1.0)]))
    assert [e["event"] for e in chaos.events] == ["skipped"]
    assert "--network" in chaos.events[0]["why"]


def _reaches_once(net: Network) -> bool:
    probe = ["bash", "-c", f"exec 3<>/dev/tcp/{net.hosts['temporal'].address}/{PORT}"]
    return net.run("worker", ["timeout", "1", *probe]).returncode == 0
