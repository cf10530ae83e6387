"""The coding environment's steps inside RolloutWorkflow (deterministic: activities only).

Invariants:
- One sandbox per rollout, keyed by the rollout id; it is destroyed when the rollout ends, however it ends
  (the workflow's finalize path; a reaper covers terminated workflows).
- A create that finds no free pool slot, or a sandbox backend that is not ready, waits on a durable timer
  and asks again (the pool says how long; else exponential back-off to 30 s); waiting for a slot never
  fails the rollout (only its own timeout ends the wait), a backend not ready after ~2.5 min does.
  The record counts the waits (``sandbox_slot_waits``).
- A sandbox that dies is recovered by replaying the rollout's recorded actions into a fresh one (the
  record counts the replays); if that fails too, the rollout fails as ``infra: SandboxGone``. A dead
  sandbox is never scored.
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from workflows.types import ActionResult, EnvStepResult, RolloutInput, SandboxStepInput

SANDBOX_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    maximum_interval=timedelta(seconds=10),
    maximum_attempts=5,
    non_retryable_error_types=["SandboxGone", "SandboxPathError"],
)
MAX_RECOVERIES = 2
NOT_READY = ("SandboxSlotPending", "SandboxNotReady")
"""Create failures that wait (durable timer) and try again instead of failing the rollout: no pool slot
yet (until the rollout's timeout), or the daemon not ready after the activity's own retries."""
MAX_NOT_READY_WAITS = 8
"""Waits (~2.5 min in all) before a backend that stays not ready fails the rollout as infra."""
TOOL_ACTIVITY = {
    "bash": "sandbox_exec",
    "write_file": "sandbox_write_file",
    "read_file": "sandbox_read_file",
    "submit": "sandbox_reward",
}


def _step_input(inp: RolloutInput, engine: str, turn: int, with_spec: bool = False) -> SandboxStepInput:
    return SandboxStepInput(
        run_id=inp.run_id,
        rollout_id=inp.rollout_id,
        task_id=inp.task_id,
        turn=turn,
        engine_url=engine,
        model=inp.engine.model,
        spec_json=inp.sandbox_spec_json if with_spec else "",
        pool_json=inp.pool_json if with_spec else "",
    )


def _is_gone(e: ActivityError) -> bool:
    return isinstance(e.cause, ApplicationError) and e.cause.type == "SandboxGone"


class CodingSteps:
    """The sandbox side of one coding rollout; counts recoveries for the record."""

    def __init__(self, inp: RolloutInput, engine: str) -> None:
        self.inp, self.engine = inp, engine
        self.replays = 0
        self.slot_waits = 0

    async def create(self) -> None:
        """Create the sandbox; while the pool has no free slot, wait (durable timer) and ask again."""
        waits = 0
        while True:
            try:
                await workflow.execute_activity(
                    "sandbox_create",
                    _step_input(self.inp, self.engine, 0, with_spec=True),
                    start_to_close_timeout=timedelta(minutes=5),
                    heartbeat_timeout=timedelta(seconds=30),
                    retry_policy=SANDBOX_RETRY,
                )
                return
            except ActivityError as e:
                cause = e.cause
                if not (isinstance(cause, ApplicationError) and cause.type in NOT_READY):
                    raise
                if cause.type == "SandboxNotReady" and waits >= MAX_NOT_READY_WAITS:
                    raise  # not a passing hiccup (e.g. the image is missing): fail as infra
                # the pool's estimate of when its slot is ready; else exponential back-off
                hint = float(cause.details[0]) if cause.details else 2.0 ** min(waits + 1, 5)
            waits += 1
            self.slot_waits += 1
            delay = min(30.0, max(0.5, hint))
            workflow.set_current_details(f"waiting for a sandbox slot ({waits}): {cause.message}"[:300])
            await workflow.sleep(delay)

    async def destroy(self) -> None:
        await workflow.execute_activity(
            "sandbox_destroy",
            self.inp.rollout_id,
            start_to_close_timeout=timedelta(minutes=2),
            retry_policy=RetryPolicy(maximum_interval=timedelta(seconds=30), maximum_attempts=20),
        )

    async def step(self, turn: int, score_only: bool = False) -> EnvStepResult:
        """Parse the turn's tool call and run it; submit() (or score_only) scores the rollout."""
        if score_only:
            return _env_result(await self._sandbox("submit", turn))
        parsed: ActionResult = await workflow.execute_activity(
            "parse_action",
            _step_input(self.inp, self.engine, turn),
            result_type=ActionResult,
            start_to_close_timeout=timedelta(seconds=60),
            retry_policy=RetryPolicy(maximum_attempts=5, maximum_interval=timedelta(seconds=5)),
        )
        if parsed.tool is None:
            return EnvStepResult(done=False, observation_tokens=parsed.observation_tokens)
        return _env_result(await self._sandbox(parsed.tool, turn))

    async def _sandbox(self, tool: str, turn: int) -> ActionResult:
        while True:
            try:
                return await workflow.execute_activity(
                    TOOL_ACTIVITY[tool],
                    _step_input(self.inp, self.engine, turn),
                    result_type=ActionResult,
                    start_to_close_timeout=timedelta(minutes=15),
                    heartbeat_timeout=timedelta(seconds=30),
                    retry_policy=SANDBOX_RETRY,
                )
            except ActivityError as e:
                if not _is_gone(e) or self.replays >= MAX_RECOVERIES:
                    raise
            workflow.set_current_details(f"sandbox lost at turn {turn}: replaying {turn} recorded turns")
            await workflow.execute_activity(
                "sandbox_recover",
                _step_input(self.inp, self.engine, turn, with_spec=True),
                start_to_close_timeout=timedelta(minutes=15),
                heartbeat_timeout=timedelta(seconds=60),
                retry_policy=SANDBOX_RETRY,
            )
            self.replays += 1


def _env_result(r: ActionResult) -> EnvStepResult:
    return EnvStepResult(
        done=r.done,
        reward=r.reward,
        observation_tokens=r.observation_tokens,
        reward_s=r.reward_s,
        truncated_reason=r.truncated_reason,
    )
