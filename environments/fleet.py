"""Which live workers can run an environment: asked of Temporal, at submit.

A worker polls, besides its task queue, one queue per environment it loaded at start (``registry.env_queue``:
the queue plus the environment's name and ``env_version``), with every workflow and activity registered
there. A run is started on its environment's queue, so its workflows (children and continue-as-new inherit
the queue), its activities and its local activities only ever run on a worker that loaded the environment
at that version: a worker started before the environment was installed never gets any of its work.

Invariants:
- `require_worker` is the submit check: the environment's queue must have a poller that polled within
  `LIVE_POLLER_S` (Temporal's long polls last about a minute, so a live idle worker always has); else the
  run is refused with one line naming the environment and the fix, and nothing is started.
- A run that was accepted and then loses its last capable worker waits (its tasks stay queued) until one
  polls again; it never fails for want of one.
"""

from __future__ import annotations

import time

from temporalio.api.enums.v1 import TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest
from temporalio.client import Client

from durable_rollouts.environments import registry
from durable_rollouts.errors import ConfigError

LIVE_POLLER_S = 90.0
"""A poller seen this recently is a live worker (an idle worker re-polls at least once a minute)."""

RESTART_HINT = (
    "restart or upgrade the workers (`rollouts stack down && rollouts stack up -d`, or restart "
    "`rollouts worker`): a worker loads the environments installed when it starts"
)


async def live_pollers(client: Client, queue: str, within_s: float = LIVE_POLLER_S) -> list[str]:
    """The identities of the workers that polled ``queue``'s workflow tasks within ``within_s`` seconds."""
    resp = await client.workflow_service.describe_task_queue(
        DescribeTaskQueueRequest(
            namespace=client.namespace,
            task_queue=TaskQueue(name=queue),
            task_queue_type=TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW,
        )
    )
    now = time.time()
    return [p.identity for p in resp.pollers if now - p.last_access_time.ToMicroseconds() / 1e6 <= within_s]


async def require_worker(client: Client, task_queue: str, env: str) -> str:
    """The queue to start a run of ``env`` on (its environment's, at the version this process loads),
    once a live worker polls it.

    Raises:
        ConfigError: ``env`` does not load here, or no live worker of ``task_queue`` loaded it at this
            version (one line: the environment, its version and the fix).
    """
    queue = registry.run_queue(task_queue, env)
    if not await live_pollers(client, queue):
        version = registry.get(env).env_version
        raise ConfigError(
            f"run.env: no live worker of task queue {task_queue!r} can load environment {env!r} "
            f"(env_version {version}); {RESTART_HINT}"
        )
    return queue
