"""Continue-as-new carries a workflow's state whole: a rollout's RolloutState, a run's RunState (the
adaptive dispatcher's DispatchState included), and no group or turn runs twice or is skipped.

A run continues as new on its own every ``run.groups_per_run_segment`` groups. A rollout only does when
the server suggests it (``workflow.info().is_continue_as_new_suggested()``), which the test server never
does; the `small_history` fixture makes the worker suggest it for RolloutWorkflow once a run's history
reaches a few dozen events, as a server with a small history limit would (deterministic: the history
length is part of each activation, so a replay sees the same suggestion).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, TypeVar

import pytest
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment
from temporalio.worker._workflow_instance import _WorkflowInstanceImpl

from durable_rollouts.config.models import AdmissionSection, Config, RolloutConfig, RunConfig
from durable_rollouts.contracts.types import (
    EngineTarget,
    Outcome,
    RolloutInput,
    RolloutResult,
    RolloutState,
    RunInput,
    RunProgress,
    group_id,
    rollout_id,
)
from durable_rollouts.workflows.rollout import RolloutWorkflow, rollout_replicas
from durable_rollouts.workflows.run import RunWorkflow

from .fakes import Fakes, fake_worker, rollout_input

T = TypeVar("T")
HISTORY_LIMIT = 30
"""Events after which the patched worker suggests continue-as-new to a rollout (a turn takes ~12)."""


@pytest.fixture
def small_history(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    original = _WorkflowInstanceImpl.workflow_is_continue_as_new_suggested

    def suggested(self: _WorkflowInstanceImpl) -> bool:
        if self._info.workflow_type == RolloutWorkflow.__name__:
            return self.workflow_get_current_history_length() >= HISTORY_LIMIT
        return original(self)

    monkeypatch.setattr(_WorkflowInstanceImpl, "workflow_is_continue_as_new_suggested", suggested)
    yield


async def continued_inputs(client: Client, workflow_id: str, first_run_id: str, cls: type[T]) -> list[T]:
    """The input each continue-as-new of the chain started with, oldest first (from history)."""
    out: list[T] = []
    run_id: str | None = first_run_id
    while run_id is not None:
        history = await client.get_workflow_handle(workflow_id, run_id=run_id).fetch_history()
        last = history.events[-1]
        run_id = None
        if last.HasField("workflow_execution_continued_as_new_event_attributes"):
            attrs = last.workflow_execution_continued_as_new_event_attributes
            [inp] = client.data_converter.payload_converter.from_payloads(attrs.input.payloads, [cls])
            out.append(inp)
            run_id = attrs.new_execution_run_id
    return out


def without_state(inp: Any) -> Any:
    return inp.model_copy(update={"state": None})


async def test_rollout_continues_as_new_with_its_state_whole(
    ts_env: WorkflowEnvironment, small_history: None, uid: str
) -> None:
    """A rollout resumed mid-way (turn 4, every counter set) continues as new several times on its way to
    turn 10: each new run starts from the state the previous one ended with, and the record gets that
    state unchanged plus the new turns' tokens."""
    client = ts_env.client
    now = (await ts_env.get_current_time()).timestamp()
    start = RolloutState(
        turn=4,
        tokens=200,
        started_at=now - 5.0,
        version="v0",
        engine_failovers=1,
        reprefill_tokens=50,
        sampled_tokens=120,
        step_sampled=20,
        partial_steps=2,
        sandbox=False,
        sandbox_replays=1,
        sandbox_slot_waits=3,
    )
    inp = rollout_input(
        uid,
        max_turns=20,
        engine=EngineTarget(urls=["http://engine-a", "http://engine-b"], model="tiny", request_timeout_s=30),
        state=start,
    )
    fakes = Fakes()
    fakes.done_on_turn = 10
    fakes.context[inp.rollout_id] = start.tokens
    tq = f"tq-{uid}"
    async with fake_worker(client, tq, fakes):
        handle = await client.start_workflow(RolloutWorkflow.run, inp, id=inp.rollout_id, task_queue=tq)
        result: RolloutResult = await handle.result()
    assert handle.first_execution_run_id is not None
    carried = await continued_inputs(client, inp.rollout_id, handle.first_execution_run_id, RolloutInput)

    new_turns = 10 - start.turn
    assert len(carried) >= 2, f"expected several continue-as-new, got {len(carried)}"
    assert all(without_state(c) == without_state(inp) for c in carried), "the settings travel unchanged"
    turns = [c.state.turn for c in carried if c.state is not None]
    assert len(turns) == len(carried) and turns == sorted(set(turns)) and start.turn < turns[0] < 10
    unchanged = {
        "started_at", "engine_failovers", "reprefill_tokens", "partial_steps", "sandbox", "sandbox_replays",
        "sandbox_slot_waits",
    }  # fmt: skip
    for c in carried:
        assert c.state is not None
        assert c.state.model_dump(include=unchanged) == start.model_dump(include=unchanged)
        done = c.state.turn - start.turn
        assert c.state.sampled_tokens == start.sampled_tokens + 10 * done
        assert c.state.tokens == start.tokens + 15 * done
        assert c.state.version == "v1"

    # Every turn ran exactly once, on the replica the carried failover count selects.
    second = rollout_replicas(inp)[1]
    assert [(g.turn, g.engine_url) for g in fakes.calls["generate_turn"]] == [
        (t, second) for t in range(start.turn, 10)
    ]
    assert all(g.prepare is None for g in fakes.calls["generate_turn"])
    assert (result.outcome, result.turns) == (Outcome.COMPLETED, 10)
    [rec] = fakes.finalized(inp.rollout_id)
    expected = start.model_copy(
        update={
            "turn": 10,
            "tokens": start.tokens + 10 * new_turns + 5 * (new_turns - 1),
            "sampled_tokens": start.sampled_tokens + 10 * new_turns,
            "step_sampled": start.step_sampled + 10 * new_turns,
            "version": "v1",
        }
    )
    assert rec.state == expected
    assert result.num_tokens == expected.tokens


async def test_rollout_without_suggestion_does_not_continue_as_new(ts_client: Client, uid: str) -> None:
    inp = rollout_input(uid, max_turns=20)
    fakes = Fakes()
    fakes.done_on_turn = 10
    tq = f"tq-{uid}"
    async with fake_worker(ts_client, tq, fakes):
        handle = await ts_client.start_workflow(RolloutWorkflow.run, inp, id=inp.rollout_id, task_queue=tq)
        result: RolloutResult = await handle.result()
    assert handle.first_execution_run_id is not None
    assert (
        await continued_inputs(ts_client, inp.rollout_id, handle.first_execution_run_id, RolloutInput) == []
    )
    assert result.turns == 10 and len(fakes.finalized(inp.rollout_id)) == 1


def run_config(adaptive: bool) -> Config:
    return Config(
        run=RunConfig(num_groups=5, group_size=2, groups_per_run_segment=2, max_inflight_groups=2),
        rollout=RolloutConfig(max_turns=3),
        admission=AdmissionSection(
            enabled=adaptive,
            initial_cap=4,
            max_inflight=8,
            admit_window_s=0.0,
            poll_interval_s=1.0,
        ),
    )


async def run_to_end(
    client: Client, fakes: Fakes, inp: RunInput, uid: str
) -> tuple[RunProgress, list[RunInput]]:
    tq = f"tq-{uid}"
    async with fake_worker(client, tq, fakes):
        handle = await client.start_workflow(RunWorkflow.run, inp, id=inp.run_id, task_queue=tq)
        result: RunProgress = await handle.result()
    assert handle.first_execution_run_id is not None
    return result, await continued_inputs(client, inp.run_id, handle.first_execution_run_id, RunInput)


def assert_every_group_ran_once(fakes: Fakes, inp: RunInput) -> None:
    cfg = inp.config.run
    gids = [g.record.group_id for g in fakes.calls["finalize_group"]]
    assert sorted(gids) == [group_id(i) for i in range(cfg.num_groups)], "each group once, none missing"
    members = {
        rollout_id(inp.run_id, group_id(i), k) for i in range(cfg.num_groups) for k in range(cfg.group_size)
    }
    assert set(fakes.records) == members
    assert all(len(fakes.finalized(rid)) == 1 for rid in members)
    turns = [(g.rollout_id, g.turn) for g in fakes.calls["generate_turn"]]
    assert len(turns) == len(set(turns)) == len(members) * 3, "every model turn ran once"
    assert len(fakes.calls["load_run"]) == 1, "the run is loaded once, not per segment"
    assert fakes.calls["finish_run"] == [inp.run_id]


async def test_adaptive_run_continues_as_new_with_its_dispatch_state(
    own_env: WorkflowEnvironment, uid: str
) -> None:
    fakes = Fakes()
    fakes.clock = own_env.get_current_time
    inp = RunInput(run_id=f"run-{uid}", config=run_config(adaptive=True))
    result, carried = await run_to_end(own_env.client, fakes, inp, uid)

    assert result == RunProgress(
        run_id=inp.run_id,
        total_groups=5,
        groups_done=5,
        groups_inflight=0,
        rollouts_total=10,
        outcomes={"completed": 10},
        segment=2,
        done=True,
        cap=result.cap,
    )
    assert_every_group_ran_once(fakes, inp)

    # Two segments of two groups each, then the last group: the state each new run started with.
    assert [c.state.segment if c.state else None for c in carried] == [1, 2]
    assert all(without_state(c) == inp for c in carried)
    polls, caps = [], []
    lengths = {f.state.tokens for f in fakes.finalized()}
    assert len(lengths) == 1 and min(lengths) > 0, lengths  # every rollout of the fakes is as long
    tokens = float(min(lengths))
    footprints = []
    for c in carried:
        st = c.state
        assert st is not None and st.env == fakes.env and st.num_tasks == fakes.num_tasks
        assert st.groups_done + len(st.slots) == st.next_group == 2 * st.segment
        assert sum(st.outcomes.values()) == st.groups_done * 2
        ds = st.dispatch
        assert ds.admission is not None and ds.admission.cap is not None
        caps.append(ds.admission.cap)
        assert ds.admission.polls == ds.polls, "the controller's state is the one carried"
        assert ds.last_log is not None and ds.last_log.seq == ds.polls
        # rule P5 learnt every completed member once: seen in flight, or from its group's record
        seen = sum(s.seen_complete for s in st.slots.values())
        learnt = ds.admission.footprint_rollouts
        assert learnt + ds.unseen_complete == st.outcomes.get("completed", 0) + seen
        assert ds.admission.footprint == (tokens if learnt else None)
        footprints.append(learnt)
        assert set(ds.readings) == set(inp.config.engine.urls)
        polls.append(ds.polls)
    assert polls == sorted(set(polls)), "the poll count only grows across segments"
    assert footprints[-1] > 0, footprints  # by the last segment some rollout's footprint was learnt
    # No overload: the cap starts at initial_cap and may only grow; a segment that lost the controller's
    # state would start again from initial_cap.
    assert result.cap is not None and [4, *caps, result.cap] == sorted([4, *caps, result.cap])

    # The dispatch log: every decision handed to the next poll once, in order, none lost at a segment.
    seqs = [p.log.seq if p.log is not None else None for p in fakes.calls["poll_fleet"]]
    assert seqs[0] is None
    assert seqs[1:] == list(range(1, len(seqs))), seqs
    assert all(p.run_id == inp.run_id for p in fakes.calls["poll_fleet"])


async def test_fixed_cap_run_continues_as_new_every_segment(own_client: Client, uid: str) -> None:
    fakes = Fakes()
    inp = RunInput(run_id=f"run-{uid}", config=run_config(adaptive=False))
    result, carried = await run_to_end(own_client, fakes, inp, uid)

    assert (result.groups_done, result.segment, result.done, result.cap) == (5, 2, True, None)
    assert result.outcomes == {"completed": 10}
    assert_every_group_ran_once(fakes, inp)
    assert fakes.calls["poll_fleet"] == [], "a fixed cap polls nothing"
    assert [c.state.next_group if c.state else None for c in carried] == [2, 4]
    assert all(c.state is not None and c.state.dispatch.polls == 0 for c in carried)
