"""Rollouts run inside their group's workflow (``group.inline_rollouts``), on the time-skipping server with
the real workers' activities, store and environments (a fake engine underneath): the same records as
child workflows, no child workflow and no search-attribute upsert in the group's history, a history that
replays; a member the group sheds for admission ends cancelled with its record and its slot runs again;
``rollouts cancel`` of a member reaches it through its group."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowHandle, WorkflowHistory
from temporalio.service import RPCError
from temporalio.worker import Replayer

from durable_rollouts.admission.controller import CANCEL_REASON
from durable_rollouts.cli import ops
from durable_rollouts.config.models import Config, GroupConfig, RolloutConfig
from durable_rollouts.contracts.types import EnvTraits, GroupInput, GroupResult, Outcome
from durable_rollouts.engines.client import Generation
from durable_rollouts.store import RunStore
from durable_rollouts.workers.worker import build_worker
from durable_rollouts.workflows.group import GroupWorkflow, inline_members
from durable_rollouts.workflows.patches import REVISION
from durable_rollouts.workflows.rollout import RolloutWorkflow

from .fakes import rollout_input
from .test_environment_failures import PARSES, FakeEngine, records, test_environments

__all__ = ["test_environments"]  # the autouse fixture that registers the test environments

ENV = EnvTraits(name="broken-parse", inline_steps=True)
"""Member 0 is right (reward 1), member 1's parse raises (environment failure), member 2 is wrong."""


class HeldEngine(FakeEngine):
    """Holds member ``held``'s model call until it is cancelled (at most a minute).

    A local call's cancel lands when the worker next completes the workflow task: the SDK heartbeats a
    task held open by a local activity (every ~8 s of a 10 s task timeout), and the signal comes with the
    next one. Only then is the call cancelled."""

    def __init__(self, held: str) -> None:
        self.held = held
        self.waiting = asyncio.Event()
        self.cancelled = asyncio.Event()

    async def generate(self, base_url: str, model: str, prompt_ids: list[int], *args: object) -> Generation:
        request_id = str(args[-1])  # <rollout id>/<turn>/<attempt>
        if request_id.rsplit("/", 2)[0] == self.held:
            self.waiting.set()
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        return await super().generate(base_url, model, prompt_ids, *args)


def group_input(uid: str, store: RunStore, size: int, inline: bool, **group: object) -> GroupInput:
    run_id = f"run-{uid}"
    cfg = Config(rollout=RolloutConfig(local_model_calls=True), group=GroupConfig(inline_rollouts=inline))
    store.register_run(run_id, cfg.model_dump_json(), "test-hash")
    store.put_tasks(run_id, [{"id": "task-0"}])
    template = rollout_input(uid, env=ENV, local_model_calls=True, in_group=inline)
    return GroupInput(
        run_id=run_id, group_id="g000000", task_id="task-0", size=size, advantage_eps=1e-6, template=template,
        revision=REVISION, **group,  # type: ignore[arg-type]
    )  # fmt: skip


async def run_group(client: Client, store: RunStore, uid: str, inp: GroupInput, engine: FakeEngine) -> tuple[
    GroupResult, WorkflowHistory
]:  # fmt: skip
    async with build_worker(client, f"tq-{uid}", store, engine):  # type: ignore[arg-type]
        handle = await client.start_workflow(
            GroupWorkflow.run, inp, id=f"{inp.run_id}/g000000", task_queue=f"tq-{uid}"
        )
        result: GroupResult = await handle.result()
        return result, await handle.fetch_history()


@asynccontextmanager
async def held_group(
    client: Client, store: RunStore, uid: str, inp: GroupInput, engine: HeldEngine
) -> AsyncIterator[WorkflowHandle]:
    """The group running on a worker, once its held member's model call has begun."""
    async with build_worker(client, f"tq-{uid}", store, engine):  # type: ignore[arg-type]
        handle = await client.start_workflow(
            GroupWorkflow.run, inp, id=f"{inp.run_id}/g000000", task_queue=f"tq-{uid}"
        )
        await asyncio.wait_for(engine.waiting.wait(), 30)
        yield handle


def event_types(history: WorkflowHistory) -> list[str]:
    return [EventType.Name(e.event_type).removeprefix("EVENT_TYPE_") for e in history.events]


def test_only_members_whose_every_step_is_local_run_inline() -> None:
    cfg = Config(rollout=RolloutConfig(local_model_calls=True), group=GroupConfig(inline_rollouts=True))
    assert inline_members(cfg, ENV)
    assert not inline_members(cfg, EnvTraits(name="coding", uses_sandbox=True))
    assert not inline_members(cfg, EnvTraits(name="fake"))  # steps in their own activity
    assert not inline_members(cfg, EnvTraits(name="h", inline_steps=True, harness=True))
    assert not inline_members(Config(rollout=RolloutConfig(local_model_calls=True)), ENV)


async def test_inline_members_get_the_records_of_child_workflows_in_one_history_that_replays(
    ts_client: Client, uid: str, tmp_path: Path
) -> None:
    results = {}
    for inline in (False, True):
        store = RunStore(tmp_path / str(inline))
        inp = group_input(f"{uid}-{inline}", store, 3, inline)
        result, history = await run_group(ts_client, store, f"{uid}-{inline}", inp, FakeEngine())
        recs = records(store, f"{uid}-{inline}")
        keep = ("outcome", "reason", "reward", "scorable", "advantage", "num_tokens", "prompt_length")
        results[inline] = ([[r[k] for k in keep] for _, r in sorted(recs.items())], result, history)
    (child_recs, child, child_history), (recs, group, history) = results[False], results[True]

    assert recs == child_recs and len(recs) == 3
    assert [r[0] for r in recs] == ["completed", "failed", "completed"]
    assert recs[1][1].startswith("environment: ZeroDivisionError"), "the environment's failure stays its own"
    assert PARSES[f"run-{uid}-True/g000000/1"] == 1, "an exception of the environment's code is not retried"
    keep = ("size", "scorable", "failed", "reward_mean", "outcomes")
    assert [getattr(group, k) for k in keep] == [getattr(child, k) for k in keep]

    types = event_types(history)
    assert "START_CHILD_WORKFLOW_EXECUTION_INITIATED" not in types
    assert "UPSERT_WORKFLOW_SEARCH_ATTRIBUTES" not in types, "a member indexes nothing on its group"
    assert types.count("MARKER_RECORDED") == 3 * 2 + 1  # per member its turn and its record; the group's
    # the child group's history alone varies with how the members' completions batch into workflow tasks
    # (24 events or more); with the members' own histories it is the whole price of child workflows
    members = [ts_client.get_workflow_handle(f"run-{uid}-False/g000000/{i}") for i in range(3)]
    child_events = len(event_types(child_history)) + sum(
        [len((await m.fetch_history()).events) for m in members]
    )
    print(f"events: inline {len(types)}, child workflows {child_events}")
    assert len(types) < len(event_types(child_history)) and len(types) < child_events / 3
    for i in range(3):  # a member has no workflow of its own
        try:
            await ts_client.get_workflow_handle(f"run-{uid}-True/g000000/{i}").describe()
            raise AssertionError(f"member {i} has a workflow")
        except RPCError:
            pass
    await Replayer(workflows=[GroupWorkflow, RolloutWorkflow]).replay_workflow(history)


async def test_a_shed_inline_member_ends_cancelled_with_its_record_and_its_slot_runs_again(
    ts_client: Client, uid: str, tmp_path: Path
) -> None:
    store = RunStore(tmp_path)
    inp = group_input(uid, store, 3, True, redispatch_cancelled=True)
    held = f"run-{uid}/g000000/2"
    engine = HeldEngine(held)
    async with held_group(ts_client, store, uid, inp, engine) as handle:
        prog = await handle.query(GroupWorkflow.progress)
        assert prog["running"] == [held] and prog["members"][held]["phase"] == "generate"
        await handle.signal(GroupWorkflow.shed, 1)
        await asyncio.wait_for(engine.cancelled.wait(), 30)
        result: GroupResult = await handle.result()
        history = await handle.fetch_history()
    recs = {r["rollout_id"]: r for r in store.rollouts(inp.run_id)}
    assert (recs[held]["outcome"], recs[held]["reason"]) == (Outcome.CANCELLED.value, CANCEL_REASON)
    again = recs[f"{held}r1"]
    assert (again["outcome"], again["reward"]) == (Outcome.COMPLETED.value, 0.0)  # member 2's answer
    assert result.admission_cancelled == 1 and result.scorable == 2
    await Replayer(workflows=[GroupWorkflow, RolloutWorkflow]).replay_workflow(history)


async def test_rollouts_cancel_of_an_inline_member_reaches_it_through_its_group(
    ts_client: Client, uid: str, tmp_path: Path
) -> None:
    store = RunStore(tmp_path)
    inp = group_input(uid, store, 2, True)
    held = f"run-{uid}/g000000/0"
    engine = HeldEngine(held)
    async with held_group(ts_client, store, uid, inp, engine) as handle:
        target = await ops.resolve(ts_client, held, store)
        assert (target.kind, target.inline, target.group_id) == ("rollout", True, "g000000")
        try:
            await ops.terminate(ts_client, store, held)
            raise AssertionError("terminate of an inline member did not refuse")
        except ops.OpsError as e:
            assert "runs inside its group's workflow" in str(e)
        said = await ops.cancel(ts_client, store, held, wait_s=30)
        assert engine.cancelled.is_set()
        result: GroupResult = await handle.result()
    assert said.startswith(f"cancelled {held}: recorded cancelled (manual)"), said
    rec = store.rollout(held)
    assert rec is not None and (rec["outcome"], rec["reason"]) == ("cancelled", "manual")
    assert result.outcomes.get("cancelled") == 1
