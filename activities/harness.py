"""Activities of harness rollouts: the harness's run in its sandbox (with the rollout's gateway served
beside it) and each of its model calls.

Invariants:
- ``harness_run`` runs on the worker of the sandbox's host (the only process that can serve the socket the
  sandbox mounts). It starts the harness once per sandbox and watches it with heartbeats; a retry (its
  worker died) serves the gateway again and watches the same process. Cancelled, it stops the harness.
  Once the harness exited, the files its environment keeps are stored with the rollout (first write stands).
- A harness that exits non-zero, or exits 0 without one answered model call, is `EnvironmentFailure` (the
  rollout fails ``environment:`` with its last output lines); a sandbox that is gone is ``infra``.
- ``gateway_call`` is a model call (engine retry policy, engine failover): idempotent on (rollout id,
  call index) through ``gateway.turn``; it wakes the waiting request when the gateway is in this process.
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import timedelta

from temporalio import activity
from temporalio.common import RetryPolicy

from durable_rollouts.activities.calls import Options, options
from durable_rollouts.activities.heartbeat import heartbeating
from durable_rollouts.activities.sandbox import SandboxActivities
from durable_rollouts.contracts.harness import (
    GatewayCallInput,
    GatewayCallResult,
    HarnessExit,
    HarnessRunInput,
)
from durable_rollouts.engines.client import EngineClient
from durable_rollouts.engines.watchdog import watching
from durable_rollouts.environments import registry
from durable_rollouts.environments.base import Sandbox, calling
from durable_rollouts.errors import (
    EnvironmentFailure,
    RolloutError,
    SandboxFileError,
    SandboxGone,
    SandboxPathError,
    names,
)
from durable_rollouts.gateway import harness
from durable_rollouts.gateway.server import GatewayServer, gateway_key
from durable_rollouts.gateway.turn import GatewayTurns
from durable_rollouts.store import RunStore

POLL_S = 1.0
"""How often the harness's exit is looked for (one exec in its sandbox)."""
HARNESS_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    maximum_interval=timedelta(seconds=10),
    maximum_attempts=10,
    non_retryable_error_types=names(SandboxGone),
)
"""A dead worker's harness activity is retried (on the same host's queue) and watches the same process."""


class HarnessActivities:
    """The harness activities of a worker: the store, the engine, its sandboxes and its gateways."""

    def __init__(
        self, store: RunStore, engine: EngineClient, sandboxes: SandboxActivities, gateway: GatewayServer
    ) -> None:
        self.store = store
        self.sandboxes = sandboxes
        self.gateway = gateway
        self.turns = GatewayTurns(store, engine)

    # As long as a task's agent may run; a dead worker is noticed by the heartbeat within 30 s.
    @options(
        Options(timedelta(hours=24), HARNESS_RETRY, heartbeat=timedelta(seconds=30), wait_cancellation=True)
    )
    @activity.defn
    async def harness_run(self, inp: HarnessRunInput) -> HarnessExit:
        """Serve the rollout's gateway, run its harness (once) and wait for it to exit."""
        ref = inp.ref
        rid = ref.rollout_id
        try:
            box = await self.sandboxes.bound(rid)
            if box is None:
                await self.gateway.stop(rid)  # the socket file a SIGKILLed worker's gateway left, if any
                raise SandboxGone(f"rollout {rid}: no sandbox to run the harness in")
            env = registry.get(ref.env)
            row = await asyncio.to_thread(self.store.get_task, ref.run_id, ref.task_id)
            with calling(env, "validate_task", rid):
                task = env.validate_task(row, where=f"run {ref.run_id} task {ref.task_id}")
            with calling(env, "harness_command", rid):
                cmd = env.harness_command(task)  # type: ignore[attr-defined]
            client = activity.client()

            async def signal(rollout_id: str, index: int) -> None:
                await client.get_workflow_handle(rollout_id).signal("gateway_call", index)

            await self.gateway.serve(rid, ref.model, signal)
            try:
                env_vars = harness.gateway_env(cmd, gateway_key(rid, self.gateway.secret), ref.model)
                await harness.start(box, cmd, env_vars)
                while (code := await harness.poll(box)) is None:
                    activity.heartbeat()
                    await asyncio.sleep(POLL_S)
                tail = await harness.tail(box)
                await self._keep(rid, box, cmd.keep)
            except asyncio.CancelledError:
                with contextlib.suppress(Exception):
                    await asyncio.shield(harness.stop(box))
                raise
            finally:
                await self.gateway.stop(rid)
            calls = await asyncio.to_thread(self.store.gateway_calls, rid)
            if code != 0:
                raise EnvironmentFailure(f"rollout {rid}: harness exited with code {code}: {tail[-400:]}")
            if not any(c.answered for c in calls):
                raise EnvironmentFailure(
                    f"rollout {rid}: harness exited 0 without calling the model: {tail[-400:]}"
                )
            return HarnessExit(exit_code=code, tail=tail[-2000:])
        except RolloutError as e:
            raise e.to_application_error() from e

    async def _keep(self, rid: str, box: Sandbox, paths: tuple[str, ...]) -> None:
        """Store the files the environment keeps from its harness (or why one could not be read)."""
        for path in paths:
            data, error = None, None
            try:
                data = await harness.read_kept(box, path)
            except (SandboxFileError, SandboxPathError) as e:
                error = str(e)
            await asyncio.to_thread(self.store.keep_harness_file, rid, path, data, error)

    # start-to-close is derived from engine.request_timeout_s by the caller; retry from [engine]
    @options(Options(timedelta(minutes=5), heartbeat=timedelta(seconds=10), wait_cancellation=True))
    @activity.defn
    async def gateway_call(self, inp: GatewayCallInput) -> GatewayCallResult:
        """Answer one call of a rollout's harness (``gateway.turn``); its tokens go to the store."""
        info = activity.info()
        queued = max(0.0, (info.started_time - info.current_attempt_scheduled_time).total_seconds())
        try:
            with watching(inp.stall_timeout_s):
                result = await heartbeating(self.turns.answer(inp, info.attempt, queued))
        except RolloutError as e:
            raise e.to_application_error() from e
        self.gateway.notify(inp.ref.rollout_id, inp.index)
        return result

    def all(self) -> list:
        return [self.harness_run, self.gateway_call]
