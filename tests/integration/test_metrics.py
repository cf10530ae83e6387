"""Metrics end to end: a small math run on the simulated engine with an in-process worker serving
``rollouts_*`` and the Temporal SDK's metrics; Debian's ``prometheus`` (started by pid, stopped by pid)
scrapes them every second, and its HTTP API gives the run's numbers back. Real Temporal dev server."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY
from temporalio.testing import WorkflowEnvironment

from durable_rollouts.contracts.client import connect
from durable_rollouts.metrics.serve import serve_metrics, temporal_runtime
from durable_rollouts.simengine import SimEngine, SimSettings
from durable_rollouts.stack.procs import free_port, wait_until
from tests.integration.support import export, make_config, run_to_end, worker

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
QUICK = {"policy": "random", "random_min_tokens": 4, "random_max_tokens": 8, "decode_ms_per_token": 5}


def _query(api: str, expr: str) -> list[dict[str, Any]]:
    url = f"{api}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as r:
        body = json.load(r)
    assert body["status"] == "success", body
    return body["data"]["result"]


def _scalar(api: str, expr: str) -> float | None:
    result = _query(api, expr)
    return float(result[0]["value"][1]) if result else None


async def _until(api: str, expr: str, want: float, timeout_s: float = 60.0) -> float | None:
    """Poll Prometheus until ``expr`` evaluates to ``want`` (a scrape after the fact); the last value."""
    got = None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = await asyncio.to_thread(_scalar, api, expr)
        if got == want:
            return got
        await asyncio.sleep(0.5)
    return got


def _records_total() -> float:
    return sum(
        s.value
        for m in REGISTRY.collect()
        if m.name == "rollouts_records"
        for s in m.samples
        if s.name.endswith("_total")
    )


@pytest.mark.timeout(300)
async def test_prometheus_scrapes_a_running_worker_and_reads_the_run_back(
    temporal_env: WorkflowEnvironment, task_queue: str, tmp_path: Path
) -> None:
    if not Path(PROMETHEUS).exists():
        pytest.skip("Debian's prometheus is not installed (.ci/with-services.sh installs it)")
    port, sdk_port, web_port = free_port(), free_port(), free_port()
    address = temporal_env.client.service_client.config.target_host
    client = await connect(address, runtime=temporal_runtime(sdk_port))
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - {{job_name: rollouts-worker, static_configs: [{{targets: ['127.0.0.1:{port}']}}]}}\n"
        f"  - {{job_name: temporal-sdk, static_configs: [{{targets: ['127.0.0.1:{sdk_port}']}}]}}\n"
    )
    log = (tmp_path / "prometheus.log").open("w")
    prom = subprocess.Popen(
        [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{web_port}"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    api = f"http://127.0.0.1:{web_port}"
    try:
        await asyncio.to_thread(
            wait_until, lambda: _ready(api), 60, "prometheus", prom.pid, tmp_path / "prometheus.log"
        )
        groups, size = 3, 2
        async with SimEngine(SimSettings(**QUICK)).serve(port=0) as url:
            cfg = make_config(
                [url],
                task_queue,
                run={"num_groups": groups, "group_size": size},
                admission={"enabled": True, "poll_interval_s": 0.3, "admit_window_s": 0.0, "initial_cap": 4},
            )
            with serve_metrics(port):
                before = _records_total()
                async with worker(client, task_queue, tmp_path / "home") as store:
                    result = await run_to_end(client, cfg, "metrics-run")
                    rollouts, _ = export(store, "metrics-run")
                    turns = sum(len(r["turns"]) for r in rollouts)
                    assert result.done and len(rollouts) == groups * size
                    want = before + groups * size
                    assert _records_total() == want
                    # the worker is still up: Prometheus scrapes it after the run and reads the totals back
                    got = await _until(api, "sum(rollouts_records_total)", want)
                    assert got == want, (got, want)
                    histogram = 'sum(rollouts_turn_model_seconds_count{env="math"})'
                    model_turns = REGISTRY.get_sample_value(
                        "rollouts_turn_model_seconds_count", {"env": "math"}
                    )
                    assert model_turns is not None and model_turns >= turns
                    assert await _until(api, histogram, model_turns) == model_turns
                    cap = _scalar(api, 'rollouts_admission_cap{run="metrics-run"}')
                    kv = _scalar(api, f'rollouts_engine_kv_usage{{engine="{url}"}}')
                    assert cap is not None and cap >= size and kv is not None and 0.0 <= kv <= 1.0
                    # every turn's activity went through the in-flight interceptor (0 now, the run is over)
                    assert (
                        _scalar(api, 'rollouts_inflight{phase="generate", activity="generate_turn"}') == 0.0
                    )
                    # the SDK's endpoint is scraped as the worker's is (waited for, as the totals are above:
                    # an instant query can land before Prometheus's first scrape of that target)
                    assert await _until(api, 'up{job="temporal-sdk"}', 1.0) == 1.0
                    sdk = _query(api, 'count({job="temporal-sdk", __name__=~"temporal_.+"})')
                    assert sdk and float(sdk[0]["value"][1]) > 0, "no temporal_* series from the SDK"
    finally:
        prom.terminate()
        try:
            prom.wait(timeout=20)
        except subprocess.TimeoutExpired:
            prom.kill()
            prom.wait()
        log.close()


def _ready(api: str) -> bool:
    try:
        with urllib.request.urlopen(f"{api}/-/ready", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False
