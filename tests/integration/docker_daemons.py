"""A second Docker daemon for tests that need another host's daemon (a sandbox host, a registry's pull side,
a user-remapping daemon), started and stopped by its pid.

Each daemon gets a bridge of its own: one started with ``--bridge none`` deletes the host's ``docker0``
(dockerd removes the default bridge interface when told to have none), which the main daemon's builds need
for their RUN steps.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import docker
import pytest

from durable_rollouts.sandboxes import DockerBackend
from durable_rollouts.stack import procs


def need_second_daemon() -> None:
    """Skip (a failure under CI) where no second daemon can start."""
    if shutil.which("dockerd") is None or shutil.which("ip") is None or os.geteuid() != 0:
        pytest.skip(
            "a second Docker daemon needs dockerd, ip and root (.ci/with-services.sh installs docker.io)"
        )


class SecondDockerd:
    """A dockerd on its own socket, data root and bridge; ``extra``: more dockerd flags. Start and stop it
    (again, for a host that goes away and comes back); `close` removes everything it made."""

    def __init__(self, prefix: str, *extra: str) -> None:
        self.root = Path(tempfile.mkdtemp(prefix=f"/tmp/{prefix}-"))  # short: a socket path is <108 bytes
        self.root.chmod(0o711)  # a remapped root must traverse to its own data folder
        self.bridge = f"dr-{uuid.uuid4().hex[:8]}"  # an interface name has at most 15 characters
        self.extra = extra
        self.pid = 0

    @property
    def url(self) -> str:
        return f"unix://{self.root}/docker.sock"

    def backend(self, timeout: int = 60) -> DockerBackend:
        return DockerBackend(docker.DockerClient(base_url=self.url, timeout=timeout))

    def start(self) -> None:
        if subprocess.run(["ip", "link", "show", self.bridge], capture_output=True).returncode != 0:
            subprocess.run(["ip", "link", "add", "name", self.bridge, "type", "bridge"], check=True)
        argv = [
            "dockerd", "--host", self.url, "--data-root", str(self.root / "data"),
            "--exec-root", str(self.root / "exec"), "--pidfile", str(self.root / "docker.pid"),
            "--bridge", self.bridge, "--iptables=false", "--ip6tables=false", "--ip-masq=false", *self.extra,
        ]  # fmt: skip
        with (self.root / "dockerd.log").open("ab") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=log, start_new_session=True)
        self.pid = proc.pid
        deadline = time.monotonic() + 60
        while subprocess.run(["docker", "-H", self.url, "info"], capture_output=True).returncode != 0:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"second dockerd did not answer: {self.log()[-800:]}")
            time.sleep(0.5)

    def load(self, *images: str) -> None:
        """Copy ``images`` from the main daemon."""
        save = subprocess.Popen(["docker", "save", *images], stdout=subprocess.PIPE)
        load = ["docker", "-H", self.url, "load", "-q"]
        loaded = subprocess.run(load, stdin=save.stdout, capture_output=True)
        assert save.wait(300) == 0 and loaded.returncode == 0, loaded.stderr

    def log(self) -> str:
        return (self.root / "dockerd.log").read_text(errors="replace")

    def stop(self) -> None:
        if self.pid:
            procs.stop_pid(self.pid, timeout=40.0)
            self.pid = 0

    def close(self) -> None:
        self.stop()
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        shutil.rmtree(self.root, ignore_errors=True)
