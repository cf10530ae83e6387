"""The README's and docs' commands for the field's environments (`rollouts run harbor --wait`,
`rollouts run mini-swe-agent --wait`, `rollouts run swe --wait`, `rollouts run reasoning_gym --wait`) run
their bundled example configs; with the simulated engine playing each environment's reference transcripts,
those configs' limits let the reference solution finish: no rollout ends truncated by max_turns or
max_tokens.

Each run is the command's config as `rollouts run NAME` reads it (from the repository's root, as the README
runs it), cut to the smallest run (one group of one rollout: one task) and pointed at the simulated engine
and the test's Temporal queue; every limit is the example's own. The images are those the environments'
own tests build (their fixtures, reused here).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client

from durable_rollouts.config.load import config_file, load_config
from durable_rollouts.config.models import Config
from durable_rollouts.config.paths import resolve_path
from durable_rollouts.environments import registry
from durable_rollouts.environments.tasks import load_tasks
from durable_rollouts.simengine import Mode, ModeRule, SimEngine, SimSettings
from tests import REPO_ROOT
from tests.integration.support import CODING_TASKS, export, run_to_end, worker
from tests.integration.test_harbor import harbor_base  # noqa: F401  (fixture)
from tests.integration.test_harness import harness_image  # noqa: F401  (fixture)
from tests.integration.test_swe import swe_tasks  # noqa: F401  (fixture)

pytestmark = pytest.mark.timeout(1200)

REFERENCE = [ModeRule(on="request", prefix="", mode=Mode.REFERENCE)]


@pytest.fixture(autouse=True)
def from_the_checkout(monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's commands run from the repository's root (the Harbor examples' path is relative to it)."""
    monkeypatch.chdir(REPO_ROOT)


async def serve(transcripts: Path | None, max_model_len: int, **given: Any) -> AsyncIterator[str]:
    settings = SimSettings(
        transcripts=transcripts, mode_rules=REFERENCE, max_model_len=max_model_len, **given
    )
    async with SimEngine(settings).serve(port=0) as url:
        yield url


def example(name: str, url: str, task_queue: str, **run: Any) -> Config:
    """The bundled example ``name`` as `rollouts run NAME` reads it, cut to one group of one rollout and
    pointed at ``url`` and ``task_queue``; every limit is the example's own."""
    overrides = {
        "engine.urls": [url],
        "temporal.task_queue": task_queue,
        "run.num_groups": 1,
        "run.group_size": 1,
        "run.max_inflight_groups": 1,
        "engine.retry_initial_s": 0.2,
        "engine.retry_max_s": 1.0,
        **{f"run.{k}": v for k, v in run.items()},
    }
    return load_config(config_file(name), [f"{k}={json.dumps(v)}" for k, v in overrides.items()])


async def run_example(client: Client, cfg: Config, run_id: str, tmp_path: Path) -> list[dict[str, Any]]:
    """Run ``cfg`` to its end as `rollouts run` submits it (tasks read and stored at submit); its rollouts,
    checked: at least one completed, none truncated by max_turns or max_tokens, no model call cut at
    max_tokens, each within the limits."""
    tasks_path = resolve_path(cfg.run.task_file, "run.task_file")  # as `rollouts run` does at submit
    cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"task_file": str(tasks_path)})})
    tasks = load_tasks(tasks_path, cfg.run.env)
    async with worker(client, cfg.temporal.task_queue, tmp_path) as store:
        store.put_tasks(run_id, tasks)
        result = await run_to_end(client, cfg, run_id)
    assert result.done
    rollouts, _ = export(store, run_id)
    assert rollouts
    for rec in rollouts:
        reason = rec.get("reason") or ""
        assert not (rec["outcome"] == "truncated" and ("max_turns" in reason or "max_tokens" in reason)), (
            rec["task_id"],
            reason,
        )
        assert rec["outcome"] == "completed", (rec["task_id"], rec["outcome"], reason)
        # no model call cut at sampling.max_tokens either (a cut tool call fails the task, not truncated)
        assert all(t["finish_reason"] != "length" for t in rec["turns"]), (rec["task_id"], rec["turns"])
        assert len(rec["turns"]) < cfg.rollout.max_turns or cfg.rollout.max_turns == 1
        assert len(rec["token_ids"]) <= cfg.rollout.max_total_tokens
    return rollouts


@pytest.fixture(scope="module")
async def rgym_sim(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[str]:
    from rgym_env.transcripts import write

    async for url in serve(write(tmp_path_factory.mktemp("rgym") / "transcripts.jsonl"), 4096):
        yield url


@pytest.fixture(scope="module")
async def coding_sim() -> AsyncIterator[str]:
    """The simulated engine's scripted coding agent on the bundled coding tasks (as test_coding.py)."""
    async for url in serve(None, 4096, tasks=CODING_TASKS):
        yield url


@pytest.fixture(scope="module")
async def swe_sim(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[str]:
    from swe_env.transcripts import write

    async for url in serve(write(tmp_path_factory.mktemp("swe") / "transcripts.jsonl"), 4096):
        yield url


@pytest.fixture(scope="module")
async def harbor_sim(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[str]:
    from harbor_env.transcripts import write

    examples = REPO_ROOT / "environments" / "harbor" / "examples"
    async for url in serve(write(tmp_path_factory.mktemp("harbor") / "transcripts.jsonl", examples), 8192):
        yield url


@pytest.fixture(scope="module")
async def harness_sim(harness_image: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[str]:  # noqa: F811
    from harness_env.transcripts import write

    examples = REPO_ROOT / "environments" / "harbor" / "examples"
    async for url in serve(write(tmp_path_factory.mktemp("mswea") / "transcripts.jsonl", examples), 65536):
        yield url


async def test_rollouts_run_reasoning_gym(
    client: Client, rgym_sim: str, task_queue: str, tmp_path: Path
) -> None:
    cfg = example("reasoning_gym", rgym_sim, task_queue)
    (rec,) = await run_example(client, cfg, "example-rgym", tmp_path)
    assert rec["reward"] == 1.0 and len(rec["turns"]) == 1


@pytest.mark.usefixtures("docker")
async def test_rollouts_run_coding(client: Client, coding_sim: str, task_queue: str, tmp_path: Path) -> None:
    cfg = example("coding", coding_sim, task_queue)
    (rec,) = await run_example(client, cfg, "example-coding", tmp_path)
    assert rec["reward"] == 1.0


@pytest.mark.usefixtures("swe_tasks")
async def test_rollouts_run_swe(client: Client, swe_sim: str, task_queue: str, tmp_path: Path) -> None:
    cfg = example("swe", swe_sim, task_queue)
    (rec,) = await run_example(client, cfg, "example-swe", tmp_path)
    assert rec["reward"] == 1.0 and len(rec["turns"]) == 3  # cat, write_file, submit


@pytest.mark.usefixtures("harbor_base")
async def test_rollouts_run_harbor(client: Client, harbor_sim: str, task_queue: str, tmp_path: Path) -> None:
    cfg = example("harbor", harbor_sim, task_queue)
    first = registry.get("harbor").load_tasks(resolve_path(cfg.run.task_file))[0]
    assert first.id != "examples/slow-verifier"  # its verifier runs past its timeout by design
    (rec,) = await run_example(client, cfg, "example-harbor", tmp_path)
    assert rec["reward"] == 1.0 and len(rec["turns"]) >= 4  # upload, decode, solve.sh, submit
    print(f"harbor {rec['task_id']}: {len(rec['turns'])} turns, {len(rec['token_ids'])} tokens")


async def test_rollouts_run_mini_swe_agent(
    client: Client, harness_sim: str, task_queue: str, tmp_path: Path
) -> None:
    cfg = example("mini-swe-agent", harness_sim, task_queue)
    (rec,) = await run_example(client, cfg, "example-mswea", tmp_path)
    assert rec["reward"] == 1.0 and len(rec["turns"]) >= 2
    print(f"mini-swe-agent: {len(rec['turns'])} turns, {len(rec['token_ids'])} tokens")
