"""Fake activities for the workflow tests, registered under the real activity names.

Each fake records its inputs and answers from in-memory dicts (the "store"), so a test scripts what the
engine, the environment, the sandbox and the fleet say, and reads back what the workflows asked for. A
test changes behaviour through the ``*_hook`` attributes: an async function of the activity's input that
returns a result (used as the answer), returns None (fall through to the default) or raises.

Default script: the prompt has ``prompt_tokens``, every model turn samples ``turn_tokens`` (fewer if the
workflow allows fewer, then with finish reason "length"), and the environment answers ``obs_tokens`` of
observation until the rollout's ``done_on_turn``-th turn, which ends it with ``reward``.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from typing import Any

from temporalio import activity
from temporalio.client import Client
from temporalio.worker import Worker

from durable_rollouts.activities.batch import tell_run
from durable_rollouts.activities.closed_groups import closed_among, unended_members
from durable_rollouts.config.models import AdmissionSection, Config, RolloutConfig, RunConfig
from durable_rollouts.contracts.activity_io import (
    ClosedGroupsInput,
    EnvStepInput,
    FinalizeGroupInput,
    FinalizeRolloutInput,
    GenerateInput,
    LoadRunInput,
    LoadRunResult,
    PrepareInput,
    StoredOutcome,
    TerminatedGroup,
    TerminatedGroupInput,
)
from durable_rollouts.contracts.batch import ReportGroupInput
from durable_rollouts.contracts.sandbox import SandboxCreated
from durable_rollouts.contracts.types import (
    RAN_TO_END,
    EngineReading,
    EngineTarget,
    EnvStepResult,
    EnvTraits,
    FleetPoll,
    GroupCounts,
    PollFleetInput,
    PrepareResult,
    RetrySettings,
    RolloutInput,
    RolloutResult,
    RunInput,
    SamplingParams,
    SandboxStepInput,
    TurnResult,
)
from durable_rollouts.workflows.group import GroupWorkflow
from durable_rollouts.workflows.patches import REVISION
from durable_rollouts.workflows.rollout import RolloutWorkflow
from durable_rollouts.workflows.run import RunWorkflow

WORKFLOWS = [RunWorkflow, GroupWorkflow, RolloutWorkflow]

Hook = Callable[[Any], Awaitable[Any]]


class Fakes:
    """Every activity a worker registers, faked; one instance per test."""

    def __init__(self) -> None:
        self.prompt_tokens = 7
        self.turn_tokens = 10
        self.obs_tokens = 5
        self.done_on_turn: int | None = 3
        """The environment says done after this many turns (None: never)."""
        self.reward = 1.0
        self.truncated_reward = 0.25
        """What a score-only step (a truncated rollout the run scores) answers."""
        self.policy_version: str | None = "v1"
        self.num_tasks = 3
        self.env = EnvTraits(name="fake")
        self.kv_usage = 0.1
        self.clock: Callable[[], Awaitable[datetime]] | None = None
        """The server's clock (``WorkflowEnvironment.get_current_time``): the time a reading is taken,
        comparable to the workflow's ``now`` once the test server has skipped time; None = wall clock."""

        self.generate_hook: Hook | None = None
        self.env_hook: Hook | None = None
        self.sandbox_create_hook: Hook | None = None
        self.report_hook: Hook | None = None

        self.calls: dict[str, list[Any]] = defaultdict(list)
        self.context: dict[str, int] = {}
        """Context length per rollout id (what the store's token sequence would hold)."""
        self.turns: dict[tuple[str, int], TurnResult] = {}
        self.records: dict[str, StoredOutcome] = {}
        self.groups: dict[str, FinalizeGroupInput] = {}

    # -- helpers --------------------------------------------------------------------------------------
    def _record(self, name: str, inp: Any) -> None:
        self.calls[name].append(inp)

    def finalized(self, rollout_id: str | None = None) -> list[FinalizeRolloutInput]:
        """finalize_rollout inputs (of one rollout), in call order."""
        out: list[FinalizeRolloutInput] = self.calls["finalize_rollout"]
        return [f for f in out if rollout_id is None or f.rollout_id == rollout_id]

    def all(self) -> list[Callable[..., Any]]:
        return [
            self.load_run,
            self.task_ids_at,
            self.latest_policy_version,
            self.prepare_rollout,
            self.generate_turn,
            self.finalize_rollout,
            self.finalize_group,
            self.report_group,
            self.finish_run,
            self.env_step,
            self.sandbox_create,
            self.sandbox_destroy,
            self.sandbox_recover,
            self.poll_fleet,
            self.terminated_group,
            self.closed_groups,
        ]

    # -- RolloutActivities ----------------------------------------------------------------------------
    @activity.defn(name="load_run")
    async def load_run(self, inp: LoadRunInput) -> LoadRunResult:
        self._record("load_run", inp)
        return LoadRunResult(num_tasks=self.num_tasks, env=self.env)

    @activity.defn(name="task_ids_at")
    async def task_ids_at(self, run_id: str, idxs: list[int]) -> list[str]:
        self._record("task_ids_at", (run_id, idxs))
        return [f"task-{i}" for i in idxs]

    @activity.defn(name="latest_policy_version")
    async def latest_policy_version(self) -> str | None:
        self._record("latest_policy_version", None)
        return self.policy_version

    @activity.defn(name="prepare_rollout")
    async def prepare_rollout(self, inp: PrepareInput) -> PrepareResult:
        self._record("prepare_rollout", inp)
        self.context.setdefault(inp.rollout_id, self.prompt_tokens)
        return PrepareResult(prompt_tokens=self.prompt_tokens, engine=inp.engine_url)

    @activity.defn(name="generate_turn")
    async def generate_turn(self, inp: GenerateInput) -> TurnResult:
        self._record("generate_turn", inp)
        if self.generate_hook is not None:
            scripted = await self.generate_hook(inp)
            if scripted is not None:
                return scripted
        key = (inp.rollout_id, inp.turn)
        if key in self.turns:  # idempotent on (rollout, turn), as the real one
            return self.turns[key]
        if inp.prepare is not None:
            self.context.setdefault(inp.rollout_id, self.prompt_tokens)
        start = self.context.get(inp.rollout_id, 0)
        n = min(self.turn_tokens, inp.max_tokens)
        turn = TurnResult(
            turn=inp.turn,
            start=start,
            end=start + n,
            finish_reason="length" if n < self.turn_tokens else "stop",
            policy_version=self.policy_version,
        )
        self.turns[key] = turn
        self.context[inp.rollout_id] = turn.end
        return turn

    @activity.defn(name="finalize_rollout")
    async def finalize_rollout(self, inp: FinalizeRolloutInput) -> StoredOutcome:
        self._record("finalize_rollout", inp)
        if inp.rollout_id in self.records:  # the first write wins
            return self.records[inp.rollout_id].model_copy(update={"inserted": False})
        stored = StoredOutcome(
            outcome=inp.outcome,
            reason=inp.reason,
            reward=inp.reward,
            scorable=inp.scorable,
            wasted_tokens=inp.wasted_tokens or 0,
        )
        self.records[inp.rollout_id] = stored
        return stored

    @activity.defn(name="finalize_group")
    async def finalize_group(self, inp: FinalizeGroupInput) -> bool:
        self._record("finalize_group", inp)
        new = inp.record.group_id not in self.groups
        self.groups.setdefault(inp.record.group_id, inp)
        return new

    @activity.defn(name="report_group")
    async def report_group(self, inp: ReportGroupInput) -> bool:
        """The real close's steps (activities.batch): the record (as ``finalize_group``), then the run told
        by the real client and the real ``tell_run`` (its update refused while the run drains, or not
        answered in time: this try fails, a later one lands). ``report_hook`` runs before the run is told."""
        self._record("report_group", inp)
        written = await self.finalize_group(inp.finalize)
        if self.report_hook is not None:
            await self.report_hook(inp)
        if inp.run_workflow_id:
            await tell_run(activity.client(), inp.run_workflow_id, inp.finalize.record, inp.by_update)
        return written

    @activity.defn(name="finish_run")
    async def finish_run(self, run_id: str, status: str = "finished") -> None:
        self._record("finish_run", run_id)
        self._record("finish_run_status", status)

    # -- EnvironmentActivities ------------------------------------------------------------------------
    @activity.defn(name="env_step")
    async def env_step(self, inp: EnvStepInput) -> EnvStepResult:
        self._record("env_step", inp)
        if self.env_hook is not None:
            scripted = await self.env_hook(inp)
            if scripted is not None:
                return scripted
        if inp.score_only:
            return EnvStepResult(done=True, reward=self.truncated_reward)
        if self.done_on_turn is not None and inp.turn + 1 >= self.done_on_turn:
            return EnvStepResult(done=True, reward=self.reward)
        self.context[inp.rollout_id] = self.context.get(inp.rollout_id, 0) + self.obs_tokens
        return EnvStepResult(done=False, observation_tokens=self.obs_tokens)

    # -- SandboxActivities ----------------------------------------------------------------------------
    @activity.defn(name="sandbox_create")
    async def sandbox_create(self, inp: SandboxStepInput) -> bool | SandboxCreated:
        self._record("sandbox_create", inp)
        if self.sandbox_create_hook is not None:
            scripted = await self.sandbox_create_hook(inp)
            if isinstance(scripted, SandboxCreated):
                return scripted
            if scripted is not None:
                return bool(scripted)
        return True

    @activity.defn(name="sandbox_destroy")
    async def sandbox_destroy(self, rollout_id: str) -> None:
        self._record("sandbox_destroy", rollout_id)

    @activity.defn(name="sandbox_recover")
    async def sandbox_recover(self, inp: SandboxStepInput) -> int:
        self._record("sandbox_recover", inp)
        return inp.turn

    # -- DispatchActivities ---------------------------------------------------------------------------
    @activity.defn(name="poll_fleet")
    async def poll_fleet(self, inp: PollFleetInput) -> FleetPoll:
        """Every engine fresh at ``kv_usage``; group counts from the records written so far."""
        self._record("poll_fleet", inp)
        now = (await self.clock()).timestamp() if self.clock is not None else time.time()
        finalized: dict[str, FinalizeRolloutInput] = {}
        for f in self.finalized():
            finalized.setdefault(f.rollout_id, f)
        counts = {}
        for g in inp.groups:
            members = [f for f in finalized.values() if f.ref.run_id == inp.run_id and f.ref.group_id == g]
            cancelled = sum(1 for f in members if f.reason == "admission")
            complete = [f for f in members if f.outcome in RAN_TO_END]
            counts[g] = GroupCounts(
                finished=len(members),
                admission_cancelled=cancelled,
                complete=len(complete),
                complete_tokens=sum(f.state.tokens for f in complete),
            )
        readings = [
            EngineReading(
                engine_id=url,
                at=now,
                kv_usage=self.kv_usage,
                running=0,
                waiting_capacity=0,
                preemptions_total=0.0,
                kv_capacity_tokens=1_000_000,
            )
            for url in inp.engine_urls
        ]
        return FleetPoll(at=now, readings=readings, counts=counts)

    @activity.defn(name="terminated_group")
    async def terminated_group(self, inp: TerminatedGroupInput) -> TerminatedGroup:
        """The fake store's view of the group (as the real one reads it from the store); the members
        Temporal holds come from the test server, as the real activity asks them."""
        self._record("terminated_group", inp)
        first: dict[str, FinalizeRolloutInput] = {}
        for f in self.finalized():
            if f.run_id == inp.run_id and f.group_id == inp.group_id:
                first.setdefault(f.rollout_id, f)
        members = [
            RolloutResult(
                rollout_id=rid, sample_index=f.sample_index, outcome=self.records[rid].outcome,
                reason=self.records[rid].reason, reward=self.records[rid].reward,
                scorable=self.records[rid].scorable, wasted_tokens=self.records[rid].wasted_tokens,
            )
            for rid, f in first.items()
        ]  # fmt: skip
        group = self.groups.get(inp.group_id)
        task_id = group.record.task_id if group else f"task-{inp.task_index}"
        unended = await unended_members(activity.client(), inp.run_id, inp.group_id, inp.size)
        return TerminatedGroup(
            task_id=task_id, members=members, record=group.record if group else None, unended=unended
        )

    @activity.defn(name="closed_groups")
    async def closed_groups(self, inp: ClosedGroupsInput) -> dict[str, str]:
        """As the real one: asks the test server."""
        self._record("closed_groups", inp)
        return await closed_among(activity.client(), inp.run_id, inp.groups)


def fake_worker(client: Client, task_queue: str, fakes: Fakes, workflow_slots: int | None = None) -> Worker:
    """A worker with the real workflows and the fake activities (heartbeats reach the server at once, so
    a cancellation reaches a heartbeating fake within milliseconds); ``workflow_slots``: its workflow-task
    slots (the SDK's default otherwise)."""
    slots = {} if workflow_slots is None else {"max_concurrent_workflow_tasks": workflow_slots}
    return Worker(
        client,
        task_queue=task_queue,
        workflows=WORKFLOWS,
        activities=fakes.all(),
        **slots,
        max_heartbeat_throttle_interval=timedelta(milliseconds=50),
        default_heartbeat_throttle_interval=timedelta(milliseconds=50),
    )


def sampling() -> SamplingParams:
    return SamplingParams(
        temperature=1.0, top_p=1.0, top_k=-1, max_tokens=16, seed=0, logprob_mode="processed_logprobs"
    )


def rollout_input(uid: str, **update: Any) -> RolloutInput:
    """A single rollout's input (as GroupWorkflow would build it), with fields replaced by ``update``."""
    run_id = f"run-{uid}"
    inp = RolloutInput(
        run_id=run_id,
        group_id="g000000",
        rollout_id=f"{run_id}/g000000/0",
        task_id="task-0",
        sample_index=0,
        env=EnvTraits(name="fake"),
        sampling=sampling(),
        engine=EngineTarget(urls=["http://engine-a"], model="tiny", request_timeout_s=30.0),
        retry=RetrySettings(max_attempts=2, initial_s=0.05, max_s=0.1),
        max_turns=10,
        max_total_tokens=1000,
        timeout_s=600.0,
        score_truncated=False,
        revision=REVISION,  # as rollout_template sets it
    )
    return inp.model_copy(update=update)


def admitted_run(uid: str, admission: AdmissionSection, groups: int, size: int, inflight: int) -> RunInput:
    """A run of ``groups`` groups of ``size`` two-turn rollouts under ``admission`` (disabled: the fixed
    cap), at most ``inflight`` groups in flight."""
    run = RunConfig(num_groups=groups, group_size=size, max_inflight_groups=inflight)
    cfg = Config(run=run, rollout=RolloutConfig(max_turns=2), admission=admission)
    return RunInput(run_id=f"run-{uid}", config=cfg)


async def wait_for(predicate: Callable[[], bool], timeout_s: float = 10.0, what: str = "condition") -> None:
    """Poll ``predicate`` (real time) until it holds."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)
