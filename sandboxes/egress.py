"""Egress networks: a sandbox whose policy allows hosts gets a route to the egress proxy and nothing else.

For such a sandbox the backend makes its own Docker network, ``--internal`` (no route out) with no address
on the host's side of its bridge (``com.docker.network.bridge.inhibit_ipv4``: the host's ports are not
reachable through it either), and attaches two members: the sandbox and the proxy of its policy. The proxy
(``sandboxes.egress_proxy``, run by the sandbox image's python3, hardened like a sandbox) is one container
per policy (`EgressPolicy.key`), also on the policy's ``upstream_network``, the only way out; sandboxes
never share a network, so one sandbox cannot reach another.

Invariants:
- Idempotent: the proxy is named by its policy's key and the network by its sandbox's container name;
  a retried create finds and reuses both (a proxy of the same name that is not running is replaced).
- Labelled for cleanup: a network whose sandbox container is gone, and a proxy no sandbox network is
  attached to, are removed by `EgressNetworks.reap` (the sandbox reaper's pass); a sandbox's
  ``destroy`` removes its network at once. A proxy removed while a create attaches to it is made again.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.resources
import json
import re
import threading
import time
from typing import Any

import docker
import docker.errors

from durable_rollouts.errors import SandboxNotReady
from durable_rollouts.sandboxes.egress_policy import EgressPolicy
from durable_rollouts.sandboxes.egress_proxy import PORT

LABEL_PROXY = "durable-rollouts.egress-proxy"
"""On the proxy container and on every sandbox network: the policy's key."""
LABEL_NETWORK = "durable-rollouts.egress-network"
"""On a sandbox's egress network: the sandbox's container name."""
LABEL_RUN = "durable-rollouts.run"
NO_PROXY = "localhost,127.0.0.1,::1"
NETWORK_GRACE_S = 120.0
"""A sandbox network younger than this is never reaped: its sandbox may be being created right now."""


def proxy_name(policy: EgressPolicy) -> str:
    return f"dr-egress-proxy-{policy.key()}"


def network_name(container: str) -> str:
    """The egress network of the sandbox container ``container``."""
    return f"{container}-egress"


def proxy_env(address: str) -> dict[str, str]:
    """What every command of a sandbox behind the proxy at ``address`` finds in its environment."""
    url = f"http://{address}:{PORT}"
    return {
        "HTTP_PROXY": url, "HTTPS_PROXY": url, "http_proxy": url, "https_proxy": url,
        "NO_PROXY": NO_PROXY, "no_proxy": NO_PROXY,
    }  # fmt: skip


def _source() -> str:
    return importlib.resources.files("durable_rollouts.sandboxes").joinpath("egress_proxy.py").read_text()


class EgressNetworks:
    """Egress networks and proxies on one Docker daemon (thread-safe)."""

    def __init__(self, api: docker.APIClient) -> None:
        self.api = api
        self._lock = threading.Lock()

    def attach(self, container: str, run_id: str, policy: EgressPolicy) -> tuple[str, dict[str, str]]:
        """The network sandbox ``container`` is to be created on, and its proxy environment (idempotent).

        Raises:
            SandboxNotReady: the proxy's image or upstream network is missing, or the daemon failed.
        """
        net = network_name(container)
        for _attempt in range(3):
            proxy = self._proxy(policy)
            self._network(net, container, run_id, policy)
            try:
                address = self._connect(proxy, net)
            except docker.errors.NotFound:  # the proxy was reaped meanwhile: make it again
                continue
            return net, proxy_env(address)
        raise SandboxNotReady(f"egress proxy {proxy_name(policy)}: removed while {container} attached")

    def detach(self, container: str) -> None:
        """Remove sandbox ``container``'s egress network (the proxy leaves it first); absent is fine."""
        net = network_name(container)
        try:
            attrs = self.api.inspect_network(net)
        except docker.errors.NotFound:
            return
        for member in attrs.get("Containers") or {}:
            with contextlib.suppress(docker.errors.APIError):  # gone already
                self.api.disconnect_container_from_network(member, net, force=True)
        try:
            self.api.remove_network(net)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as exc:
            if exc.status_code != 409:  # 409: a member still attached (a create racing); the reaper retries
                raise

    def reap(self, run_id: str | None = None, older_than_s: float | None = None) -> list[str]:
        """Remove egress networks whose sandbox container is gone (of one run, or all), then proxies that
        no sandbox network is attached to (created at least ``older_than_s`` ago); returns their names."""
        removed: list[str] = []
        labels = [LABEL_NETWORK] + ([f"{LABEL_RUN}={run_id}"] if run_id is not None else [])
        now = time.time()
        for net in self.api.networks(filters={"label": labels}):
            if now - _created(net.get("Created", "")) < NETWORK_GRACE_S:
                continue
            sandbox = (net.get("Labels") or {}).get(LABEL_NETWORK, "")
            try:
                self.api.inspect_container(sandbox)
            except docker.errors.NotFound:
                self.detach(sandbox)
                removed.append(net["Name"])
        for row in self.api.containers(all=True, filters={"label": [LABEL_PROXY]}):
            key = row["Labels"].get(LABEL_PROXY, "")
            if older_than_s is not None and now - float(row.get("Created", 0)) < older_than_s:
                continue
            if self.api.networks(filters={"label": [f"{LABEL_PROXY}={key}", LABEL_NETWORK]}):
                continue
            try:
                self.api.remove_container(row["Id"], force=True)
            except docker.errors.NotFound:
                continue
            removed.append(row["Names"][0].lstrip("/"))
        return removed

    # ----------------------------------------------------------------------------------------- parts

    def _proxy(self, policy: EgressPolicy) -> str:
        """The running proxy of ``policy`` (made when missing); returns its name."""
        name = proxy_name(policy)
        with self._lock:
            for _attempt in range(3):
                try:
                    state = self.api.inspect_container(name)["State"]
                except docker.errors.NotFound:
                    state = None
                if state is not None and state.get("Running") and not state.get("Paused"):
                    return name
                if state is not None:
                    self.api.remove_container(name, force=True)
                try:
                    self._start_proxy(name, policy)
                except docker.errors.APIError as exc:
                    if exc.status_code == 409:  # another worker made it meanwhile: look again
                        continue
                    raise
                return name
        raise SandboxNotReady(f"egress proxy {name}: the name stays in conflict")

    def _start_proxy(self, name: str, policy: EgressPolicy) -> None:
        try:
            self.api.inspect_image(policy.proxy_image)
        except docker.errors.ImageNotFound:
            raise SandboxNotReady(
                f"sandbox.egress.proxy_image {policy.proxy_image!r} not found on this daemon (any local "
                "image with python3; the default: the sandbox image, built by sandboxes/image/build_image.sh)"
            ) from None
        try:
            self.api.inspect_network(policy.upstream_network)
        except docker.errors.NotFound:
            raise SandboxNotReady(
                f"sandbox.egress.upstream_network {policy.upstream_network!r}: no such Docker network"
            ) from None
        host_config = self.api.create_host_config(
            network_mode=policy.upstream_network,
            cap_drop=["ALL"],
            security_opt=["no-new-privileges"],
            read_only=True,
            mem_limit="256m",
            memswap_limit="256m",
            pids_limit=256,
            init=True,
            restart_policy={"Name": "unless-stopped"},
        )
        created = self.api.create_container(
            policy.proxy_image,
            command=["python3", "-c", _source(), json.dumps(policy.rules())],
            name=name,
            user="65534:65534",
            labels={LABEL_PROXY: policy.key()},
            host_config=host_config,
        )
        self.api.start(created["Id"])

    def _network(self, net: str, container: str, run_id: str, policy: EgressPolicy) -> None:
        try:
            self.api.inspect_network(net)
            return
        except docker.errors.NotFound:
            pass
        labels = {LABEL_NETWORK: container, LABEL_RUN: run_id, LABEL_PROXY: policy.key()}
        try:
            self.api.create_network(
                net, driver="bridge", internal=True, check_duplicate=True, labels=labels,
                options={"com.docker.network.bridge.inhibit_ipv4": "true"},
            )  # fmt: skip
        except docker.errors.APIError as exc:
            if exc.status_code != 409:
                raise

    def _connect(self, proxy: str, net: str) -> str:
        """Attach ``proxy`` to ``net`` (unless it is) and return its address there."""
        if net not in self._networks_of(proxy):
            try:
                self.api.connect_container_to_network(proxy, net)
            except docker.errors.NotFound:
                raise
            except docker.errors.APIError as exc:
                if "already exists" not in str(exc):
                    raise
        address = self._networks_of(proxy).get(net, {}).get("IPAddress")
        if not address:
            raise SandboxNotReady(f"egress proxy {proxy} has no address on {net}")
        return str(address)

    def _networks_of(self, container: str) -> dict[str, Any]:
        return dict(self.api.inspect_container(container)["NetworkSettings"].get("Networks") or {})


def _created(stamp: str) -> float:
    """Unix time of a Docker timestamp (RFC 3339, nanoseconds); now when it cannot be read."""
    match = re.fullmatch(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)", stamp)
    if match is None:
        return time.time()
    whole, fraction, zone = match.groups()
    when = datetime.datetime.fromisoformat(whole + ("+00:00" if zone == "Z" else zone))
    return when.timestamp() + float(f"0.{fraction or 0}")
