"""SWE-bench-style rows (swe_env.swebench) against real hardened Docker sandboxes, in their own images.

For each bundled row: the scripted agent applies a diff through the tools (``parse``/``act``) and ``score``
applies the row's test_patch and runs its FAIL_TO_PASS and PASS_TO_PASS tests. The reference patch scores
1.0; a patch that fixes the FAIL_TO_PASS tests but breaks a PASS_TO_PASS test scores 0.0, and so does the
untouched repository (its FAIL_TO_PASS tests fail).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable

import pytest
from swe_env import SweBenchTask, SweEnvironment
from swe_env.transcripts import SWEBENCH, turns

from durable_rollouts.environments.base import Score, Step, TurnContext
from durable_rollouts.sandboxes import DockerBackend

Setup = Callable[..., Awaitable[TurnContext]]

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def rows() -> list[SweBenchTask]:
    return [t for t in SweEnvironment().load_tasks(SWEBENCH) if isinstance(t, SweBenchTask)]


async def _play(env: SweEnvironment, ctx: TurnContext, texts: list[str]) -> list[Step]:
    steps = []
    for n, text in enumerate(texts):
        turn = dataclasses.replace(ctx, turn=n, last_turn=n == len(texts) - 1)
        parsed = env.parse(turn, text)
        steps.append(parsed if isinstance(parsed, Step) else await env.act(turn, parsed))
    return steps


async def test_reference_patch_scores_one_and_a_patch_breaking_pass_to_pass_scores_zero(
    env: SweEnvironment, rows: list[SweBenchTask], sandbox_for: Setup, docker: DockerBackend
) -> None:
    assert {t.image_name is not None for t in rows} == {True, False}  # SWE-smith's and R2E-Gym's field
    assert len({t.image for t in rows}) == 2

    async def one(task: SweBenchTask, mode: str) -> tuple[float | None, list[Step]]:
        ctx = await sandbox_for(task, f"swebench-{task.id}-{mode}")
        steps = await _play(env, ctx, turns(task, mode) if mode != "untouched" else [])
        score = await env.score(ctx, None)
        assert isinstance(score, Score)
        assert score.metrics["test_patch_stdlib"] == 1.0  # these images have neither git nor patch
        return score.reward, steps

    cases = [(t, m) for t in rows for m in ("reference", "wrong", "untouched")]
    results = await asyncio.gather(*(one(t, m) for t, m in cases))
    running = docker.client.containers.list(filters={"label": "durable-rollouts.run=swe-tests"})
    assert {t.image for t in rows} <= {tag for c in running for tag in c.image.tags}
    for (task, mode), (reward, steps) in zip(cases, results, strict=True):
        if mode != "untouched":
            applied = steps[2].observation or ""
            assert "patched " in applied and "[exit code 0]" in applied, (task.id, mode, applied)
            assert steps[-1].done
        assert reward == (1.0 if mode == "reference" else 0.0), (task.id, mode)


async def test_the_breaking_patch_passes_fail_to_pass_and_fails_a_pass_to_pass_test(
    env: SweEnvironment, rows: list[SweBenchTask], sandbox_for: Setup
) -> None:
    """What the 0.0 above is made of: the tests' own statuses in swebench's report of the scoring log."""
    from swe_env import swebench

    for task in rows:
        ctx = await sandbox_for(task, f"swebench-{task.id}-statuses")
        await _play(env, ctx, turns(task, "wrong"))
        assert ctx.sandbox is not None
        hidden, files = swebench.hidden_files(task)
        for name, content in files.items():
            await ctx.sandbox.write_file(f"{hidden}/{name}", content)
        res = await ctx.sandbox.exec(swebench.scoring_command(task, hidden, "t0"), timeout_s=120)
        tried = swebench.appliers(res.output)
        assert tried == ("stdlib", ["git: not in the image", "patch: not in the image"]), res.output
        report = swebench.grade(task, (await ctx.sandbox.read_file(swebench.log_name("t0"))).decode())
        got = report["tests_status"]
        assert got["FAIL_TO_PASS"] == {"success": task.FAIL_TO_PASS, "failure": []}, got
        assert got["PASS_TO_PASS"]["failure"], got
        assert report["parser"] == "parse_log_pytest" and report["resolved"] is False
