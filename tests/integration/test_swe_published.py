"""SWE-bench rows as published (no image field), on two repositories whose logs are not pytest's, through the
real pipeline: real Temporal, real hardened Docker sandboxes in the images SWE-bench's harness names for the
instances (built locally from the projects' PyPI sdists: environments/swe/images/sweb-django, sweb-sympy),
an in-process worker, the simulated engine playing the scripted agent. The reference patch scores 1.0 for
both instances, a broken patch 0.0; the test patch was applied by git (the scored turn's metrics)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from swe_env import SweBenchTask, SweEnvironment, SweTask
from swe_env.transcripts import PUBLISHED, PUBLISHED_BREAKING, write
from temporalio.client import Client

from durable_rollouts.sandboxes import DockerBackend
from durable_rollouts.simengine import Mode, ModeRule, SimEngine, SimSettings
from tests.integration.support import assert_no_containers, export, run_to_end, worker
from tests.integration.test_swe import images_seen, swe_config, swe_tasks  # noqa: F401  (fixture)


@pytest.fixture(scope="module")
async def sim_published(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[str]:
    """The simulated engine playing the published rows' transcripts (the diff applied through the tools)."""
    out = tmp_path_factory.mktemp("published") / "transcripts.jsonl"
    transcripts = write(out, PUBLISHED, PUBLISHED_BREAKING)
    rules = [
        ModeRule(on="request", prefix="published-ref-", mode=Mode.REFERENCE),
        ModeRule(on="request", prefix="published-wrong-", mode=Mode.WRONG),
    ]
    settings = SimSettings(transcripts=transcripts, mode_rules=rules, max_model_len=32768)
    async with SimEngine(settings).serve(port=0) as url:
        yield url


@pytest.mark.timeout(600)
async def test_published_django_and_sympy_rows_score_one_by_reference_and_zero_by_a_broken_patch(
    client: Client,
    docker: DockerBackend,
    swe_tasks: list[SweTask],  # noqa: F811  (the fixture builds the images)
    sim_published: str,
    task_queue: str,
    tmp_path: Path,
) -> None:
    rows = [t for t in SweEnvironment().load_tasks(PUBLISHED) if isinstance(t, SweBenchTask)]
    by_id = {t.id: t for t in rows}
    assert {t.repo for t in rows} == {"django/django", "sympy/sympy"}
    assert all(t.image.startswith("swebench/sweb.eval.x86_64.") and t.image_name is None for t in rows)
    big = {"sampling": {"max_tokens": 16000}, "rollout": {"max_turns": 6, "max_total_tokens": 32000}}
    async with worker(client, task_queue, tmp_path) as store:
        for run_id in ("published-ref-run", "published-wrong-run"):
            run = {"task_file": str(PUBLISHED)}
            cfg = swe_config(sim_published, task_queue, groups=2, size=1, run=run, **big)
            with images_seen(docker, run_id) as seen:
                await run_to_end(client, cfg, run_id)
            assert seen == {t.image for t in rows}
            assert_no_containers(docker, run_id)
    for run_id, want in (("published-ref-run", 1.0), ("published-wrong-run", 0.0)):
        recs, _ = export(store, run_id)
        assert {r["task_id"] for r in recs} == set(by_id)
        for rec in recs:
            why = (run_id, rec["task_id"], rec["reason"])
            assert rec["outcome"] == "completed" and rec["reward"] == want, why
            assert rec["lineage"]["sandbox_image"] == by_id[rec["task_id"]].image
            metrics = rec["turns"][-1].get("metrics") or {}
            assert metrics.get("test_patch_git") == 1.0, (rec["task_id"], rec["turns"][-1])
            assert metrics.get("fail_to_pass") == want and metrics.get("pass_to_pass") == 1.0, metrics
