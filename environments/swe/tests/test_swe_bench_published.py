"""SWE-bench rows as published (no image field) on two repositories whose logs are not pytest's: django
(its runtests.py) and sympy (its bin/test), in images built locally from the projects' PyPI sdists
(images/sweb-django, images/sweb-sympy) and tagged with the names SWE-bench's harness gives them.

Each row finds its image by that name, its test command from SWE-bench's specs, and its log is graded by the
swebench package's parser for the repository. The reference patch scores 1.0, a broken patch 0.0; the test
patch is applied by ``git apply`` (the images have git). A test patch whose context git refuses is applied
by ``patch`` (with fuzz), and git's refusal is recorded.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Awaitable, Callable

import pytest
from swe_env import SweBenchTask, SweEnvironment, swebench
from swe_env.transcripts import PUBLISHED, PUBLISHED_BREAKING, turns

from durable_rollouts.environments.base import Score, Step, TurnContext
from durable_rollouts.sandboxes import DockerBackend

Setup = Callable[..., Awaitable[TurnContext]]

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def rows() -> list[SweBenchTask]:
    tasks = SweEnvironment(image_pattern=None).load_tasks(PUBLISHED)
    return [t for t in tasks if isinstance(t, SweBenchTask)]


async def _play(env: SweEnvironment, ctx: TurnContext, texts: list[str]) -> None:
    for n, text in enumerate(texts):
        turn = dataclasses.replace(ctx, turn=n, last_turn=n == len(texts) - 1)
        parsed = env.parse(turn, text)
        if not isinstance(parsed, Step):
            await env.act(turn, parsed)


@pytest.mark.parametrize("repo", ["django/django", "sympy/sympy"])
async def test_a_published_row_scores_one_by_its_reference_patch_and_zero_by_a_broken_one(
    env: SweEnvironment, rows: list[SweBenchTask], sandbox_for: Setup, docker: DockerBackend, repo: str
) -> None:
    assert {t.repo for t in rows} == {"django/django", "sympy/sympy"}
    task = next(t for t in rows if t.repo == repo)
    # The row as published: no image field; the harness's name for the instance's image.
    assert task.image_name is None and task.docker_image is None
    assert task.image == f"swebench/sweb.eval.x86_64.{task.instance_id.replace('__', '_1776_')}:latest"
    breaking = json.loads(PUBLISHED_BREAKING.read_text())

    async def one(mode: str) -> Score:
        ctx = await sandbox_for(task, f"published-{task.id}-{mode}")
        await _play(env, ctx, turns(task, mode, breaking))
        score = await env.score(ctx, None)
        assert isinstance(score, Score)
        return score

    reference, wrong = await asyncio.gather(one("reference"), one("wrong"))
    running = docker.client.containers.list(filters={"label": "durable-rollouts.run=swe-tests"})
    assert task.image in {tag for c in running for tag in c.image.tags}
    assert (reference.reward, wrong.reward) == (1.0, 0.0), (reference, wrong)
    for score in (reference, wrong):
        assert score.metrics["test_patch_git"] == 1.0, score
        # Graded by swebench's parser of the repository: the FAIL_TO_PASS test passed only with the fix, the
        # PASS_TO_PASS tests (django's 18, sympy's 46: what the parser reads in a passing run) both times.
        assert score.metrics["pass_to_pass"] == 1.0, score
    assert (reference.metrics["fail_to_pass"], wrong.metrics["fail_to_pass"]) == (1.0, 0.0)


async def test_a_test_patch_git_refuses_is_applied_by_patch_and_git_s_cause_recorded(
    env: SweEnvironment, rows: list[SweBenchTask], sandbox_for: Setup
) -> None:
    django = next(t for t in rows if t.repo == "django/django")
    # One context line off: git apply refuses it, patch applies it with fuzz.
    bent = django.test_patch.replace(
        "             with self.assertRaisesMessage(ValueError, msg):",
        "             with self.assertRaisesMessage(ValueError, msg):  # bent",
    )
    assert bent != django.test_patch
    task = django.model_copy(update={"test_patch": bent})
    ctx = await sandbox_for(task, "published-bent")
    await _play(env, ctx, turns(task, "reference"))
    assert ctx.sandbox is not None
    hidden, files = swebench.hidden_files(task)
    for name, content in files.items():
        await ctx.sandbox.write_file(f"{hidden}/{name}", content)
    res = await ctx.sandbox.exec(swebench.scoring_command(task, hidden, "bent"), timeout_s=300)
    applied, tried = swebench.appliers(res.output)
    assert applied == "patch", res.output
    assert len(tried) == 1 and tried[0].startswith("git: ") and "patch failed" in tried[0], tried
    log = (await ctx.sandbox.read_file(swebench.log_name("bent"))).decode()
    assert swebench.grade(task, log)["resolved"] is True
