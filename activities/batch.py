"""The batch activity: a group's rollouts run together inside one activity (``group.batch_rollouts``).

Temporal records the batch, not each turn: a 1-turn rollout costs its share of one activity instead of a
workflow with its tasks and events (docs/measurements/cost.md).

Invariants:
- One turn logic: each member runs the rollout workflow's own turn sequence (``turns.sequence``), its
  steps the implementations the rollout's activities run (``turns.model.ModelTurns.turn`` with its inline
  env step, ``turns.step.EnvSteps.step``, ``RolloutActivities.finalize_rollout``), awaited in process.
- Durable at the store's grain: every turn's segment, env step and record is written once, keyed by
  (rollout id, turn) and rollout id. A retried batch (its worker died, it timed out) runs every member
  again from its first turn: a stored turn is read back, never sampled again, and a recorded member
  returns its record without running.
- Exactly one record per member that ends here (completed, truncated, failed by cause); a member the batch
  did not end (the batch cancelled, or failed past its retries) is recorded by its group, whose record
  call returns the stored one if the member had ended after all (``workflows.group``).
- Retries as a rollout workflow's: model calls under the run's ``[engine]`` retry settings, then failover
  to the next replica (``engine.failover``) or waits until ``engine.outage_budget_s`` is spent; env steps
  under ``ENV_RETRY``. The attempt number in a call's request id and segment counts every try of the
  turn, across the batch's own retries and the group's later batches (``attempt_base``): a member's
  first batch starts at 1, and a member run again from the store always calls with an attempt above 1,
  so its steps look for what an earlier try recorded (``turns.step``).
- A group's close (``report_group``: batched groups from input revision 2, every group from 3) writes its
  record and tells the run in one local activity, idempotent on the group (the run ignores a second
  report). From revision 3 it tells the run by update, which the run refuses while it drains for
  continue-as-new: refused, the call is retried, and the next segment takes it (workflows/run.py).
- A report never holds its worker's workflow-task slot while it waits on the run: the local activity holds
  the group's workflow task open, and the run's workflow task, which completes the update, needs a slot of
  its own. A try waits at most ``REPORT_WAIT_S`` for the update, every retry of the close waits on a
  timer (``local_retry_threshold``), which ends the group's task and frees its slot, and every try sends
  the update under the group's own id, so a retry after the run answered returns at once; with every slot
  held by a group waiting on its report, the run could never answer one.
- Heartbeats every ``HEARTBEAT_EVERY_S`` name every member still running (turn, phase, replica, since
  when): an operator finds a stuck batch in the web UI as its group's pending activity, and a cancel of
  the batch reaches it through the heartbeat. The first comes after one interval, as every activity's
  (``activities.heartbeat``): a batch that ends sooner costs the server no heartbeat.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import TypeVar

from temporalio import activity
from temporalio.client import Client, WorkflowUpdateFailedError, WorkflowUpdateRPCTimeoutOrCancelledError
from temporalio.common import RetryPolicy
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from durable_rollouts.activities.calls import Options, options
from durable_rollouts.activities.environment import ENV_RETRY
from durable_rollouts.activities.heartbeat import HEARTBEAT_EVERY_S
from durable_rollouts.activities.members import finalize_rollout_input, rollout_replicas
from durable_rollouts.activities.rollout import RECORD_RETRY, RolloutActivities
from durable_rollouts.contracts.activity_io import EnvStepInput, GenerateInput, PrepareInput
from durable_rollouts.contracts.batch import BatchInput, ReportGroupInput
from durable_rollouts.contracts.types import (
    EnvStepResult,
    GroupResult,
    Outcome,
    RolloutInput,
    RolloutResult,
    RolloutState,
    TruncationReason,
    TurnResult,
)
from durable_rollouts.engines.watchdog import watching
from durable_rollouts.errors import EngineUnavailable, RolloutError, failure_details, failure_reason
from durable_rollouts.turns.sequence import Ended, outage_wait, run_turns, score_truncated

T = TypeVar("T")

BATCH_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=30), maximum_attempts=10
)
"""A batch whose worker died, or that failed outside a member's own failures (the store, a bug), runs
again and resumes from the store; past these attempts its group records the members it did not end as
failed (infra)."""
BATCH_MARGIN_S = 120.0
"""A batch may run this long past its members' ``rollout.timeout_s`` (their scoring and records)."""
GROUP_DONE = "group_done"
"""The run workflow's signal a group's close sends (``workflows.run.RunWorkflow.group_done``; activities sit
below the workflows, so by name, as ``activities.harness`` signals its rollout)."""
GROUP_REPORT = "group_report"
"""The run workflow's update a group's close sends from input revision 3
(``workflows.run.RunWorkflow.group_report``)."""
REPORT_WAIT_S = 4.0
"""Longest one try of a group's report waits for the run's ``group_report`` update; then the try fails and
the close is retried after a timer, its group's workflow task ended meanwhile. The update stays with the
server and lands with the run's next task; the retry sends it under the same id (``report_id``), so it is
answered once and the retry gets that answer."""
REPORT_RETRY_THRESHOLD = timedelta(milliseconds=500)
"""The close's retries (RECORD_RETRY: 1 s and up) all wait on a durable timer, never inside the group's
workflow task."""
ATTEMPTS_PER_TRY = 10_000
"""Attempt numbers each try of a batch owns for one turn's calls (its retries, failovers and outage waits
stay below this, so the attempt numbers of two tries never meet)."""


def attempt_base(batch_round: int, attempt: int) -> int:
    """The attempt number a try of a batch counts its calls from: try ``attempt`` (1 = first) of the
    group's batch number ``batch_round`` (0 = its first)."""
    return (batch_round * (BATCH_RETRY.maximum_attempts + 1) + attempt - 1) * ATTEMPTS_PER_TRY


class BatchActivities:
    """The batch activity; runs its members' steps through the rollout's activities' implementations."""

    def __init__(self, rollouts: RolloutActivities) -> None:
        self.rollouts = rollouts

    @options(
        Options(timedelta(hours=1), BATCH_RETRY, heartbeat=timedelta(seconds=10), wait_cancellation=True)
    )
    @activity.defn
    async def run_batch(self, inp: BatchInput) -> list[RolloutResult]:
        """Run every member to its record; their results in the input's order. The caller derives the
        start-to-close timeout from the members' ``timeout_s`` (``batch_timeout``)."""
        base = attempt_base(inp.batch_round, activity.info().attempt)
        live: dict[str, _Member] = {}
        members = [_Member(self.rollouts, m, base, live) for m in inp.members]
        tasks = [asyncio.ensure_future(m.run()) for m in members]
        everything = asyncio.gather(*tasks)
        try:
            while True:  # the first heartbeat after HEARTBEAT_EVERY_S: a short batch sends none
                done, _ = await asyncio.wait({everything}, timeout=HEARTBEAT_EVERY_S)
                if done:
                    return everything.result()
                activity.heartbeat(in_flight(live))
        finally:  # cancelled, or a member failed outside its own failures: stop the others
            for t in tasks:
                t.cancel()
            with contextlib.suppress(BaseException):
                await everything

    @options(
        Options(timedelta(seconds=60), RECORD_RETRY, local=True, local_retry_threshold=REPORT_RETRY_THRESHOLD)
    )
    @activity.defn
    async def report_group(self, inp: ReportGroupInput) -> bool:
        """A group's close in one local activity: finalize_group's writes (idempotent), then the run's
        ``group_report`` update (``by_update``) or ``group_done`` signal, sent by this worker's client
        instead of a signal command of the group's (which costs the group a workflow task and three events
        more); a retry may report again, which the run ignores. An update the run refuses (it is draining
        for continue-as-new) fails this try, and a later try reaches the next segment. A run that is gone
        fails the call for good, as the group's signal did. An update not answered within
        ``REPORT_WAIT_S`` fails this try too (``RunBusy``)."""
        written = await self.rollouts.finalize_group(inp.finalize)
        if inp.run_workflow_id:
            await tell_run(activity.client(), inp.run_workflow_id, inp.finalize.record, inp.by_update)
        return written

    def all(self) -> list:
        return [self.run_batch, self.report_group]


def report_id(record: GroupResult) -> str:
    """The update id of a group's report: the same on every try, so a try after one the run has answered
    gets that answer from the server at once, without a workflow task of the run."""
    return f"report/{record.group_id}"


async def tell_run(client: Client, run_workflow_id: str, record: GroupResult, by_update: bool) -> None:
    """Tell the run a group's record: its ``group_report`` update (``by_update``) or ``group_done`` signal.
    Raises ``RunDraining`` (refused while it continues as new) and ``RunBusy`` (no answer within
    ``REPORT_WAIT_S``) for a retry, ``RunGone`` (no such run) for good."""
    run = client.get_workflow_handle(run_workflow_id)
    try:
        if by_update:
            await run.execute_update(
                GROUP_REPORT, record, id=report_id(record), rpc_timeout=timedelta(seconds=REPORT_WAIT_S)
            )
        else:
            await run.signal(GROUP_DONE, record)
    except WorkflowUpdateFailedError as e:  # refused while the run drains: the next segment takes it
        raise ApplicationError(f"run {run_workflow_id}: {e.cause}", type="RunDraining") from e
    except WorkflowUpdateRPCTimeoutOrCancelledError as e:
        task = asyncio.current_task()
        if task is not None and task.cancelling():  # this try itself was cancelled, not the wait timed out
            raise
        wait = f"no answer to group {record.group_id}'s report within {REPORT_WAIT_S:.0f} s"
        raise ApplicationError(f"run {run_workflow_id}: {wait}", type="RunBusy") from e
    except RPCError as e:
        if e.status != RPCStatusCode.NOT_FOUND:
            raise
        gone = f"run {run_workflow_id}: {e.message}"
        raise ApplicationError(gone, type="RunGone", non_retryable=True) from e


def batch_timeout(members: list[RolloutInput]) -> timedelta:
    """Start-to-close timeout of a batch of ``members``."""
    return timedelta(seconds=max(m.timeout_s for m in members) + BATCH_MARGIN_S)


def utc_text(ts: float) -> str:
    """Epoch seconds as the UTC text the live details show (as ``rollouts stuck`` shows a rollout's)."""
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def in_flight(live: dict[str, _Member]) -> list[str]:
    """The heartbeat's details: one line per member still running (what an operator sees of the batch)."""
    return [m.describe() for m in live.values()]


class _Member:
    """One rollout of a batch: the steps of its turn sequence (``turns.sequence.TurnSteps``)."""

    def __init__(self, acts: RolloutActivities, m: RolloutInput, base: int, live: dict[str, _Member]) -> None:
        self.acts, self.m, self.base, self.live = acts, m, base, live
        self.tries: dict[int, int] = {}
        """Tries of each turn's calls in this try of the batch."""
        self.s = m.state.model_copy() if m.state is not None else RolloutState()
        if self.s.started_at is None:
            self.s.started_at = time.time()
        self.ref = m.ref()
        self.order = rollout_replicas(m)
        self.engine = self.order[0]
        self.phase, self.since = "starting", time.time()
        live[m.rollout_id] = self  # listed from the batch's first heartbeat on

    def describe(self) -> str:
        s = self.s
        return (
            f"{self.m.rollout_id}: {self.phase} turn={s.turn} tokens={s.tokens} engine={self.engine}"
            f" since {utc_text(self.since)}"
        )

    def _at(self, phase: str) -> None:
        self.phase, self.since = phase, time.time()

    async def run(self) -> RolloutResult:
        """The member's result: its record as stored (written now, or by an earlier try of the batch)."""
        rid = self.m.rollout_id
        try:
            row = await asyncio.to_thread(self.acts.store.rollout, rid)
            if row is not None:  # ended in an earlier try of the batch
                outcome = Outcome(row["outcome"])
                return self._result(outcome, row["reason"], row["reward"], bool(row["scorable"]))
            self._at("prepare")
            ended = await self._ended()
            self._at("finalize")
            record = finalize_rollout_input(
                self.m, ended.outcome, ended.reason, ref=self.ref, reward=ended.reward, state=self.s,
                ended_at=time.time(), failure=ended.details,
            )  # fmt: skip
            stored = await self.acts.finalize_rollout(record)
            return self._result(stored.outcome, stored.reason, stored.reward, stored.scorable)
        finally:
            self.live.pop(rid, None)

    def _result(
        self, outcome: Outcome, reason: str | None, reward: float | None, scorable: bool
    ) -> RolloutResult:
        return RolloutResult(
            rollout_id=self.m.rollout_id,
            sample_index=self.m.sample_index,
            outcome=outcome,
            reason=reason,
            reward=reward,
            scorable=scorable,
            num_tokens=self.s.tokens,
            turns=self.s.turn,
        )

    async def _ended(self) -> Ended:
        """How the member ends: the turn sequence's verdict, its wall-clock limit, or a final failure."""
        m, s = self.m, self.s
        assert s.started_at is not None
        try:
            try:
                left = m.timeout_s - (time.time() - s.started_at)
                if left <= 0:
                    raise TimeoutError
                with watching(m.engine.stall_timeout_s):
                    await asyncio.wait_for(run_turns(m, s, self), timeout=left)
            except TimeoutError:
                raise await score_truncated(m, self, TruncationReason.TIMEOUT) from None
        except Ended as end:
            return end
        except RolloutError as e:
            app = e.to_application_error()
            return Ended(Outcome.FAILED, failure_reason(app), details=failure_details(app))
        raise AssertionError("turn sequence returned without an outcome")

    async def _tried(
        self, call: Callable[[int], Awaitable[T]], attempts: int, first_s: float, most_s: float
    ) -> T:
        """``call(attempt)`` until it succeeds, fails for good, or ``attempts`` are spent (0: no limit)."""
        n = 0
        while True:
            n += 1
            tried = self.tries[self.s.turn] = self.tries.get(self.s.turn, 0) + 1
            try:
                return await call(self.base + tried)
            except RolloutError as e:
                if not e.retryable or (attempts and n >= attempts):
                    raise
            await asyncio.sleep(min(most_s, first_s * 2.0 ** (n - 1)))

    # The steps of the turn sequence (turns.sequence.TurnSteps).

    async def generate(self, inp: RolloutInput, max_tokens: int, last: bool) -> TurnResult:
        s, r = self.s, inp.retry
        while True:
            self._at("generate")
            gen = self._generate_input(inp, max_tokens, last)
            try:
                turn = await self._tried(
                    partial(self.acts.turns.turn, gen), r.max_attempts, r.initial_s, r.max_s
                )
                break
            except EngineUnavailable as e:
                if inp.engine.failover and s.engine_failovers + 1 < len(self.order):
                    s.engine_failovers += 1
                    s.reprefill_tokens += s.tokens  # the new replica prefills the whole context again
                    self.engine = self.order[s.engine_failovers]
                    continue
                await self._ride_out_outage(inp, e)
        s.outage_since = None
        s.tokens = turn.end
        s.sampled_tokens += turn.end - turn.start
        s.step_sampled += turn.end - turn.start
        if turn.policy_version is not None:
            s.version = turn.policy_version
        return turn

    def _generate_input(self, inp: RolloutInput, max_tokens: int, last: bool) -> GenerateInput:
        s = self.s
        prepare = None
        if s.tokens == 0:  # the first call builds the prompt (stored once)
            prepare = PrepareInput(
                ref=self.ref, engine_url=self.engine, stall_timeout_s=inp.engine.stall_timeout_s
            )
        return GenerateInput(
            ref=self.ref,
            turn=s.turn,
            engine_url=self.engine,
            sampling=inp.sampling,
            max_tokens=max_tokens,
            env_after=self._step_input(last),
            max_total_tokens=inp.max_total_tokens,
            prepare=prepare,
            stall_timeout_s=inp.engine.stall_timeout_s,
        )

    def _step_input(self, last: bool, score_only: bool = False) -> EnvStepInput:
        return EnvStepInput(
            ref=self.ref, turn=self.s.turn, last_turn=last, score_only=score_only, engine_url=self.engine
        )

    async def _ride_out_outage(self, inp: RolloutInput, e: BaseException) -> None:
        """Wait for the engine to come back, or re-raise ``e`` once the outage budget is spent."""
        wait = outage_wait(self.s, inp.engine.outage_budget_s, time.time())
        if wait is None:
            raise e
        delay, _ = wait
        self._at(f"engine unavailable (wait {self.s.outage_waits}, retrying in {delay:.0f}s)")
        activity.logger.warning(
            "rollout %s: engine %s unavailable; retrying in %.0fs", self.ref.rollout_id, self.engine, delay
        )
        await asyncio.sleep(delay)

    async def env_step(self, inp: RolloutInput, last: bool, score_only: bool = False) -> EnvStepResult:
        self._at("env")
        step = self._step_input(last, score_only)
        steps = self.acts.turns.steps
        assert steps is not None, "a worker that runs batches runs their env steps"
        retry = ENV_RETRY
        first = retry.initial_interval.total_seconds()
        most = retry.maximum_interval.total_seconds() if retry.maximum_interval else first
        return await self._tried(partial(steps.step, step), retry.maximum_attempts, first, most)

    async def await_newer_policy(self, inp: RolloutInput) -> None:
        raise AssertionError("group.batch_rollouts excludes rollout.step_token_budget (config validation)")

    async def turn_done(self, inp: RolloutInput) -> None:
        self._at("generate")
