"""RunWorkflow: the dispatcher. Starts a run's groups under an in-flight cap, with a bounded history.

Two modes (``admission.enabled``):
- fixed: at most ``run.max_inflight_groups`` groups in flight; nothing is polled.
- adaptive: every ``admission.poll_interval_s`` (and whenever a group ends) a local activity polls every
  engine's /metrics, the run store's record counts of the groups in flight and the sandbox pool; the
  `AdmissionController` (a pure state machine, state carried across continue-as-new) turns that into a cap
  in rollouts, admissions and cancels. Cancels go to the youngest groups as ``shed`` signals; sandboxed
  runs also stay within the pool's limit and, while the pool scales up, a tasks-per-minute token bucket.
  Each decision is written to the store's dispatch log by the next poll (idempotent on its sequence number).

In both modes a group's replica is chosen here (``engine.affinity = "group"``): consistent hashing of its
task id with bounded load over the healthy replicas (workflows/dispatch.py).

Invariants:
- Group i samples task i modulo the number of tasks and has the deterministic workflow id ``<run>/g<i>``;
  ``next_group`` is carried across continue-as-new, so no group is ever started twice.
- Groups are started with ParentClosePolicy.ABANDON and report back by the ``group_done`` signal, so the
  run continues-as-new every ``groups_per_run_segment`` groups without waiting for in-flight groups.
- The run ends when every group has reported.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy, TypedSearchAttributes
from temporalio.exceptions import ActivityError, ApplicationError
from temporalio.workflow import ParentClosePolicy

with workflow.unsafe.imports_passed_through():
    from config.models import Config
    from workflows import search_attributes as sa
    from workflows.admission import AdmissionConfig, AdmissionController
    from workflows.dispatch import (
        cancels_by_group,
        choose_replica,
        inflight_view,
        replica_load,
        sandbox_room,
        take_tokens,
    )
    from workflows.group import GroupWorkflow
    from workflows.types import (
        DispatchLog,
        EngineTarget,
        FleetPoll,
        GroupCounts,
        GroupInput,
        GroupResult,
        GroupSlot,
        LoadRunInput,
        PollFleetInput,
        RetrySettings,
        RolloutInput,
        RunInput,
        RunProgress,
        SamplingParams,
        group_id,
    )


def rollout_template(cfg: Config, run_id: str) -> RolloutInput:
    """The per-run part of every rollout's input (members fill in ids, index and seed)."""
    return RolloutInput(
        run_id=run_id,
        group_id="",
        rollout_id="",
        task_id="",
        sample_index=0,
        env=cfg.run.env,
        sampling=SamplingParams(
            temperature=cfg.sampling.temperature,
            top_p=cfg.sampling.top_p,
            top_k=cfg.sampling.top_k,
            max_tokens=cfg.sampling.max_tokens,
            min_tokens=cfg.sampling.min_tokens,
            seed=cfg.sampling.seed,
            logprob_mode=cfg.engine.logprob_mode,
        ),
        engine=EngineTarget(
            urls=cfg.engine.urls,
            model=cfg.engine.model,
            request_timeout_s=cfg.engine.request_timeout_s,
            default_policy_version=cfg.engine.policy_version,
            failover=cfg.engine.failover,
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
        sandbox_spec_json=cfg.sandbox.model_dump_json() if cfg.run.env == "coding" else "",
        pool_json=cfg.sandbox_pool.model_dump_json() if cfg.run.env == "coding" else "",
    )


TASK_ID_BATCH = 32
"""Task ids the run looks up at once (one local activity per this many groups, off the critical path)."""


def controller_config(cfg: Config) -> AdmissionConfig:
    """The controller's constants from the run's admission section (group size from the run)."""
    fields = cfg.admission.model_dump(include=set(AdmissionConfig.model_fields))
    return AdmissionConfig(**{**fields, "group_size": cfg.run.group_size})


@workflow.defn(name="RunWorkflow")
class RunWorkflow:
    @workflow.init
    def __init__(self, inp: RunInput) -> None:
        # State comes from the input here, not in run(): signals buffered across continue-as-new are
        # delivered before run() starts and must find the carried in-flight groups (slots).
        self._inp = inp
        self._cfg = Config.model_validate(inp.config)
        self._total = self._cfg.run.num_groups
        self._group_size = self._cfg.run.group_size
        self._counts: dict[str, GroupCounts] = {}
        self._task_ids: dict[int, str] = {}
        self._cap: int | None = None
        self._freed = False

    @workflow.signal
    def group_done(self, record: GroupResult) -> None:
        """A group closed; duplicate signals for the same group are ignored."""
        if self._inp.slots.pop(record.group_id, None) is None:
            return
        self._counts.pop(record.group_id, None)
        self._freed = True
        self._inp.groups_done += 1
        self._inp.admission_cancelled += record.admission_cancelled
        self._inp.wasted_tokens += record.wasted_tokens
        for outcome, n in record.outcomes.items():
            self._inp.outcomes[outcome] = self._inp.outcomes.get(outcome, 0) + n

    @workflow.query
    def progress(self) -> RunProgress:
        inp = self._inp
        return RunProgress(
            run_id=inp.run_id,
            total_groups=self._total,
            groups_done=inp.groups_done,
            groups_inflight=len(self._inp.slots),
            rollouts_total=self._total * self._group_size,
            outcomes=dict(inp.outcomes),
            segment=inp.segment,
            done=inp.groups_done >= self._total > 0,
            cap=self._cap,
            admission_cancelled=inp.admission_cancelled,
            wasted_tokens=inp.wasted_tokens,
        )

    @workflow.run
    async def run(self, inp: RunInput) -> RunProgress:
        inp, cfg = self._inp, self._cfg  # one state object, shared with the signal handler
        if inp.num_tasks == 0:
            inp.num_tasks = await workflow.execute_activity(
                "load_run",
                LoadRunInput(
                    run_id=inp.run_id,
                    config_json=cfg.model_dump_json(),
                    config_hash=inp.config_hash,
                    task_file=cfg.run.task_file,
                    env=cfg.run.env,
                ),
                result_type=int,
                start_to_close_timeout=timedelta(minutes=5),
                retry_policy=RetryPolicy(maximum_attempts=3, non_retryable_error_types=["TaskFileError"]),
            )
        template = rollout_template(cfg, inp.run_id)
        if cfg.admission.enabled:
            await self._dispatch_adaptive(inp, cfg, template)
        else:
            started = 0
            while inp.next_group < cfg.run.num_groups:
                await workflow.wait_condition(lambda: len(self._inp.slots) < cfg.run.max_inflight_groups)
                await self._start_group(inp, cfg, template, cfg.engine.urls)
                started += 1
                await self._maybe_continue_as_new(inp, started >= cfg.run.groups_per_run_segment)
        await workflow.wait_condition(lambda: not self._inp.slots)
        await workflow.execute_activity(
            "finish_run", inp.run_id, start_to_close_timeout=timedelta(seconds=60)
        )
        return self.progress()

    async def _maybe_continue_as_new(self, inp: RunInput, segment_full: bool) -> None:
        if not (segment_full or workflow.info().is_continue_as_new_suggested()):
            return
        await workflow.wait_condition(workflow.all_handlers_finished)
        workflow.continue_as_new(inp.model_copy(update={"segment": inp.segment + 1}))

    async def _dispatch_adaptive(self, inp: RunInput, cfg: Config, template: RolloutInput) -> None:
        """Poll, decide, cancel, admit; until every group has ended (the controller keeps trimming while
        the last groups run)."""
        ctl = AdmissionController(controller_config(cfg), inp.admission)
        adm, pool_cfg = cfg.admission, cfg.sandbox_pool
        size, started = cfg.run.group_size, 0
        while inp.next_group < cfg.run.num_groups or self._inp.slots:
            poll = await self._poll(inp, cfg, template)
            now = workflow.now().timestamp()
            for r in poll.readings:
                inp.readings[r.engine_id] = r
            self._counts = {g: poll.counts.get(g, GroupCounts()) for g in inp.slots}
            inflight = inflight_view(inp.slots, self._counts, adm.redispatch_cancelled)
            d = ctl.step(now, list(inp.readings.values()), inflight)
            inp.admission, self._cap = ctl.state, d.cap
            for gid, k in cancels_by_group(d.cancel, inp.slots, self._counts).items():
                inp.slots[gid].told += k
                await workflow.get_external_workflow_handle(f"{inp.run_id}/{gid}").signal("shed", k)
            room, reasons, ready = d.admit, list(d.reasons), 1 << 30
            if poll.pool is not None:
                limit, ready = sandbox_room(poll.pool, len(inflight))
                wanted = min(room, limit)
                if wanted > ready:  # some would wait for a slot to start: pace them by the bucket
                    inp.bucket = take_tokens(inp.bucket, now, pool_cfg.tasks_per_minute / 60.0, float(size))
                    wanted = min(wanted, ready + int(inp.bucket.tokens))
                if wanted < room:
                    reasons.append(f"sandbox pool {poll.pool.model_dump()}: admit {room} -> {wanted}")
                room = wanted
            healthy = [u for u in cfg.engine.urls if u in d.healthy]
            max_groups = cfg.run.max_inflight_groups
            if adm.max_queued_groups is not None:  # freshness: do not outrun the trainer
                max_groups = min(max_groups, adm.max_queued_groups - poll.unconsumed_groups)
                if len(self._inp.slots) >= max_groups:
                    reasons.append(f"queue: {poll.unconsumed_groups} groups wait for the trainer")
            admitted = 0
            while (
                inp.next_group < cfg.run.num_groups
                and healthy
                and len(self._inp.slots) < max_groups
                and (room >= size or (room > 0 and not inflight and admitted == 0))
            ):
                await self._start_group(inp, cfg, template, healthy)
                room, admitted, started = room - size, admitted + size, started + 1
            if inp.bucket is not None and admitted > ready:
                spent = float(admitted - ready)
                inp.bucket = inp.bucket.model_copy(update={"tokens": max(0.0, inp.bucket.tokens - spent)})
            inp.polls += 1
            inp.last_log = DispatchLog(
                run_id=inp.run_id,
                seq=inp.polls,
                at=now,
                cap=d.cap,
                inflight=len(inflight),
                admitted=admitted,
                cancelled=len(d.cancel),
                kv_usage=d.kv_usage,
                healthy=d.healthy,
                pool=poll.pool,
                reasons=reasons,
            )
            await self._maybe_continue_as_new(inp, started >= cfg.run.groups_per_run_segment)
            if inp.next_group >= cfg.run.num_groups and not self._inp.slots:
                await self._poll(inp, cfg, template)  # writes the last decision to the dispatch log
            else:
                self._freed = False
                with contextlib.suppress(TimeoutError):  # the poll interval passed with no group ending
                    await workflow.wait_condition(lambda: self._freed, timeout=adm.poll_interval_s)

    async def _poll(self, inp: RunInput, cfg: Config, template: RolloutInput) -> FleetPoll:
        try:
            return await workflow.execute_local_activity(
                "poll_fleet",
                PollFleetInput(
                    run_id=inp.run_id,
                    engine_urls=cfg.engine.urls,
                    groups=sorted(inp.slots),
                    pool_json=template.pool_json,
                    log=inp.last_log,
                    count_unconsumed=cfg.admission.max_queued_groups is not None,
                ),
                result_type=FleetPoll,
                start_to_close_timeout=timedelta(seconds=30),
                retry_policy=RetryPolicy(maximum_attempts=3, maximum_interval=timedelta(seconds=5)),
            )
        except (ActivityError, ApplicationError) as e:
            # A failed poll admits nothing new this round; the readings age out if it persists.
            workflow.logger.warning("run %s: fleet poll failed: %s", inp.run_id, e)
            return FleetPoll(at=workflow.now().timestamp(), readings=[], counts=dict(self._counts))

    def _choose_engine(self, inp: RunInput, cfg: Config, task_id: str, healthy: list[str]) -> str | None:
        if cfg.engine.affinity != "group":
            return None
        load = replica_load(inp.slots, self._counts, cfg.admission.redispatch_cancelled)
        return choose_replica(healthy, task_id, load, cfg.run.group_size, cfg.admission.load_factor)

    async def _start_group(
        self, inp: RunInput, cfg: Config, template: RolloutInput, healthy: list[str]
    ) -> None:
        assert inp.num_tasks > 0
        idx = inp.next_group
        gid = group_id(idx)
        if idx not in self._task_ids:  # the next TASK_ID_BATCH groups' task ids, in one local activity
            ids: list[str] = await workflow.execute_local_activity(
                "task_ids_at",
                args=[inp.run_id, [(idx + k) % inp.num_tasks for k in range(TASK_ID_BATCH)]],
                result_type=list[str],
                start_to_close_timeout=timedelta(seconds=30),
            )
            self._task_ids = {idx + k: t for k, t in enumerate(ids)}
        task_id = self._task_ids.pop(idx)
        run_wf_id = workflow.info().workflow_id
        engine = self._choose_engine(inp, cfg, task_id, healthy)
        # In flight before the start resolves: on replay the group's group_done signal can be delivered in
        # the same activation as its start, and signal handlers run first.
        inp.slots[gid] = GroupSlot(
            admitted_at=workflow.now().timestamp(), engine=engine or "", size=cfg.run.group_size
        )
        await workflow.start_child_workflow(
            GroupWorkflow.run,
            GroupInput(
                run_id=inp.run_id,
                group_id=gid,
                task_id=task_id,
                size=cfg.run.group_size,
                advantage_eps=cfg.run.advantage_eps,
                template=template,
                run_workflow_id=run_wf_id,
                engine=engine,
                redispatch_cancelled=cfg.admission.redispatch_cancelled,
            ),
            id=f"{inp.run_id}/{gid}",
            parent_close_policy=ParentClosePolicy.ABANDON,
            search_attributes=TypedSearchAttributes(
                [sa.RUN.value_set(inp.run_id), sa.GROUP.value_set(gid), sa.TASK.value_set(task_id)]
            ),
        )
        inp.next_group += 1
