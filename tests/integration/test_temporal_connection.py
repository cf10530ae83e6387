"""Temporal reached as the ``temporal`` CLI reaches it, on the real dev server: a worker started with
``rollouts worker --namespace NS`` and a run submitted by ``rollouts run`` with only ``TEMPORAL_ADDRESS`` and
``TEMPORAL_NAMESPACE`` set (the config names no address) complete a run in a namespace that is not
``default``; a profile that does not exist is refused in one line."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import math_env
import pytest
from temporalio.client import Client

from durable_rollouts.config.paths import venv_bin
from durable_rollouts.contracts.client import connect
from durable_rollouts.environments.registry import env_queue
from durable_rollouts.simengine import SimEngine, SimSettings
from durable_rollouts.stack import procs
from durable_rollouts.store.runstore import RunStore
from durable_rollouts.workflows.search_attributes import DEFINITIONS
from tests import REPO_ROOT
from tests.integration.support import until_polled

pytestmark = pytest.mark.integration


def _rollouts(*args: str, env: dict[str, str], timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "durable_rollouts.cli.rollouts", *args],
        capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO_ROOT,
    )  # fmt: skip


async def test_a_run_completes_in_another_namespace_reached_through_the_temporal_variables(
    client: Client, task_queue: str, tmp_path: Path
) -> None:
    address = client.service_client.config.target_host
    namespace = f"research-{secrets.token_hex(3)}"
    made = subprocess.run(
        [str(venv_bin("temporal")), "operator", "namespace", "create", "--namespace", namespace,
         "--address", address],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    home = tmp_path / "home"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("TEMPORAL_")},
        "ROLLOUTS_HOME": str(home),
        "TEMPORAL_CONFIG_FILE": str(tmp_path / "no-profile.toml"),
    }
    registered = _rollouts(
        "stack", "search-attributes", "--address", address, "--namespace", namespace, env=env
    )
    assert registered.returncode == 0, registered.stderr
    assert namespace in registered.stdout

    async with SimEngine(SimSettings(policy="random")).serve(port=0) as url:
        worker = procs.spawn(
            "worker",
            [sys.executable, "-m", "durable_rollouts.cli.rollouts", "worker",
             "--namespace", namespace, "--task-queue", task_queue, "--store", str(home)],
            home, {**env, "TEMPORAL_ADDRESS": address},  # the address from the environment, as the CLI's
        )  # fmt: skip
        elsewhere = await connect(address, namespace)
        try:
            await until_polled(elsewhere, env_queue(task_queue, "math", math_env.ENV_VERSION))
            # its first line says where it polls, as resolved (not the flag it was not given)
            started = (home / "logs" / "worker.log").read_text()
            assert f"on {address} (namespace {namespace})" in started, started[-2000:]
            sets = {
                "engine.urls": [url], "engine.model": "tiny", "temporal.task_queue": task_queue,
                "sampling.max_tokens": 8, "admission.enabled": False,
            }  # fmt: skip
            overrides = [a for k, v in sets.items() for a in ("--set", f"{k}={json.dumps(v)}")]
            run_env = {**env, "TEMPORAL_ADDRESS": address, "TEMPORAL_NAMESPACE": namespace}
            done = await asyncio.to_thread(  # the engine serves from this loop meanwhile
                _rollouts,
                "run", "math", "--run-id", "elsewhere", "--groups", "2", "--group-size", "2", "--wait",
                *overrides, env=run_env,
            )  # fmt: skip
            assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        finally:
            procs.stop_pid(worker, timeout=10)

    run = await elsewhere.get_workflow_handle("elsewhere").describe()
    assert run.status is not None and run.status.name == "COMPLETED"
    with pytest.raises(Exception, match="not found"):
        await client.get_workflow_handle("elsewhere").describe()  # not in the default namespace
    records = RunStore(home).rollouts("elsewhere")
    assert len(records) == 4 and len({r["rollout_id"] for r in records}) == 4
    assert set(DEFINITIONS) <= set(json.loads(_search_attributes(address, namespace)))


def _search_attributes(address: str, namespace: str) -> str:
    listed = subprocess.run(
        [str(venv_bin("temporal")), "operator", "search-attribute", "list", "--address", address,
         "--namespace", namespace, "-o", "json"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return json.dumps(json.loads(listed.stdout).get("customAttributes") or {})


def test_a_profile_that_does_not_exist_is_refused_in_one_line(tmp_path: Path) -> None:
    env = {**os.environ, "ROLLOUTS_HOME": str(tmp_path), "TEMPORAL_CONFIG_FILE": str(tmp_path / "none.toml")}
    done = _rollouts("status", "some-run", "--profile", "staging", env=env, timeout=60)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "profile 'staging'" in lines[0], done.stderr
