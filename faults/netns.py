"""Hosts of a cluster on one machine: network namespaces joined by a bridge, and the link faults between them.

Layout: a *switch* namespace holds a bridge (``br0``); each host is a namespace of its own whose ``eth0`` (one
end of a veth pair, with the host's address) reaches the bridge through the pair's other end, which lives in
the switch namespace. Nothing is added to the root namespace: no address, no link, no route.

Faults, each healed by its own context manager's exit (or `Network.heal`):

- partition of two hosts: a ``blackhole`` route to the other's address in each (everything else still flows);
- latency, loss and bandwidth of a host's link: ``tc qdisc ... netem`` (delay, jitter, loss) with a ``tbf``
  (rate) below it, on both ends of the host's veth pair, so both directions see them. On a kernel built
  without ``sch_netem``, delay, jitter and loss come from a user-space wire (faults/linkrelay.py) spliced
  between the host's link and the bridge (the ``tbf`` stays in the kernel); each host's link then carries
  one segment per frame (``gso_max_segs 1``), set when the host is added.

Invariants: names carry a random tag, so two networks (two test runs) never share a namespace name; every
namespace and process made here is recorded on the `Network`, and `Network.close` stops the processes (by
pid, then their process group, which each was started as the leader of) and deletes the namespaces (which
deletes their links), idempotently and also after a failure halfway through building.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

__all__ = [
    "UNNAMED", "Host", "LinkFault", "NetnsError", "Network", "available", "enter", "namespaces", "netns_of",
]  # fmt: skip

UNNAMED = "<unnamed>"
"""What `netns_of` returns for a namespace other than this process's own that has no name."""


class NetnsError(RuntimeError):
    """A namespace, link or fault could not be made or removed (one line: the command and its error)."""


def available() -> str | None:
    """None when this process can make network namespaces, else why not (one line)."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed (apt-get install iproute2)"
    if shutil.which("nsenter") is None:
        return "nsenter is not installed (apt-get install util-linux)"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_SYS_ADMIN and CAP_NET_ADMIN)"
    return None


def enter(netns: str) -> list[str]:
    """The argv prefix that runs a program in network namespace ``netns``, and only there: ``nsenter``
    enters its network namespace and execs the program (same pid). Unlike ``ip netns exec`` it makes no
    mount namespace, whose fresh /sys hides the cgroup mounts a Docker daemon needs."""
    return ["nsenter", f"--net=/run/netns/{netns}", "--"]


def netns_of(pid: int) -> str | None:
    """The named network namespace (``/run/netns/NAME``) process ``pid`` runs in, as ``ip netns identify``
    finds it (the same inode); None when it is this process's own, `UNNAMED` for another one without a name.

    Raises:
        OSError: ``pid`` is not running (or its namespace cannot be read).
    """
    theirs = os.stat(f"/proc/{pid}/ns/net").st_ino
    run = Path("/run/netns")
    for ns in sorted(run.iterdir()) if run.is_dir() else []:
        with contextlib.suppress(OSError):
            if os.stat(ns).st_ino == theirs:
                return ns.name
    return None if theirs == os.stat("/proc/self/ns/net").st_ino else UNNAMED


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {done.stderr.strip() or done.returncode}")
    return done


def _tc(ns: str, *args: str, check: bool = True) -> None:
    done = subprocess.run([*enter(ns), "tc", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise NetnsError(f"tc {' '.join(args)} in {ns}: {done.stderr.strip() or done.returncode}")


@dataclass(frozen=True)
class Host:
    """One host: its namespace, its address on the bridge, and the switch-side end of its link."""

    name: str
    """The part's name (``temporal``, ``worker-a``, ...)."""
    netns: str
    """The namespace's name (``ip netns exec NETNS ...``)."""
    address: str
    """Its IPv4 address on the bridge."""
    port: str
    """The switch-side veth end (in the switch namespace); the host's own end is ``eth0``."""


@dataclass(frozen=True)
class LinkFault:
    """What a host's link suffers, both directions: extra delay (and jitter), a loss share, a rate cap."""

    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss_pct: float = 0.0
    rate_kbit: int | None = None

    def __post_init__(self) -> None:
        if self.delay_ms < 0 or self.jitter_ms < 0 or not 0 <= self.loss_pct <= 100:
            raise ValueError(f"link fault {self}: delay and jitter must be >= 0, loss within 0..100")
        if self.rate_kbit is not None and self.rate_kbit <= 0:
            raise ValueError(f"link fault {self}: rate_kbit must be > 0")

    @property
    def needs_netem(self) -> bool:
        """Whether it delays or drops (else it only caps the rate)."""
        return bool(self.delay_ms or self.jitter_ms or self.loss_pct)

    def tc_commands(self, dev: str, netem_ok: bool = True) -> list[list[str]]:
        """The ``tc`` arguments that install this fault on ``dev`` (empty: no fault); with ``netem_ok``
        False, only the rate cap (the rest is the user-space wire's)."""
        netem: list[str] = []
        if self.delay_ms or self.jitter_ms:
            netem += ["delay", f"{self.delay_ms:g}ms"] + ([f"{self.jitter_ms:g}ms"] if self.jitter_ms else [])
        if self.loss_pct:
            netem += ["loss", f"{self.loss_pct:g}%"]
        if not netem_ok:
            netem = []
        tbf = None
        if self.rate_kbit is not None:  # burst: at least one MTU-sized packet, else nothing passes
            burst = max(1600, self.rate_kbit * 1000 // 8 // 100)
            tbf = ["tbf", "rate", f"{self.rate_kbit}kbit", "burst", str(burst), "latency", "400ms"]
        if netem and tbf:
            return [
                ["qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", *netem],
                ["qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *tbf],
            ]
        if netem:
            return [["qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", *netem]]
        if tbf:
            return [["qdisc", "add", "dev", dev, "root", "handle", "1:", *tbf]]
        return []


@dataclass
class Network:
    """A switch namespace and the hosts attached to it; `close` removes all of it.

    ``subnet``: the hosts' /24 (addresses .2, .3, ... in the order added); it lives only inside these
    namespaces, so two networks may use the same one.
    """

    subnet: str = "10.77.0.0/24"
    tag: str = field(default_factory=lambda: secrets.token_hex(3))
    hosts: dict[str, Host] = field(default_factory=dict)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    _made: list[str] = field(default_factory=list)
    _stop_signals: dict[int, int] = field(default_factory=dict)
    _relays: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    _netem: bool | None = None
    _cuts: set[tuple[str, str]] = field(default_factory=set)
    _degraded: set[str] = field(default_factory=set)
    attached: bool = False
    """Made by `attach`: the namespaces are another `Network`'s (this one only injects and heals faults;
    its `close` stops only the processes it started itself and deletes nothing)."""

    def __post_init__(self) -> None:
        net = ipaddress.ip_network(self.subnet)
        if net.version != 4 or net.prefixlen != 24:
            raise ValueError(f"subnet {self.subnet!r}: an IPv4 /24 is expected")
        self._net = net
        self.switch = f"dr-{self.tag}-switch"
        if self.attached:
            return
        self._netns_add(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")

    def describe(self) -> dict[str, object]:
        """What another process needs to fault this network (`attach`): its tag, subnet and hosts."""
        hosts = {
            h.name: {"netns": h.netns, "address": h.address, "port": h.port} for h in self.hosts.values()
        }
        return {"tag": self.tag, "subnet": self.subnet, "switch": self.switch, "hosts": hosts}

    @classmethod
    def attach(cls, description: Mapping[str, object]) -> Network:
        """The network `describe` described, made by another process, to inject and heal its faults.

        Raises:
            NetnsError: the description is malformed, or its switch namespace no longer exists.
        """
        try:
            raw: Any = description["hosts"]
            hosts = {str(n): Host(name=str(n), **h) for n, h in raw.items()}
            net = cls(
                subnet=str(description["subnet"]), tag=str(description["tag"]), hosts=hosts, attached=True
            )
        except (KeyError, TypeError, ValueError) as e:
            raise NetnsError(f"network description: {type(e).__name__}: {e}") from None
        if net.switch not in namespaces():
            raise NetnsError(f"network {net.tag}: its switch namespace {net.switch} does not exist")
        return net

    @property
    def made(self) -> list[str]:
        """The namespaces made here and not yet deleted (the switch's first)."""
        return list(self._made)

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _netns_add(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def add_host(self, name: str) -> Host:
        """A new namespace for part ``name``, linked to the bridge, with the next address of the subnet."""
        if name in self.hosts:
            raise NetnsError(f"host {name!r} already exists in network {self.tag}")
        index = len(self.hosts) + 2
        ns, port = f"dr-{self.tag}-{name}", f"p{index}"
        address = str(self._net.network_address + index)
        self._netns_add(ns)
        _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
        _ip("-n", ns, "addr", "add", f"{address}/{self._net.prefixlen}", "dev", "eth0")
        _ip("-n", ns, "link", "set", "dev", "eth0", "gso_max_segs", "1")  # frames within the MTU (docstring)
        _ip("-n", ns, "link", "set", "eth0", "up")
        host = Host(name=name, netns=ns, address=address, port=port)
        self.hosts[name] = host
        return host

    def argv(self, host: Host | str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside the host's network namespace (`enter`: same pid)."""
        return [*enter(self._host(host).netns), *argv]

    def spawn(
        self,
        host: Host | str,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        log: Path | None = None,
        cwd: Path | None = None,
        stop_signal: int = signal.SIGTERM,
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` inside the host (its own process group), recorded for `close` (which sends it
        ``stop_signal`` first); output to ``log``."""
        return self._spawn(self._host(host).netns, argv, env, log, cwd, stop_signal)

    def _spawn(
        self,
        netns: str,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        log: Path | None = None,
        cwd: Path | None = None,
        stop_signal: int = signal.SIGTERM,
    ) -> subprocess.Popen[bytes]:
        out: IO[bytes] | int = subprocess.DEVNULL
        if log is not None:
            out = log.open("ab")
        try:
            proc = subprocess.Popen(
                [*enter(netns), *argv], env=dict(env) if env is not None else None, cwd=cwd,
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        finally:
            if not isinstance(out, int):
                out.close()
        self.procs.append(proc)
        self._stop_signals[proc.pid] = stop_signal
        return proc

    def run(
        self,
        host: Host | str,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        timeout: float = 120,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside the host to its end; its output captured."""
        return subprocess.run(
            self.argv(host, argv), env=dict(env) if env is not None else None,
            capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip

    def _host(self, host: Host | str) -> Host:
        if isinstance(host, Host):
            return host
        if host not in self.hosts:
            raise NetnsError(f"no host {host!r} in network {self.tag} (hosts: {', '.join(self.hosts)})")
        return self.hosts[host]

    # --- faults -------------------------------------------------------------------------------------------

    def cut(self, a: Host | str, b: Host | str) -> None:
        """Partition ``a`` from ``b`` (both directions); every other pair still talks."""
        ha, hb = self._host(a), self._host(b)
        self._cuts.add((ha.name, hb.name))
        for src, dst in ((ha, hb), (hb, ha)):
            _ip("-n", src.netns, "route", "replace", "blackhole", f"{dst.address}/32")

    def mend(self, a: Host | str, b: Host | str) -> None:
        """Heal the partition of ``a`` from ``b`` (idempotent)."""
        ha, hb = self._host(a), self._host(b)
        for src, dst in ((ha, hb), (hb, ha)):
            _ip("-n", src.netns, "route", "del", "blackhole", f"{dst.address}/32", check=False)
        self._cuts.discard((ha.name, hb.name))

    @contextlib.contextmanager
    def partitioned(self, a: Host | str, b: Host | str) -> Iterator[None]:
        """``a`` and ``b`` cannot reach each other inside the block; healed at its end, whatever happens."""
        self.cut(a, b)
        try:
            yield
        finally:
            self.mend(a, b)

    def netem_available(self) -> bool:
        """Whether the kernel has ``sch_netem`` (probed once, on the switch's loopback)."""
        if self._netem is None:
            probe = ["qdisc", "add", "dev", "lo", "root", "netem", "delay", "0ms"]
            try:
                _tc(self.switch, *probe)
                self._netem = True
                _tc(self.switch, "qdisc", "del", "dev", "lo", "root", check=False)
            except NetnsError:
                self._netem = False
        return self._netem

    def degrade(self, host: Host | str, fault: LinkFault) -> None:
        """Put ``fault`` on the host's link, both ends (replacing any earlier one)."""
        h = self._host(host)
        self.heal(h)
        self._degraded.add(h.name)
        netem = self.netem_available()
        for ns, dev in ((h.netns, "eth0"), (self.switch, h.port)):
            for cmd in fault.tc_commands(dev, netem_ok=netem):
                _tc(ns, *cmd)
        if fault.needs_netem and not netem:
            self._splice(h, fault)

    def _splice(self, h: Host, fault: LinkFault) -> None:
        """Put a user-space wire (faults/linkrelay.py) between the host's switch port and the bridge."""
        wire, tap = f"q{h.port[1:]}", f"r{h.port[1:]}"
        _ip("-n", self.switch, "link", "add", wire, "type", "veth", "peer", "name", tap)
        _ip("-n", self.switch, "link", "set", wire, "up")
        argv = [sys.executable, "-m", "durable_rollouts.faults.linkrelay", h.port, wire,
                "--delay-ms", f"{fault.delay_ms:g}", "--jitter-ms", f"{fault.jitter_ms:g}",
                "--loss-pct", f"{fault.loss_pct:g}"]  # fmt: skip
        relay = subprocess.Popen(
            [*enter(self.switch), *argv], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        self.procs.append(relay)
        self._relays[h.name] = relay
        assert relay.stdout is not None
        if not relay.stdout.readline().startswith(b"linkrelay"):  # its one line: its sockets are bound
            raise NetnsError(f"the link relay of {h.name} exited with {relay.wait(5)}")
        _ip("-n", self.switch, "link", "set", h.port, "nomaster")
        _ip("-n", self.switch, "link", "set", tap, "master", "br0", "up")

    def heal(self, host: Host | str) -> None:
        """Remove any link fault of the host (idempotent)."""
        h = self._host(host)
        for ns, dev in ((h.netns, "eth0"), (self.switch, h.port)):
            _tc(ns, "qdisc", "del", "dev", dev, "root", check=False)
        self._degraded.discard(h.name)
        relay = self._relays.pop(h.name, None)
        if relay is not None:
            self.stop(relay, timeout=5)
            _ip("-n", self.switch, "link", "del", f"q{h.port[1:]}", check=False)
            _ip("-n", self.switch, "link", "set", h.port, "master", "br0")

    @contextlib.contextmanager
    def degraded(self, host: Host | str, fault: LinkFault) -> Iterator[None]:
        """The host's link suffers ``fault`` inside the block; healed at its end, whatever happens."""
        self.degrade(host, fault)
        try:
            yield
        finally:
            self.heal(host)

    def qdiscs(self, host: Host | str) -> str:
        """``tc qdisc show`` of the host's ``eth0`` (what a fault installed, for checks and logs)."""
        h = self._host(host)
        done = subprocess.run(
            [*enter(h.netns), "tc", "qdisc", "show", "dev", "eth0"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        return done.stdout

    # --- teardown -----------------------------------------------------------------------------------------

    def stop(self, proc: subprocess.Popen[bytes], timeout: float = 15.0, sig: int | None = None) -> None:
        """Stop a process `spawn` started: ``sig`` (default: its stop signal) to its pid, then SIGKILL to
        its process group."""
        if sig is None:
            sig = self._stop_signals.get(proc.pid, signal.SIGTERM)
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # its children, in the group it leads
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout)

    def close(self) -> list[str]:
        """Stop every process started here and delete every namespace made here; returns what was left
        behind (one line each; empty when all of it is gone). Faults injected here are healed first."""
        for a, b in list(self._cuts):
            self.mend(a, b)
        for name in list(self._degraded):
            self.heal(name)
        for proc in reversed(self.procs):
            self.stop(proc, timeout=10)
        left = [f"process {p.pid} ({_args(p)})" for p in self.procs if p.poll() is None]
        for ns in reversed(self._made):
            _ip("netns", "del", ns, check=False)
        deadline = time.monotonic() + 5
        listed = set(namespaces())
        while listed & set(self._made) and time.monotonic() < deadline:
            time.sleep(0.1)
            listed = set(namespaces())
        left += [f"namespace {ns}" for ns in self._made if ns in listed]
        self._made = [ns for ns in self._made if ns in listed]
        return left


def _args(proc: subprocess.Popen[bytes]) -> str:
    args = proc.args
    return (" ".join(map(str, args)) if isinstance(args, list) else str(args))[:80]


def namespaces() -> list[str]:
    """The names of the machine's named network namespaces."""
    done = _ip("netns", "list", check=False)
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]
