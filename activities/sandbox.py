"""Sandbox lifecycle activities: create (with the task's plan), destroy, recover. One activity each, so
each retries and shows in history.

Invariants:
- Idempotent on the rollout id: the sandbox's key is the rollout id, so a retried create reattaches to (or
  replaces) the same container, and its files and setup are laid out once per container.
- The sandbox a task gets is the environment's choice (``Environment.sandbox``: image, limits, files,
  setup), derived from the run's default spec.
- A dead sandbox surfaces as ``SandboxGone``, never as command output; recovery replays the actions the
  environment recorded with earlier turns into a fresh container.
- A plan's image (``SandboxPlan.image_build``) is built by the daemon that runs the sandbox, before its
  container is created, once per tag and host across every worker (``sandboxes.images``: the claim is in
  the store); a failed build is an ``EnvironmentFailure`` naming the task and the log's last lines.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from temporalio import activity
from temporalio.common import RetryPolicy

from durable_rollouts.activities.calls import Options, options
from durable_rollouts.activities.heartbeat import heartbeating
from durable_rollouts.contracts.sandbox import (
    SandboxCreated,
    SandboxPlaceInput,
    SandboxPlacement,
    SandboxStepInput,
)
from durable_rollouts.environments import registry
from durable_rollouts.environments.base import SandboxPlan, TurnContext, calling
from durable_rollouts.environments.registry import env_part
from durable_rollouts.errors import EnvironmentFailure, RolloutError, SandboxGone, SandboxPathError, names
from durable_rollouts.sandboxes import AsyncSandboxBackend, SandboxHandle
from durable_rollouts.sandboxes.base import BoundSandbox, SandboxSpec, owner_key, sibling_key
from durable_rollouts.sandboxes.hosts import SandboxHosts
from durable_rollouts.sandboxes.images import ImageBuilds, ensure_image
from durable_rollouts.sandboxes.pool import SandboxPool
from durable_rollouts.store import RunStore

SANDBOX_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    maximum_interval=timedelta(seconds=10),
    maximum_attempts=5,
    non_retryable_error_types=names(SandboxGone, SandboxPathError),
)
"""Sandbox operations: a daemon hiccup is retried; a lost sandbox, a bad path or a failed setup is not (an
environment failure by its own flag, unless the environment declared it transient)."""


class SandboxActivities:
    """Sandbox activities of a worker: the store, the sandbox backend (connected on first use), the pool."""

    def __init__(
        self, store: RunStore, backend: Callable[[], AsyncSandboxBackend], pool: SandboxPool | None = None
    ) -> None:
        self.store = store
        self._make_backend = backend
        self._backend: AsyncSandboxBackend | None = None
        self.pool = pool if isinstance(pool, SandboxHosts) else SandboxHosts(pool.db if pool else store)
        """The pool's slots, on the worker's count (``placement = "local"``) or on registered hosts."""

    @property
    def backend(self) -> AsyncSandboxBackend:
        """The sandbox backend, connected on first use (workers of sandbox-free runs never need Docker)."""
        if self._backend is None:
            try:
                self._backend = self._make_backend()
            except RolloutError as e:
                raise e.to_application_error() from e
        return self._backend

    async def bound(self, rollout_id: str) -> BoundSandbox | None:
        """The rollout's live sandbox (None when it has none)."""
        handle = await asyncio.to_thread(self.store.get_sandbox, rollout_id)
        return None if handle is None else BoundSandbox(self.backend, handle)

    def siblings(self, rollout_id: str, run_id: str) -> RolloutSandboxes:
        """The rollout's further sandboxes (``environments.base.Sandboxes``), e.g. a separate verifier's."""
        return RolloutSandboxes(self, rollout_id, run_id)

    async def _plan(self, inp: SandboxStepInput) -> tuple[Any, SandboxPlan | None]:
        ref = inp.ref
        env = registry.get(ref.env)
        row = await asyncio.to_thread(self.store.get_task, ref.run_id, ref.task_id)
        with calling(env, "validate_task", ref.rollout_id):
            task = env.validate_task(row, where=f"run {ref.run_id} task {ref.task_id}")
        with calling(env, "sandbox", inp.rollout_id):
            return task, env.sandbox(task, inp.spec)

    @options(Options(timedelta(seconds=30), SANDBOX_RETRY))
    @activity.defn
    async def sandbox_place(self, inp: SandboxPlaceInput) -> SandboxPlacement:
        """Hold a slot on a live sandbox host for the rollout (idempotent; ``placement = "hosts"``); any
        worker of the store runs it. None free raises a non-retryable ``SandboxSlotPending`` with the
        seconds to wait in its details: the workflow backs off durably, as for the local pool."""
        try:
            host = await asyncio.to_thread(self.pool.place, inp.rollout_id, inp.pool, frozenset(inp.avoid))
        except RolloutError as e:
            raise e.to_application_error() from e
        # A run on an environment's queue uses the host's queue for that environment (workers/sandbox_host.py)
        return SandboxPlacement(
            host=host.name, task_queue=host.task_queue + env_part(activity.info().task_queue)
        )

    @options(Options(timedelta(seconds=30), SANDBOX_RETRY))
    @activity.defn
    async def sandbox_release(self, rollout_id: str) -> None:
        """Give back a rollout's slot without its host (a host that is gone cannot destroy the container;
        its reaper removes it when the host comes back). Absent is fine."""
        await asyncio.to_thread(self.pool.release, rollout_id)

    # Long enough for an image build (sandboxes.images); a dead worker is noticed by the heartbeat.
    @options(Options(timedelta(minutes=45), SANDBOX_RETRY, heartbeat=timedelta(seconds=30)))
    @activity.defn
    async def sandbox_create(self, inp: SandboxStepInput) -> SandboxCreated:
        """Create (or reattach to) the rollout's sandbox, lay out the task's files and run its setup.

        Returns whether the task got a sandbox (not when the environment gives it none) and the host
        running it (the Docker daemon's name: the rollout's ``RolloutSandboxHost``). With a pool, a slot
        is held first; none free raises a non-retryable ``SandboxSlotPending`` whose details carry the
        seconds to wait: the workflow backs off durably.
        """
        try:
            _, plan = await self._plan(inp)
            if plan is None:
                return SandboxCreated(created=False)
            if inp.pool is not None and inp.pool.placement == "local":  # "hosts": sandbox_place held it
                await asyncio.to_thread(self.pool.acquire, inp.rollout_id, inp.pool)
            await heartbeating(self._image(plan, inp))
            handle = await heartbeating(self.backend.create(inp.rollout_id, inp.ref.run_id, plan.spec))
            known = await asyncio.to_thread(self.store.get_sandbox, inp.rollout_id)
            if known is None or known.container_id != handle.container_id:
                try:
                    await heartbeating(self._lay_out(handle, plan, inp.rollout_id))
                except EnvironmentFailure:
                    # A failed setup is final: the rollout never holds this sandbox, so its own destroy
                    # step would not remove it; removed here, and a local slot given back.
                    await self.backend.destroy(inp.rollout_id)
                    if inp.pool is not None and inp.pool.placement == "local":
                        await asyncio.to_thread(self.pool.release, inp.rollout_id)
                    raise
                await asyncio.to_thread(self.store.put_sandbox, inp.rollout_id, handle)
            host = await self.backend.host()
        except RolloutError as e:
            raise e.to_application_error() from e
        return SandboxCreated(created=True, host=host, timeout_s=plan.timeout_s)

    async def _image(self, plan: SandboxPlan, inp: SandboxStepInput) -> None:
        """Build the plan's image on this backend's daemon unless it has it (once per tag and host), or,
        with ``sandbox_pool.registry``, once per tag, pulled by digest on every other host."""
        if plan.image_build is None:
            return
        host = await self.backend.host() or "local"
        where = inp.pool.registry if inp.pool is not None else None
        await ensure_image(
            ImageBuilds(self.store.db), self.backend, host, plan.image_build, inp.rollout_id, registry=where
        )

    async def _lay_out(self, handle: SandboxHandle, plan: SandboxPlan, rollout_id: str) -> None:
        for path, content in plan.files.items():
            await self.backend.write_file(handle, path, content)
        for cmd in plan.setup:
            res = await self.backend.exec(handle, cmd, plan.setup_timeout_s)
            if res.exit_code != 0 or res.timed_out:
                status = "timed out" if res.timed_out else f"exit code {res.exit_code}"
                raise EnvironmentFailure(
                    f"rollout {rollout_id}: setup {cmd[:80]!r}: {status}: {res.output[-300:]}"
                )

    @options(
        Options(
            timedelta(minutes=2), RetryPolicy(maximum_interval=timedelta(seconds=30), maximum_attempts=20)
        )
    )
    @activity.defn
    async def sandbox_destroy(self, rollout_id: str) -> None:
        """Remove the rollout's sandbox and its further sandboxes (absent is fine) and give back its pool
        slot."""
        try:
            own = await asyncio.to_thread(self.store.get_sandbox, rollout_id)
            await self.backend.destroy(rollout_id)
            # Its further sandboxes (RolloutSandboxes) carry its run's label; they exist only beside a stored
            # sandbox of its own, so a rollout without one has none to look for.
            for info in await self.backend.list_containers(own.run_id) if own is not None else []:
                if info.key != rollout_id and owner_key(info.key) == rollout_id:
                    await self.backend.destroy(info.key)
        except RolloutError as e:
            raise e.to_application_error() from e
        await asyncio.to_thread(self.pool.release, rollout_id)

    @options(Options(timedelta(minutes=15), SANDBOX_RETRY, heartbeat=timedelta(seconds=60)))
    @activity.defn
    async def sandbox_recover(self, inp: SandboxStepInput) -> int:
        """Replace a dead sandbox and replay the rollout's recorded actions before this turn.

        Returns how many actions were replayed. A replay whose command now fails differently is still
        replayed (outputs are not compared); a sandbox that dies again raises SandboxGone.
        """
        try:
            task, plan = await self._plan(inp)
            if plan is None:
                raise SandboxGone(f"rollout {inp.rollout_id}: no sandbox to recover")
            await self.backend.destroy(inp.rollout_id)
            await heartbeating(self._image(plan, inp))
            handle = await self.backend.create(inp.rollout_id, inp.ref.run_id, plan.spec)
            await self._lay_out(handle, plan, inp.rollout_id)
            env = registry.get(inp.ref.env)
            ctx = TurnContext(task=task, rollout_id=inp.rollout_id, turn=inp.turn, last_turn=False,
                              sandbox=BoundSandbox(self.backend, handle))  # fmt: skip
            replayed = 0
            for seg in await asyncio.to_thread(self.store.segments, inp.rollout_id):
                action = seg.meta.get("action") if seg.kind == "model" else None
                if seg.turn is None or seg.turn >= inp.turn or not action:
                    continue
                with calling(env, "replay", inp.rollout_id):
                    await env.replay(ctx, action)
                replayed += 1
                activity.heartbeat(replayed)
            await asyncio.to_thread(self.store.put_sandbox, inp.rollout_id, handle)
        except RolloutError as e:
            raise e.to_application_error() from e
        return replayed

    def all(self) -> list:
        return [self.sandbox_create, self.sandbox_destroy, self.sandbox_recover]

    def placement(self) -> list:
        """The activities any worker of the store runs for sandbox hosts (the run's own queue)."""
        return [self.sandbox_place, self.sandbox_release]


class RolloutSandboxes:
    """A rollout's further sandboxes (``environments.base.Sandboxes``) on this worker's backend, each keyed
    ``<rollout id>#<name>`` (`sandboxes.base.sibling_key`): a retried step reattaches to the same container,
    whose files and setup are laid out once (a marker in its /tmp); its image is built like the rollout's
    own (once per tag and host), on this daemon. ``sandbox_destroy`` of the rollout removes them."""

    LAID_OUT = "/tmp/.dr-laid-out"

    def __init__(self, acts: SandboxActivities, rollout_id: str, run_id: str) -> None:
        self.acts, self.rollout_id, self.run_id = acts, rollout_id, run_id

    async def open(self, name: str, plan: SandboxPlan) -> BoundSandbox:
        key = sibling_key(self.rollout_id, name)
        backend = self.acts.backend
        if plan.image_build is not None:
            host = await backend.host() or "local"
            await ensure_image(ImageBuilds(self.acts.store.db), backend, host, plan.image_build, key)
        handle = await backend.create(key, self.run_id, plan.spec)
        if (await backend.exec(handle, f"test -e {self.LAID_OUT}", 60)).exit_code != 0:
            await self.acts._lay_out(handle, plan, key)
            await backend.exec(handle, f"touch {self.LAID_OUT}", 60)
        return BoundSandbox(backend, handle)

    async def base_spec(self) -> SandboxSpec:
        handle = await asyncio.to_thread(self.acts.store.get_sandbox, self.rollout_id)
        if handle is None:
            raise SandboxGone(f"rollout {self.rollout_id}: its own sandbox is gone")
        return handle.spec
