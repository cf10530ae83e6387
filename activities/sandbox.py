"""Activities of the coding environment: one per sandbox operation, so each retries and shows in history.

Invariants:
- Idempotent on the rollout id: the sandbox's key is the rollout id, so a retried create reattaches to (or
  replaces) the same container; an observation is stored once per (rollout, turn).
- The turn's parsed action lives in the store (model segment meta ``action``), never in history; sandbox
  activities read it from there. The actions recorded so far are what a recovery replays.
- A dead sandbox surfaces as ``ApplicationError(type="SandboxGone")``, never as command output.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Callable
from typing import Any

from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.heartbeat import heartbeating
from engines.client import EngineClient
from envs import coding
from envs.tool_calls import ToolCallError, parse_tool_call
from errors import RolloutError, SandboxFileError, SandboxPathError
from sandboxes import AsyncSandboxBackend, SandboxError, SandboxGone, SandboxHandle, SandboxSpec
from sandboxes.pool import PoolSettings, SandboxPool, SandboxSlotPending
from store.runstore import RunStore, Segment, model_segment, obs_segment
from workflows.types import ActionResult, SandboxStepInput, TruncationReason

READ_LIMIT = 16384


def _sandbox_error(e: SandboxError) -> ApplicationError:
    gone = isinstance(e, SandboxGone)
    return ApplicationError(str(e)[:500], type=type(e).__name__, non_retryable=gone)


def _store_error(msg: str) -> ApplicationError:
    return ApplicationError(msg, type="StoreError")


class SandboxActivities:
    """Sandbox activities of a worker: the store, the engine (to tokenize observations), the backend."""

    def __init__(
        self,
        store: RunStore,
        engine: EngineClient,
        backend: Callable[[], AsyncSandboxBackend],
        pool: SandboxPool | None = None,
    ) -> None:
        self.store = store
        self.engine = engine
        self._make_backend = backend
        self._backend: AsyncSandboxBackend | None = None
        self.pool = pool or SandboxPool(store.root / "pool.sqlite")

    @property
    def backend(self) -> AsyncSandboxBackend:
        """The sandbox backend, connected on first use (workers of math-only runs never need Docker)."""
        if self._backend is None:
            try:
                self._backend = self._make_backend()
            except SandboxError as e:
                raise _sandbox_error(e) from e
        return self._backend

    # -- lifecycle ------------------------------------------------------------------------------------
    @activity.defn(name="sandbox_create")
    async def sandbox_create(self, inp: SandboxStepInput) -> str:
        """Create (or reattach to) the rollout's sandbox and lay out the task's files; returns its name.

        With a pool (``pool_json``), a slot is held first; none free raises a non-retryable
        ``SandboxSlotPending`` whose details carry the seconds to wait: the workflow backs off durably.
        """
        spec = SandboxSpec.model_validate_json(inp.spec_json)
        if inp.pool_json:
            settings = PoolSettings.model_validate_json(inp.pool_json)
            try:
                await asyncio.to_thread(self.pool.acquire, inp.rollout_id, settings)
            except SandboxSlotPending as e:
                raise ApplicationError(
                    str(e), e.retry_after_s, type="SandboxSlotPending", non_retryable=True
                ) from e
        try:
            handle = await heartbeating(self.backend.create(inp.rollout_id, inp.run_id, spec))
            fresh = await asyncio.to_thread(self.store.get_sandbox, inp.rollout_id)
            if fresh is None or fresh.container_id != handle.container_id:
                task = await asyncio.to_thread(self.store.get_task, inp.run_id, inp.task_id)
                for path, content in task.get("files", {}).items():
                    await self.backend.write_file(handle, path, content)
                await asyncio.to_thread(self.store.put_sandbox, inp.rollout_id, handle)
        except SandboxError as e:
            raise _sandbox_error(e) from e
        return handle.name

    @activity.defn(name="sandbox_destroy")
    async def sandbox_destroy(self, rollout_id: str) -> None:
        """Remove the rollout's sandbox (absent is fine) and give back its pool slot."""
        try:
            await self.backend.destroy(rollout_id)
        except SandboxError as e:
            raise _sandbox_error(e) from e
        await asyncio.to_thread(self.pool.release, rollout_id)

    @activity.defn(name="sandbox_recover")
    async def sandbox_recover(self, inp: SandboxStepInput) -> int:
        """Replace a dead sandbox and replay the rollout's recorded actions before this turn.

        Returns how many actions were replayed. A replay whose command now fails differently is still
        replayed (outputs are not compared); a sandbox that dies again raises SandboxGone.
        """
        spec = SandboxSpec.model_validate_json(inp.spec_json)
        try:
            await self.backend.destroy(inp.rollout_id)
            handle = await self.backend.create(inp.rollout_id, inp.run_id, spec)
            task = await asyncio.to_thread(self.store.get_task, inp.run_id, inp.task_id)
            for path, content in task.get("files", {}).items():
                await self.backend.write_file(handle, path, content)
            replayed = 0
            for seg in await asyncio.to_thread(self.store.segments, inp.rollout_id):
                action = seg.meta.get("action") if seg.kind == "model" else None
                if seg.turn is None or seg.turn >= inp.turn or not action:
                    continue
                await self._replay(handle, action)
                replayed += 1
                activity.heartbeat(replayed)
            await asyncio.to_thread(self.store.put_sandbox, inp.rollout_id, handle)
        except SandboxError as e:
            raise _sandbox_error(e) from e
        return replayed

    async def _replay(self, handle: SandboxHandle, action: dict) -> None:
        args = action.get("arguments", {})
        if action["name"] == "bash":
            await self.backend.exec(handle, args["cmd"])
        elif action["name"] == "write_file":
            with contextlib.suppress(SandboxPathError, SandboxFileError):  # it failed the first time too
                await self.backend.write_file(handle, args["path"], args["content"])

    # -- one turn -------------------------------------------------------------------------------------
    @activity.defn(name="parse_action")
    async def parse_action(self, inp: SandboxStepInput) -> ActionResult:
        """Parse the turn's tool call; a malformed call becomes an error observation for the model."""
        seg = await asyncio.to_thread(self.store.get_segment, inp.rollout_id, model_segment(inp.turn))
        if seg is None:
            raise ApplicationError(
                f"rollout {inp.rollout_id}: turn {inp.turn} was never stored", type="StoreError"
            )
        try:
            text = await self.engine.detokenize(inp.engine_url, inp.model, seg.token_ids)
        except RolloutError as e:
            raise e.to_application_error() from e
        call = parse_tool_call(text.split("<|end|>", 1)[0])
        if isinstance(call, ToolCallError):
            obs = await self._observe(inp, seg, call.message)
            return ActionResult(tool=None, observation_tokens=obs)
        await asyncio.to_thread(
            self.store.update_segment_meta, inp.rollout_id, seg.name, action=call.model_dump(mode="json")
        )
        return ActionResult(tool=call.name)

    @activity.defn(name="sandbox_exec")
    async def sandbox_exec(self, inp: SandboxStepInput) -> ActionResult:
        """Run the turn's bash command; a command over its time limit truncates the rollout."""
        seg, action, handle = await self._load(inp)
        existing = await self._existing_observation(inp)
        if existing is not None:
            return existing
        try:
            res = await heartbeating(self.backend.exec(handle, action["cmd"]))
        except SandboxError as e:
            raise _sandbox_error(e) from e
        reason = TruncationReason.COMMAND_TIMEOUT if res.timed_out else None
        text = coding.format_exec(res.exit_code, res.output, res.timed_out)
        obs = await self._observe(inp, seg, text, truncated_reason=reason)
        return ActionResult(tool="bash", observation_tokens=obs, truncated_reason=reason)

    @activity.defn(name="sandbox_write_file")
    async def sandbox_write_file(self, inp: SandboxStepInput) -> ActionResult:
        seg, action, handle = await self._load(inp)
        try:
            await self.backend.write_file(handle, action["path"], action["content"])
            text = f"wrote {len(action['content'].encode())} bytes to {action['path']}"
        except (SandboxPathError, SandboxFileError) as e:
            text = f"error: {e}"
        except SandboxError as e:
            raise _sandbox_error(e) from e
        return ActionResult(tool="write_file", observation_tokens=await self._observe(inp, seg, text))

    @activity.defn(name="sandbox_read_file")
    async def sandbox_read_file(self, inp: SandboxStepInput) -> ActionResult:
        seg, action, handle = await self._load(inp)
        try:
            data = await self.backend.read_file(handle, action["path"], READ_LIMIT)
            text = data.decode("utf-8", errors="replace")
        except (SandboxPathError, SandboxFileError) as e:
            text = f"error: {e}"
        except SandboxError as e:
            raise _sandbox_error(e) from e
        return ActionResult(tool="read_file", observation_tokens=await self._observe(inp, seg, text))

    @activity.defn(name="sandbox_reward")
    async def sandbox_reward(self, inp: SandboxStepInput) -> ActionResult:
        """Score the rollout: hidden tests run in the sandbox on a copy of the submitted files."""
        t0 = time.monotonic()
        handle = await asyncio.to_thread(self.store.get_sandbox, inp.rollout_id)
        task = await asyncio.to_thread(self.store.get_task, inp.run_id, inp.task_id)
        if handle is None:
            raise ApplicationError(
                f"rollout {inp.rollout_id}: no sandbox", type="SandboxGone", non_retryable=True
            )
        hidden = f".hidden-{secrets.token_hex(6)}"
        try:
            for path, src in task["tests"].items():
                await self.backend.write_file(handle, f"{hidden}/{path}", src)
            files = sorted(set(task.get("files", {})) | set(task.get("reference", {})))
            cmd, _ = coding.scoring_command(files, hidden)
            res = await heartbeating(self.backend.exec(handle, cmd, timeout_s=300))
        except SandboxError as e:
            raise _sandbox_error(e) from e
        reward, passed, total = coding.reward_from_junit(res.output, coding.count_tests(task["tests"]))
        activity.logger.info("rollout %s: %d/%d hidden tests passed", inp.rollout_id, passed, total)
        return ActionResult(tool="submit", done=True, reward=reward, reward_s=time.monotonic() - t0)

    # -- helpers --------------------------------------------------------------------------------------
    async def _load(self, inp: SandboxStepInput) -> tuple[Segment, dict, SandboxHandle]:
        seg = await asyncio.to_thread(self.store.get_segment, inp.rollout_id, model_segment(inp.turn))
        handle = await asyncio.to_thread(self.store.get_sandbox, inp.rollout_id)
        if seg is None or "action" not in seg.meta:
            raise ApplicationError(
                f"rollout {inp.rollout_id}: turn {inp.turn} has no action", type="StoreError"
            )
        if handle is None:
            raise ApplicationError(
                f"rollout {inp.rollout_id}: no sandbox", type="SandboxGone", non_retryable=True
            )
        return seg, seg.meta["action"]["arguments"], handle

    async def _existing_observation(self, inp: SandboxStepInput) -> ActionResult | None:
        obs = await asyncio.to_thread(self.store.get_segment, inp.rollout_id, obs_segment(inp.turn))
        if obs is None:
            return None
        reason = obs.meta.get("truncated_reason")
        return ActionResult(tool="bash", observation_tokens=len(obs.token_ids), truncated_reason=reason)

    async def _observe(self, inp: SandboxStepInput, seg: Segment, text: str, **meta: Any) -> int:
        """Store the observation of this turn as a ``tool`` message (loss mask 0); returns its length."""
        name = obs_segment(inp.turn)
        existing = await asyncio.to_thread(self.store.get_segment, inp.rollout_id, name)
        if existing is None:
            try:
                ids = await self.engine.tokenize_chat(
                    inp.engine_url, inp.model, [{"role": "tool", "content": text}]
                )
            except RolloutError as e:
                raise e.to_application_error() from e
            obs = Segment(
                name=name, kind="observation", turn=inp.turn, start=seg.end, token_ids=ids, meta=meta
            )
            existing = await asyncio.to_thread(self.store.put_segment, inp.rollout_id, obs)
        return len(existing.token_ids)

    def all(self) -> list:
        return [
            self.sandbox_create,
            self.sandbox_destroy,
            self.sandbox_recover,
            self.parse_action,
            self.sandbox_exec,
            self.sandbox_write_file,
            self.sandbox_read_file,
            self.sandbox_reward,
        ]
