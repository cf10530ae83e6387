"""RunWorkflow: the dispatcher. Starts a run's groups under an in-flight cap, with a bounded history.

Two modes (``admission.enabled``):
- fixed: at most ``run.max_inflight_groups`` groups in flight; nothing is polled.
- adaptive: every ``admission.poll_interval_s`` (and whenever a group ends) a local activity polls every
  engine's /metrics, the run store's record counts of the groups in flight and the sandbox pool; the
  `AdmissionController` (a pure state machine, state carried across continue-as-new) turns that into a cap
  in rollouts, admissions and cancels; the poll also reads the run's own task queue backlog (rule O: the
  cap stops growing when the workers, not the engines, are the bottleneck). Cancels go to the youngest
  groups as ``shed`` signals; sandboxed runs also stay within the pool's limit and, while the pool scales
  up, a tasks-per-minute token bucket.
  Each decision is written to the store's dispatch log by the next poll (idempotent on its sequence number).

In both modes ``run.overprovision`` is added to the group bounds (``run.max_inflight_groups``, and
``admission.max_queued_groups`` when set); the feed keeps late groups for its next batch (trainer/feed.py).
At 0 (every 0.2.0 config) the commands are those of 0.2.0, so replay needs no patch.

In both modes a group's replica is chosen here (``engine.affinity = "group"``): consistent hashing of its
task id with bounded load over the healthy replicas (admission/replicas.py).

Invariants:
- Group i samples task i modulo the number of tasks and has the deterministic workflow id ``<run>/g<i>``;
  ``next_group`` is carried across continue-as-new, so no group is ever started twice.
- Groups are started with ParentClosePolicy.ABANDON and report back by the ``group_done`` signal, so the
  run continues-as-new every ``groups_per_run_segment`` groups without waiting for in-flight groups. The
  carried state is taken in the continue-as-new's own workflow task, after every handler ran: a report that
  lands while that task is in flight gets it rejected (UNHANDLED_COMMAND) and the retry applies it, so each
  report counts once. A group's close follows its report by a task of the group; the run waits for those
  closes first (patch ``quiet-segment-end``), as they would land in that task; so it does before its end.
- The run ends when every group has reported.
- Every group admitted at one decision is started in the same workflow task (the server starts them in
  parallel; one after another, a run of N groups took N x ~0.2 s to fill).
- A group terminated by hand cannot report: ``rollouts terminate GROUP`` terminates it and then sends the
  run ``group_terminated``, and the run accounts for it itself (workflows/unreported.py: its unrecorded
  members recorded as failed infra, its record written from the store, counted with its full size), as if
  it had reported. A group that closes without reporting (terminated from the web UI or the ``temporal``
  CLI, failed, timed out) is noticed by the run itself (workflows/closed_groups.py: its handle within a
  segment, a check every poll interval for groups carried over continue-as-new) and accounted the same
  way, once, whichever path comes first.
- A run cancelled as a whole (``rollouts cancel RUN``, or its handle's ``cancel``) starts no more groups,
  tells each in-flight group ``cancel_all`` (every running member ends cancelled, reason ``run-cancelled``,
  with its record; sandboxes are destroyed as at any rollout's end) and waits for each to report, accounts
  itself for a group it cannot tell (as for a terminated one, its members recorded cancelled), marks the run
  ``cancelled`` in the store and ends cancelled. Groups never started have no record: the ledger checks a
  cancelled run's started groups only, and does not ask it for a success.
- A streak of ``run.max_consecutive_environment_failures`` environment failures (admission/breaker.py)
  stops the run: no group starts after it, the groups in flight are cancelled as for a run cancel (reason
  ``run-stopped``), the store marks the run ``stopped`` and the run returns its progress with the reason
  (``stopped``; also the workflow's current details).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable

from temporalio import workflow
from temporalio.common import SearchAttributePair, TypedSearchAttributes
from temporalio.exceptions import ActivityError, ApplicationError
from temporalio.workflow import ParentClosePolicy

with workflow.unsafe.imports_passed_through():
    from durable_rollouts.activities.dispatch import DispatchActivities
    from durable_rollouts.activities.rollout import RolloutActivities
    from durable_rollouts.admission import breaker
    from durable_rollouts.admission.controller import AdmissionController, Decision
    from durable_rollouts.admission.replicas import choose_replica, replica_load
    from durable_rollouts.admission.room import (
        admission_room,
        cancels_by_group,
        closed_unseen,
        inflight_view,
        newly_complete,
        spend_bucket,
    )
    from durable_rollouts.contracts.activity_io import LoadRunInput, TerminatedGroupInput
    from durable_rollouts.contracts.types import (
        DispatchLog,
        FailureKind,
        FleetPoll,
        GroupCounts,
        GroupInput,
        GroupResult,
        GroupSlot,
        Outcome,
        PollFleetInput,
        RolloutInput,
        RunInput,
        RunProgress,
        RunState,
        group_id,
    )
    from durable_rollouts.workflows import patches
    from durable_rollouts.workflows import search_attributes as sa
    from durable_rollouts.workflows.calls import call
    from durable_rollouts.workflows.closed_groups import ClosedGroups
    from durable_rollouts.workflows.group import (
        RUN_CANCEL_REASON,
        RUN_STOP_REASON,
        GroupWorkflow,
        rollout_template,
    )
    from durable_rollouts.workflows.run_end import cancel_groups
    from durable_rollouts.workflows.unreported import record_unreported


TASK_ID_BATCH = 32
"""Task ids the run looks up at once (one local activity per this many groups, off the critical path)."""
QUIET_WAIT_S = 2.0
"""Longest wait at a segment's end for reported groups' closes (patch ``quiet-segment-end``) where groups
report by signal (input revisions below 3): a close takes one task of its group, but a fleet whose groups
report faster than that is never quiet, and admits nothing meanwhile. Workflow logic: changing it needs a
patch."""
DRAIN_WAIT_S = 30.0
"""Longest wait at a segment's end for reported groups' closes while the run refuses reports (``drain``):
no report can start another close, so the wait ends with the last close unless a group hangs between its
report and its close. Workflow logic: changing it needs a patch."""


@workflow.defn(name="RunWorkflow")
class RunWorkflow:
    @workflow.init
    def __init__(self, inp: RunInput) -> None:
        # State comes from the input here, not in run(): signals buffered across continue-as-new are
        # delivered before run() starts and must find the carried in-flight groups (slots).
        self._state = inp.state.model_copy(deep=True) if inp.state is not None else RunState()
        self._cfg = inp.config
        self._run_id = inp.run_id
        self._counts: dict[str, GroupCounts] = {}
        self._task_ids: dict[int, str] = {}
        self._cap: int | None = None
        self._freed = False
        self._reported_in_poll = 0
        """Groups that reported since the latest fleet poll was asked: complete, out of the slots, and
        possibly not yet in the poll's count of unconsumed groups (``QUEUE_RACE``)."""
        self._accounting: set[str] = set()
        """Groups that cannot report, being or already accounted for (``_account_for``)."""
        self._closed = ClosedGroups(self._run_id, self._state.slots, self._account_for)
        """This segment's watch for groups closed without reporting (workflows/closed_groups.py)."""
        self._draining = False
        """Continuing as new: a report that would start another close of this segment's groups is refused
        (``group_report``'s validator) until the next segment."""

    @workflow.signal
    def group_done(self, record: GroupResult) -> None:
        """A group closed; duplicate signals for the same group are ignored."""
        st = self._state
        slot = st.slots.pop(record.group_id, None)
        if slot is None:
            return
        self._counts.pop(record.group_id, None)
        closed_unseen(st.dispatch, slot, record)
        self._freed = True
        self._reported_in_poll += 1
        st.groups_done += 1
        st.admission_cancelled += record.admission_cancelled
        st.wasted_tokens += record.wasted_tokens
        for outcome, n in record.outcomes.items():
            st.outcomes[outcome] = st.outcomes.get(outcome, 0) + n
        run = self._cfg.run
        env_stop = run.max_consecutive_environment_failures if workflow.patched(patches.ENV_STOP.id) else None
        st.breaker = breaker.record(
            st.breaker, record.group_id, record.infra_failures, record.successes, workflow.now().timestamp(),
            run.breaker_failures, record.environment_failures, env_stop, record.environment_failure,
        )  # fmt: skip

    @workflow.update
    def group_report(self, record: GroupResult) -> None:
        """A group closed (input revision 3): as ``group_done``, by update, which the validator refuses
        while the run drains for continue-as-new."""
        self.group_done(record)

    @group_report.validator
    def _report_open(self, record: GroupResult) -> None:
        """Refused while draining, for a group of this segment still in flight: taking it would start its
        close (ChildWorkflowExecutionCompleted), which could land in the task carrying the continue-as-new.
        A refused report leaves no event; its sender tries again and the next segment takes it."""
        gid = record.group_id
        if self._draining and gid in self._state.slots and gid in self._closed.handles:
            raise ApplicationError(f"run {self._run_id}: continuing as new, report again", type="RunDraining")

    @workflow.signal
    async def group_terminated(self, inp: TerminatedGroupInput) -> None:
        """A group was terminated by hand: record its running members as failed (infra: terminated),
        write its record from what the store holds (the one it wrote itself, if it got that far) and
        count it as done. A group that already reported, or is being accounted for, is ignored."""
        reason = f"{FailureKind.INFRA.value}: WorkflowTerminated: group terminated ({inp.reason})"[:500]
        await self._account_for(inp, Outcome.FAILED, reason)

    async def _account_for(self, inp: TerminatedGroupInput, outcome: Outcome, reason: str) -> None:
        """Close a group that cannot report itself: its unrecorded members recorded with ``outcome`` and
        ``reason``, its record written from the store, then counted as if it had reported."""
        st, cfg = self._state, self._cfg
        slot = st.slots.get(inp.group_id)
        if slot is None or inp.group_id in self._accounting or st.env is None:
            return
        self._accounting.add(inp.group_id)
        self._closed.why[inp.group_id] = reason
        idx = int(inp.group_id.removeprefix("g"))
        template = rollout_template(cfg, self._run_id, st.env)
        try:
            record = await record_unreported(
                inp, slot, idx % max(1, st.num_tasks), template, cfg.run.advantage_eps, outcome, reason
            )
        except Exception:
            self._accounting.discard(inp.group_id)  # noticed again at the next check
            raise
        finally:
            self._closed.why.pop(inp.group_id, None)
        self.group_done(record)

    @workflow.query
    def progress(self) -> RunProgress:
        st, run = self._state, self._cfg.run
        return RunProgress(
            run_id=self._run_id,
            total_groups=run.num_groups,
            groups_done=st.groups_done,
            groups_inflight=len(st.slots),
            rollouts_total=run.num_groups * run.group_size,
            outcomes=dict(st.outcomes),
            segment=st.segment,
            done=st.groups_done >= run.num_groups > 0,
            cap=self._cap,
            admission_cancelled=st.admission_cancelled,
            wasted_tokens=st.wasted_tokens,
            breaker=breaker.describe(st.breaker, run.breaker_probe_s),
            breaker_opened=st.breaker.opened,
            accounting=dict(self._closed.why),
            stopped=st.breaker.stopped,
        )

    def _may_admit(self) -> bool:
        return breaker.may_admit(
            self._state.breaker, workflow.now().timestamp(), self._cfg.run.breaker_probe_s
        )

    @workflow.run
    async def run(self, inp: RunInput) -> RunProgress:
        try:
            return await self._run(inp)
        except asyncio.CancelledError:
            if not workflow.patched(patches.RUN_CANCEL.id):
                raise
            st = self._state
            await cancel_groups(inp.run_id, st.slots, self._account_for, RUN_CANCEL_REASON, "cancelled")
            raise

    async def _run(self, inp: RunInput) -> RunProgress:
        st, cfg = self._state, self._cfg  # one state object, shared with the signal handler
        if st.env is None:
            loaded = await call(
                RolloutActivities.load_run,
                LoadRunInput(
                    run_id=inp.run_id,
                    config_json=cfg.model_dump_json(),
                    config_hash=inp.config_hash,
                    task_file=cfg.run.task_file,
                    env=cfg.run.env,
                ),
            )
            st.num_tasks, st.env = loaded.num_tasks, loaded.env
        assert st.env is not None
        template = rollout_template(cfg, inp.run_id, st.env)
        if self._closed.carried and workflow.patched(patches.NOTICE_CLOSED_GROUPS.id):
            self._closed.check_carried(st.slots, cfg)
        if cfg.admission.enabled:
            await self._dispatch_adaptive(inp, template)
        else:
            started = 0
            while st.next_group < cfg.run.num_groups:
                await self._room_for_a_group()
                if st.breaker.stopped is not None:
                    break
                if workflow.patched(patches.CONCURRENT_START.id):
                    # every free slot at once; while the breaker is open, only its probe
                    k = self._free_slots() if st.breaker.open_since is None else 1
                    k = min(k, cfg.run.num_groups - st.next_group, cfg.run.groups_per_run_segment - started)
                    k = max(1, k)
                    starts = [await self._begin_group(inp, template, cfg.engine.urls) for _ in range(k)]
                    await asyncio.gather(*starts)
                    started += k
                else:
                    await self._start_group(inp, template, cfg.engine.urls)
                    started += 1
                await self._maybe_continue_as_new(inp, started >= cfg.run.groups_per_run_segment)
        await workflow.wait_condition(lambda: not st.slots or st.breaker.stopped is not None)
        if st.breaker.stopped is not None:  # a streak of environment failures: cancel what still runs
            workflow.set_current_details(f"stopped: {st.breaker.stopped}")
            await cancel_groups(inp.run_id, st.slots, self._account_for, RUN_STOP_REASON, "stopped")
            return self.progress()
        if workflow.patched(patches.QUIET_SEGMENT_END.id):  # the last groups' closes, before the last task
            await workflow.wait_condition(lambda: not self._closed.closing(st.slots))
        await call(RolloutActivities.finish_run, inp.run_id)
        return self.progress()

    async def _room_for_a_group(self) -> None:
        """Wait (fixed cap) until a group may start: a free slot, and the circuit breaker closed or due for
        its probe. The breaker's state changes with group_done signals and its probe time with the clock,
        so each wait ends on whichever comes first and the loop looks again."""
        st, run = self._state, self._cfg.run
        free = lambda: self._free_slots() > 0  # noqa: E731
        closed = lambda: st.breaker.open_since is None  # noqa: E731
        while st.breaker.stopped is None:
            b = st.breaker
            if b.open_since is None:
                await workflow.wait_condition(lambda: free() or not closed())
                if closed():
                    return
            elif b.probe is not None:  # the probe's result decides
                await workflow.wait_condition(lambda: st.breaker.probe is None or closed())
            elif (due := b.open_since + run.breaker_probe_s - workflow.now().timestamp()) > 0:
                with contextlib.suppress(TimeoutError):
                    await workflow.wait_condition(lambda: closed() or bool(st.breaker.stopped), timeout=due)
            else:
                await workflow.wait_condition(lambda: free() or closed())
                if free() and self._may_admit():
                    return

    def _free_slots(self) -> int:
        """Groups the fixed cap still admits."""
        run = self._cfg.run
        return run.max_inflight_groups + run.overprovision - len(self._state.slots)

    async def _maybe_continue_as_new(self, inp: RunInput, segment_full: bool) -> None:
        if not (segment_full or workflow.info().is_continue_as_new_suggested()):
            return
        st, closed, since = self._state, self._closed, workflow.now()
        quiet = workflow.patched(patches.QUIET_SEGMENT_END.id)  # reported groups' closes in first
        drain = quiet  # groups of revision 3 report by update, refused while draining

        def settled() -> bool:
            if closed.why or not workflow.all_handlers_finished():
                return False
            waited = (workflow.now() - since).total_seconds()
            return not quiet or not closed.closing(st.slots) or (not drain and waited >= QUIET_WAIT_S)

        if drain:  # reports refused from here: the closes settle, and nothing else lands in the last task
            self._draining = True
            with contextlib.suppress(asyncio.TimeoutError):
                await workflow.wait_condition(settled, timeout=DRAIN_WAIT_S)
            await closed.stop()
            await workflow.wait_condition(lambda: not closed.why and workflow.all_handlers_finished())
        else:
            await workflow.wait_condition(settled)
        st.segment += 1  # the state is taken after every handler of this workflow task ran
        workflow.continue_as_new(inp.model_copy(update={"state": st}))

    async def _dispatch_adaptive(self, inp: RunInput, template: RolloutInput) -> None:
        """Poll, decide, cancel, admit; until every group has ended (the controller keeps trimming while
        the last groups run)."""
        st, cfg = self._state, self._cfg
        ds, adm = st.dispatch, cfg.admission
        if adm.preset != "prime-rl" and not workflow.patched(patches.PROBE_ADMISSION.id):
            adm = adm.model_copy(update={"preset": "prime-rl"})
        if adm.preset == "probe" and not workflow.patched(patches.PROBE_RAMP.id):
            adm = adm.model_copy(update={"ramp_below_usage": 0.0, "near_storm_fraction": 1.0})
        if adm.preset == "probe" and not workflow.patched(patches.FOOTPRINT.id):
            adm = adm.model_copy(update={"predicted_fill": 0.0})
        ctl = AdmissionController(adm, ds.admission, group_size=cfg.run.group_size)
        size, started, over = cfg.run.group_size, 0, cfg.run.overprovision
        ended_at_decision = False
        while (st.next_group < cfg.run.num_groups or st.slots) and st.breaker.stopped is None:
            self._reported_in_poll = 0
            poll = await self._poll(inp, template)
            now = workflow.now().timestamp()
            for r in poll.readings:
                ds.readings[r.engine_id] = r
            self._counts = {g: poll.counts.get(g, GroupCounts()) for g in st.slots}
            inflight = inflight_view(st.slots, self._counts, adm.redispatch_cancelled)
            ended, ended_tokens = newly_complete(ds, st.slots, self._counts)
            read_at = poll.at if workflow.patched(patches.READING_AGE.id) else None
            readings = list(ds.readings.values())
            d = ctl.step(now, readings, inflight, ended, ended_tokens, poll.backlog, read_at)
            ds.admission, self._cap = ctl.state, d.cap
            for gid, k in cancels_by_group(d.cancel, st.slots, self._counts).items():
                st.slots[gid].told += k
                group = workflow.get_external_workflow_handle_for(GroupWorkflow.run, f"{inp.run_id}/{gid}")
                await group.signal(GroupWorkflow.shed, k)
            queue_race = adm.max_queued_groups is not None and workflow.patched(patches.QUEUE_RACE.id)
            room = admission_room(
                d.admit, now, len(inflight), len(st.slots), poll.pool, ds.bucket,
                cfg.sandbox_pool.tasks_per_minute, size, cfg.run.max_inflight_groups + over,
                None if adm.max_queued_groups is None else adm.max_queued_groups + over,
                poll.unconsumed_groups + (self._reported_in_poll if queue_race else 0),
            )  # fmt: skip
            ds.bucket = room.bucket
            healthy = [u for u in cfg.engine.urls if u in d.healthy]
            left, admitted = room.rollouts, 0
            if not self._may_admit():
                room.reasons.append(f"breaker {breaker.describe(st.breaker, cfg.run.breaker_probe_s)}")
            concurrent = workflow.patched(patches.CONCURRENT_START.id)
            starts = []
            while (
                st.next_group < cfg.run.num_groups
                and healthy
                and self._may_admit()
                and len(st.slots) < room.max_groups
                and (left >= size or (left > 0 and not inflight and admitted == 0))
                and (not concurrent or started < cfg.run.groups_per_run_segment)  # a segment: exactly so many
            ):
                if concurrent:
                    starts.append(await self._begin_group(inp, template, healthy))
                else:
                    await self._start_group(inp, template, healthy)
                left, admitted, started = left - size, admitted + size, started + 1
            await asyncio.gather(*starts)
            ds.bucket = spend_bucket(ds.bucket, admitted, room.ready)
            self._log_decision(inp, now, d, ctl, poll, len(inflight), admitted, [*d.reasons, *room.reasons])
            await self._maybe_continue_as_new(inp, started >= cfg.run.groups_per_run_segment)
            if ended_at_decision := st.next_group >= cfg.run.num_groups and not st.slots:
                break
            self._freed = False
            with contextlib.suppress(TimeoutError):  # the poll interval passed with no group ending
                await workflow.wait_condition(lambda: self._freed, timeout=adm.poll_interval_s)
        if st.breaker.stopped is not None:
            return
        # The last group ended, seen at a decision or (more often) during the wait after one: 0.2.0 wrote
        # the last decision only in the first case, and saw no readings taken after it in either.
        if ended_at_decision or workflow.patched(patches.FINAL_DECISION.id):
            last = await self._poll(inp, template)  # writes the last decision to the dispatch log
            if workflow.patched(patches.FINAL_DECISION.id):
                await self._log_final_decision(inp, template, ctl, last)

    async def _log_final_decision(
        self, inp: RunInput, template: RolloutInput, ctl: AdmissionController, last: FleetPoll
    ) -> None:
        """What the controller makes of the fleet once the last group has ended, logged too: a preemption
        (or usage) that the run's end outran would otherwise never show its reaction in the dispatch log."""
        st = self._state
        ds = st.dispatch
        now = workflow.now().timestamp()
        for r in last.readings:
            ds.readings[r.engine_id] = r
        read_at = last.at if workflow.patched(patches.READING_AGE.id) else None
        d = ctl.step(now, list(ds.readings.values()), [], read_at=read_at)
        ds.admission, self._cap = ctl.state, d.cap
        self._log_decision(inp, now, d, ctl, last, 0, 0, ["final", *d.reasons])
        await self._poll(inp, template)  # writes it

    def _log_decision(
        self, inp: RunInput, now: float, d: Decision, ctl: AdmissionController, poll: FleetPoll,
        inflight: int, admitted: int, reasons: list[str],
    ) -> None:  # fmt: skip
        """The decision the next poll writes to the dispatch log (sequence number: the poll count)."""
        ds = self._state.dispatch
        ds.polls += 1
        ds.last_log = DispatchLog(
            run_id=inp.run_id, seq=ds.polls, at=now, cap=d.cap, inflight=inflight, admitted=admitted,
            cancelled=len(d.cancel), kv_usage=d.kv_usage, healthy=d.healthy, pool=poll.pool,
            reasons=reasons, footprint=ctl.state.footprint, kv_cap=d.kv_cap, backlog=poll.backlog,
        )  # fmt: skip

    async def _poll(self, inp: RunInput, template: RolloutInput) -> FleetPoll:
        st, cfg = self._state, self._cfg
        try:
            return await call(
                DispatchActivities.poll_fleet,
                PollFleetInput(
                    run_id=inp.run_id,
                    engine_urls=cfg.engine.urls,
                    groups=sorted(st.slots),
                    pool=template.pool,
                    log=st.dispatch.last_log,
                    count_unconsumed=cfg.admission.max_queued_groups is not None,
                    task_queue=workflow.info().task_queue,
                ),
                local=patches.run_local(),
            )
        except (ActivityError, ApplicationError) as e:
            # A failed poll admits nothing new this round; the readings age out if it persists.
            workflow.logger.warning("run %s: fleet poll failed: %s", inp.run_id, e)
            return FleetPoll(at=workflow.now().timestamp(), readings=[], counts=dict(self._counts))

    def _choose_engine(self, task_id: str, healthy: list[str]) -> str | None:
        cfg = self._cfg
        if cfg.engine.affinity != "group":
            return None
        load = replica_load(self._state.slots, self._counts, cfg.admission.redispatch_cancelled)
        return choose_replica(healthy, task_id, load, cfg.run.group_size, cfg.admission.load_factor)

    async def _task_id(self, inp: RunInput, idx: int) -> str:
        """Group idx's task id (the next TASK_ID_BATCH groups' ids come in one local activity)."""
        st = self._state
        assert st.num_tasks > 0
        if idx not in self._task_ids:
            ids: list[str] = await call(
                RolloutActivities.task_ids_at,
                inp.run_id,
                [(idx + k) % st.num_tasks for k in range(TASK_ID_BATCH)],
                local=patches.run_local(),
            )
            self._task_ids = {idx + k: t for k, t in enumerate(ids)}
        return self._task_ids.pop(idx)

    async def _begin_group(
        self, inp: RunInput, template: RolloutInput, healthy: list[str]
    ) -> Awaitable[workflow.ChildWorkflowHandle]:
        """Admit the next group: in flight, counted by the breaker and ``next_group`` at once; returns its
        start, which the caller awaits together with the other groups admitted at the same decision."""
        st = self._state
        idx = st.next_group
        task_id = await self._task_id(inp, idx)
        start = self._group_start(inp, template, healthy, idx, task_id)
        self._admitted(idx)
        return start

    async def _start_group(self, inp: RunInput, template: RolloutInput, healthy: list[str]) -> None:
        """Runs of 0.2.0 (before the CONCURRENT_START patch): one group, its start awaited."""
        st = self._state
        idx = st.next_group
        task_id = await self._task_id(inp, idx)
        await self._group_start(inp, template, healthy, idx, task_id)
        self._admitted(idx)

    def _admitted(self, idx: int) -> None:
        """Group idx counts as started: the breaker's (while open, it is the probe) and ``next_group``'s."""
        st = self._state
        st.breaker = breaker.admitted(st.breaker, group_id(idx))
        st.next_group += 1

    def _group_start(
        self, inp: RunInput, template: RolloutInput, healthy: list[str], idx: int, task_id: str
    ) -> Awaitable[workflow.ChildWorkflowHandle]:
        st, cfg = self._state, self._cfg
        gid = group_id(idx)
        engine = self._choose_engine(task_id, healthy)
        # In flight before the start resolves: on replay the group's group_done signal can be delivered in
        # the same activation as its start, and signal handlers run first.
        st.slots[gid] = GroupSlot(
            admitted_at=workflow.now().timestamp(), engine=engine or "", size=cfg.run.group_size
        )
        start = workflow.start_child_workflow(
            GroupWorkflow.run,
            GroupInput(
                run_id=inp.run_id,
                group_id=gid,
                task_id=task_id,
                size=cfg.run.group_size,
                advantage_eps=cfg.run.advantage_eps,
                template=template,
                run_workflow_id=workflow.info().workflow_id,
                engine=engine,
                redispatch_cancelled=cfg.admission.redispatch_cancelled,
                infra_retries=cfg.rollout.infra_retries,
                on_infra_failure=cfg.group.on_infra_failure,
                revision=patches.REVISION,
            ),
            id=f"{inp.run_id}/{gid}",
            parent_close_policy=ParentClosePolicy.ABANDON,
            search_attributes=TypedSearchAttributes(
                [
                    SearchAttributePair(sa.RUN, inp.run_id),
                    SearchAttributePair(sa.GROUP, gid),
                    SearchAttributePair(sa.TASK, task_id),
                ]
            ),
        )
        return self._closed.watched(gid, start)
