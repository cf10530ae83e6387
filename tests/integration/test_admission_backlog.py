"""Rule O (admission/backlog.py) end to end: a simulated engine with ample KV cache, so the engine rules
alone would keep growing the cap, and a worker with four workflow-task slots whose workflow tasks are slow,
so the orchestration is the bottleneck. Real Temporal dev server, whose task queue stats and history the
poll reads."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import pytest
from temporalio import workflow
from temporalio.client import Client
from temporalio.worker import (
    Interceptor,
    StartActivityInput,
    WorkflowInboundInterceptor,
    WorkflowInterceptorClassInput,
    WorkflowOutboundInterceptor,
)

from durable_rollouts.contracts.types import RunProgress
from durable_rollouts.simengine import SimEngine, SimSettings
from tests.integration.support import make_config, run_to_end, worker


class SlowWorkflowTasks(Interceptor):
    """Every workflow task that starts an activity takes ``delay_s`` longer (the worker's own CPU, as if
    its workflow code were heavy): with few slots the workflow tasks, not the engine, bound the run."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    def workflow_interceptor_class(
        self, input: WorkflowInterceptorClassInput
    ) -> type[WorkflowInboundInterceptor] | None:
        delay_s = self.delay_s

        class Outbound(WorkflowOutboundInterceptor):
            def start_activity(self, input: StartActivityInput) -> workflow.ActivityHandle:
                time.sleep(delay_s)  # blocks this workflow task's thread: the slot stays taken
                return super().start_activity(input)

        class Inbound(WorkflowInboundInterceptor):
            def init(self, outbound: WorkflowOutboundInterceptor) -> None:
                super().init(Outbound(outbound))

        return Inbound


# One turn of 8-16 tokens at 200 ms (the engine runs them all at once) on a cache of 1.6 M tokens: KV
# usage stays near 0, so the probe preset's ramp doubles a binding cap every poll, while every rollout
# needs slow workflow tasks of 4 slots. Rollouts of seconds keep the cap binding between polls.
FAST = {"policy": "random", "random_min_tokens": 8, "random_max_tokens": 16, "decode_ms_per_token": 200}
AMPLE_KV = {"num_gpu_blocks": 100_000, "max_model_len": 640}
MAX_INFLIGHT = 256


def summary(log: list[dict]) -> list[tuple]:
    """Per decision: seq, seconds since the first, cap, the engine rules' cap, in flight, admitted, the wait
    and the reasons."""
    t0 = log[0]["at"] if log else 0.0
    return [
        (
            e["seq"],
            round(e["at"] - t0, 1),
            e["cap"],
            e["kv_cap"],
            e["inflight"],
            e["admitted"],
            wait(e),
            e["reasons"],
        )
        for e in log
    ]


def wait(entry: dict) -> float | None:
    b = entry["backlog"]
    return None if b is None else max(b["age_s"], b["latency_s"] or 0.0)


async def constrained_run(
    client: Client, task_queue: str, home: Path, run_id: str, rule: bool
) -> tuple[RunProgress, list[dict]]:
    """192 one-turn rollouts (12 groups of 16) from a cap of 4, on the slowed worker; rule O on or off."""
    async with SimEngine(SimSettings(**FAST, **AMPLE_KV)).serve(port=0) as url:
        cfg = make_config(
            [url],
            task_queue,
            run={"num_groups": 12, "group_size": 16, "max_inflight_groups": 64},
            rollout={"max_turns": 1},
            sampling={"max_tokens": 16},
            admission={
                "enabled": True,
                "poll_interval_s": 0.5,
                "admit_window_s": 0.0,
                # far below the workflow tasks' waits: a reading is aged at the poll that read it, so a
                # decision that waited for a slot still sees its engine (it saw none when aged at itself)
                "metrics_max_age_s": 1.0,
                "initial_cap": 4,
                "max_inflight": MAX_INFLIGHT,
                "max_model_len": 640,
                "orchestration_backlog": rule,
            },
        )
        slow = SlowWorkflowTasks(0.3)
        async with worker(
            client, task_queue, home, sandboxed=False, max_workflow_tasks=4, interceptors=[slow]
        ) as store:
            result = await run_to_end(client, cfg, run_id)
            log = store.dispatch_log(run_id)
    for line in summary(log):  # shown with -s: the measured caps and waits
        print(run_id, *line)
    assert result.done and sum(result.outcomes.values()) == 192, (result.outcomes, summary(log))
    assert not result.outcomes.get("failed"), result.outcomes
    # the signal: every poll read the queue's stats and the run's own workflow tasks' wait
    assert all(e["backlog"]["reported"] and e["backlog"]["latency_s"] is not None for e in log), summary(log)
    assert all(e["healthy"] for e in log), summary(log)  # every decision saw its engine's reading
    assert all(e["kv_usage"] < 0.05 for e in log), summary(log)  # the KV cache stayed near empty
    return result, log


@pytest.mark.timeout(180)
async def test_a_worker_short_of_workflow_task_slots_holds_the_cap_the_kv_rules_would_grow(
    client: Client, task_queue: str, tmp_path: Path
) -> None:
    _, log = await constrained_run(client, task_queue, tmp_path, "backlog", rule=True)
    ruled = [e for e in log if any(r.startswith("orchestration-backlog") for r in e["reasons"])]
    held = [e for e in ruled if e["kv_cap"] > e["cap"]]
    # the backlog rule held (or reverted) the cap where the engine rules alone would have grown it: the KV
    # cache stayed near empty, so their verdict was always to grow a binding cap
    assert held, summary(log)
    # ... it judged (held or reverted) only while workflow tasks waited longer than the threshold (1 s at
    # least); past a revert its ceiling holds the cap whatever the wait, until reprobe_polls lift it
    judged = [
        e
        for e in ruled
        if any(
            r.startswith(("orchestration-backlog: hold", "orchestration-backlog: revert"))
            for r in e["reasons"]
        )
    ]
    assert all(wait(e) > 1.0 for e in judged), summary(log)
    capped = [e for e in ruled if any(" by ceiling " in r for r in e["reasons"])]
    reverts = [
        e["seq"] for e in judged if any(r.startswith("orchestration-backlog: revert") for r in e["reasons"])
    ]
    assert all(reverts and min(reverts) < e["seq"] for e in capped), summary(log)
    lifted = [e for e in ruled if any(r.endswith(" lifted") for r in e["reasons"])]
    assert {e["seq"] for e in judged + capped + lifted} == {e["seq"] for e in ruled}, summary(log)
    first = held[0]
    verdict = first["reasons"][-1]
    assert verdict.startswith(
        f"orchestration-backlog: hold cap {first['cap']} (engine rules: {first['kv_cap']})"
    ) or (
        verdict.startswith("orchestration-backlog: revert cap")
        and f"-> {first['cap']} (engine rules: {first['kv_cap']})" in verdict
    ), summary(log)
    # before the backlog built up, the engine rules decided alone
    before = [e for e in log if e["seq"] < ruled[0]["seq"]]
    assert before and all(e["kv_cap"] == e["cap"] for e in before), summary(log)


@pytest.mark.timeout(180)
async def test_without_the_rule_the_kv_rules_grow_the_cap_while_workflow_tasks_wait(
    client: Client, task_queue: str, tmp_path: Path
) -> None:
    # the control: the same run with rule O off (the backlog is still read and logged); on a poll where
    # workflow tasks wait longer than the rule's threshold, the cap still grows, or is already at
    # max_inflight (the ramp can double it there in a few polls, before the backlog builds up)
    _, log = await constrained_run(client, task_queue, tmp_path, "no-backlog-rule", rule=False)
    assert not any(r.startswith("orchestration-backlog") for e in log for r in e["reasons"]), summary(log)
    assert all(e["kv_cap"] == e["cap"] for e in log), summary(log)
    kept_up = [
        e
        for prev, e in itertools.pairwise(log)
        if (e["cap"] > prev["cap"] or e["cap"] == MAX_INFLIGHT) and wait(e) > 1.0
    ]
    assert kept_up, summary(log)
