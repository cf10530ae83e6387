"""A worker as a sandbox host: its own Docker daemon and capacity, registered in the store, and a task queue
of its own for the sandbox activities of the rollouts placed on it (``sandbox_pool.placement = "hosts"``).

    rollouts worker --store postgresql://... --sandbox-host h1 --docker-host unix:///run/docker-h1.sock \\
        --sandbox-slots 16

Invariants:
- The host heartbeats into the store every `HEARTBEAT_S` seconds while its worker runs; on a clean stop it
  leaves (nothing new is placed on it). A host that dies simply stops heartbeating: after the run's
  ``host_timeout_s`` nothing is placed on it, and its rollouts move (workflows/sandbox_steps.py).
- The host queue's worker runs only sandbox activities and env steps, with this host's daemon; every
  other activity and every workflow runs on the run's own queue, on any worker.
- A run started on an environment's queue (environments/fleet.py) is placed on the host's queue for that
  environment (the registered queue plus ``registry.env_part`` of the run's queue), polled only by a host
  that loaded the environment at that version: a host without it never picks the rollout's sandbox work
  up, so the rollout leaves it (``host_timeout_s``) for another, as for a host that is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import docker
from temporalio.client import Client
from temporalio.worker import Worker

from durable_rollouts.activities.environment import EnvironmentActivities
from durable_rollouts.activities.harness import HarnessActivities
from durable_rollouts.activities.sandbox import SandboxActivities
from durable_rollouts.engines.client import EngineClient
from durable_rollouts.environments.registry import env_part, env_queue
from durable_rollouts.errors import SandboxNotReady
from durable_rollouts.gateway.server import GatewayServer
from durable_rollouts.sandboxes import AsyncSandboxBackend, DockerBackend
from durable_rollouts.sandboxes.hosts import SandboxHosts, host_queue
from durable_rollouts.store import RunStore

log = logging.getLogger(__name__)

HEARTBEAT_S = 2.0
"""Seconds between a host's heartbeats (runs should keep ``host_timeout_s`` several times longer)."""


@dataclass(frozen=True)
class SandboxHostSpec:
    """This worker's sandbox host: its name, its Docker daemon and how many sandboxes it runs at once."""

    name: str
    docker_host: str
    """``unix:///path``, ``tcp://host:port`` or ``ssh://user@host`` (the ssh client is used)."""
    slots: int


def docker_at(docker_host: str) -> Callable[[], AsyncSandboxBackend]:
    """A sandbox backend factory on the Docker daemon at ``docker_host``."""

    def make() -> AsyncSandboxBackend:
        try:
            client = docker.DockerClient(
                base_url=docker_host,
                timeout=120,
                max_pool_size=64,
                use_ssh_client=docker_host.startswith("ssh://"),
            )
        except docker.errors.DockerException as exc:
            raise SandboxNotReady(f"docker daemon {docker_host} unreachable: {exc}") from exc
        return AsyncSandboxBackend(DockerBackend(client))

    return make


def build_host_workers(
    client: Client,
    task_queue: str,
    store: RunStore,
    engine: EngineClient,
    spec: SandboxHostSpec,
    envs: dict[str, str],
) -> list[Worker]:
    """The workers of the host's own queue and of its per-environment variants (one per environment in
    ``envs``, name -> ``env_version``): sandbox activities and env steps on this host's daemon."""
    sandbox_acts = SandboxActivities(store, docker_at(spec.docker_host))
    env_acts = EnvironmentActivities(store, engine, sandbox_acts)
    harness_acts = HarnessActivities(store, engine, sandbox_acts, GatewayServer(store))
    base = host_queue(task_queue, spec.name)
    queues = [base] + [base + env_part(env_queue(task_queue, n, v)) for n, v in sorted(envs.items())]
    return [
        Worker(
            client,
            task_queue=q,
            activities=sandbox_acts.all() + env_acts.all() + harness_acts.all(),
            max_concurrent_activities=max(16, 4 * spec.slots),
        )
        for q in queues
    ]


@contextlib.asynccontextmanager
async def registered(store: RunStore, task_queue: str, spec: SandboxHostSpec) -> AsyncIterator[SandboxHosts]:
    """The host registered (and heartbeating) while the block runs; it leaves when the block ends."""
    hosts = SandboxHosts(store)
    queue = host_queue(task_queue, spec.name)
    await asyncio.to_thread(hosts.register, spec.name, queue, spec.docker_host, spec.slots)

    async def beat() -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            try:
                await asyncio.to_thread(hosts.heartbeat, spec.name)
            except Exception as e:  # a store hiccup skips one beat; the next one retries
                log.warning("sandbox host %s: heartbeat failed: %s", spec.name, e)

    task = asyncio.create_task(beat())
    try:
        yield hosts
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await asyncio.to_thread(hosts.leave, spec.name)
