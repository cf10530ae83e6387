"""Groups terminated with the ``temporal`` CLI (as an operator would from the web UI or the CLI) on the real
Temporal dev server, mid-run, before and after a continue-as-new: the run notices each by itself
(workflows/closed_groups.py) and finishes; one record per rollout, every group with its full size, the
ledger clean; a rollout terminated the same way is recorded by its group; ``rollouts terminate`` of a
group the run already accounted for changes nothing; every segment's history replays."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from temporalio.client import Client, WorkflowHandle
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

from durable_rollouts.cli import ops
from durable_rollouts.config.paths import venv_bin
from durable_rollouts.contracts.types import RunInput
from durable_rollouts.faults import LedgerReport
from durable_rollouts.simengine import SimEngine, SimSettings
from durable_rollouts.store import RunStore
from durable_rollouts.workers.worker import WORKFLOWS
from tests.integration.support import export, make_config, start_run, worker
from tests.integration.test_ops import never_tasks, running_rollouts, wait_for

TERMINATED = "infra: WorkflowTerminated: group terminated (web UI or CLI)"


def temporal_terminate(client: Client, workflow_id: str) -> None:
    """``temporal workflow terminate``: what an operator runs (the web UI sends the same request)."""
    argv = [str(venv_bin("temporal")), "workflow", "terminate", "--address",
            client.service_client.config.target_host, "--namespace", client.namespace,
            "--workflow-id", workflow_id, "--reason", "stuck, said the operator"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, (argv, done.stdout, done.stderr)


async def segments(client: Client, handle: WorkflowHandle) -> list[tuple[str, RunInput | None]]:
    """(run id, the input it continued as new with, None for the last) of each segment, oldest first."""
    out: list[tuple[str, RunInput | None]] = []
    run_id = handle.first_execution_run_id
    while run_id is not None:
        history = await client.get_workflow_handle(handle.id, run_id=run_id).fetch_history()
        last, nxt, carried = history.events[-1], None, None
        if last.HasField("workflow_execution_continued_as_new_event_attributes"):
            attrs = last.workflow_execution_continued_as_new_event_attributes
            convert = client.data_converter.payload_converter
            [carried] = convert.from_payloads(attrs.input.payloads, [RunInput])
            nxt = attrs.new_execution_run_id
        out.append((run_id, carried))
        run_id = nxt
    return out


@pytest.mark.timeout(300)
async def test_groups_terminated_with_the_temporal_cli_before_and_after_a_continue_as_new(
    client: Client, ledger: Callable[..., Awaitable[LedgerReport]], task_queue: str, tmp_path: Path
) -> None:
    """Six groups of two, three in flight, four per segment; rollouts of ~30 s. g0 is terminated in the
    segment that started it (noticed by its handle; g3 takes its place, the fourth start: the run continues
    as new carrying g1, g2, g3); then g2, carried, is terminated (noticed by the check of carried groups),
    and so is one rollout of g1 (recorded by its group)."""
    run_id = "cli-terminated"
    g = lambda i: f"{run_id}/g{i:06d}"  # noqa: E731
    async with SimEngine(SimSettings(policy="random", prefill_ms=500)).serve(port=0) as url:
        cfg = make_config(
            [url], task_queue,
            run={"num_groups": 6, "group_size": 2, "max_inflight_groups": 3, "groups_per_run_segment": 4,
                 "closed_group_check_s": 2.0, "task_file": never_tasks(tmp_path)},
            rollout={"max_turns": 60, "max_total_tokens": 8192},  # ~30 s each: the actions land first
        )  # fmt: skip
        async with worker(client, task_queue, tmp_path) as store:
            handle = await start_run(client, cfg, run_id)

            async def running(n: int, *groups: str) -> bool:
                ids = await running_rollouts(client, run_id)
                mine = [r for r in ids if any(r.startswith(f"{x}/") for x in groups)]
                return len(mine) == n and all(store.get_segment(r, "t00000.model") for r in mine)

            await wait_for(lambda: running(6, g(0), g(1), g(2)), 90, "g0-g2's rollouts past their first turn")
            await asyncio.to_thread(temporal_terminate, client, g(0))
            await wait_for(lambda: running(2, g(3)), 60, "g3 started in g0's place")
            assert await running(4, g(1), g(2)), "g3 took g0's slot, not that of a group that ended"

            async def continued() -> bool:
                return len(await segments(client, handle)) >= 2

            await wait_for(continued, 30, "the run continued as new")
            await asyncio.to_thread(temporal_terminate, client, g(2))
            await asyncio.to_thread(temporal_terminate, client, f"{g(1)}/0")

            async def accounted() -> bool:
                return store.group(run_id, "g000002") is not None

            await wait_for(accounted, 30, "g2 accounted by the run")
            said = await ops.terminate(client, store, g(2))  # `rollouts terminate g2`, afterwards
            assert said.startswith(f"terminated group {g(2)}: recorded size 2"), said
            result = await asyncio.wait_for(handle.result(), 200)
            await ledger(store, run_id, client=client)
            chain = await segments(client, handle)
            replayer = Replayer(workflows=WORKFLOWS, data_converter=pydantic_data_converter)
            for rid, _ in chain:
                history = await client.get_workflow_handle(run_id, run_id=rid).fetch_history()
                await replayer.replay_workflow(history)

    first_carry = chain[0][1]
    assert first_carry is not None and first_carry.state is not None
    assert sorted(first_carry.state.slots) == ["g000001", "g000002", "g000003"], "g0 accounted in segment 0"
    rollouts, groups = export(store, run_id)
    by_id = {x["rollout_id"]: x for x in rollouts}
    assert len(by_id) == len(rollouts) == 12, "one record per rollout"
    assert len(groups) == 6 and all(x["size"] == 2 for x in groups)
    assert result.done and result.groups_done == 6 and sum(result.outcomes.values()) == 12
    for i in (0, 2):
        for k in range(2):
            x = by_id[f"{g(i)}/{k}"]
            assert (x["outcome"], x["reason"]) == ("failed", TERMINATED), x
    single = by_id[f"{g(1)}/0"]
    assert single["outcome"] == "failed" and single["reason"].startswith("infra: child workflow Terminated")
    assert RunStore(tmp_path).group(run_id, "g000002") is not None
