"""A cluster on one machine: Temporal behind a TLS proxy that verifies client certificates, the PostgreSQL
store, a simulated engine, workers and a client ("driver") host, each in a network namespace of its own with
its own address (faults/netns.py), reached only by those addresses.

Parts and ports: ``temporal`` runs the dev server on its own loopback (127.0.0.1:7234) and HAProxy on
``ADDRESS:7233`` terminating TLS (ALPN h2, ``verify required`` against the cluster's CA); ``store`` runs
PostgreSQL on ``ADDRESS:5432`` (trust for the subnet); ``engine`` the simulated engine on ``ADDRESS:8000``;
workers and the driver reach them with the ``TEMPORAL_*`` variables the ``temporal`` CLI reads and
``ROLLOUTS_STORE``. The network's description is written to `Cluster.network_file`, so ``rollouts chaos
--network FILE`` (run on the driver host) can cut and degrade the links between the parts and restart the
store's server (faults/netfaults.py, faults/pgrestart.py).

Invariants: the certificates are a throwaway CA made with openssl in the cluster's folder; every process and
namespace is the `Network`'s, so `Cluster.close` removes all of it (also after a failed start), and a
PostgreSQL server the chaos kit started again on the store's data directory is stopped by its pid file.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from durable_rollouts.config.paths import venv_bin
from durable_rollouts.faults import pgrestart
from durable_rollouts.faults.netns import Host, NetnsError, Network
from durable_rollouts.faults.pgrestart import PgRestartError
from durable_rollouts.store.local_postgres import postgres_bin

__all__ = ["Certs", "Cluster", "make_certs"]

TLS_PORT = 7233
DEV_PORT = 7234
STORE_PORT = 5432
ENGINE_PORT = 8000


@dataclass(frozen=True)
class Certs:
    """PEM files: the cluster's CA, the server's certificate, a client's, and a client's from another CA."""

    ca: Path
    server_pem: Path
    """The server's certificate and key in one file (HAProxy's ``crt``)."""
    client_cert: Path
    client_key: Path
    rogue_cert: Path
    """Signed by a CA the server does not trust."""
    rogue_key: Path


def _openssl(*args: str, cwd: Path) -> None:
    done = subprocess.run(["openssl", *args], capture_output=True, text=True, cwd=cwd, timeout=60)
    if done.returncode != 0:
        raise NetnsError(f"openssl {args[0]}: {done.stderr.strip().splitlines()[-1:]}")


def _issue(folder: Path, name: str, ca: str, subject: str, ext: str) -> None:
    """Key ``name.key`` and certificate ``name.pem`` signed by CA ``ca`` (``ca.pem``, ``ca.key``)."""
    (folder / f"{name}.ext").write_text(ext)
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", f"{name}.key"]
    _openssl("req", "-new", *key, "-out", f"{name}.csr", "-subj", subject, cwd=folder)
    sign = ["-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial", "-days", "2"]
    _openssl("x509", "-req", "-in", f"{name}.csr", *sign, "-out", f"{name}.pem", "-extfile", f"{name}.ext",
             cwd=folder)  # fmt: skip


def make_certs(folder: Path, server_ip: str, server_name: str = "temporal") -> Certs:
    """A throwaway CA, a server certificate for ``server_ip``/``server_name``, a client certificate, and a
    client certificate from a second CA (the wrong one)."""
    folder.mkdir(parents=True, exist_ok=True)
    for ca in ("ca", "rogue-ca"):
        _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                 "-keyout", f"{ca}.key", "-out", f"{ca}.pem", "-days", "2", "-subj", f"/CN={ca}",
                 "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign",
                 cwd=folder)  # fmt: skip
    usage = "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n"
    names = f"subjectAltName=DNS:{server_name},IP:{server_ip}\n"
    _issue(folder, "server", "ca", f"/CN={server_name}", f"{usage}extendedKeyUsage=serverAuth\n{names}")
    _issue(folder, "client", "ca", "/CN=worker", f"{usage}extendedKeyUsage=clientAuth\n")
    _issue(folder, "rogue", "rogue-ca", "/CN=worker", f"{usage}extendedKeyUsage=clientAuth\n")
    pem = folder / "server-full.pem"
    pem.write_text((folder / "server.pem").read_text() + (folder / "server.key").read_text())
    return Certs(
        ca=folder / "ca.pem", server_pem=pem, client_cert=folder / "client.pem",
        client_key=folder / "client.key", rogue_cert=folder / "rogue.pem", rogue_key=folder / "rogue.key",
    )  # fmt: skip


HAPROXY_CFG = """global
    maxconn 4096
    log stdout format raw local0 info
defaults
    mode tcp
    log global
    option tcplog
    timeout connect 5s
    timeout client 1h
    timeout server 1h
frontend temporal_tls
    bind {address}:{tls_port} ssl crt {pem} ca-file {ca} verify required alpn h2
    default_backend dev_server
backend dev_server
    server dev 127.0.0.1:{dev_port}
"""


_POLLED = """
import asyncio, os, sys, time
from durable_rollouts.contracts.client import connect
from durable_rollouts.environments.fleet import live_pollers

async def main(queue, timeout, pids):
    client = await connect()
    end = time.monotonic() + timeout
    while True:
        seen = await live_pollers(client, queue)
        if all(any(i.startswith(f"{p}@") for i in seen) for p in pids):
            return
        if time.monotonic() > end:
            print(f"pollers: {seen}", file=sys.stderr, flush=True)
            os._exit(1)
        await asyncio.sleep(0.3)

asyncio.run(main(sys.argv[1], float(sys.argv[2]), sys.argv[3:]))
os._exit(0)
"""
"""Run on the driver host: wait until each pid's worker (the SDK's identity ``PID@HOST``) polls a queue. It
leaves by ``os._exit``: the SDK's runtime thread can abort the interpreter's finalization."""


class Cluster:
    """The parts (module docstring) on a `Network`, started in order; `close` stops them all."""

    def __init__(self, root: Path, workers: Sequence[str] = ("worker-a", "worker-b")) -> None:
        self.root = root
        self.logs = root / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.net = Network()
        self.workers: dict[str, subprocess.Popen[bytes]] = {}
        self._pg_root: Path | None = None
        self._docker_roots: list[Path] = []
        try:
            for name in ("temporal", "store", "engine", *workers, "driver"):
                self.net.add_host(name)
            self.network_file.write_text(json.dumps(self.net.describe(), indent=2) + "\n")
            self.certs = make_certs(root / "certs", self.host("temporal").address)
        except BaseException:
            self.net.close()
            raise

    @property
    def network_file(self) -> Path:
        """The network's description (`Network.describe`): ``rollouts chaos --network FILE`` faults its
        links."""
        return self.root / "network.json"

    def host(self, name: str) -> Host:
        return self.net.hosts[name]

    @property
    def temporal_address(self) -> str:
        return f"{self.host('temporal').address}:{TLS_PORT}"

    @property
    def store_url(self) -> str:
        return f"postgresql://postgres@{self.host('store').address}:{STORE_PORT}/postgres"

    @property
    def engine_url(self) -> str:
        return f"http://{self.host('engine').address}:{ENGINE_PORT}"

    def engine_url_at(self, port: int) -> str:
        return f"http://{self.host('engine').address}:{port}"

    def env(self, part: str, **extra: str) -> dict[str, str]:
        """The environment of a part's commands: Temporal over mutual TLS and the store, from the variables
        (no profile file), its own ROLLOUTS_HOME."""
        base = {k: v for k, v in os.environ.items() if not k.startswith(("TEMPORAL_", "ROLLOUTS_"))}
        return {
            **base,
            "ROLLOUTS_HOME": str(self.root / "home" / part),
            "ROLLOUTS_STORE": self.store_url,
            "TEMPORAL_CONFIG_FILE": str(self.root / "no-profile.toml"),
            "TEMPORAL_ADDRESS": self.temporal_address,
            "TEMPORAL_TLS_CLIENT_CERT_PATH": str(self.certs.client_cert),
            "TEMPORAL_TLS_CLIENT_KEY_PATH": str(self.certs.client_key),
            "TEMPORAL_TLS_SERVER_CA_CERT_PATH": str(self.certs.ca),
            "PYTHONUNBUFFERED": "1",
            **extra,
        }

    def reachable(self, part: str, address: str, port: int) -> bool:
        """Whether ``part`` opens a TCP connection to ``address:port``."""
        probe = ["bash", "-c", f"exec 3<>/dev/tcp/{address}/{port}"]
        return self.net.run(part, probe, timeout=10).returncode == 0

    def wait_reachable(
        self,
        part: str,
        address: str,
        port: int,
        proc: subprocess.Popen[bytes],
        what: str,
        timeout: float = 120,
    ) -> None:
        deadline = time.monotonic() + timeout
        while not self.reachable(part, address, port):
            if proc.poll() is not None:
                raise NetnsError(f"{what} exited with {proc.returncode}; see {self.logs}")
            if time.monotonic() > deadline:
                raise NetnsError(f"{what} did not answer on {address}:{port} within {timeout:.0f} s")
            time.sleep(0.3)

    def start_temporal(self) -> None:
        """The dev server on the temporal host's loopback, HAProxy verifying client certificates in front."""
        db = self.root / "temporal.db"
        dev = self.net.spawn("temporal", [
            str(venv_bin("temporal")), "server", "start-dev", "--ip", "127.0.0.1", "--port", str(DEV_PORT),
            "--headless", "--db-filename", str(db), "--log-level", "error",
        ], log=self.logs / "temporal.log")  # fmt: skip
        self.wait_reachable("temporal", "127.0.0.1", DEV_PORT, dev, "the Temporal dev server")
        cfg = self.root / "haproxy.cfg"
        cfg.write_text(HAPROXY_CFG.format(
            address=self.host("temporal").address, tls_port=TLS_PORT, pem=self.certs.server_pem,
            ca=self.certs.ca, dev_port=DEV_PORT,
        ))  # fmt: skip
        proxy = self.net.spawn("temporal", ["haproxy", "-db", "-f", str(cfg)], log=self.logs / "haproxy.log")
        self.wait_reachable("driver", self.host("temporal").address, TLS_PORT, proxy, "HAProxy")

    def start_store(self) -> None:
        """PostgreSQL on the store host's address, run as the ``postgres`` user (it refuses root)."""
        bindir = postgres_bin()
        if bindir is None:
            raise NetnsError("PostgreSQL is not installed (apt-get install postgresql)")
        # its own folder under the system's temporary one: the postgres user cannot enter a test's tmp_path
        self._pg_root = Path(tempfile.mkdtemp(prefix="rollouts-pg-"))
        data = self._pg_root / "data"
        data.mkdir()
        subprocess.run(["chown", "postgres:postgres", str(self._pg_root)], check=True, timeout=30)
        run_as = ["setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups"]
        subprocess.run(["chown", "postgres:postgres", str(data)], check=True, timeout=30)
        init = [*run_as, str(bindir / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust",
                "-EUTF8", "--no-locale"]  # fmt: skip
        done = subprocess.run(init, capture_output=True, text=True, timeout=120, cwd="/")
        if done.returncode != 0:
            raise NetnsError(f"initdb: {done.stderr.strip()[-300:]}")
        with (data / "pg_hba.conf").open("a") as hba:
            hba.write(f"host all all {self.net.subnet} trust\n")
        address = self.host("store").address
        pg = self.net.spawn("store", [
            *run_as, str(bindir / "postgres"), "-D", str(data), "-p", str(STORE_PORT), "-k", str(data),
            "-c", f"listen_addresses={address}", "-c", "max_connections=200", "-c", "fsync=off",
        ], log=self.logs / "postgres.log", cwd=Path("/"), stop_signal=2)  # fmt: skip  # SIGINT: fast shutdown
        self.wait_reachable("driver", address, STORE_PORT, pg, "PostgreSQL")

    def start_engine(self, *args: str, port: int = ENGINE_PORT) -> None:
        """A simulated engine (``python -m durable_rollouts.simengine``) on the engine host's address."""
        argv = [sys.executable, "-m", "durable_rollouts.simengine", "--host", self.host("engine").address,
                "--port", str(port), *args]  # fmt: skip
        eng = self.net.spawn("engine", argv, env=self.env("engine"), log=self.logs / f"engine-{port}.log")
        self.wait_reachable("driver", self.host("engine").address, port, eng, "the simulated engine")

    def start_dockerd(self, part: str, tcp_port: int | None = None) -> str:
        """A Docker daemon of its own on host ``part`` (its socket, data root and exec root in a short
        folder under /tmp: a unix socket path is < 108 bytes; no bridge, no iptables: sandboxes run without
        a network); its socket URL once it answers. With ``tcp_port`` it also listens on the host's address
        (plain TCP, inside the cluster's network only: `docker_tcp_url`), so a worker on another host can
        drive it."""
        root = Path(tempfile.mkdtemp(prefix="/tmp/dr-mh-"))
        self._docker_roots.append(root)
        url = f"unix://{root}/docker.sock"
        argv = ["dockerd", "--host", url, "--data-root", str(root / "data"),
                "--exec-root", str(root / "exec"), "--pidfile", str(root / "docker.pid"),
                "--bridge", "none", "--iptables=false", "--ip6tables=false"]  # fmt: skip
        if tcp_port is not None:
            argv += ["--host", self.docker_tcp_url(part, tcp_port)]
        proc = self.net.spawn(part, argv, log=self.logs / f"dockerd-{part}.log")
        deadline = time.monotonic() + 90
        while subprocess.run(["docker", "-H", url, "info"], capture_output=True).returncode != 0:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise NetnsError(f"dockerd on {part} did not answer; see {self.logs}/dockerd-{part}.log")
            time.sleep(0.5)
        return url

    def docker_tcp_url(self, part: str, port: int) -> str:
        """The TCP URL of the Docker daemon `start_dockerd` started on ``part`` with ``tcp_port=port``."""
        return f"tcp://{self.host(part).address}:{port}"

    def start_worker(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        """``rollouts worker`` on host ``name``, reaching Temporal over mutual TLS (replacing an earlier
        one in `workers`)."""
        argv = [sys.executable, "-m", "durable_rollouts.cli.rollouts", "worker", *args]
        proc = self.net.spawn(name, argv, env=self.env(name), log=self.logs / f"{name}.log")
        self.workers[name] = proc
        return proc

    def wait_polled(self, queue: str, pids: Sequence[int], timeout: float = 120) -> None:
        """Wait until the workers of ``pids`` poll ``queue``'s workflow tasks, as Temporal lists its pollers
        (asked from the driver host, over mutual TLS)."""
        argv = [sys.executable, "-c", _POLLED, queue, str(timeout), *map(str, pids)]
        done = self.net.run("driver", argv, env=self.env("driver"), timeout=timeout + 60)
        if done.returncode != 0:
            why = done.stderr.strip()[-500:]
            raise NetnsError(f"workers {list(pids)} did not poll {queue} (exit {done.returncode}): {why}")

    def rollouts(
        self, *args: str, part: str = "driver", env: Mapping[str, str] | None = None, timeout: float = 300
    ) -> subprocess.CompletedProcess[str]:
        """``rollouts ARGS`` on host ``part`` (the driver), to its end."""
        argv = [sys.executable, "-m", "durable_rollouts.cli.rollouts", *args]
        return self.net.run(part, argv, env=env if env is not None else self.env(part), timeout=timeout)

    def sql(self, query: str) -> str:
        """One query on the store, from the driver host (``psql``), its unaligned output."""
        done = self.net.run("driver", ["psql", "-XAtq", self.store_url, "-c", query], timeout=30)
        if done.returncode != 0:
            raise NetnsError(f"psql: {done.stderr.strip()}")
        return done.stdout.strip()

    def close(self) -> list[str]:
        """Stop every part and delete every namespace; what was left behind (one line each)."""
        left = self.net.close()
        if self._pg_root is not None:  # a server the chaos kit restarted is no process of the network's
            with contextlib.suppress(PgRestartError):  # none running there: nothing to stop
                pgrestart.stop(pgrestart.find(self._pg_root / "data"), timeout_s=15)
        for root in [self._pg_root, *self._docker_roots]:
            if root is not None:
                shutil.rmtree(root, ignore_errors=True)
        return left
