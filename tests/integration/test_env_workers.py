"""Workers that know their environments (issue 22, item 2), on the real Temporal dev server with a simulated
engine: an environment installed while a worker runs is refused at submit (one line, exit 2, nothing
started), and once a worker started after the install polls, the run goes to that worker only and completes.

The new environment is a tiny distribution (module + dist-info with its entry point) in a temporary
directory, seen only by processes whose PYTHONPATH names it: the shared venv is never modified, and the
worker started before it cannot load it, as a worker started before a ``pip install -e`` cannot.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import math_env
import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode

from durable_rollouts.environments.registry import env_queue
from durable_rollouts.stack import procs
from durable_rollouts.store import open_store
from durable_rollouts.workflows.run import RunWorkflow
from tests import REPO_ROOT
from tests.integration.support import until_polled

pytestmark = pytest.mark.integration

TINY = '''
from typing import ClassVar

from durable_rollouts.environments.base import Environment, Prompt, Step


class TinyEnvironment(Environment):
    """Answers once: every rollout is one turn, reward 1."""

    name: ClassVar[str] = "tiny"
    env_version: ClassVar[str] = "t1"
    verifier_version: ClassVar[str] = "t1"
    inline_steps: ClassVar[bool] = True

    def prompt(self, task):
        return Prompt(messages=[{"role": "user", "content": f"say {task.id}"}])

    def parse(self, ctx, text):
        return Step(done=True, reward=1.0)
'''


def tiny_distribution(site: Path) -> None:
    """The environment's package as an installer would lay it out: the module and its dist-info."""
    site.mkdir(parents=True)
    (site / "tinyenv.py").write_text(TINY)
    info = site / "tinyenv-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tinyenv\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[durable_rollouts.environments]\ntiny = tinyenv:TinyEnvironment\n"
    )


def start_worker(name: str, home: Path, address: str, task_queue: str, pythonpath: str) -> int:
    argv = [sys.executable, "-m", "durable_rollouts.workers.worker", "--address", address,
            "--task-queue", task_queue, "--store", str(home)]  # fmt: skip
    return procs.spawn(name, argv, home, {"PYTHONPATH": pythonpath, "ROLLOUTS_HOME": str(home)})


def submit(home: Path, pythonpath: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ROLLOUTS_HOME": str(home), "PYTHONPATH": pythonpath}
    return subprocess.run(
        [sys.executable, "-m", "durable_rollouts.cli.rollouts", "run", *args],
        capture_output=True, text=True, timeout=240, env=env, cwd=REPO_ROOT,
    )  # fmt: skip


async def identities(client: Client, workflow_id: str) -> set[str]:
    """The identities of the workers that started the workflow's tasks and activities."""
    found = set()
    async for e in client.get_workflow_handle(workflow_id).fetch_history_events():
        if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED:
            found.add(e.workflow_task_started_event_attributes.identity)
        elif e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED:
            found.add(e.activity_task_started_event_attributes.identity)
    return found


@pytest.mark.timeout(300)
async def test_an_environment_installed_while_a_worker_runs_is_refused_then_runs_on_a_worker_that_loads_it(
    client: Client, task_queue: str, tmp_path: Path
) -> None:
    home, site = tmp_path / "home", tmp_path / "site"
    address = client.service_client.config.target_host
    base_path = str(REPO_ROOT)
    tasks = tmp_path / "tiny.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"t{i}"}) + "\n" for i in range(2)))
    pids: list[int] = []
    try:
        port = procs.free_port()
        pids.append(
            procs.spawn(
                "engine",
                [
                    sys.executable,
                    "-m",
                    "durable_rollouts.simengine",
                    "--port",
                    str(port),
                    "--policy",
                    "random",
                ],
                home,
            )
        )
        url = f"http://127.0.0.1:{port}"
        procs.wait_until(lambda: procs.http_ok(f"{url}/health"), 60, "simengine", pid=pids[-1])

        # The stack's worker starts before the environment exists.
        pids.append(start_worker("worker-old", home, address, task_queue, base_path))
        await until_polled(client, env_queue(task_queue, "math", math_env.ENV_VERSION))

        tiny_distribution(site)  # "pip install -e", seen by processes started from now on
        with_tiny = f"{base_path}{os.pathsep}{site}"
        run_id = "tiny-run"
        args = ["--run-id", run_id, "--wait", "--groups", "1", "--group-size", "4",
                "--task-file", str(tasks), "--set", 'run.env="tiny"',
                "--set", f"engine.urls={json.dumps([url])}", "--set", "sampling.max_tokens=8",
                "--set", f"temporal.address={json.dumps(address)}",
                "--set", f"temporal.task_queue={json.dumps(task_queue)}"]  # fmt: skip

        refused = submit(home, with_tiny, *args)
        assert refused.returncode == 2, refused.stdout + refused.stderr
        lines = refused.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in refused.stdout + refused.stderr, refused.stderr
        assert lines[0].startswith("error: run.env: ") and "'tiny'" in lines[0] and "t1" in lines[0]
        assert "rollouts stack down && rollouts stack up -d" in lines[0] and "rollouts worker" in lines[0]
        with pytest.raises(RPCError) as gone:  # nothing was started ...
            await client.get_workflow_handle(run_id).describe()
        assert gone.value.status == RPCStatusCode.NOT_FOUND
        assert open_store(home).task_count(run_id) == 0  # ... nor uploaded

        # A worker started after the install loads it; the same submission now runs, on that worker only.
        pids.append(start_worker("worker-new", home, address, task_queue, with_tiny))
        new_worker = pids[-1]
        await until_polled(client, env_queue(task_queue, "tiny", "t1"))
        done = submit(home, with_tiny, *args)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "Traceback" not in done.stdout + done.stderr and done.stdout.startswith(run_id)

        result = await client.get_workflow_handle_for(RunWorkflow.run, run_id).result()
        assert result.outcomes == {"completed": 4} and result.done
        rollouts = open_store(home).rollouts(run_id)
        assert sorted(r["outcome"] for r in rollouts) == ["completed"] * 4
        assert {r["reward"] for r in rollouts} == {1.0}
        ids = [run_id, f"{run_id}/g000000", *(f"{run_id}/g000000/{k}" for k in range(4))]
        seen = set().union(*[await identities(client, w) for w in ids])
        assert seen and {s.split("@")[0] for s in seen} == {str(new_worker)}, seen
    finally:
        for pid in reversed(pids):
            procs.stop_pid(pid, timeout=10)
