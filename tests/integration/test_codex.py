"""Codex CLI 0.169.0, unchanged, as the agent of every Harbor example through the real pipeline: each of
its model calls a durable, token-exact gateway call (``/v1/responses``, streamed).

Real Temporal (dev server), real Docker (each task's image built on the daemon, /opt/codex copied from the
image environments/codex/build_image.sh builds offline), the simulated engine playing the harbor oracle's
turns as Codex's ``exec_command`` calls:
- every example scores 1.0 (but slow-verifier, whose verifier outlasts its timeout by design), each call
  sampled once and extending the stored tokens, loss mask 1 exactly on sampled tokens, and Codex's own
  session log (kept with the rollout) agrees with the gateway's calls;
- a worker SIGKILLed while a call waits at the gateway: Codex keeps running in its container, the call is
  answered once by the next worker, the rollout still scores 1.0, its session log agrees.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment

from durable_rollouts.contracts.types import group_id, rollout_id
from durable_rollouts.environments import registry
from durable_rollouts.sandboxes import DockerBackend
from durable_rollouts.sandboxes.pool import SandboxPool
from durable_rollouts.simengine import Mode, ModeRule, SimEngine, SimSettings
from durable_rollouts.stack import procs
from durable_rollouts.store.runstore import RunStore
from tests import REPO_ROOT
from tests.integration.support import assert_no_containers, export, run_to_end, start_run, worker
from tests.integration.test_harness import assert_token_exact, harness_config

CODEX = REPO_ROOT / "environments" / "codex"
HARBOR = REPO_ROOT / "environments" / "harbor"
EXAMPLES = HARBOR / "examples"
SLOW = "examples/slow-verifier"
"""The example whose verifier runs past its timeout by design (tests/integration/test_harbor.py)."""

pytestmark = pytest.mark.timeout(1500)


@pytest.fixture(scope="module")
def codex_image(docker: DockerBackend, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The harbor examples' base image and the Codex image (offline once the binary is here); returns the
    folder of the plug-in's dist-info (for a worker's PYTHONPATH)."""
    for script in (HARBOR / "base_images.sh", CODEX / "build_image.sh"):
        done = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stdout + done.stderr
    site = tmp_path_factory.mktemp("site")
    info = site / "durable_rollouts_codex_test-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: durable-rollouts-codex-test\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[durable_rollouts.environments]\ncodex = codex_env:CodexEnvironment\n"
    )
    for p in (str(site), str(CODEX), str(HARBOR)):  # this checkout's plug-ins before an editable install
        if p not in sys.path:
            sys.path.insert(0, p)
    registry.get.cache_clear()
    registry.get("codex")
    return site


def transcripts(dataset: Path, out: Path) -> Path:
    from codex_env.transcripts import write

    return write(out / "transcripts.jsonl", dataset)


@pytest.fixture(scope="module")
async def sim(codex_image: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[str]:
    rules = [ModeRule(on="request", prefix="", mode=Mode.REFERENCE)]
    written = transcripts(EXAMPLES, tmp_path_factory.mktemp("tr"))
    settings = SimSettings(transcripts=written, mode_rules=rules, max_model_len=131072)
    async with SimEngine(settings).serve(port=0) as url:
        yield url


def assert_session_agrees(store: Any, rid: str) -> None:
    """Codex's own session log, kept with the rollout, holds every answer of the gateway's log once and in
    order: its function calls are the answers' tool calls (call id, name, arguments), its assistant
    messages the answers' texts; and each tool output it sent back is the next call's tool message."""
    from codex_env import SESSION_LOG

    kept = store.harness_files(rid)
    assert isinstance(kept.get(SESSION_LOG), bytes), kept
    items = [json.loads(line) for line in kept[SESSION_LOG].decode().splitlines()]
    got = [i["payload"] for i in items if i.get("type") == "response_item"]
    calls = store.gateway_calls(rid)
    answers = [c.response["choices"][0]["message"] for c in calls]
    want_calls = [
        (t["id"], t["function"]["name"], json.loads(t["function"]["arguments"]))
        for a in answers
        for t in a.get("tool_calls") or []
    ]
    seen_calls = [
        (p["call_id"], p["name"], json.loads(p["arguments"])) for p in got if p["type"] == "function_call"
    ]
    assert seen_calls == want_calls
    said = [p["content"][0]["text"] for p in got if p["type"] == "message" and p["role"] == "assistant"]
    assert said == [a["content"] for a in answers if a.get("content")]
    outputs = [p["call_id"] for p in got if p["type"] == "function_call_output"]
    sent = [m["tool_call_id"] for c in calls for m in c.request["messages"][-1:] if m["role"] == "tool"]
    assert outputs == sent == [c[0] for c in want_calls]


async def test_codex_scores_every_harbor_example(
    client: Client, docker: DockerBackend, sim: str, task_queue: str, tmp_path: Path
) -> None:
    from codex_env.transcripts import turns
    from harbor_env.tasks import load_dataset

    tasks = {t.id: t for t in load_dataset(EXAMPLES)}
    cfg = harness_config(
        [sim], task_queue, EXAMPLES, "codex", run={"num_groups": len(tasks)},
        sampling={"max_tokens": 4096}, rollout={"max_total_tokens": 120000},
    )  # fmt: skip
    async with worker(client, task_queue, tmp_path) as store:
        await run_to_end(client, cfg, "codex-ref")
    everything, _ = export(store, "codex-ref")
    # one final record per task; an attempt failed for infrastructure is kept, marked superseded
    recs = [r for r in everything if not r.get("superseded_by")]
    assert sorted(r["task_id"] for r in recs) == sorted(tasks)
    assert all(r["failure_kind"] == "infra" for r in everything if r.get("superseded_by")), everything
    for rec in recs:
        if rec["task_id"] == SLOW:  # its verifier runs past [verifier].timeout_sec: no reward, ever
            assert rec["outcome"] == "failed" and rec["reward"] is None, rec["reason"]
            assert rec["reason"].startswith("environment:") and "timeout" in rec["reason"], rec["reason"]
            continue
        assert rec["outcome"] == "completed" and rec["reward"] == 1.0, (rec["task_id"], rec["reason"])
        calls = store.gateway_calls(rec["rollout_id"])
        assert len(calls) == len(turns(tasks[rec["task_id"]], "reference"))  # one call per scripted turn
        assert all(c.status == 200 and c.request["api"] == "responses" for c in calls)
        assert_token_exact(store, rec)
        assert_session_agrees(store, rec["rollout_id"])
        assert rec["lineage"]["env"] == "codex"
    assert_no_containers(docker, "codex-ref")


@pytest.fixture(scope="module")
async def slow_sim(codex_image: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[str]:
    rules = [ModeRule(on="request", prefix="", mode=Mode.REFERENCE)]
    written = transcripts(EXAMPLES, tmp_path_factory.mktemp("tr-slow"))
    settings = SimSettings(
        transcripts=written, mode_rules=rules, max_model_len=131072, decode_ms_per_token=20.0
    )
    async with SimEngine(settings).serve(port=0) as url:
        yield url


def spawn(env: WorkflowEnvironment, task_queue: str, home: Path, name: str, site: Path) -> int:
    address = env.client.service_client.config.target_host
    parts = [site, CODEX, HARBOR, REPO_ROOT]
    path = os.pathsep.join([*map(str, parts), os.environ.get("PYTHONPATH", "")])
    return procs.spawn(
        name,
        procs.worker_argv(address, task_queue),
        home,
        env={"ROLLOUTS_HOME": str(home), "PYTHONPATH": path},
    )


async def test_worker_sigkill_while_a_codex_call_waits(
    temporal_env: WorkflowEnvironment, client: Client, docker: DockerBackend, codex_image: Path,
    slow_sim: str, task_queue: str, tmp_path: Path, ledger: Any,
) -> None:  # fmt: skip
    run_id = "codex-sigkill"
    rid = rollout_id(run_id, group_id(0), 0)
    dataset = tmp_path / "dataset"
    shutil.copytree(EXAMPLES / "fix-inventory-totals", dataset / "fix-inventory-totals")
    cfg = harness_config([slow_sim], task_queue, dataset, "codex", sampling={"max_tokens": 4096})
    store = RunStore(tmp_path)
    first = spawn(temporal_env, task_queue, tmp_path, "worker-1", codex_image)
    second = None
    try:
        handle = await start_run(client, cfg, run_id)
        for _ in range(1200):  # wait for call 1 to be recorded and not answered yet (the engine is slow)
            calls = store.gateway_calls(rid)
            if len(calls) >= 2 and not calls[-1].answered:
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError(
                f"no pending call 1: {[(c.index, c.status) for c in store.gateway_calls(rid)]}"
            )
        killed_at = calls[-1].index
        os.killpg(first, signal.SIGKILL)
        kill_time = time.time()
        assert rid in [i.key for i in docker.list_containers(run_id)]  # Codex's sandbox lives on
        second = spawn(temporal_env, task_queue, tmp_path, "worker-2", codex_image)
        await asyncio.wait_for(handle.result(), timeout=600)
    finally:
        procs.stop_pid(first)
        if second is not None:
            procs.stop_pid(second)
    await ledger(store, run_id, client=client, backend=docker, pool=SandboxPool(store))
    (rec,), _ = export(store, run_id)
    assert rec["outcome"] == "completed" and rec["reward"] == 1.0, rec["reason"]
    calls = store.gateway_calls(rid)
    model = [s for s in store.segments(rid) if s.kind == "model"]
    # Every call answered and sampled exactly once; the one pending at the kill among them.
    assert [c.index for c in calls] == [s.turn for s in model] == list(range(len(calls)))
    assert killed_at < len(calls) and all(c.status == 200 for c in calls)
    (answered_at,) = store.db.execute(
        "SELECT answered_at FROM gateway_calls WHERE rollout_id=? AND idx=?", (rid, killed_at)
    ).fetchone()
    assert answered_at > kill_time  # the pending call was answered by the second worker
    assert_token_exact(store, rec)
    assert_session_agrees(store, rid)  # Codex got every answer once, the pending one included
    assert_no_containers(docker, run_id)
