"""BatchActivities.report_group: a group's record written once and its run told by the worker's client,
``group_done`` signal or (input revision 3) ``group_report`` update (again on a retry: the run ignores a
second); an update the run refuses (draining for continue-as-new) fails the try for a retry; a run that is
gone fails it for good."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import WorkflowUpdateFailedError, WorkflowUpdateRPCTimeoutOrCancelledError
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode
from temporalio.testing import ActivityEnvironment

from durable_rollouts.activities.batch import (
    GROUP_DONE,
    GROUP_REPORT,
    REPORT_WAIT_S,
    BatchActivities,
)
from durable_rollouts.activities.calls import options_of
from durable_rollouts.activities.rollout import RECORD_RETRY, RolloutActivities
from durable_rollouts.contracts.activity_io import FinalizeGroupInput
from durable_rollouts.contracts.batch import ReportGroupInput
from durable_rollouts.contracts.types import GroupResult
from durable_rollouts.engines.client import EngineClient
from durable_rollouts.store import RunStore

RECORD = GroupResult(
    run_id="run", group_id="g00000", task_id="t1", size=2, scorable=2, failed=0, reward_mean=0.5,
    reward_std=0.5, zero_variance=False, outcomes={"completed": 2},
)  # fmt: skip


class FakeClient:
    """What report_group asks of the worker's client: a handle by workflow id, and its signal."""

    def __init__(self, fail: Exception | None = None) -> None:
        self.signals: list[tuple[str, str, Any]] = []
        self.update_waits: list[tuple[str | None, timedelta | None]] = []
        self.fail = fail

    def get_workflow_handle(self, wid: str) -> FakeClient._Handle:
        return FakeClient._Handle(self, wid)

    class _Handle:
        def __init__(self, client: FakeClient, wid: str) -> None:
            self.client, self.wid = client, wid

        async def signal(self, name: str, arg: Any) -> None:
            if self.client.fail is not None:
                raise self.client.fail
            self.client.signals.append((self.wid, name, arg))

        async def execute_update(
            self, name: str, arg: Any, id: str | None = None, rpc_timeout: timedelta | None = None
        ) -> None:
            self.client.update_waits.append((id, rpc_timeout))
            await self.signal(name, arg)


async def _report(
    tmp_path: Path, client: FakeClient, run_workflow_id: str | None = "run", by_update: bool = False
) -> list[bool]:
    store = RunStore(tmp_path / "home")
    engine = EngineClient()
    acts = BatchActivities(RolloutActivities(store, engine))
    inp = ReportGroupInput(
        finalize=FinalizeGroupInput(record=RECORD, advantages={"run/g00000/0": 1.0, "run/g00000/1": -1.0}),
        run_workflow_id=run_workflow_id,
        by_update=by_update,
    )
    env = ActivityEnvironment(client=client)  # type: ignore[arg-type]
    try:
        return [await env.run(acts.report_group, inp) for _ in range(2)]  # the second: a retry
    finally:
        await engine.aclose()
        assert store.group("run", "g00000") == RECORD.model_dump(mode="json")


async def test_the_record_is_written_once_and_the_run_told_on_every_try(tmp_path: Path) -> None:
    client = FakeClient()
    assert await _report(tmp_path, client) == [True, False]
    assert client.signals == [("run", GROUP_DONE, RECORD)] * 2


async def test_a_group_without_a_run_tells_nobody(tmp_path: Path) -> None:
    client = FakeClient()
    assert await _report(tmp_path, client, run_workflow_id=None) == [True, False]
    assert client.signals == []


async def test_a_run_that_is_gone_fails_the_report_for_good(tmp_path: Path) -> None:
    gone = RPCError("workflow not found", RPCStatusCode.NOT_FOUND, b"")
    with pytest.raises(ApplicationError) as e:
        await _report(tmp_path, FakeClient(gone))
    assert e.value.non_retryable and e.value.type == "RunGone"


async def test_another_rpc_failure_is_retried(tmp_path: Path) -> None:
    unavailable = RPCError("server unavailable", RPCStatusCode.UNAVAILABLE, b"")
    with pytest.raises(RPCError):
        await _report(tmp_path, FakeClient(unavailable))


async def test_by_update_the_run_is_told_by_its_group_report_update(tmp_path: Path) -> None:
    client = FakeClient()
    assert await _report(tmp_path, client, by_update=True) == [True, False]
    assert client.signals == [("run", GROUP_REPORT, RECORD)] * 2
    # a try never waits without end, and every try is the same update: answered once, by the run
    assert client.update_waits == [("report/g00000", timedelta(seconds=REPORT_WAIT_S))] * 2


async def test_an_update_not_answered_in_time_fails_the_try_for_a_retry_on_a_timer(tmp_path: Path) -> None:
    """The run's workflow task may wait for a worker slot that groups waiting on their reports hold: the try
    gives up (RunBusy, retried) and the close's retries wait on a timer, which ends the group's task."""
    with pytest.raises(ApplicationError) as e:
        await _report(tmp_path, FakeClient(WorkflowUpdateRPCTimeoutOrCancelledError()), by_update=True)
    assert not e.value.non_retryable and e.value.type == "RunBusy"
    opts = options_of(BatchActivities.report_group)
    assert opts.local and opts.retry is RECORD_RETRY
    threshold = opts.kwargs()["local_retry_threshold"]
    assert threshold < RECORD_RETRY.initial_interval  # every retry's backoff exceeds it: a durable timer


async def test_an_update_the_draining_run_refuses_fails_the_try_for_a_retry(tmp_path: Path) -> None:
    refused = WorkflowUpdateFailedError(ApplicationError("continuing as new", type="RunDraining"))
    with pytest.raises(ApplicationError) as e:
        await _report(tmp_path, FakeClient(refused), by_update=True)
    assert not e.value.non_retryable and e.value.type == "RunDraining"
