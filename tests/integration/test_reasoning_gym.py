"""The reasoning-gym plug-in (environments/reasoning_gym, entry point ``reasoning_gym``) through the pipeline.

Real Temporal, an in-process worker, the simulated engine playing the plug-in's transcripts. The tasks are
made and stored the way ``rollouts run`` does at submit (``environments.tasks.load_tasks`` of the spec, then
``put_tasks``), so the worker reads them from the store only. Every reward is checked against
``score_answer`` recomputed here from the exported record alone: its sampled tokens decoded, the answer taken
with reasoning-gym's own ``extract_answer``, the dataset re-created with reasoning-gym's ``create_dataset``
from the spec's generator, seed and size.
"""

from __future__ import annotations

import tomllib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import reasoning_gym
from reasoning_gym.utils import extract_answer
from rgym_env import ReasoningGymEnvironment
from rgym_env.transcripts import SPEC, write
from temporalio.client import Client

from durable_rollouts.config.models import Config
from durable_rollouts.config.paths import TINY_POLICY, resource_path
from durable_rollouts.environments.tasks import load_tasks
from durable_rollouts.simengine import Mode, ModeRule, SimEngine, SimSettings
from durable_rollouts.simengine.tokenizer import SimTokenizer
from tests.integration.support import (
    assert_schema_valid,
    export,
    export_lines,
    make_config,
    run_to_end,
    worker,
)


@pytest.fixture(scope="module")
async def sim(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[str]:
    """The simulated engine: right answers, except spell_backward's, reversed (partly right or wrong)."""
    transcripts = write(tmp_path_factory.mktemp("rgym") / "transcripts.jsonl")
    rules = [ModeRule(on="task", prefix="spell_backward", mode=Mode.WRONG)]
    settings = SimSettings(transcripts=transcripts, mode_rules=rules, max_model_len=4096)
    async with SimEngine(settings).serve(port=0) as url:
        yield url


def rgym_config(url: str, task_queue: str, groups: int, size: int) -> Config:
    return make_config(
        [url],
        task_queue,
        run={"env": "reasoning_gym", "task_file": str(SPEC), "num_groups": groups, "group_size": size},
        sampling={"max_tokens": 256},
        rollout={"max_turns": 1, "max_total_tokens": 2048},
    )


def datasets_of(spec: Path) -> dict[str, Any]:
    """Generator name -> the dataset reasoning-gym makes for the spec's entry, read from the TOML here."""
    gens = tomllib.loads(spec.read_text())["generators"]
    return {
        g["name"]: reasoning_gym.create_dataset(
            g["name"], seed=g["seed"], size=g["size"], **g.get("config", {})
        )
        for g in gens
    }


def sampled_text(tok: SimTokenizer, rec: dict[str, Any]) -> str:
    ids = [t for t, m in zip(rec["token_ids"], rec["loss_mask"], strict=True) if m]
    return tok.decode(ids).split("<|end|>")[0]


@pytest.mark.timeout(600)
async def test_three_generators_in_one_run_every_reward_is_score_answer(
    client: Client, sim: str, task_queue: str, tmp_path: Path
) -> None:
    cfg = rgym_config(sim, task_queue, groups=6, size=2)
    run_id = "rgym-three"
    tasks = load_tasks(cfg.run.task_file, cfg.run.env)  # what `rollouts run` does at submit
    async with worker(client, task_queue, tmp_path) as store:
        store.put_tasks(run_id, tasks)
        result = await run_to_end(client, cfg, run_id)
    assert result.done and result.groups_done == 6
    rollouts, groups = export(store, run_id)
    assert len(rollouts) == 12 and len(groups) == 6
    assert_schema_valid(export_lines(store, run_id))
    datasets = datasets_of(SPEC)
    tok = SimTokenizer(resource_path(TINY_POLICY))
    seen = set()
    for rec in rollouts:
        assert rec["outcome"] == "completed" and rec["scorable"], (rec["task_id"], rec["reason"])
        assert len(rec["turns"]) == 1
        lineage = rec["lineage"]
        assert (lineage["env"], lineage["env_version"], lineage["verifier_version"]) == (
            "reasoning_gym",
            ReasoningGymEnvironment.env_version,
            ReasoningGymEnvironment.verifier_version,
        )
        name, _seed, index = rec["task_id"].rsplit("-", 2)
        ds = datasets[name]
        expected = ds.score_answer(extract_answer(sampled_text(tok, rec)), ds[int(index)])
        assert rec["reward"] == expected, rec["rollout_id"]
        seen.add(name)
    assert seen == {"basic_arithmetic", "spell_backward", "number_sorting"}
    rewards = {r["task_id"].split("-")[0]: r["reward"] for r in rollouts}
    assert rewards["basic_arithmetic"] == rewards["number_sorting"] == 1.0
    assert all(r["reward"] < 1.0 for r in rollouts if r["task_id"].startswith("spell_backward"))


@pytest.mark.timeout(600)
async def test_an_exception_inside_score_answer_fails_the_rollout_as_environment(
    client: Client, sim: str, task_queue: str, tmp_path: Path
) -> None:
    cfg = rgym_config(sim, task_queue, groups=1, size=2)
    run_id = "rgym-raises"
    tasks = load_tasks(cfg.run.task_file, cfg.run.env)
    # An oracle answer of None: the base score_answer's `oracle in answer` raises TypeError.
    tasks[0] = {**tasks[0], "answer": None}
    assert tasks[0]["generator"] == "basic_arithmetic"
    async with worker(client, task_queue, tmp_path) as store:
        store.put_tasks(run_id, tasks)
        result = await run_to_end(client, cfg, run_id)
    assert result.done and result.outcomes.get("failed") == 2
    rollouts, _ = export(store, run_id)
    for rec in rollouts:
        assert rec["outcome"] == "failed" and rec["reward"] is None
        assert rec["reason"].startswith("environment: EnvironmentFailure: task basic_arithmetic-42-0: "), rec
        assert "score_answer raised TypeError" in rec["reason"]
