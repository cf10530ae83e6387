"""A rollout worker process: polls one task queue and runs every workflow and activity of the project.

It also polls, for each environment it loaded at start, that environment's queue (``registry.env_queue``),
where `rollouts run` starts the runs of that environment (environments/fleet.py): a worker started before an
environment was installed never gets its work; restart it to take it.

Run as ``python -m durable_rollouts.workers.worker --address HOST:PORT --task-queue Q`` or ``rollouts
worker``; it stops
cleanly on SIGTERM or SIGINT. With ``--metrics-port P`` it serves the project's ``rollouts_*`` metrics on
127.0.0.1:P and the Temporal SDK's own ``temporal_*`` metrics on ``--sdk-metrics-port`` (default P + 1);
without it, no port is bound (see ``metrics``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from temporalio.client import Client
from temporalio.worker import Interceptor, UnsandboxedWorkflowRunner, Worker

from durable_rollouts.activities.batch import BatchActivities
from durable_rollouts.activities.dispatch import DispatchActivities
from durable_rollouts.activities.environment import EnvironmentActivities
from durable_rollouts.activities.harness import HarnessActivities
from durable_rollouts.activities.rollout import RolloutActivities
from durable_rollouts.activities.sandbox import SandboxActivities
from durable_rollouts.config.temporal import Connection
from durable_rollouts.contracts.client import connect, describe
from durable_rollouts.engines.client import EngineClient
from durable_rollouts.environments import registry
from durable_rollouts.errors import ConfigError
from durable_rollouts.gateway.server import GatewayServer
from durable_rollouts.metrics.serve import ActivitiesInFlight, serve_metrics, temporal_runtime
from durable_rollouts.sandboxes import AsyncSandboxBackend, DockerBackend, SandboxError
from durable_rollouts.sandboxes.hosts import SandboxHosts
from durable_rollouts.sandboxes.pool import SandboxPool
from durable_rollouts.sandboxes.reaper import reap_forever
from durable_rollouts.store import RunStore, open_store
from durable_rollouts.workers.sandbox_host import SandboxHostSpec, build_host_workers, docker_at, registered
from durable_rollouts.workflows.group import GroupWorkflow
from durable_rollouts.workflows.rollout import RolloutWorkflow
from durable_rollouts.workflows.run import RunWorkflow

WORKFLOWS = [RunWorkflow, GroupWorkflow, RolloutWorkflow]


def cache_workflow_bytecode() -> int:
    """Write the bytecode of the workflow modules where Python looks for it; returns how many were written.

    The SDK's sandbox imports a workflow's module afresh for every workflow run it creates, through the
    normal import system: with no bytecode cache (``PYTHONDONTWRITEBYTECODE``, a read-only install) it
    compiles the source every time. Measured: 6.7 ms per RolloutWorkflow instance, 2.3 ms with the cache.
    A cache that is present and fresh is left alone; one that cannot be written is skipped.
    """
    import importlib.util
    import py_compile

    written = 0
    for module in {w.__module__ for w in WORKFLOWS}:
        spec = importlib.util.find_spec(module)
        src = spec.origin if spec is not None else None
        if src is None or not src.endswith(".py"):
            continue
        pyc = importlib.util.cache_from_source(src)
        with contextlib.suppress(OSError):
            if os.stat(pyc).st_mtime >= os.stat(src).st_mtime:
                continue
        with contextlib.suppress(OSError, py_compile.PyCompileError):
            py_compile.compile(src, cfile=pyc, doraise=True)
            written += 1
    return written


def docker_sandboxes() -> AsyncSandboxBackend:
    """The default sandbox backend: the local Docker daemon."""
    return AsyncSandboxBackend(DockerBackend())


def build_worker(
    client: Client,
    task_queue: str,
    store: RunStore,
    engine: EngineClient,
    sandboxes: Callable[[], AsyncSandboxBackend] = docker_sandboxes,
    sandboxed: bool = True,
) -> Worker:
    """A worker with every workflow and activity registered; activities are I/O bound, so many at once.

    ``sandboxed=False`` runs workflow code without the SDK's workflow sandbox: about a quarter less CPU per
    workflow task, at the price of the sandbox's guard against non-deterministic calls (the replay check
    of history still applies). The workflows here import nothing non-deterministic; the default keeps it.
    """
    return build_workers(client, task_queue, store, engine, sandboxes, sandboxed, envs={})[0]


def build_workers(
    client: Client,
    task_queue: str,
    store: RunStore,
    engine: EngineClient,
    sandboxes: Callable[[], AsyncSandboxBackend] = docker_sandboxes,
    sandboxed: bool = True,
    envs: dict[str, str] | None = None,
    max_workflow_tasks: int = 64,
    interceptors: Sequence[Interceptor] = (),
) -> list[Worker]:
    """The worker of ``task_queue``, then one per environment in ``envs`` (name -> ``env_version``; default:
    every environment this process loads) on that environment's queue (``registry.env_queue``), each with
    every workflow and activity: runs are started on their environment's queue (environments/fleet.py), so
    this
    process only gets work of environments it loaded. The activities' objects are shared. Each worker runs
    at most ``max_workflow_tasks`` workflow tasks at once (its workflow-task slots); ``interceptors`` are
    added to every worker's own."""
    pool = SandboxHosts(store)  # the pool's state lives in the store, shared by its workers on any host
    sandbox_acts = SandboxActivities(store, sandboxes, pool)
    env_acts = EnvironmentActivities(store, engine, sandbox_acts)
    rollout_acts = RolloutActivities(store, engine, env_acts)
    batch_acts = BatchActivities(rollout_acts)
    harness_acts = HarnessActivities(store, engine, sandbox_acts, GatewayServer(store))
    dispatch_acts = DispatchActivities(store, pool)
    runner: dict[str, Any] = {} if sandboxed else {"workflow_runner": UnsandboxedWorkflowRunner()}
    if sandboxed:
        cache_workflow_bytecode()
    activities = (
        rollout_acts.all()
        + batch_acts.all()
        + env_acts.all()
        + sandbox_acts.all()
        + sandbox_acts.placement()
        + dispatch_acts.all()
        + harness_acts.all()
    )
    loaded = registry.loadable() if envs is None else envs
    queues = [task_queue] + [registry.env_queue(task_queue, n, v) for n, v in sorted(loaded.items())]
    return [
        Worker(
            client,
            task_queue=q,
            workflows=WORKFLOWS,
            activities=activities,
            max_concurrent_activities=256,
            max_concurrent_workflow_tasks=max_workflow_tasks,
            interceptors=[ActivitiesInFlight(), *interceptors],
            **runner,
        )
        for q in queues
    ]


async def serve(
    address: str | Connection | None,
    task_queue: str,
    namespace: str | None = None,
    home: Path | None = None,
    store_url: str | None = None,
    sandboxed: bool = True,
    metrics_port: int | None = None,
    sdk_metrics_port: int | None = None,
    metrics_host: str = "127.0.0.1",
    sandbox_host: SandboxHostSpec | None = None,
) -> None:
    """Run a worker until SIGTERM/SIGINT; serve metrics on ``metrics_host`` at the ports given (None: not
    served). Bind ``0.0.0.0`` only where a scraper on another host (a compose network) must reach them.

    With ``sandbox_host`` the worker is also a sandbox host (workers/sandbox_host.py): registered in the
    store with its capacity, polling its own queue, its sandboxes on its own Docker daemon."""
    conn = address if isinstance(address, Connection) else Connection(address=address)
    if namespace is not None:
        conn = conn.model_copy(update={"namespace": namespace})
    where = describe(conn)  # as resolved: an address from TEMPORAL_ADDRESS or a profile shows as itself
    client = await connect(conn, runtime=temporal_runtime(sdk_metrics_port, metrics_host))
    store = open_store(store_url, home=home)
    engine = EngineClient()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    sandboxes = docker_sandboxes if sandbox_host is None else docker_at(sandbox_host.docker_host)
    first = None if sandbox_host is None else 0.0
    reaper = _start_reaper(client, SandboxPool(store), sandboxes, first_s=first)
    try:
        with serve_metrics(metrics_port, metrics_host) as port:
            async with contextlib.AsyncExitStack() as stack:
                envs = registry.loadable()  # read once: what this process can run, for its whole life
                for w in build_workers(client, task_queue, store, engine, sandboxes, sandboxed, envs):
                    await stack.enter_async_context(w)
                if sandbox_host is not None:
                    for w in build_host_workers(client, task_queue, store, engine, sandbox_host, envs):
                        await stack.enter_async_context(w)
                    await stack.enter_async_context(registered(store, task_queue, sandbox_host))
                served = f", metrics on :{port}" if port is not None else ""
                host = f", sandbox host {sandbox_host.name}" if sandbox_host is not None else ""
                loaded = ", ".join(f"{n} {v}" for n, v in sorted(envs.items())) or "none"
                print(
                    f"worker polling {task_queue!r} on {where}{served}{host}; environments: {loaded}",
                    flush=True,
                )
                await stop.wait()
    finally:
        if reaper is not None:
            reaper.cancel()
        await engine.aclose()


def _start_reaper(
    client: Client,
    pool: SandboxPool,
    sandboxes: Callable[[], AsyncSandboxBackend] = docker_sandboxes,
    first_s: float | None = None,
) -> asyncio.Task | None:
    """Reap orphaned sandboxes in the background where a Docker daemon answers (a sandbox host reaps at
    once: what its rollouts left while it was gone)."""
    try:
        backend = sandboxes()
    except SandboxError:
        return None
    return asyncio.create_task(reap_forever(client, backend, pool=pool, first_s=first_s))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="durable_rollouts.workers.worker", description=__doc__)
    parser.add_argument("--task-queue", default="rollouts")
    # Temporal as the `temporal` CLI reaches it: these flags, else TEMPORAL_* variables, else the CLI's
    # profile, else the embedded stack (contracts/client.py).
    parser.add_argument("--address", default=None, help="Temporal frontend host:port")
    parser.add_argument("--namespace", default=None, help="Temporal namespace")
    parser.add_argument("--api-key", default=None, help="API key (prefer TEMPORAL_API_KEY: argv is visible)")
    parser.add_argument("--tls", action=argparse.BooleanOptionalAction, default=None, help="TLS on or off")
    parser.add_argument("--tls-cert-path", default=None, help="client certificate (PEM) for mutual TLS")
    parser.add_argument("--tls-key-path", default=None, help="client private key (PEM) for mutual TLS")
    parser.add_argument(
        "--tls-ca-path", default=None, help="CA certificate (PEM) the server's is checked against"
    )
    parser.add_argument("--tls-server-name", default=None, help="server name its certificate is checked for")
    parser.add_argument("--profile", default=None, help="profile of the temporal CLI's configuration file")
    parser.add_argument(
        "--store",
        default=None,
        help="run store URL (postgresql://..., sqlite:///dir or a directory; default $ROLLOUTS_STORE, "
        "else $ROLLOUTS_HOME)",
    )
    parser.add_argument(
        "--unsandboxed",
        action="store_true",
        help="run workflow code without the SDK's sandbox (less CPU per workflow task; see build_worker)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve rollouts_* metrics on 127.0.0.1:PORT (default: off)",
    )
    parser.add_argument(
        "--sdk-metrics-port",
        type=int,
        default=None,
        help="serve the Temporal SDK's metrics on 127.0.0.1:PORT (default: --metrics-port + 1 if set)",
    )
    parser.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="address the metrics ports bind (default 127.0.0.1; 0.0.0.0 in a container scraped over a "
        "network)",
    )
    parser.add_argument("--sandbox-host", default=None, help="be a sandbox host of this name (--docker-host)")
    parser.add_argument(
        "--docker-host",
        default=None,
        help="the sandbox host's Docker daemon: unix:///path, tcp://host:port or ssh://user@host "
        "(default: $DOCKER_HOST, else the local socket)",
    )
    parser.add_argument("--sandbox-slots", type=int, default=8, help="sandboxes the host runs at once")
    args = parser.parse_args(argv)
    if args.sandbox_host is not None and args.sandbox_slots < 1:
        parser.error("--sandbox-slots must be at least 1")
    host = None
    if args.sandbox_host is not None:
        docker_host = args.docker_host or os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
        host = SandboxHostSpec(args.sandbox_host, docker_host, args.sandbox_slots)
    elif args.docker_host is not None:
        parser.error("--docker-host needs --sandbox-host NAME")
    sdk_port = args.sdk_metrics_port
    if sdk_port is None and args.metrics_port:  # 0 (a free port) has no neighbour to name
        sdk_port = args.metrics_port + 1
    conn = Connection(
        address=args.address, namespace=args.namespace, api_key=args.api_key, tls=args.tls,
        tls_cert_path=args.tls_cert_path, tls_key_path=args.tls_key_path, tls_ca_path=args.tls_ca_path,
        tls_server_name=args.tls_server_name, profile=args.profile,
    )  # fmt: skip
    try:
        describe(conn)  # a missing profile or certificate file: one line before anything starts
    except ConfigError as e:
        parser.exit(2, f"worker: {e}\n")
    asyncio.run(
        serve(
            conn,
            args.task_queue,
            None,
            store_url=args.store,
            sandboxed=not args.unsandboxed,
            metrics_port=args.metrics_port,
            sdk_metrics_port=sdk_port,
            metrics_host=args.metrics_host,
            sandbox_host=host,
        )
    )


if __name__ == "__main__":
    from durable_rollouts.stack.procs import run_main

    run_main(main)
