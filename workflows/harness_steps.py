"""A harness rollout inside RolloutWorkflow (deterministic: activities only): the harness runs in the
rollout's sandbox while its model calls are served, one ``gateway_call`` activity each, in call order.

Invariants:
- The workflow learns of a call by the signal ``gateway_call(index)``, sent by the gateway after the
  request is in the store; a signal repeated (a client's retry, a gateway restarted) or for a call already
  answered is ignored: a call is answered by exactly one activity, idempotent on (rollout id, index).
- The harness's activity (``harness_run``) runs on the rollout's sandbox host, heartbeating, for as long
  as the harness runs; a worker that dies is replaced by a retry that watches the same process (the harness
  keeps running in its container). Its calls meanwhile wait in the store.
- A limit (``max_turns`` calls, the token budget, the engine's context length) answers the call without a
  sample (``length``) or with the engine's refusal, then the harness is stopped (its activity cancelled:
  the process is killed) and the rollout ends truncated with the limit's reason.
- A sandbox lost under a harness cannot be replayed (a process's state is not recorded): the rollout
  fails as ``infra: SandboxGone``.
- No continue-as-new while the harness runs: its activity would be lost with the old run.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from durable_rollouts.activities.harness import HarnessActivities
    from durable_rollouts.activities.rollout import engine_retry
    from durable_rollouts.contracts.harness import (
        GatewayCallInput,
        GatewayCallResult,
        HarnessExit,
        HarnessRunInput,
    )
    from durable_rollouts.contracts.types import RolloutInput, RolloutRef, RolloutState, TruncationReason
    from durable_rollouts.turns.budget import turn_budget, turn_truncation
    from durable_rollouts.workflows.calls import call
    from durable_rollouts.workflows.patches import HARNESS
    from durable_rollouts.workflows.sandbox_steps import SandboxSteps

Failover = Callable[[RolloutInput, Callable[[RolloutInput, str], Awaitable[Any]]], Awaitable[Any]]


class HarnessSteps:
    """The harness of one rollout; its counters live in the rollout's state (``turn`` counts calls)."""

    def __init__(
        self,
        inp: RolloutInput,
        ref: RolloutRef,
        state: RolloutState,
        sandbox: SandboxSteps,
        calls: set[int],
        failover: Failover,
    ) -> None:
        self.inp, self.ref, self.state, self.sandbox = inp, ref, state, sandbox
        self.calls, self.failover = calls, failover

    async def run(self) -> TruncationReason | None:
        """Run the harness to its exit (None: it exited 0 after calling the model) or to a limit."""
        workflow.patched(HARNESS.id)
        inp, s = self.inp, self.state
        ask = HarnessRunInput(ref=self.ref)
        harness: asyncio.Task[HarnessExit] = asyncio.ensure_future(
            self.sandbox.on_host(HarnessActivities.harness_run, ask)
        )
        try:
            while True:
                await workflow.wait_condition(lambda: harness.done() or s.turn in self.calls)
                if harness.done():
                    harness.result()  # a failure (non-zero exit, no call, lost sandbox) raises here
                    return None
                self.calls.discard(s.turn)
                workflow.set_current_details(f"serving harness call {s.turn}")
                done: GatewayCallResult = await self.failover(inp, self._answer)
                s.turn += 1
                s.sampled_tokens += done.end - done.start
                s.step_sampled += done.end - done.start
                s.tokens = done.end
                if done.policy_version is not None:
                    s.version = done.policy_version
                reason = done.truncated_reason or turn_truncation(
                    done.finish_reason, done.end, inp.max_total_tokens
                )
                if reason is not None:
                    return reason
        finally:
            if not harness.done():
                harness.cancel()  # the activity kills the harness (it learns of it by its next heartbeat)
                with contextlib.suppress(BaseException):
                    await harness

    async def _answer(self, inp: RolloutInput, engine: str) -> GatewayCallResult:
        s = self.state
        budget = turn_budget(s.tokens, inp.max_total_tokens, inp.sampling.max_tokens)
        limit = TruncationReason.MAX_TURNS if s.turn >= inp.max_turns else budget.truncated
        result: GatewayCallResult = await call(
            HarnessActivities.gateway_call,
            GatewayCallInput(
                ref=self.ref,
                index=s.turn,
                engine_url=engine,
                sampling=inp.sampling,
                max_tokens=budget.max_tokens or inp.sampling.max_tokens,
                max_total_tokens=inp.max_total_tokens,
                limit=limit,
                stall_timeout_s=inp.engine.stall_timeout_s,
            ),
            retry=engine_retry(inp.retry),
            start_to_close=timedelta(seconds=inp.engine.request_timeout_s + 30),
        )
        return result
