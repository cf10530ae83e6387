"""Environment queues (environments/registry.py, environments/fleet.py): a worker polls one queue per
environment it loads,
named by the run's queue, the environment and its env_version; a broken environment is not advertised; a
sandbox host's queue for a run carries the run's environment part."""

from __future__ import annotations

import asyncio
import dataclasses
from importlib.metadata import EntryPoint

import coding_env as coding
import math_env as math
import pytest
from temporalio.testing import ActivityEnvironment

from durable_rollouts.activities.sandbox import SandboxActivities
from durable_rollouts.contracts.sandbox import SandboxPlaceInput
from durable_rollouts.environments import registry
from durable_rollouts.errors import ConfigError
from durable_rollouts.sandboxes.hosts import SandboxHosts, host_queue
from durable_rollouts.sandboxes.pool import SandboxPoolConfig
from durable_rollouts.store import RunStore


def test_an_environment_queue_names_the_queue_the_environment_and_its_version() -> None:
    assert registry.env_queue("rollouts", "math", "7") == "rollouts@env-math:7"
    assert registry.run_queue("rollouts", "math") == f"rollouts@env-math:{math.ENV_VERSION}"
    assert registry.env_queue("q", "math", "1") != registry.env_queue("q", "math", "2")
    assert registry.env_part(registry.env_queue("q", "coding", "c1")) == "@env-coding:c1"
    assert registry.env_part("q") == "" and registry.env_part(host_queue("q", "h1")) == ""
    with pytest.raises(ConfigError, match="unknown environment 'nope'"):
        registry.run_queue("rollouts", "nope")


def test_a_worker_advertises_the_environments_it_loads_and_not_a_broken_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    found = registry.loadable()
    assert found["math"] == math.ENV_VERSION and found["coding"] == coding.ENV_VERSION
    broken = EntryPoint("broken", "no_such_module_anywhere:Env", registry.GROUP)
    real = registry.installed()
    monkeypatch.setattr(registry, "installed", lambda: {**real, "broken": broken})
    try:
        advertised = registry.loadable()
    finally:
        registry.get.cache_clear()
    assert "broken" not in advertised and advertised == found


def test_a_sandbox_host_placement_goes_to_the_hosts_queue_of_the_runs_environment(tmp_path) -> None:
    store = RunStore(tmp_path)
    hosts = SandboxHosts(store)
    hosts.register("h1", host_queue("rollouts", "h1"), "unix:///h1.sock", 2)
    acts = SandboxActivities(store, lambda: None, hosts)  # type: ignore[arg-type,return-value]
    pool = SandboxPoolConfig(placement="hosts", max_size=100, host_timeout_s=10.0)

    def place(run_queue: str, rollout_id: str) -> str:
        env = ActivityEnvironment()
        env.info = dataclasses.replace(env.info, task_queue=run_queue)
        placed = asyncio.run(env.run(acts.sandbox_place, SandboxPlaceInput(rollout_id=rollout_id, pool=pool)))
        return placed.task_queue

    on_env = place(registry.env_queue("rollouts", "coding", "c1"), "r1")
    assert on_env == "rollouts@sandbox-host-h1@env-coding:c1"
    assert place("rollouts", "r2") == "rollouts@sandbox-host-h1"  # a run on the plain queue: as before
