"""A rollout worker process: polls one task queue and runs every workflow and activity of the project.

Run as ``python -m workers.worker --address HOST:PORT --task-queue Q`` or ``rollouts worker``; it stops
cleanly on SIGTERM or SIGINT. With ``--metrics-port P`` it serves the project's ``rollouts_*`` metrics on
127.0.0.1:P and the Temporal SDK's own ``temporal_*`` metrics on ``--sdk-metrics-port`` (default P + 1);
without it, no port is bound (see ``metrics``).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

from temporalio.client import Client
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from activities.dispatch import DispatchActivities
from activities.environment import EnvironmentActivities
from activities.rollout import RolloutActivities
from activities.sandbox import SandboxActivities
from contracts.client import connect
from engines.client import EngineClient
from metrics.serve import ActivitiesInFlight, serve_metrics, temporal_runtime
from sandboxes import AsyncSandboxBackend, DockerBackend, SandboxError
from sandboxes.pool import SandboxPool
from sandboxes.reaper import reap_forever
from store import RunStore, open_store
from workflows.group import GroupWorkflow
from workflows.rollout import RolloutWorkflow
from workflows.run import RunWorkflow

WORKFLOWS = [RunWorkflow, GroupWorkflow, RolloutWorkflow]


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
    pool = SandboxPool(store)  # the pool state lives in the store, shared by its workers on any host
    sandbox_acts = SandboxActivities(store, sandboxes, pool)
    env_acts = EnvironmentActivities(store, engine, sandbox_acts)
    rollout_acts = RolloutActivities(store, engine, env_acts)
    dispatch_acts = DispatchActivities(store, pool)
    runner: dict[str, Any] = {} if sandboxed else {"workflow_runner": UnsandboxedWorkflowRunner()}
    return Worker(
        client,
        task_queue=task_queue,
        workflows=WORKFLOWS,
        activities=rollout_acts.all() + env_acts.all() + sandbox_acts.all() + dispatch_acts.all(),
        max_concurrent_activities=256,
        max_concurrent_workflow_tasks=64,
        interceptors=[ActivitiesInFlight()],
        **runner,
    )


async def serve(
    address: str,
    task_queue: str,
    namespace: str = "default",
    home: Path | None = None,
    store_url: str | None = None,
    sandboxed: bool = True,
    metrics_port: int | None = None,
    sdk_metrics_port: int | None = None,
    metrics_host: str = "127.0.0.1",
) -> None:
    """Run a worker until SIGTERM/SIGINT; serve metrics on ``metrics_host`` at the ports given (None: not
    served). Bind ``0.0.0.0`` only where a scraper on another host (a compose network) must reach them."""
    client = await connect(address, namespace, runtime=temporal_runtime(sdk_metrics_port, metrics_host))
    store = open_store(store_url, home=home)
    engine = EngineClient()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    reaper = _start_reaper(client, SandboxPool(store))
    try:
        with serve_metrics(metrics_port, metrics_host) as port:
            async with build_worker(client, task_queue, store, engine, sandboxed=sandboxed):
                served = f", metrics on :{port}" if port is not None else ""
                print(f"worker polling {task_queue!r} on {address}{served}", flush=True)
                await stop.wait()
    finally:
        if reaper is not None:
            reaper.cancel()
        await engine.aclose()


def _start_reaper(client: Client, pool: SandboxPool) -> asyncio.Task | None:
    """Reap orphaned sandboxes in the background where a Docker daemon answers."""
    try:
        backend = docker_sandboxes()
    except SandboxError:
        return None
    return asyncio.create_task(reap_forever(client, backend, pool=pool))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="workers.worker", description=__doc__)
    parser.add_argument("--address", default="127.0.0.1:7233")
    parser.add_argument("--task-queue", default="rollouts")
    parser.add_argument("--namespace", default="default")
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
    args = parser.parse_args(argv)
    sdk_port = args.sdk_metrics_port
    if sdk_port is None and args.metrics_port:  # 0 (a free port) has no neighbour to name
        sdk_port = args.metrics_port + 1
    asyncio.run(
        serve(
            args.address,
            args.task_queue,
            args.namespace,
            store_url=args.store,
            sandboxed=not args.unsandboxed,
            metrics_port=args.metrics_port,
            sdk_metrics_port=sdk_port,
            metrics_host=args.metrics_host,
        )
    )


if __name__ == "__main__":
    main()
