"""Local stand-ins for the hosts an egress policy allows: one container on a Docker ``--internal`` network
made for the test (so nothing it or the proxy does can leave the machine) serving, by ``Host`` header,
a PEP 503 simple index (``pypi.org``), its wheel (``files.pythonhosted.org``) and an installer script
(``astral.sh``), all made here offline. Everything is labelled and removed by the fixture that made it."""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import io
import ipaddress
import json
import subprocess
import uuid
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import docker

from durable_rollouts.sandboxes.base import DEFAULT_IMAGE

PORT = 8000
LABEL = "durable-rollouts.test-egress"
SERVER = r"""
import base64, http.server, json, sys
SITES = {h: {p: base64.b64decode(b) for p, b in f.items()} for h, f in json.loads(sys.argv[1]).items()}
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        host = (self.headers.get("Host") or "").split(":")[0]
        body = SITES.get(host, {}).get(self.path.split("?")[0])
        if body is None:
            body, code = f"no {self.path} on stand-in {host!r}\n".encode(), 404
        else:
            code = 200
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        kind = "application/octet-stream" if self.path.endswith(".whl") else "text/html"
        self.send_header("Content-Type", kind)
        self.end_headers()
        self.wfile.write(body)
http.server.ThreadingHTTPServer(("0.0.0.0", 8000), H).serve_forever()
"""

PROBE_TOOL = "drprobe"
"""The package the stand-in index serves: ``python3 -m drprobe FILE`` prints 1 when FILE holds 42, else 0."""


def wheel(name: str = PROBE_TOOL, version: str = "1.0") -> tuple[str, bytes]:
    """A pure-Python wheel made here (file name, bytes), with a valid RECORD."""
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    files = {
        f"{name}/__init__.py": b"",
        f"{name}/__main__.py": (
            b"import sys\nfrom pathlib import Path\n"
            b"p = Path(sys.argv[1])\nprint(1 if p.is_file() and p.read_text().strip() == '42' else 0)\n"
        ),
        f"{name}-{version}.dist-info/METADATA": metadata.encode(),
        f"{name}-{version}.dist-info/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: durable-rollouts-tests\nRoot-Is-Purelib: true\n"
            b"Tag: py3-none-any\n"
        ),
    }
    record_name = f"{name}-{version}.dist-info/RECORD"
    rows = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        rows.append(f"{path},sha256={digest},{len(data)}")
    rows.append(f"{record_name},,")
    files[record_name] = ("\n".join(rows) + "\n").encode()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for path, data in files.items():
            z.writestr(path, data)
    return f"{name}-{version}-py3-none-any.whl", buf.getvalue()


def sites() -> dict[str, dict[str, bytes]]:
    """What each stand-in host serves: the simple index, its wheel, and uv's installer's stand-in."""
    file_name, data = wheel()
    sha = hashlib.sha256(data).hexdigest()
    url = f"http://files.pythonhosted.org/packages/{file_name}#sha256={sha}"
    page = f'<!DOCTYPE html><html><body><a href="{url}">{file_name}</a></body></html>\n'.encode()
    installer = b'#!/bin/sh\nmkdir -p "$HOME/.local/bin" && echo "uv stand-in" > "$HOME/.local/bin/uv.txt"\n'
    return {
        "pypi.org": {f"/simple/{PROBE_TOOL}/": page, "/simple/": b'<a href="drprobe/">drprobe</a>\n'},
        "files.pythonhosted.org": {f"/packages/{file_name}": data},
        "astral.sh": {"/uv/install.sh": installer, "/ok": b"astral stand-in\n"},
    }


def pip_zip(dest: Path) -> Path:
    """The test venv's own pip as a zip a task image runs as ``python3 pip.zip/pip`` (offline)."""
    # Found by its distribution's files, not imported: importing pip in this process turns off setuptools'
    # distutils shim, and a later in-process import of setuptools (torch, vLLM) then fails its assertion.
    root = Path(str(importlib.metadata.distribution("pip").locate_file("pip")))
    with zipfile.ZipFile(dest, "w", zipfile.ZIP_DEFLATED) as z:
        for path in sorted(root.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                z.write(path, Path("pip") / path.relative_to(root))
    return dest


@dataclass(frozen=True)
class StandIns:
    network: str
    """The --internal network the stand-ins (and the proxy, as its upstream) are on."""
    address: str
    """The stand-in server's address there."""
    gateway: str
    """The host's address on that network."""

    def map(self) -> dict[str, str]:
        return {
            host: f"{self.address}:{PORT}" for host in ("pypi.org", "files.pythonhosted.org", "astral.sh")
        }


def bridge_gateway(network: dict) -> str:
    """The host's address on a Docker bridge network (its ``docker network inspect`` attributes): IPAM's
    gateway, or, where the daemon leaves it out (Docker 20.10 for the default bridge it made at its first
    start), the address of the bridge's interface on the host."""
    config = network["IPAM"]["Config"][0]
    if config.get("Gateway"):
        return str(config["Gateway"])
    iface = (network.get("Options") or {}).get("com.docker.network.bridge.name") or "br-" + network["Id"][:12]
    shown = subprocess.run(["ip", "-4", "-o", "addr", "show", "dev", iface], capture_output=True, text=True)
    for line in shown.stdout.splitlines():
        address = line.split()[3].split("/")[0]
        if ipaddress.ip_address(address) in ipaddress.ip_network(config["Subnet"]):
            return address
    raise AssertionError(f"no address of {network['Name']}'s interface {iface} in {config}: {shown.stderr}")


@contextmanager
def stand_ins(client: docker.DockerClient) -> Iterator[StandIns]:
    """The stand-in server on a fresh --internal network; both removed afterwards."""
    tag = uuid.uuid4().hex[:10]
    net = client.networks.create(
        f"dr-test-upstream-{tag}", driver="bridge", internal=True, labels={LABEL: tag}
    )
    payload = {h: {p: base64.b64encode(b).decode() for p, b in files.items()} for h, files in sites().items()}
    container = None
    try:
        container = client.containers.run(
            DEFAULT_IMAGE, ["python3", "-c", SERVER, json.dumps(payload)], name=f"dr-test-standin-{tag}",
            detach=True, network=net.name, labels={LABEL: tag}, user="65534:65534", cap_drop=["ALL"],
        )  # fmt: skip
        container.reload()
        address = container.attrs["NetworkSettings"]["Networks"][net.name]["IPAddress"]
        net.reload()
        gateway = bridge_gateway(net.attrs)
        yield StandIns(network=net.name, address=address, gateway=gateway)
    finally:
        if container is not None:
            container.remove(force=True)
        for proxy in client.containers.list(all=True, filters={"network": net.name}):
            proxy.remove(force=True)  # a proxy still on this upstream network (a failed test's)
        net.remove()
