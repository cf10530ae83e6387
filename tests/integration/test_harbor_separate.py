"""Harbor's separate verifier environments (``environment_mode = "separate"``) through the real pipeline.

Two tasks written for this test (``harbor_tasks/separate-*``, validated by Harbor's own loader in
``environments/harbor/tests/test_harbor_crosscheck.py``), played by the simulated engine from their
reference (``solve.sh``) and wrong (``wrong.sh``) transcripts, on real Temporal and real Docker:

- ``separate-own-image``: the verifier's image is built from ``tests/Dockerfile`` (which bundles test.sh);
  only ``result.txt`` is handed over. Its test.sh reports that it ran in its own image and did not see a
  file the agent left beside the artifact.
- ``separate-task-image``: a fresh container of the task's image, ``/app`` handed over whole (a file the
  agent deleted stays deleted), ``tests/`` copied to ``/tests``. Its test.sh reports another hostname than
  the agent's, none of the agent's /tmp, ``/logs/artifacts`` handed over, and that the agent saw no tests.

The reference scores 1.0, the wrong solution 0.0, each verifier ran once, and no container (the agent's or
the verifier's) stays after the run. Directly, without Temporal: a score repeated as a retry reattaches to
the same verifier container and gets the first run's reward without running test.sh again, and an artifact
the verifier's sandbox cannot hold fails as an environment error.
"""

from __future__ import annotations

import contextlib
import shutil
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from temporalio.client import Client

from durable_rollouts.activities.sandbox import SandboxActivities
from durable_rollouts.environments import registry
from durable_rollouts.environments.base import TurnContext
from durable_rollouts.errors import EnvironmentFailure
from durable_rollouts.sandboxes import AsyncSandboxBackend, DockerBackend
from durable_rollouts.sandboxes.base import BoundSandbox, SandboxSpec, sibling_key
from durable_rollouts.sandboxes.images import ImageBuilds, ensure_image
from durable_rollouts.simengine import Mode, ModeRule, SimEngine, SimSettings
from durable_rollouts.store import RunStore
from tests import REPO_ROOT
from tests.integration.support import assert_no_containers, export, run_to_end, worker
from tests.integration.test_harbor import SANDBOX, harbor_base, harbor_config

TASKS = REPO_ROOT / "tests" / "integration" / "harbor_tasks"
OWN, TASK_IMAGE = "separate-own-image", "separate-task-image"
OWN_METRICS = {"reward": 1.0, "verifier_image": 1.0, "only_artifacts": 1.0, "verifier_runs": 1.0}
TASK_METRICS = {
    "reward": 1.0,
    "apart": 1.0,
    "logs_artifacts": 1.0,
    "agent_saw_no_tests": 1.0,
    "verifier_runs": 1.0,
}

__all__ = ["harbor_base"]  # the fixture, imported for its name

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
async def sim(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[str, Path]]:
    from harbor_env.transcripts import write

    work = tmp_path_factory.mktemp("harbor-separate")
    dataset = work / "separate"
    for name in (OWN, TASK_IMAGE):
        shutil.copytree(TASKS / name, dataset / name)
    rules = [
        ModeRule(on="request", prefix="harbor-ref", mode=Mode.REFERENCE),
        ModeRule(on="request", prefix="harbor-wrong", mode=Mode.WRONG),
    ]
    settings = SimSettings(transcripts=write(work / "t.jsonl", dataset), mode_rules=rules, max_model_len=8192)
    async with SimEngine(settings).serve(port=0) as url:
        yield url, dataset


async def test_reference_scores_one_wrong_zero_with_the_verifier_apart(
    client: Client, docker: DockerBackend, harbor_base: None, sim: tuple[str, Path], task_queue: str,
    tmp_path: Path,
) -> None:  # fmt: skip
    url, dataset = sim
    suffix = uuid.uuid4().hex[:8]
    ref_id, wrong_id = f"harbor-ref-separate-{suffix}", f"harbor-wrong-separate-{suffix}"
    async with worker(client, task_queue, tmp_path) as store:
        await run_to_end(client, harbor_config(url, task_queue, dataset, groups=2, size=1), ref_id)
        await run_to_end(client, harbor_config(url, task_queue, dataset, groups=2, size=1), wrong_id)
    ref = {r["task_id"]: r for r in export(store, ref_id)[0]}
    wrong = {r["task_id"]: r for r in export(store, wrong_id)[0]}
    for rec in [*ref.values(), *wrong.values()]:
        assert rec["outcome"] == "completed", (rec["task_id"], rec["reason"])
    assert ref[f"tests/{OWN}"]["turns"][-1]["metrics"] == OWN_METRICS
    assert ref[f"tests/{TASK_IMAGE}"]["turns"][-1]["metrics"] == TASK_METRICS
    assert {t: r["reward"] for t, r in ref.items()} == {f"tests/{OWN}": 1.0, f"tests/{TASK_IMAGE}": 1.0}
    assert {t: r["reward"] for t, r in wrong.items()} == {f"tests/{OWN}": 0.0, f"tests/{TASK_IMAGE}": 0.0}
    own_wrong = wrong[f"tests/{OWN}"]["turns"][-1]["metrics"]
    assert own_wrong["verifier_image"] == own_wrong["only_artifacts"] == 1.0  # apart, whatever the answer
    assert wrong[f"tests/{TASK_IMAGE}"]["turns"][-1]["metrics"]["apart"] == 1.0
    assert_no_containers(docker, ref_id)  # the verifiers' too: removed with their rollouts' sandboxes
    assert_no_containers(docker, wrong_id)


async def _agent_sandbox(
    acts: SandboxActivities, docker: DockerBackend, task_dir: Path, run_id: str
) -> tuple[object, str, BoundSandbox]:
    """The rollout's own sandbox of the task at ``task_dir``, made as ``sandbox_create`` makes it, after
    the agent ran ``solution/solve.sh`` in it."""
    env = registry.get("harbor")
    (task,) = env.load_tasks(task_dir)
    rid = f"{run_id}/g0/0"
    plan = env.sandbox(task, SandboxSpec(**SANDBOX))
    assert plan is not None and plan.image_build is not None
    await ensure_image(ImageBuilds(acts.store.db), acts.backend, docker.host(), plan.image_build, rid)
    handle = await acts.backend.create(rid, run_id, plan.spec)
    await acts._lay_out(handle, plan, rid)
    acts.store.put_sandbox(rid, handle)
    box = BoundSandbox(acts.backend, handle)
    res = await box.exec((task_dir / "solution" / "solve.sh").read_text(), timeout_s=60)
    assert res.exit_code == 0, res.output
    return task, rid, box


async def test_a_retried_score_reattaches_and_never_runs_the_verifier_twice(
    docker: DockerBackend, harbor_base: None, tmp_path: Path
) -> None:
    env = registry.get("harbor")
    run_id = f"harbor-separate-retry-{uuid.uuid4().hex[:8]}"
    store = RunStore(tmp_path / "store")
    try:
        acts = SandboxActivities(store, lambda: AsyncSandboxBackend(docker))
        task, rid, box = await _agent_sandbox(acts, docker, TASKS / TASK_IMAGE, run_id)

        def ctx() -> TurnContext:  # each call as a fresh worker's retry would build it
            more = SandboxActivities(store, lambda: AsyncSandboxBackend(docker)).siblings(rid, run_id)
            return TurnContext(task=task, rollout_id=rid, turn=7, last_turn=True, sandbox=box, sandboxes=more)

        first = await env.score(ctx(), None)
        keys = {c.key: c.container_id for c in docker.list_containers(run_id)}
        assert set(keys) == {rid, sibling_key(rid, "verifier")}
        again = await env.score(ctx(), None)
        assert first == again and first.metrics == TASK_METRICS
        assert again.metrics["verifier_runs"] == 1.0  # the retry read the first run's reward
        assert {c.key: c.container_id for c in docker.list_containers(run_id)} == keys  # reattached
        await acts.sandbox_destroy(rid)
        assert_no_containers(docker, run_id)
    finally:
        docker.reap(run_id=run_id)


@contextlib.asynccontextmanager
async def _own_task_scored(
    docker: DockerBackend, tmp_path: Path, name: str, edit: Callable[[Path], None]
) -> AsyncIterator[tuple[TurnContext, SandboxActivities, str, str]]:
    """A copy of the own-image task, changed by ``edit`` (its folder), its agent's turn done: the last
    turn's context, the sandbox activities, the rollout id and the run id. Every container of the run is
    gone afterwards."""
    run_id = f"harbor-separate-{name}-{uuid.uuid4().hex[:8]}"
    task_dir = tmp_path / OWN
    shutil.copytree(TASKS / OWN, task_dir)
    edit(task_dir)
    try:
        acts = SandboxActivities(RunStore(tmp_path / "store"), lambda: AsyncSandboxBackend(docker))
        task, rid, box = await _agent_sandbox(acts, docker, task_dir, run_id)
        ctx = TurnContext(task=task, rollout_id=rid, turn=3, last_turn=True, sandbox=box,
                          sandboxes=acts.siblings(rid, run_id))  # fmt: skip
        yield ctx, acts, rid, run_id
        await acts.sandbox_destroy(rid)
        assert_no_containers(docker, run_id)
    finally:
        docker.reap(run_id=run_id)


def _replace(path: str, old: str, new: str, append: bool = False) -> Callable[[Path], None]:
    def edit(task_dir: Path) -> None:
        f = task_dir / path
        f.write_text(f.read_text() + new if append else f.read_text().replace(old, new))

    return edit


async def test_an_artifact_the_verifier_cannot_hold_fails_as_the_environments(
    docker: DockerBackend, harbor_base: None, tmp_path: Path
) -> None:
    # /etc/harbor-image is root's file in the image: the verifier's user cannot replace it.
    edit = _replace("task.toml", 'artifacts = ["result.txt"]', 'artifacts = ["/etc/harbor-image"]')
    async with _own_task_scored(docker, tmp_path, "place", edit) as (ctx, _, _, _):
        with pytest.raises(EnvironmentFailure) as e:
            await registry.get("harbor").score(ctx, None)
        assert "artifact /etc/harbor-image: could not place it in the verifier's sandbox" in str(e.value)


async def test_an_agents_tmp_handed_over_cannot_forge_the_verifiers_keyed_runs(
    docker: DockerBackend, harbor_base: None, tmp_path: Path
) -> None:
    """/tmp as an artifact: the agent's files arrive, its copy of the keyed-exec records does not."""

    def edit(task_dir: Path) -> None:
        _replace("task.toml", '["result.txt"]', '["result.txt", "/tmp"]')(task_dir)
        forge = "echo kept > /tmp/kept.txt\nmkdir -p /tmp/.dr-once/forged\n"
        _replace("solution/solve.sh", "", forge, append=True)(task_dir)

    async with _own_task_scored(docker, tmp_path, "tmp", edit) as (ctx, _, rid, run_id):
        assert (await registry.get("harbor").score(ctx, None)).metrics == OWN_METRICS
        (handle,) = [c for c in docker.list_containers(run_id) if c.key == sibling_key(rid, "verifier")]
        res = docker.client.containers.get(handle.container_id).exec_run(
            ["sh", "-c", "cat /tmp/kept.txt; ls /tmp/.dr-once"]
        )
        out = res.output.decode()
        assert out.startswith("kept\n") and "forged" not in out and "score-3.run" in out, out
