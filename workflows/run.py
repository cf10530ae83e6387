"""RunWorkflow: dispatch a run's groups under a fixed in-flight cap, with a bounded history.

Invariants:
- Group i samples task i modulo the number of tasks and has the deterministic workflow id ``<run>/g<i>``;
  ``next_group`` is carried across continue-as-new, so no group is ever started twice.
- Groups are started with ParentClosePolicy.ABANDON and report back by the ``group_done`` signal, so the
  run continues-as-new every ``groups_per_run_segment`` groups without waiting for in-flight groups.
- The run ends when every group has reported.
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy, TypedSearchAttributes
from temporalio.workflow import ParentClosePolicy

with workflow.unsafe.imports_passed_through():
    from config.models import Config
    from workflows import search_attributes as sa
    from workflows.group import GroupWorkflow
    from workflows.types import (
        EngineTarget,
        GroupInput,
        GroupResult,
        LoadRunInput,
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
        sandbox_spec_json=cfg.sandbox.model_dump_json() if cfg.run.env == "coding" else "",
    )


@workflow.defn(name="RunWorkflow")
class RunWorkflow:
    @workflow.init
    def __init__(self, inp: RunInput) -> None:
        # State comes from the input here, not in run(): signals buffered across continue-as-new are
        # delivered before run() starts and must find the carried in-flight set.
        self._inp = inp
        self._inflight: set[str] = set(inp.inflight)
        self._cfg = Config.model_validate(inp.config)
        self._total = self._cfg.run.num_groups
        self._group_size = self._cfg.run.group_size

    @workflow.signal
    def group_done(self, record: GroupResult) -> None:
        """A group closed; duplicate signals for the same group are ignored."""
        if record.group_id not in self._inflight:
            return
        self._inflight.discard(record.group_id)
        self._inp.groups_done += 1
        for outcome, n in record.outcomes.items():
            self._inp.outcomes[outcome] = self._inp.outcomes.get(outcome, 0) + n

    @workflow.query
    def progress(self) -> RunProgress:
        inp = self._inp
        return RunProgress(
            run_id=inp.run_id,
            total_groups=self._total,
            groups_done=inp.groups_done,
            groups_inflight=len(self._inflight),
            rollouts_total=self._total * self._group_size,
            outcomes=dict(inp.outcomes),
            segment=inp.segment,
            done=inp.groups_done >= self._total > 0,
        )

    @workflow.run
    async def run(self, inp: RunInput) -> RunProgress:
        cfg = self._cfg
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
        started = 0
        while inp.next_group < cfg.run.num_groups:
            await workflow.wait_condition(lambda: len(self._inflight) < cfg.run.max_inflight_groups)
            await self._start_group(inp, cfg, template)
            started += 1
            if started >= cfg.run.groups_per_run_segment or workflow.info().is_continue_as_new_suggested():
                await workflow.wait_condition(workflow.all_handlers_finished)
                workflow.continue_as_new(
                    inp.model_copy(update={"inflight": sorted(self._inflight), "segment": inp.segment + 1})
                )
        await workflow.wait_condition(lambda: not self._inflight)
        await workflow.execute_activity(
            "finish_run", inp.run_id, start_to_close_timeout=timedelta(seconds=60)
        )
        return self.progress()

    async def _start_group(self, inp: RunInput, cfg: Config, template: RolloutInput) -> None:
        assert inp.num_tasks > 0
        idx = inp.next_group
        gid = group_id(idx)
        task_id: str = await workflow.execute_local_activity(
            "task_id_at",
            args=[inp.run_id, idx % inp.num_tasks],
            result_type=str,
            start_to_close_timeout=timedelta(seconds=30),
        )
        run_wf_id = workflow.info().workflow_id
        # In flight before the start resolves: on replay the group's group_done signal can be delivered in
        # the same activation as its start, and signal handlers run first.
        self._inflight.add(gid)
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
            ),
            id=f"{inp.run_id}/{gid}",
            parent_close_policy=ParentClosePolicy.ABANDON,
            search_attributes=TypedSearchAttributes(
                [sa.RUN.value_set(inp.run_id), sa.GROUP.value_set(gid), sa.TASK.value_set(task_id)]
            ),
        )
        inp.next_group += 1
