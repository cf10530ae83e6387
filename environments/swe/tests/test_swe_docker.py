"""The SWE environment against real hardened Docker sandboxes: every bundled task, in its own image.

For each task: the plan's setup lays out the visible files, the scripted agent's turns (the transcripts the
simulated engine plays) go through ``parse``/``act``, and ``score`` runs the hidden tests. The reference fix
scores 1.0, the wrong fix less, the untouched repository less; at least two images are in use.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable

import pytest
from swe_env import SweEnvironment, SweTask
from swe_env.transcripts import turns

from durable_rollouts.environments.base import Step, TurnContext
from durable_rollouts.sandboxes import DockerBackend
from durable_rollouts.sandboxes.base import SandboxSpec

Setup = Callable[..., Awaitable[TurnContext]]
"""The ``sandbox_for`` fixture: (task, key[, spec]) -> a context bound to a set-up sandbox."""

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


async def _play(env: SweEnvironment, ctx: TurnContext, texts: list[str]) -> list[Step]:
    steps = []
    for n, text in enumerate(texts):
        turn = dataclasses.replace(ctx, turn=n, last_turn=n == len(texts) - 1)
        parsed = env.parse(turn, text)
        steps.append(parsed if isinstance(parsed, Step) else await env.act(turn, parsed))
    return steps


async def test_reference_fixes_score_one_and_wrong_ones_less_in_two_images(
    env: SweEnvironment, tasks: list[SweTask], sandbox_for: Setup, docker: DockerBackend
) -> None:
    assert len({t.image for t in tasks}) >= 2

    async def one(task: SweTask, mode: str) -> tuple[float | None, list[Step]]:
        ctx = await sandbox_for(task, f"swe-{task.id}-{mode}")
        steps = await _play(env, ctx, turns(task, mode))
        return await env.score(ctx, None), steps

    cases = [(t, m) for t in tasks for m in ("reference", "wrong")]
    results = await asyncio.gather(*(one(t, m) for t, m in cases))
    running = docker.client.containers.list(filters={"label": "durable-rollouts.run=swe-tests"})
    images = {tag for c in running for tag in c.image.tags}
    for (task, mode), (reward, steps) in zip(cases, results, strict=True):
        first = steps[0].observation or ""
        assert "[exit code 0]" in first and "def " in first, first  # cat of the file to fix, from the image
        assert steps[1].observation and steps[1].observation.startswith("wrote "), steps[1]
        assert steps[-1].done
        if mode == "reference":
            assert reward == 1.0, task.id
        else:
            assert reward is not None and reward < 1.0, task.id
    assert {t.image for t in tasks} <= images  # each task's sandbox ran in the task's own image


async def test_untouched_repository_scores_below_one_and_scoring_repeats(
    env: SweEnvironment, tasks: list[SweTask], sandbox_for: Setup
) -> None:
    for task in tasks[:2]:
        ctx = await sandbox_for(task, f"swe-{task.id}-untouched")
        first, again = await env.score(ctx, None), await env.score(ctx, None)
        assert first is not None and first == again and first < 1.0


async def test_agent_cannot_plant_files_that_change_the_score(
    env: SweEnvironment, tasks: list[SweTask], sandbox_for: Setup
) -> None:
    """A conftest that passes every test, a pytest.ini in /tmp and a file outside the visible paths change
    nothing: the untouched repository still fails its hidden tests."""
    task = next(t for t in tasks if t.reward == "junit")
    ctx = await sandbox_for(task, f"swe-{task.id}-planted")
    baseline = await env.score(ctx, None)
    assert baseline is not None and baseline < 1.0
    cheat = (  # honoured, it would report every test as passed
        "import pytest\n\n\n@pytest.hookimpl(hookwrapper=True)\ndef pytest_runtest_makereport(item, call):\n"
        "    outcome = yield\n    outcome.get_result().outcome = 'passed'\n"
    )
    box = ctx.sandbox
    assert box is not None
    for path in ("conftest.py", "tests/conftest.py", f"{task.visible[1]}/conftest.py"):
        await box.write_file(path, cheat)
    await box.exec("printf '[pytest]\\naddopts = -p no:junitxml\\n' > /tmp/pytest.ini")
    assert await env.score(ctx, None) == baseline


async def test_bash_timeout_truncates_and_replay_redoes_writes(
    env: SweEnvironment, tasks: list[SweTask], sandbox_for: Setup, default_spec: SandboxSpec
) -> None:
    task = tasks[0]
    ctx = await sandbox_for(
        task, f"swe-{task.id}-replay", default_spec.model_copy(update={"command_timeout_s": 1})
    )
    step = await env.act(ctx, {"name": "bash", "arguments": {"cmd": "sleep 5"}})
    assert step.truncated == "command_timeout" and step.observation and "[timed out]" in step.observation
    path, content = next(iter(task.reference.items()))
    fresh = await sandbox_for(task, f"swe-{task.id}-replayed")
    await env.replay(fresh, {"name": "write_file", "arguments": {"path": path, "content": content}})
    await env.replay(fresh, {"name": "read_file", "arguments": {"path": path}})
    assert fresh.sandbox is not None
    assert (await fresh.sandbox.read_file(path)).decode() == content
