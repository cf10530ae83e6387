"""The compose stacks: both files validate, every long-running service has a health check and a restart
policy, and the local stack (durable-rollouts:local, built offline) runs a math run through two worker
containers, one of them killed mid-run, with exactly one record per rollout and nothing left after ``down``;
and, with the worker in a container, a Harbor run and a mini-swe-agent run (every model call through the
rollout's gateway, whose socket folder the worker container shares with the host's Docker daemon), each
rollout scoring 1.0 by the examples' reference solutions.

Real Docker, real docker-compose (Debian's 1.29), real PostgreSQL and Temporal inside the stack; the test
reads the stack's store and Temporal through their published loopback ports, as an operator would.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from durable_rollouts.contracts.client import connect
from durable_rollouts.faults.ledger import check_run
from durable_rollouts.stack.procs import free_ports
from durable_rollouts.store import open_store
from tests import REPO_ROOT
from tests.integration.support import until

COMPOSE = shutil.which("docker-compose")
LOCAL = REPO_ROOT / "docker-compose.local.yml"
PRODUCTION = REPO_ROOT / "docker-compose.yml"
IMAGE = "durable-rollouts:local"
# run to completion; everything else is long-running (temporal-*: the production file's Temporal set-up jobs)
ONE_SHOT = {"setup", "cli", "temporal-schema", "temporal-namespace"}
NO_COMPOSE = "docker-compose is not installed (apt-get install docker-compose; .ci/with-services.sh does)"

pytestmark = pytest.mark.timeout(900)


def _compose(file: Path, *args: str, env: dict[str, str] | None = None, project: str | None = None,
             timeout: float = 300) -> subprocess.CompletedProcess[str]:  # fmt: skip
    if COMPOSE is None:
        pytest.skip(NO_COMPOSE)
    cmd = [COMPOSE, "-f", str(file)] + (["-p", project] if project else []) + list(args)
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}, check=False
    )


def _config(file: Path, env: dict[str, str]) -> dict:
    res = _compose(file, "config", env=env)
    assert res.returncode == 0, res.stderr
    return yaml.safe_load(res.stdout)


PRODUCTION_ENV = {"POSTGRES_PASSWORD": "secret", "MODEL_DIR": "/models/policy"}


@pytest.mark.parametrize("file,env", [(LOCAL, {}), (PRODUCTION, PRODUCTION_ENV)], ids=["local", "prod"])
def test_compose_files_validate_with_health_checks_and_restart_policies(
    file: Path, env: dict[str, str]
) -> None:
    services = _config(file, env)["services"]
    worker = "worker" if file == PRODUCTION else "worker-a"
    assert {"temporal", worker, "engine", "prometheus"} <= set(services)
    for name, svc in services.items():
        if name in ONE_SHOT:
            assert svc.get("restart", "no") == "no", name
            continue
        assert svc.get("restart") == "unless-stopped", name
        assert svc.get("healthcheck", {}).get("test"), f"{name} has no health check"


def test_the_production_file_refuses_to_start_without_its_password() -> None:
    res = _compose(PRODUCTION, "config", env={"MODEL_DIR": "/m", "POSTGRES_PASSWORD": ""})
    assert res.returncode != 0 and "POSTGRES_PASSWORD" in res.stderr


@pytest.fixture(scope="module")
def local_stack() -> Iterator[tuple[str, dict[str, str]]]:
    """The local stack up under a project name of its own, on free host ports; down -v afterwards."""
    if COMPOSE is None:
        pytest.skip(NO_COMPOSE)
    script = str(REPO_ROOT / "workers/image/build_local_image.sh")
    build = subprocess.run(["bash", script], capture_output=True, text=True, timeout=900)
    assert build.returncode == 0, build.stderr[-2000:]
    for images in ("environments/harbor/base_images.sh", "environments/harness/build_image.sh"):
        built = subprocess.run(["bash", str(REPO_ROOT / images)], capture_output=True, text=True, timeout=900)
        assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    project = f"drtest{uuid.uuid4().hex[:8]}"
    names = ("ROLLOUTS_TEMPORAL_PORT", "ROLLOUTS_UI_PORT", "ROLLOUTS_PROMETHEUS_PORT", "ROLLOUTS_STORE_PORT")
    env = {name: str(port) for name, port in zip(names, free_ports(len(names)), strict=True)}
    # the agent engines too (profile `agents`), and a gateway folder of this stack's own on the host
    gateways = Path(tempfile.mkdtemp(prefix=f"{project}-gw-"))
    env |= {"COMPOSE_PROFILES": "agents", "DR_GATEWAY_DIR": str(gateways)}
    try:
        up = _compose(LOCAL, "up", "-d", env=env, project=project, timeout=600)
        assert up.returncode == 0, up.stderr[-3000:]
        services = ["worker-a", "worker-b", "prometheus", "harbor-engine", "harness-engine"]
        _await_healthy(project, services, env)
        yield project, env
    finally:
        logs = _compose(LOCAL, "logs", "--no-color", "--tail", "30", env=env, project=project)
        down = _compose(LOCAL, "down", "-v", "--remove-orphans", env=env, project=project)
        print(logs.stdout[-4000:])
        shutil.rmtree(gateways, ignore_errors=True)
        assert down.returncode == 0, down.stderr
    left = subprocess.run(
        ["docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={project}"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    volumes = subprocess.run(
        ["docker", "volume", "ls", "-q", "--filter", f"label=com.docker.compose.project={project}"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    networks = subprocess.run(
        ["docker", "network", "ls", "-q", "--filter", f"label=com.docker.compose.project={project}"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert (left.stdout.strip(), volumes.stdout.strip(), networks.stdout.strip()) == ("", "", "")


def _container(project: str, service: str) -> str:
    return f"{project}_{service}_1"


def _await_healthy(project: str, services: list[str], env: dict[str, str], timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    state: dict[str, str] = {}
    while time.monotonic() < deadline:
        for svc in services:
            res = subprocess.run(
                ["docker", "inspect", "-f", "{{.State.Health.Status}}", _container(project, svc)],
                capture_output=True, text=True, check=False,
            )  # fmt: skip
            state[svc] = res.stdout.strip() or res.stderr.strip()
        if all(v == "healthy" for v in state.values()):
            return
        time.sleep(2)
    raise AssertionError(f"compose services not healthy after {timeout_s:.0f} s: {state}")


async def test_a_math_run_through_two_worker_containers_survives_one_killed(
    local_stack: tuple[str, dict[str, str]],
) -> None:
    project, env = local_stack
    run_id = "compose-math"
    submit = _compose(
        LOCAL, "run", "--rm", "-T", "cli", "rollouts", "run", "compose/math.toml", "--run-id", run_id,
        "--groups", "8", env=env, project=project,
    )  # fmt: skip
    assert submit.returncode == 0, submit.stdout[-2000:] + submit.stderr[-2000:]
    store = open_store(f"postgresql://postgres@127.0.0.1:{env['ROLLOUTS_STORE_PORT']}/rollouts")
    client = await connect(f"127.0.0.1:{env['ROLLOUTS_TEMPORAL_PORT']}")
    await until(lambda: len(store.rollouts(run_id)) >= 6, 180, "6 records before the kill")
    killed = subprocess.run(
        ["docker", "kill", _container(project, "worker-a")], capture_output=True, text=True, check=False
    )
    assert killed.returncode == 0, killed.stderr
    handle = client.get_workflow_handle(run_id)
    await asyncio.wait_for(handle.result(), timeout=420)
    rollouts = store.rollouts(run_id)
    counts = Counter(r["rollout_id"] for r in rollouts)
    assert len(counts) == 32 and set(counts.values()) == {1}
    assert len(store.groups(run_id)) == 8
    report = await check_run(store, run_id, client=client)
    assert report.ok, "\n".join(report.lines())
    # the export through the stack's own CLI agrees with the store, record for record
    export = _compose(LOCAL, "run", "--rm", "-T", "cli", "rollouts", "export", run_id, "-o", "/dev/stdout",
                      env=env, project=project)  # fmt: skip
    assert export.returncode == 0, export.stderr[-2000:]
    lines = [json.loads(line) for line in export.stdout.splitlines() if line.startswith("{")]
    assert Counter(rec["rollout_id"] for rec in lines if rec.get("kind") == "rollout") == counts
    # a killed container counts as stopped by hand (no restart): worker-b alone finished the run
    running = {
        svc: subprocess.run(
            ["docker", "inspect", "-f", "{{.State.Running}}", _container(project, svc)],
            capture_output=True, text=True, check=True,
        ).stdout.strip()
        for svc in ("worker-a", "worker-b")
    }  # fmt: skip
    assert running == {"worker-a": "false", "worker-b": "true"}
    # the stack's Prometheus scraped the workers' records (worker-b's at least: worker-a's died with it)
    prom = f"http://127.0.0.1:{env['ROLLOUTS_PROMETHEUS_PORT']}/api/v1/query"

    def scraped() -> bool:
        q = 'sum(rollouts_records_total{env="math"})'
        reply = httpx.get(prom, params={"query": q}, timeout=5).json()["data"]["result"]
        return bool(reply) and float(reply[0]["value"][1]) > 0

    await until(scraped, 60, "Prometheus to scrape the workers' rollouts_records_total")


@pytest.mark.parametrize(
    "config,groups",
    [("compose/harbor.toml", 3), ("compose/mini-swe-agent.toml", 2)],
    ids=["harbor", "mini-swe-agent"],
)
async def test_agent_runs_with_the_worker_in_a_container(
    local_stack: tuple[str, dict[str, str]], config: str, groups: int
) -> None:
    project, env = local_stack
    run_id = f"compose-{config.split('/')[1].removesuffix('.toml')}"
    submit = _compose(
        LOCAL, "run", "--rm", "-T", "cli", "rollouts", "run", config, "--run-id", run_id,
        "--groups", str(groups), env=env, project=project,
    )  # fmt: skip
    assert submit.returncode == 0, submit.stdout[-2000:] + submit.stderr[-2000:]
    store = open_store(f"postgresql://postgres@127.0.0.1:{env['ROLLOUTS_STORE_PORT']}/rollouts")
    client = await connect(f"127.0.0.1:{env['ROLLOUTS_TEMPORAL_PORT']}")
    await asyncio.wait_for(client.get_workflow_handle(run_id).result(), timeout=600)
    records = store.rollouts(run_id)
    seen = [(r["rollout_id"], r["outcome"], r["reason"]) for r in records]
    print(seen)
    size = 2 if "harbor" in config else 1
    assert Counter(r["rollout_id"] for r in records) == Counter({r["rollout_id"]: 1 for r in records})
    # the final attempt of each slot (``<i>`` or ``<i>r<n>``); earlier attempts are told apart by the ledger
    finals: dict[str, dict] = {}
    for r in sorted(records, key=lambda r: (len(r["rollout_id"]), r["rollout_id"])):
        group, attempt = r["rollout_id"].rsplit("/", 1)
        finals[f"{group}/{attempt.split('r')[0]}"] = r  # sorted: a later attempt (longer id) wins
    rollouts = list(finals.values())
    assert len(rollouts) == groups * size, seen
    for rec in rollouts:
        assert (rec["outcome"], rec["reward"]) == ("completed", 1.0), (rec["rollout_id"], rec["reason"])
    if "mini-swe-agent" in config:  # every model call went through the gateway, recorded once, answered
        for rec in rollouts:
            calls = store.gateway_calls(rec["rollout_id"])
            assert calls and len({c.index for c in calls}) == len(calls), rec["rollout_id"]
            assert {c.status for c in calls} == {200}, rec["rollout_id"]
    report = await check_run(store, run_id, client=client)
    assert report.ok, "\n".join(report.lines())
    left = subprocess.run(
        ["docker", "ps", "-aq", "--filter", f"label=durable-rollouts.run={run_id}"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert left.stdout.strip() == "", f"sandboxes left: {left.stdout}"
