"""Coding-agent rollouts in real hardened Docker sandboxes, driven by the simulated engine's scripted policy.

Every test checks that no container of its run is left behind. Modes are chosen per run with request-id
prefix rules (``<run-id>/`` -> mode), so one simulated engine serves every test.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client

from durable_rollouts.contracts.types import group_id, rollout_id
from durable_rollouts.sandboxes import DockerBackend, SandboxSpec
from durable_rollouts.sandboxes.pool import SandboxPool
from durable_rollouts.simengine import Mode, ModeRule, SimEngine, SimSettings
from tests import REPO_ROOT
from tests.conftest import Engine
from tests.integration.support import (
    CODING_TASKS,
    assert_no_containers,
    coding_config,
    export,
    run_to_end,
    start_run,
    wait_for_first_command,
    worker,
)

MODES = {
    "ref": Mode.REFERENCE,
    "wrong": Mode.WRONG,
    "malformed": Mode.MALFORMED,
    "loop": Mode.LOOP,
    "sleep": Mode.SLEEP,
}


LEDGERED = ("sleep-killed", "sleep-terminate")
"""Runs whose test ends with the ledger check (faults.ledger)."""


@pytest.fixture(scope="module")
async def sim() -> AsyncIterator[str]:
    # the second member of the fault tests' one group solves its task: the ledger wants a success
    solved = [ModeRule(on="request", prefix=f"{r}/{group_id(0)}/1", mode=Mode.REFERENCE) for r in LEDGERED]
    rules = solved + [ModeRule(on="request", prefix=f"{p}-", mode=m) for p, m in MODES.items()]
    settings = SimSettings(tasks=CODING_TASKS, mode_rules=rules, max_model_len=4096)
    async with SimEngine(settings).serve(port=0) as url:
        yield url


@pytest.mark.timeout(600)
async def test_reference_solutions_score_one_and_wrong_ones_less(
    client: Client, docker: DockerBackend, sim: str, task_queue: str, tmp_path: Path
) -> None:
    cfg = coding_config(sim, task_queue, groups=3, size=2)
    async with worker(client, task_queue, tmp_path) as store:
        await run_to_end(client, cfg, "ref-run")
        await run_to_end(client, cfg, "wrong-run")
    ref, ref_groups = export(store, "ref-run")
    wrong, _ = export(store, "wrong-run")
    assert len(ref) == 6 and len(ref_groups) == 3
    for rec in ref:
        assert rec["outcome"] == "completed" and rec["reward"] == 1.0, rec["reason"]
        assert len(rec["turns"]) == 2  # write_file, submit
        assert rec["sandbox_replays"] == 0
    assert all(r["outcome"] == "completed" and r["reward"] < 1.0 for r in wrong)
    assert_no_containers(docker, "ref-run")
    assert_no_containers(docker, "wrong-run")


@pytest.mark.timeout(600)
async def test_malformed_calls_become_error_observations_and_the_rollout_carries_on(
    client: Client, docker: DockerBackend, sim: str, task_queue: str, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    cfg = coding_config(sim, task_queue, groups=1, size=1)
    async with worker(client, task_queue, tmp_path) as store:
        await run_to_end(client, cfg, "malformed-run")
    (rec,), _ = export(store, "malformed-run")
    assert rec["outcome"] == "completed" and rec["reward"] == 1.0
    tok = AutoTokenizer.from_pretrained(str(REPO_ROOT / "engines" / "tiny-policy"))
    observations = []
    for turn, nxt in zip(rec["turns"], [*rec["turns"][1:], None], strict=True):
        end = nxt["range"][0] if nxt else len(rec["token_ids"])
        observations.append(tok.decode(rec["token_ids"][turn["range"][1] : end]))
    assert sum("error:" in o for o in observations[:3]) == 3, observations[:3]
    assert "wrote" in observations[3]
    assert_no_containers(docker, "malformed-run")


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("run_id", "rollout", "sandbox", "reason"),
    [
        ("loop-turns", {"max_turns": 4}, {}, "max_turns"),
        ("loop-budget", {"max_turns": 1000, "max_total_tokens": 1500}, {}, "token_budget"),
        ("sleep-cmd", {}, {"command_timeout_s": 2}, "command_timeout"),
        ("sleep-wall", {"timeout_s": 6}, {"command_timeout_s": 60}, "timeout"),
    ],
)
async def test_each_limit_has_its_own_truncation_reason(
    client: Client,
    docker: DockerBackend,
    sim: str,
    task_queue: str,
    tmp_path: Path,
    run_id: str,
    rollout: dict,
    sandbox: dict,
    reason: str,
) -> None:
    cfg = coding_config(sim, task_queue, groups=1, size=1, rollout=rollout, sandbox=sandbox)
    async with worker(client, task_queue, tmp_path) as store:
        await run_to_end(client, cfg, run_id)
    (rec,), (group,) = export(store, run_id)
    assert (rec["outcome"], rec["reason"]) == ("truncated", reason)
    assert rec["reward"] is None and not rec["scorable"] and group["scorable"] == 0
    assert rec["score_truncated"] is False
    assert_no_containers(docker, run_id)


@pytest.mark.timeout(600)
async def test_context_length_truncates(
    client: Client, docker: DockerBackend, task_queue: str, tmp_path: Path
):
    settings = SimSettings(tasks=CODING_TASKS, mode=Mode.LOOP, max_model_len=900)
    async with SimEngine(settings).serve(port=0) as url:
        cfg = coding_config(url, task_queue, groups=1, size=1, rollout={"max_turns": 1000})
        async with worker(client, task_queue, tmp_path) as store:
            await run_to_end(client, cfg, "loop-context")
    (rec,), _ = export(store, "loop-context")
    assert (rec["outcome"], rec["reason"]) == ("truncated", "context_length")
    assert len(rec["turns"]) >= 2 and rec["turns"][-1]["range"][1] <= 900  # turns filled the context
    assert_no_containers(docker, "loop-context")


@pytest.mark.timeout(600)
async def test_container_killed_mid_command_is_recovered_by_replay(
    client: Client, docker: DockerBackend, sim: str, task_queue: str, tmp_path: Path, ledger: Any
) -> None:
    run_id = "sleep-killed"
    cfg = coding_config(sim, task_queue, groups=1, size=2, rollout={"max_turns": 2})
    rid = rollout_id(run_id, group_id(0), 0)
    async with worker(client, task_queue, tmp_path) as store:
        handle = await start_run(client, cfg, run_id)
        await wait_for_first_command(store, rid)
        await asyncio.sleep(1.0)  # the first `sleep 30` is running in the sandbox
        infos = docker.list_containers(run_id)
        docker.client.containers.get(next(i for i in infos if i.key == rid).container_id).kill()
        await handle.result()
        await ledger(store, run_id, client=client, backend=docker, pool=SandboxPool(store))
    rec = next(r for r in export(store, run_id)[0] if r["rollout_id"] == rid)
    assert rec["sandbox_replays"] >= 1
    assert rec["outcome"] in ("truncated", "failed")
    if rec["outcome"] == "failed":
        assert rec["reason"].startswith("infra: SandboxGone")
    assert rec["reward"] is None  # never a reward from a dead sandbox
    assert_no_containers(docker, run_id)


def test_coding_task_file_errors_name_the_line(tmp_path: Path) -> None:
    from durable_rollouts.environments.tasks import load_tasks
    from durable_rollouts.errors import TaskFileError

    bad = tmp_path / "c.jsonl"
    bad.write_text(json.dumps({"id": "x", "prompt": "p"}) + "\n")
    with pytest.raises(TaskFileError, match=r"c\.jsonl:1"):
        load_tasks(bad, "coding")


@pytest.mark.timeout(900)
async def test_coding_run_against_real_vllm_ends_every_rollout_and_leaves_no_container(
    client: Client, docker: DockerBackend, engine: Engine, task_queue: str, tmp_path: Path
) -> None:
    cfg = coding_config(
        engine.url, task_queue, groups=2, size=2, rollout={"max_turns": 3}, sampling={"max_tokens": 48}
    )
    async with worker(client, task_queue, tmp_path) as store:
        result = await run_to_end(client, cfg, "vllm-coding")
    rollouts, groups = export(store, "vllm-coding")
    assert result.done and len(rollouts) == 4 and len(groups) == 2
    assert {r["outcome"] for r in rollouts} <= {"completed", "truncated"}
    for rec in rollouts:
        assert len(rec["token_ids"]) == len(rec["logprobs"]) == len(rec["loss_mask"])
        assert sum(rec["loss_mask"]) == sum(t["range"][1] - t["range"][0] for t in rec["turns"])
    assert_no_containers(docker, "vllm-coding")


@pytest.mark.timeout(600)
async def test_cancelled_rollout_is_recorded_and_its_sandbox_destroyed(
    client: Client, docker: DockerBackend, sim: str, task_queue: str, tmp_path: Path
) -> None:
    run_id = "sleep-cancel"
    rid = rollout_id(run_id, group_id(0), 0)
    cfg = coding_config(sim, task_queue, groups=1, size=2)
    async with worker(client, task_queue, tmp_path) as store:
        handle = await start_run(client, cfg, run_id)
        await wait_for_first_command(store, rid)
        await client.get_workflow_handle(rid).cancel()
        await client.get_workflow_handle(rollout_id(run_id, group_id(0), 1)).cancel()
        await handle.result()
    rollouts, (group,) = export(store, run_id)
    assert [r["outcome"] for r in rollouts] == ["cancelled", "cancelled"]
    assert group["size"] == 2 and group["scorable"] == 0
    assert_no_containers(docker, run_id)


@pytest.mark.timeout(600)
async def test_terminated_rollout_gets_a_failed_record_and_the_reaper_removes_its_sandbox_not_anothers(
    client: Client, docker: DockerBackend, sim: str, task_queue: str, tmp_path: Path, ledger: Any
) -> None:
    from durable_rollouts.sandboxes import AsyncSandboxBackend
    from durable_rollouts.sandboxes.reaper import reap_orphans

    run_id = "sleep-terminate"
    rid = rollout_id(run_id, group_id(0), 0)
    cfg = coding_config(sim, task_queue, groups=1, size=2)
    async with worker(client, task_queue, tmp_path) as store:
        handle = await start_run(client, cfg, run_id)
        await wait_for_first_command(store, rid)
        await client.get_workflow_handle(rid).terminate(reason="test")
        await handle.result()
        # terminated code cannot clean up after itself
        assert [i.key for i in docker.list_containers(run_id)] == [rid]
        pool = SandboxPool(store)
        assert rid in pool.holders()  # nor give back its pool slot
        # another deployment's sandbox on the same daemon (its rollout unknown to this namespace): kept
        foreign = "elsewhere/g000000/0"
        docker.create(foreign, run_id, SandboxSpec())
        removed = await reap_orphans(client, AsyncSandboxBackend(docker), run_id, min_age_s=0, pool=pool)
        assert rid not in pool.holders()
        assert [i.key for i in docker.list_containers(run_id)] == [foreign]
        # until asked for (rollouts reap --unknown)
        more = await reap_orphans(client, AsyncSandboxBackend(docker), run_id, min_age_s=0, unknown=True)
        assert len(more) == 1
        await ledger(store, run_id, client=client, backend=docker, pool=pool)
    rec = next(r for r in export(store, run_id)[0] if r["rollout_id"] == rid)
    assert rec["outcome"] == "failed" and rec["reason"].startswith("infra: child workflow")
    assert len(removed) == 1
    assert_no_containers(docker, run_id)


@pytest.mark.timeout(600)
async def test_truncated_rollouts_are_scored_when_the_run_asks(
    client: Client, docker: DockerBackend, sim: str, task_queue: str, tmp_path: Path
) -> None:
    cfg = coding_config(sim, task_queue, groups=1, size=2, rollout={"max_turns": 2, "score_truncated": True})
    async with worker(client, task_queue, tmp_path) as store:
        await run_to_end(client, cfg, "loop-scored")
    rollouts, (group,) = export(store, "loop-scored")
    for rec in rollouts:
        assert (rec["outcome"], rec["reason"], rec["score_truncated"]) == ("truncated", "max_turns", True)
        assert rec["scorable"] and rec["reward"] == 0.0  # the untouched stub passes no hidden test
    assert group["scorable"] == 2 and group["zero_variance"]
    assert_no_containers(docker, "loop-scored")
