"""GroupWorkflow: N rollouts of one task under a group id separate from the task id.

Invariants:
- Children have deterministic ids ``<run>/<group>/<i>``; the group closes on count: every member ends
  (completed, truncated, failed or cancelled), and members that failed for infrastructure reasons count
  toward the size but stay out of the reward statistics and advantages.
- A member whose child workflow itself died still gets exactly one record (written here).
- The group reports its result to the run workflow by message (never a child's result), so the run can
  continue-as-new while groups are in flight: from input revision 3 by the run's ``group_report`` update,
  sent with its record in one local activity (``BatchActivities.report_group``), which the run refuses
  while it drains for continue-as-new so no report lands in the task carrying it (the activity retries);
  before, by the ``group_done`` signal. The report never holds the group's worker slot while it waits on
  the run (its tries are bounded and retried on a timer: ``activities.batch.tell_run``).
- The dispatcher may ``shed`` members (cancel, reason admission): they get a cancelled record, count toward
  the size and stay out of the comparison; with ``redispatch_cancelled`` the slot runs again under id
  ``<run>/<group>/<i>r<n>`` (same sample index), so the group still compares ``size`` finished slots.
- An operator may ``retry`` a running member (``rollouts retry``): it is cancelled with reason
  ``manual-retry`` (its record says so) and, once it ended cancelled, its slot runs again under the next
  attempt id, as for admission; a member that ended otherwise before the cancel reached it keeps its
  outcome and the slot is not run again (no slot ever has two scorable members).
- A member that failed for infrastructure (reason ``infra: ...``, its workflow not terminated by hand) runs
  again under the next attempt id, at most ``infra_retries`` times per slot (``rollout.infra_retries``);
  the failed attempt keeps its record, marked superseded by the next (``superseded_by``, written with the
  group record). A slot whose last attempt still failed for infrastructure is left out of the statistics
  (``exclude``) or makes the whole group unscorable (``fail-group``: ``unscorable_reason``, no advantages,
  no member scorable).
- A cancelled run tells its groups ``cancel_all``: every running member is cancelled (reason
  ``run-cancelled``, its record says so), a member not started yet is recorded cancelled without running,
  no slot runs again, and the group closes with its full size as always.
- With ``group.batch_rollouts`` (``RolloutInput.batched``) the members run together in one batch activity
  (``activities.batch``), under the same rules: a cancel of any member (shed, retry, cancel_member,
  cancel_all) stops the batch; the told members are recorded cancelled (or keep the record they already
  have), the others run on in the next batch, resuming from the store; a batch that failed past its
  retries leaves its unrecorded members failed (infra). The group reports what the store holds. From
  input revision 2 a batched group writes its record and signals the run in one local activity
  (``BatchActivities.report_group``) instead of a signal command: a workflow task and five events fewer
  per group; an input of an earlier revision (a replayed history) keeps the signal command.
"""

from __future__ import annotations

import asyncio
import zlib

from temporalio import workflow
from temporalio.common import SearchAttributePair, TypedSearchAttributes
from temporalio.exceptions import ActivityError, ChildWorkflowError, TerminatedError

with workflow.unsafe.imports_passed_through():
    from durable_rollouts.activities.batch import BatchActivities, batch_timeout
    from durable_rollouts.activities.rollout import RolloutActivities
    from durable_rollouts.admission.controller import CANCEL_REASON
    from durable_rollouts.config.models import Config
    from durable_rollouts.contracts.activity_io import StoredOutcome
    from durable_rollouts.contracts.batch import BatchInput, ReportGroupInput
    from durable_rollouts.contracts.types import (
        EngineTarget,
        EnvTraits,
        GroupInput,
        GroupResult,
        Outcome,
        RetrySettings,
        RolloutInput,
        RolloutResult,
        RolloutState,
        rollout_id,
        sampling_params,
    )
    from durable_rollouts.errors import failure_reason
    from durable_rollouts.workflows import search_attributes as sa
    from durable_rollouts.workflows.calls import call
    from durable_rollouts.workflows.group_close import (  # the close's names, re-exported here too
        _infra,
        close_group,
        finalize_input,
    )
    from durable_rollouts.workflows.group_close import slot_of as slot_of
    from durable_rollouts.workflows.patches import INFRA_RETRIES, OPS, REVISION
    from durable_rollouts.workflows.rollout import RolloutWorkflow
    from durable_rollouts.workflows.rollout_record import finalize_rollout_input


def rollout_template(cfg: Config, run_id: str, env: EnvTraits) -> RolloutInput:
    """The per-run part of every rollout's input (members fill in ids, index and seed)."""
    return RolloutInput(
        run_id=run_id,
        group_id="",
        rollout_id="",
        task_id="",
        sample_index=0,
        env=env,
        sampling=sampling_params(cfg),
        engine=EngineTarget(
            urls=cfg.engine.urls,
            model=cfg.engine.model,
            request_timeout_s=cfg.engine.request_timeout_s,
            failover=cfg.engine.failover,
            outage_budget_s=cfg.engine.outage_budget_s,
            stall_timeout_s=cfg.engine.stall_timeout_s,
        ),
        retry=RetrySettings(
            max_attempts=cfg.engine.max_attempts,
            initial_s=cfg.engine.retry_initial_s,
            max_s=cfg.engine.retry_max_s,
        ),
        max_turns=cfg.rollout.max_turns,
        max_total_tokens=cfg.rollout.max_total_tokens,
        timeout_s=cfg.rollout.timeout_s,
        score_truncated=cfg.rollout.score_truncated,
        step_token_budget=cfg.rollout.step_token_budget,
        partial_poll_s=cfg.rollout.partial_poll_s,
        sandbox=cfg.sandbox if env.uses_sandbox else None,
        pool=cfg.sandbox_pool if env.uses_sandbox else None,
        revision=REVISION,
        local_model_calls=cfg.rollout.local_model_calls and not env.uses_sandbox,
        in_group=inline_members(cfg, env),
        batched=batch_members(cfg, env),
    )


def inline_members(cfg: Config, env: EnvTraits) -> bool:
    """Whether the run's groups run their rollouts inline (``group.inline_rollouts``): only rollouts whose
    every step is a local activity of the workflow (inline env steps, no sandbox, no harness)."""
    eligible = env.inline_steps and not env.uses_sandbox and not env.harness
    return cfg.group.inline_rollouts and cfg.rollout.local_model_calls and eligible


def batch_members(cfg: Config, env: EnvTraits) -> bool:
    """Whether the run's groups run their rollouts in one batch activity (``group.batch_rollouts``): only
    rollouts of environments with inline steps and neither a sandbox nor a harness."""
    eligible = env.inline_steps and not env.uses_sandbox and not env.harness
    return cfg.group.batch_rollouts and eligible


def member_input(inp: GroupInput, i: int, attempt: int = 0) -> RolloutInput:
    """The input of slot i's member under attempt ``attempt`` (id ``<run>/<group>/<i>`` or ``<i>r<n>``)."""
    rid = rollout_id(inp.run_id, inp.group_id, i) + (f"r{attempt}" if attempt else "")
    sampling = inp.template.sampling.model_copy(update={"seed": member_seed(inp.template.sampling.seed, rid)})
    return inp.template.model_copy(
        update={
            "run_id": inp.run_id,
            "group_id": inp.group_id,
            "rollout_id": rid,
            "task_id": inp.task_id,
            "sample_index": i,
            "sampling": sampling,
            "preferred_engine": inp.engine,
        }
    )


def member_seed(base: int | None, rid: str) -> int | None:
    """Distinct, reproducible seed per member (same run config and rollout id -> same seed)."""
    if base is None:
        return None
    return (base * 1_000_003 + zlib.crc32(rid.encode())) % (2**31 - 1)


MAX_REDISPATCH = 3
"""Most times one group slot is restarted after admission cancels (then it stays cancelled)."""


RETRY_REASON = "manual-retry"
"""Cancel reason of a member an operator retried (``rollouts retry``)."""
RUN_CANCEL_REASON = "run-cancelled"
"""Cancel reason of the members of a run cancelled as a whole (``rollouts cancel RUN``)."""
RUN_STOP_REASON = "run-stopped"
"""Cancel reason of the members in flight when a streak of environment failures stopped the run."""


class _Tries:
    """How often one slot ran again, and why (its attempt number counts them all)."""

    def __init__(self) -> None:
        self.attempt = self.redispatched = self.infra_retried = 0


class _InBatch:
    """A running member of the group's batch (``group.batch_rollouts``): no workflow of its own."""


IN_BATCH = _InBatch()


@workflow.defn(name="GroupWorkflow")
class GroupWorkflow:
    def __init__(self) -> None:
        self._done = 0
        self._size = 0
        self._running: dict[str, workflow.ChildWorkflowHandle | RolloutWorkflow | _InBatch] = {}
        """Running members: a child workflow's handle, the rollout running inline (in_group), or
        ``IN_BATCH``: the member runs in the group's batch activity."""
        self._batch: asyncio.Task[list[RolloutResult]] | None = None
        """The batch activity running (``group.batch_rollouts``)."""
        self._batch_told: dict[str, str] = {}
        """Members of the running batch told to cancel, with their reasons."""
        self._rounds = 0
        """Batches this group started."""
        self._told: set[str] = set()
        self._retry: set[str] = set()
        """Members an operator asked to run again (``retry``)."""
        self._cancelled: str | None = None
        """Set by ``cancel_all``: the reason every member ends cancelled with."""

    @workflow.query
    def progress(self) -> dict:
        """Members done and running; ``members``: the live state of each running inline member (what a
        rollout workflow's ``state`` query answers)."""
        inline = {rid: m.state() for rid, m in self._running.items() if isinstance(m, RolloutWorkflow)}
        batch = sorted(rid for rid, m in self._running.items() if isinstance(m, _InBatch))
        return {
            "done": self._done,
            "size": self._size,
            "running": sorted(self._running),
            "members": inline,
            "batch": batch,
        }

    async def _tell(self, rid: str, reason: str) -> None:
        """Tell a running member to cancel with ``reason`` (a signal to a child; a call to an inline one)."""
        member = self._running[rid]
        if isinstance(member, RolloutWorkflow):
            member.cancel_for(reason)
            return
        if isinstance(member, _InBatch):  # the batch stops; its other members run on in the next one
            self._batch_told.setdefault(rid, reason)
            if self._batch is not None and not self._batch.done():
                self._batch.cancel()
            return
        try:
            await member.signal(RolloutWorkflow.cancel_for, reason)
        except Exception as e:  # it ended in the meantime: nothing to cancel, its outcome stands
            workflow.logger.info("cancel %s (%s): %s", rid, reason, e)

    @workflow.signal
    async def cancel_member(self, rollout_id: str, reason: str) -> None:
        """Cancel one running member with ``reason`` (``rollouts cancel`` of a member running inline);
        unknown or ended members are ignored."""
        if rollout_id in self._running and rollout_id not in self._told:
            self._told.add(rollout_id)
            await self._tell(rollout_id, reason)

    @workflow.signal
    async def shed(self, n: int) -> None:
        """Cancel ``n`` more running members for admission (the youngest slots first); a member already
        told, or already ended, is not told again."""
        victims = [rid for rid in reversed(list(self._running)) if rid not in self._told][: max(0, n)]
        for rid in victims:
            self._told.add(rid)
            await self._tell(rid, CANCEL_REASON)

    @workflow.signal
    async def retry(self, rollout_id: str) -> None:
        """Cancel a running member (reason ``manual-retry``) and run its slot again under the next attempt
        id once it has ended cancelled; unknown or ended members are ignored."""
        if rollout_id not in self._running or rollout_id in self._retry:
            return
        self._retry.add(rollout_id)
        await self._tell(rollout_id, RETRY_REASON)

    @workflow.signal
    async def cancel_all(self, reason: str) -> None:
        """The run was cancelled: cancel every running member with ``reason``; members not started yet are
        recorded cancelled without running, and no slot runs again. Idempotent."""
        if self._cancelled is not None:
            return
        self._cancelled = reason[:200]
        for rid in list(self._running):
            await self._tell(rid, self._cancelled)

    @workflow.run
    async def run(self, inp: GroupInput) -> GroupResult:
        self._size = inp.size
        workflow.set_current_details(f"task={inp.task_id} members=0/{inp.size}")
        attempts: list[RolloutResult] = []
        if inp.template.batched:
            await self._batches(inp, attempts)
        else:
            await asyncio.gather(*(self._slot(inp, i, attempts) for i in range(inp.size)))
        record, advantages = close_group(
            inp.run_id, inp.group_id, inp.task_id, inp.size, attempts, inp.advantage_eps, inp.on_infra_failure
        )
        closing = finalize_input(record, advantages, attempts)
        if inp.revision >= 3 or (inp.template.batched and inp.revision >= 2):  # close and report: one call
            await workflow.wait_condition(workflow.all_handlers_finished)
            report = ReportGroupInput(
                finalize=closing, run_workflow_id=inp.run_workflow_id, by_update=inp.revision >= 3
            )
            await call(BatchActivities.report_group, report)
            return record
        await call(RolloutActivities.finalize_group, closing)
        await workflow.wait_condition(workflow.all_handlers_finished)
        if inp.run_workflow_id:
            with workflow.unsafe.imports_passed_through():  # run.py imports this module: resolve late
                from durable_rollouts.workflows.run import RunWorkflow

            run = workflow.get_external_workflow_handle_for(RunWorkflow.run, inp.run_workflow_id)
            await run.signal(RunWorkflow.group_done, record)
        return record

    async def _slot(self, inp: GroupInput, i: int, attempts: list[RolloutResult]) -> None:
        """Run slot i to its end; with redispatch, a member cancelled for admission is started again (at
        most MAX_REDISPATCH times), a member an operator retried is started again whenever it ended
        cancelled, and a member that failed for infrastructure at most ``inp.infra_retries`` times."""
        tries = _Tries()
        while True:
            m = member_input(inp, i, tries.attempt)
            if self._cancelled is not None:  # the run was cancelled before this member started
                attempts.append(await self._record_unrun(m, Outcome.CANCELLED, self._cancelled))
                break
            if inp.revision < 1:  # retired (workflows/patches.py); revision 1 skips its marker
                workflow.deprecate_patch(OPS.id)
            terminated = False
            if m.in_group:
                result = await self._run_inline(m)
            else:
                try:
                    result = await self._run_child(inp, m)
                except ChildWorkflowError as e:
                    terminated = isinstance(e.cause, TerminatedError)  # by hand: never run again
                    result = await self._record_dead_member(m, e)
            attempts.append(result)
            if self._cancelled is not None or not self._again(inp, m, result, tries, terminated):
                break
        self._slot_done(inp)

    def _slot_done(self, inp: GroupInput) -> None:
        self._done += 1
        workflow.set_current_details(f"task={inp.task_id} members={self._done}/{inp.size}")

    def _again(
        self, inp: GroupInput, m: RolloutInput, result: RolloutResult, tries: _Tries, terminated: bool = False
    ) -> bool:
        """Whether the slot whose member ``m`` ended with ``result`` runs again (under the next attempt id,
        counted in ``tries``): an operator's retry, an admission shed with redispatch, an infra failure."""
        cancelled = result.outcome == Outcome.CANCELLED
        if cancelled and m.rollout_id in self._retry:
            tries.attempt += 1
            return True
        shed = cancelled and result.reason == CANCEL_REASON and inp.redispatch_cancelled
        if shed and tries.redispatched < MAX_REDISPATCH:
            tries.attempt, tries.redispatched = tries.attempt + 1, tries.redispatched + 1
            return True
        if (
            _infra(result)
            and not terminated
            and tries.infra_retried < inp.infra_retries
            and workflow.patched(INFRA_RETRIES.id)
        ):
            tries.attempt, tries.infra_retried = tries.attempt + 1, tries.infra_retried + 1
            return True
        return False

    async def _batches(self, inp: GroupInput, attempts: list[RolloutResult]) -> None:
        """``group.batch_rollouts``: every slot's member runs in one batch activity, then the slots that
        run again (a retry, a redispatch, an infra retry) and the members a cancel of another interrupted
        run in the next batch, until every slot has ended (the rules of ``_slot``)."""
        tries = {i: _Tries() for i in range(inp.size)}
        pending = {i: self._batch_member(inp, i, 0) for i in range(inp.size)}
        while pending:
            if self._cancelled is not None:  # the run was cancelled: nothing starts again
                for i, m in list(pending.items()):
                    attempts.append(await self._record_stored(m, Outcome.CANCELLED, self._cancelled))
                    del pending[i]
                    self._slot_done(inp)
                break
            ended = await self._run_batch(inp, list(pending.values()))
            for i, m in list(pending.items()):
                result = ended.get(m.rollout_id)
                if result is None:  # interrupted by another member's cancel: resumes in the next batch
                    continue
                attempts.append(result)
                if self._cancelled is None and self._again(inp, m, result, tries[i]):
                    pending[i] = self._batch_member(inp, i, tries[i].attempt)
                else:
                    del pending[i]
                    self._slot_done(inp)

    def _batch_member(self, inp: GroupInput, i: int, attempt: int) -> RolloutInput:
        """Slot i's member under ``attempt``, its start time in its state (its time limit counts from it
        across batches)."""
        m = member_input(inp, i, attempt)
        return m.model_copy(update={"state": RolloutState(started_at=workflow.now().timestamp())})

    async def _run_batch(self, inp: GroupInput, members: list[RolloutInput]) -> dict[str, RolloutResult]:
        """Run ``members`` in one batch activity; the results of those that ended, by rollout id."""
        self._batch_told = {}
        for m in members:
            self._running[m.rollout_id] = IN_BATCH
        ids = " ".join(m.rollout_id.rsplit("/", 1)[-1] for m in members)
        workflow.set_current_details(
            f"task={inp.task_id} members={self._done}/{inp.size} | batch of {len(members)} in activity"
            f" run_batch (its heartbeat details: each rollout's turn and phase): slots {ids}"
        )
        batch = BatchInput(members=members, batch_round=self._rounds)
        self._rounds += 1
        run = call(BatchActivities.run_batch, batch, start_to_close=batch_timeout(members))
        self._batch = asyncio.ensure_future(run)
        try:
            return {r.rollout_id: r for r in await self._batch}
        except (ActivityError, asyncio.CancelledError) as e:
            if not self._batch_told:
                if isinstance(e, asyncio.CancelledError):
                    raise  # the group itself was cancelled
                reason = failure_reason(e)  # failed past its retries: those it did not end fail with it
                return {m.rollout_id: await self._record_stored(m, Outcome.FAILED, reason) for m in members}
            told = [m for m in members if m.rollout_id in self._batch_told]
            return {
                m.rollout_id: await self._record_stored(m, Outcome.CANCELLED, self._batch_told[m.rollout_id])
                for m in told
            }
        finally:
            self._batch = None
            for m in members:
                del self._running[m.rollout_id]

    async def _record_stored(self, m: RolloutInput, outcome: Outcome, reason: str) -> RolloutResult:
        """Record a batch member the batch did not end; what the store holds (a member that ended in the
        batch after all keeps its record)."""
        stored: StoredOutcome = await call(
            RolloutActivities.finalize_rollout, finalize_rollout_input(m, outcome, reason)
        )
        return RolloutResult(
            rollout_id=m.rollout_id,
            sample_index=m.sample_index,
            outcome=stored.outcome,
            reason=stored.reason,
            reward=stored.reward,
            scorable=stored.scorable,
            wasted_tokens=stored.wasted_tokens,
        )

    async def _run_child(self, inp: GroupInput, m: RolloutInput) -> RolloutResult:
        """Run a member as a child workflow (its own history and search attributes) to its result."""
        attrs: list[SearchAttributePair] = [
            SearchAttributePair(sa.RUN, inp.run_id),
            SearchAttributePair(sa.GROUP, inp.group_id),
            SearchAttributePair(sa.TASK, inp.task_id),
            SearchAttributePair(sa.ENV, m.env.name),
            SearchAttributePair(sa.PHASE, "queued"),
            SearchAttributePair(sa.PROGRESS_AT, workflow.now()),  # a queued rollout shows as stuck
        ]
        handle = await workflow.start_child_workflow(
            RolloutWorkflow.run, m, id=m.rollout_id, search_attributes=TypedSearchAttributes(attrs)
        )
        self._running[m.rollout_id] = handle
        try:
            if self._cancelled is not None:  # cancel_all arrived while it was being started
                await self._tell(m.rollout_id, self._cancelled)
            return await handle
        finally:
            del self._running[m.rollout_id]

    async def _run_inline(self, m: RolloutInput) -> RolloutResult:
        """Run a member inside this workflow (``group.inline_rollouts``): the rollout workflow's own code,
        its calls local activities recorded in this history; it writes its record as a child does."""
        member = RolloutWorkflow()
        self._running[m.rollout_id] = member
        try:
            return await member.run(m)
        finally:
            del self._running[m.rollout_id]

    async def _record_dead_member(self, m: RolloutInput, e: ChildWorkflowError) -> RolloutResult:
        """A member whose workflow died (terminated, timed out) is failed (infra) and still recorded."""
        reason = f"infra: child workflow {type(e.cause).__name__}: {e.cause}"[:500]
        return await self._record_unrun(m, Outcome.FAILED, reason)

    async def _record_unrun(self, m: RolloutInput, outcome: Outcome, reason: str) -> RolloutResult:
        """Record a member that cannot record itself (its workflow died, or never ran): not scorable."""
        await call(RolloutActivities.finalize_rollout, finalize_rollout_input(m, outcome, reason))
        return RolloutResult(
            rollout_id=m.rollout_id, sample_index=m.sample_index, outcome=outcome, reason=reason
        )
