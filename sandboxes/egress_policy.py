"""The egress policy a run's operator writes (``[sandbox.egress]``): which hosts sandboxes may reach.

Invariant: the default allows nothing, and a sandbox whose policy allows nothing has no network at all
(``network_mode = "none"``). A policy that allows hosts gives its sandboxes one route out: the egress proxy
(``sandboxes.egress``), which checks every request against these rules (``sandboxes.egress_proxy``).
An environment may narrow the policy for a task (`EgressPolicy.narrowed`), never widen it.

Pure data and checks: no docker, so config and environment code may import it.
"""

from __future__ import annotations

import hashlib
import re

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from durable_rollouts.sandboxes.egress_proxy import allowed, is_ip, local_address, name_matches, split_entry

PROXY_IMAGE = "durable-rollouts-sandbox:latest"
"""Default image of the proxy container: the project's sandbox image (its python3 runs the proxy)."""
_LABEL = re.compile(r"[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?")


def check_host_pattern(value: str, what: str) -> str:
    """``value`` normalised (lower case, no trailing dot) if it is ``name``, ``*.name``, either with
    ``:port``; raises ValueError naming ``what`` otherwise (raw IPs, URLs, paths are refused)."""
    try:
        name, port = split_entry(value)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None
    bare = name.removeprefix("*.")
    if is_ip(bare) or "/" in value:
        raise ValueError(f"{what}: {value!r}: name hosts, not IP addresses or ranges (never allowed)")
    if not bare or "*" in bare or not all(_LABEL.fullmatch(label) for label in bare.split(".")):
        raise ValueError(f"{what}: {value!r}: expected a host name, '*.suffix', optionally with ':port'")
    return name if port is None else f"{name}:{port}"


class EgressPolicy(BaseModel):
    """Hosts sandboxes may reach through the egress proxy (``[sandbox.egress]``); the default: none."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    allow: list[str] = Field(default_factory=list, max_length=256)
    """Host names sandboxes may reach: ``pypi.org``, ``*.debian.org`` (names under it, not itself), each
    optionally with ``:port`` (without one: ports 80 and 443). Raw IP addresses are never allowed. Empty
    (the default): sandboxes have no network at all."""

    map: dict[str, str] = Field(default_factory=dict)
    """Allowed names served by a local stand-in instead (a mirror, a cache, a test server): name ->
    ``address[:port]`` (a private, loopback or link-local address, or a name that resolves to one on the
    proxy's ``upstream_network``; without a port, the port asked for). Never a public address."""

    upstream_network: str = Field("bridge", min_length=1, max_length=128)
    """Docker network the proxy reaches the allowed hosts (and stand-ins) through; sandboxes never join
    it. ``bridge``: the daemon's default network (NAT to the host's routes)."""

    proxy_image: str = Field(PROXY_IMAGE, min_length=1, max_length=255)
    """Local image of the proxy's container (never pulled): any image with python3 (3.11 or later)."""

    @field_validator("allow")
    @classmethod
    def _check_allow(cls, value: list[str]) -> list[str]:
        return [check_host_pattern(v, "sandbox.egress.allow") for v in value]

    @model_validator(mode="after")
    def _check_map(self) -> EgressPolicy:
        for name, target in self.map.items():
            key = check_host_pattern(name, "sandbox.egress.map")
            if key.startswith("*.") or ":" in key:
                raise ValueError(f"sandbox.egress.map: {name!r}: map one host name (no wildcard, no port)")
            if not any(allowed(self.allow, key, port) for port in _ports(self.allow)):
                raise ValueError(f"sandbox.egress.map: {name!r} is not allowed by sandbox.egress.allow")
            host, _ = split_entry(target)
            if is_ip(host) and not local_address(host):
                raise ValueError(f"sandbox.egress.map: {name!r} -> {target!r}: a stand-in must be local")
        return self

    @property
    def enabled(self) -> bool:
        """Whether any host is allowed (the sandbox then gets the proxy as its only network)."""
        return bool(self.allow)

    def narrowed(self, hosts: list[str]) -> EgressPolicy:
        """This policy bounded by ``hosts`` (a task's allowlist: names and ``*.suffix`` patterns; IP
        entries match nothing): what both allow, with this policy's ports and the stand-ins still allowed."""
        kept: list[str] = []
        for entry in self.allow:
            name, port = split_entry(entry)
            for host in hosts:
                h = host.strip().lower().rstrip(".")
                if is_ip(h.split("/")[0]):
                    continue
                narrower = _narrower(name, h)
                if narrower is not None:
                    item = narrower if port is None else f"{narrower}:{port}"
                    if item not in kept:
                        kept.append(item)
        stand_ins = {n: t for n, t in self.map.items() if any(allowed(kept, n, p) for p in _ports(kept))}
        return self.model_copy(update={"allow": kept, "map": stand_ins})

    def key(self) -> str:
        """Short digest of the rules and the proxy's placement: one proxy container serves one key."""
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()[:16]

    def rules(self) -> dict[str, object]:
        """What the proxy program is started with."""
        return {"allow": list(self.allow), "map": dict(self.map)}


def _narrower(a: str, b: str) -> str | None:
    """The pattern matching what both ``a`` and ``b`` match, when one contains the other; else None."""
    if a == b:
        return a
    if not a.startswith("*.") and name_matches(b, a):
        return a
    if not b.startswith("*.") and name_matches(a, b):
        return b
    if a.startswith("*.") and b.startswith("*."):
        if name_matches(a, b[2:]):
            return b
        if name_matches(b, a[2:]):
            return a
    return None


def _ports(allow: list[str]) -> list[int]:
    ports = {80, 443}
    for entry in allow:
        _, port = split_entry(entry)
        if port is not None:
            ports.add(port)
    return sorted(ports)
