"""Network faults between the named parts of a cluster of network namespaces (faults/netns.py), as the chaos
kit's fault kinds.

A kind names its parts (the hosts of the cluster: ``temporal``, ``store``, ``engine``, ``worker-a``,
``sandbox``, ...) and, optionally, its size:

- ``partition:A/B``: A and B cannot reach each other (every other pair still talks);
- ``latency:A`` or ``latency:A=MS``: every packet to and from A is delayed (default 200 ms, a quarter of it
  as jitter);
- ``loss:A`` or ``loss:A=PCT``: a share of the packets to and from A is dropped (default 10 %);
- ``bandwidth:A`` or ``bandwidth:A=KBIT``: A's link is capped (default 1000 kbit/s).

Invariants: parsing is pure (`parse` checks the syntax; `NetFault.check` the parts against a network); a
fault is injected by entering `NetFault.injected` and healed on leaving it, whatever happens inside.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass

from durable_rollouts.faults.netns import LinkFault, Network

__all__ = ["FORMS", "LINK_KINDS", "NetFault", "parse"]

LINK_KINDS = ("partition", "latency", "loss", "bandwidth")
FORMS = ("partition:A/B", "latency:A[=MS]", "loss:A[=PCT]", "bandwidth:A[=KBIT]")
"""How each network kind is written (A, B: parts of the network)."""
DEFAULT_SIZE = {"latency": 200.0, "loss": 10.0, "bandwidth": 1000.0}
"""The size of a link fault whose kind gives none (milliseconds, percent, kbit/s)."""
_KIND = re.compile(r"^(?P<kind>[a-z]+):(?P<a>[A-Za-z0-9_.-]+)(?:/(?P<b>[A-Za-z0-9_.-]+))?(?:=(?P<size>.+))?$")


@dataclass(frozen=True)
class NetFault:
    """One network fault: its kind, the part(s) it acts on and its size (None for a partition)."""

    kind: str
    a: str
    b: str | None = None
    size: float | None = None

    @property
    def target(self) -> str:
        """How the log names what it acts on."""
        return f"{self.a}/{self.b}" if self.b else self.a

    def link(self) -> LinkFault:
        """The link fault of a latency, loss or bandwidth kind."""
        size = self.size if self.size is not None else DEFAULT_SIZE[self.kind]
        if self.kind == "latency":
            return LinkFault(delay_ms=size, jitter_ms=size / 4)
        if self.kind == "loss":
            return LinkFault(loss_pct=size)
        return LinkFault(rate_kbit=max(1, int(size)))

    def check(self, net: Network) -> None:
        """Raise ValueError (one line) when a part it names is not a host of ``net``."""
        for part in (self.a, self.b):
            if part is not None and part not in net.hosts:
                raise ValueError(
                    f"{self.kind}:{self.target}: no part {part!r} (parts: {', '.join(net.hosts)})"
                )

    @contextlib.contextmanager
    def injected(self, net: Network) -> Iterator[None]:
        """The fault is in place inside the block, healed at its end (also on an exception or a cancel)."""
        self.check(net)
        if self.kind == "partition":
            assert self.b is not None
            with net.partitioned(self.a, self.b):
                yield
        else:
            with net.degraded(self.a, self.link()):
                yield


def parse(kind: str) -> NetFault | None:
    """The network fault a chaos kind names; None when it names no network fault (another kind).

    Raises:
        ValueError: a network kind with a bad shape (one line, with the expected form).
    """
    head = kind.partition(":")[0]
    if head not in LINK_KINDS:
        return None
    m = _KIND.match(kind)
    usage = ", ".join(FORMS)
    if m is None:
        raise ValueError(f"fault kind {kind!r}: expected {usage}")
    a, b, size_text = m["a"], m["b"], m["size"]
    if head == "partition":
        if b is None or size_text is not None or a == b:
            raise ValueError(f"fault kind {kind!r}: a partition names two different parts, partition:A/B")
        return NetFault(head, a, b)
    if b is not None:
        raise ValueError(f"fault kind {kind!r}: {head} acts on one part's link ({head}:A[=SIZE])")
    size = None
    if size_text is not None:
        try:
            size = float(size_text)
        except ValueError:
            raise ValueError(f"fault kind {kind!r}: size {size_text!r} is not a number") from None
        if size <= 0 or (head == "loss" and size > 100):
            raise ValueError(f"fault kind {kind!r}: size must be > 0 (a loss at most 100)")
    return NetFault(head, a, None, size)
