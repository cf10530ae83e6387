"""faults/netns.py: the tc commands a link fault installs (pure), and on this machine (root, iproute2) real
namespaces on a bridge: two hosts talk, a partition cuts only the pair it names, latency and loss act on the
link and each is healed, and close leaves no namespace and no process behind."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from durable_rollouts.faults.netns import LinkFault, NetnsError, Network, available, namespaces

PORT = 7000
LISTEN = (
    "import socket; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
    f"s.bind(('0.0.0.0', {PORT})); s.listen(64)\n"
    "while True: s.accept()[0].close()"
)
PROBE = (
    "import socket, sys, time; t = time.monotonic()\n"
    "try: socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()\n"
    "except OSError as e: print('unreachable', e); sys.exit(1)\n"
    "print(time.monotonic() - t)"
)


def test_a_delay_with_jitter_and_loss_is_one_netem_qdisc() -> None:
    cmds = LinkFault(delay_ms=50, jitter_ms=5, loss_pct=2.5).tc_commands("eth0")
    assert cmds == [
        [
            "qdisc",
            "add",
            "dev",
            "eth0",
            "root",
            "handle",
            "1:",
            "netem",
            "delay",
            "50ms",
            "5ms",
            "loss",
            "2.5%",
        ]
    ]


def test_a_rate_alone_is_a_tbf_and_with_netem_it_sits_below_it() -> None:
    alone = LinkFault(rate_kbit=800).tc_commands("p3")
    assert alone == [
        ["qdisc", "add", "dev", "p3", "root", "handle", "1:", "tbf", "rate", "800kbit", "burst", "1600",
         "latency", "400ms"],
    ]  # fmt: skip
    both = LinkFault(delay_ms=10, rate_kbit=80_000).tc_commands("p3")
    assert both[0][:8] == ["qdisc", "add", "dev", "p3", "root", "handle", "1:", "netem"]
    assert both[1][:8] == ["qdisc", "add", "dev", "p3", "parent", "1:1", "handle", "10:"]
    assert both[1][8:12] == ["tbf", "rate", "80000kbit", "burst"] and both[1][12] == "100000"
    assert LinkFault().tc_commands("eth0") == []


@pytest.mark.parametrize(
    "kwargs", [{"delay_ms": -1}, {"loss_pct": 101}, {"rate_kbit": 0}, {"jitter_ms": -0.5}]
)
def test_a_fault_out_of_range_is_refused_in_one_line(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=r"^link fault LinkFault\(") as e:
        LinkFault(**kwargs)  # type: ignore[arg-type]
    assert "\n" not in str(e.value)


def test_a_subnet_that_is_not_an_ipv4_slash_24_is_refused() -> None:
    with pytest.raises(ValueError, match="IPv4 /24"):
        Network(subnet="10.0.0.0/16")


@pytest.fixture
def net() -> Iterator[Network]:
    if why := available():
        pytest.skip(why)
    network = Network()
    try:
        for name in ("a", "b", "c"):
            network.add_host(name)
        for name in ("b", "c"):
            network.spawn(name, [sys.executable, "-c", LISTEN])
        yield network
    finally:
        made = network.made
        assert network.close() == []
        assert not set(made) & set(namespaces())


def _connect(net: Network, src: str, dst: str, timeout: float = 2.0) -> float | None:
    """Seconds ``src`` takes to open a connection to ``dst``'s listener; None: it cannot."""
    for _ in range(50):  # the listener may still be starting: refused, not timed out
        done = net.run(src, [sys.executable, "-c", PROBE, net.hosts[dst].address, str(PORT), str(timeout)])
        if done.returncode == 0:
            return float(done.stdout)
        if "refused" not in done.stdout:
            return None
        net.run(src, ["sleep", "0.1"])
    return None


def test_hosts_talk_over_the_bridge_and_a_partition_cuts_only_its_pair(net: Network) -> None:
    assert _connect(net, "a", "b") is not None and _connect(net, "a", "c") is not None
    with net.partitioned("a", "b"):
        assert _connect(net, "a", "b", timeout=1) is None
        assert net.run("b", ["ip", "route", "get", net.hosts["a"].address]).returncode != 0  # b has none to a
        assert _connect(net, "a", "c") is not None and _connect(net, "c", "b") is not None
    assert _connect(net, "a", "b") is not None


def test_latency_loss_and_a_rate_cap_act_on_the_link_and_are_healed(net: Network) -> None:
    """netem where the kernel has it, else the user-space wire (faults/linkrelay.py): the same behaviour."""
    base = _connect(net, "a", "b")
    assert base is not None
    with net.degraded("a", LinkFault(delay_ms=150)):
        took = _connect(net, "a", "b", timeout=5)
        assert took is not None and took >= 0.3, took  # the SYN out and the SYN-ACK back, 150 ms each
        assert _connect(net, "b", "c") is not None  # other links untouched
    with net.degraded("a", LinkFault(loss_pct=100)):
        assert _connect(net, "a", "b", timeout=1) is None
    with net.degraded("a", LinkFault(rate_kbit=1000)):
        assert "tbf" in net.qdiscs("a") and "rate 1Mbit" in net.qdiscs("a")
        assert _connect(net, "a", "b") is not None
    assert "tbf" not in net.qdiscs("a") and "netem" not in net.qdiscs("a")
    healed = _connect(net, "a", "b", timeout=5)
    assert healed is not None and healed < 0.3, healed


def test_a_fault_replaced_and_healed_twice_leaves_the_link_as_it_was(net: Network) -> None:
    net.degrade("a", LinkFault(delay_ms=20, loss_pct=1))
    net.degrade("a", LinkFault(delay_ms=10, rate_kbit=5000))  # replaces, never stacks
    assert "tbf" in net.qdiscs("a")
    net.heal("a")
    net.heal("a")
    assert "tbf" not in net.qdiscs("a") and _connect(net, "a", "b") is not None
    ports = net.run("a", ["ip", "-n", net.switch, "-o", "link", "show", "master", "br0"]).stdout
    assert sum(f" {h.port}@" in ports for h in net.hosts.values()) == 3, (
        ports
    )  # every port back on the bridge


def test_close_stops_its_processes_and_deletes_its_namespaces() -> None:
    if why := available():
        pytest.skip(why)
    network = Network()
    host = network.add_host("x")
    proc = network.spawn(host, ["sleep", "600"])
    assert host.netns in namespaces() and network.switch in namespaces()
    assert network.close() == []
    assert proc.poll() is not None
    assert host.netns not in namespaces() and network.switch not in namespaces()
    assert network.close() == []  # idempotent


def test_an_unknown_host_is_refused_in_one_line() -> None:
    if why := available():
        pytest.skip(why)
    with (
        Network() as network,
        pytest.raises(NetnsError, match=r"^no host 'nowhere' in network \w+ \(hosts: \)$"),
    ):
        network.cut("nowhere", "elsewhere")
