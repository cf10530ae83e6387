"""The rest of Harbor's task.toml, as the plug-in honours it: users, container environment, health checks,
the empty tables and zero values Harbor accepts, and the deprecated size strings it migrates."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from harbor_env import HarborEnvironment, healthcheck_script
from harbor_env.config import HealthcheckConfig, parse
from harbor_env.tasks import load_dataset
from harbor_paths import MakeTask

from durable_rollouts.sandboxes.base import SandboxSpec

DEFAULT = SandboxSpec(memory_mb=512, workdir_size_mb=64, tmp_size_mb=64, command_timeout_s=60)
NO_NET = '[environment]\nnetwork_mode = "no-network"\n'


def test_empty_tables_and_zero_values_ask_for_nothing_and_are_accepted(make_task: MakeTask) -> None:
    toml = (
        'artifacts = []\n[environment]\nnetwork_mode = "no-network"\ngpus = 0\nmcp_servers = []\n'
        'memory = "1G"\nstorage = "256M"\n[environment.env]\n[verifier.env]\n[solution.env]\n'
    )
    task = load_dataset(make_task(toml=toml))[0]
    env = task.cfg.environment
    assert (env.gpus, env.mcp_servers, env.env, task.cfg.artifacts) == (0, [], {}, [])
    assert (env.memory_mb, env.storage_mb) == (1024, 256)  # migrated as Harbor migrates them
    spec = HarborEnvironment().sandbox(task, DEFAULT).spec
    assert spec.memory_mb == 1024 and spec.workdir_size_mb == 256 and spec.env == {}


def test_users_become_the_sandboxs_user_and_the_verifiers_exec_user(make_task: MakeTask) -> None:
    env = HarborEnvironment()
    plain = load_dataset(make_task("plain", toml=NO_NET))[0]
    spec = env.sandbox(plain, DEFAULT).spec
    assert (spec.user, spec.exec_users, spec.allow_root) == (DEFAULT.user, {}, False)

    d = make_task("named", toml=NO_NET + '[agent]\nuser = "sandbox"\n[verifier]\nuser = "root"\n')
    spec = env.sandbox(load_dataset(d)[0], DEFAULT).spec
    assert spec.user == "sandbox" and spec.allow_root
    assert spec.user_source == f"task named ({d}/task.toml) [agent].user = 'sandbox'"
    assert spec.exec_users == {"root": f"task named ({d}/task.toml) [verifier].user = 'root'"}

    uid = env.sandbox(load_dataset(make_task("uid", toml=NO_NET + "[agent]\nuser = 1000\n"))[0], DEFAULT)
    assert uid.spec.user == "1000" and uid.spec.exec_users == {}
    same = make_task("same", toml=NO_NET + '[agent]\nuser = "root"\n[verifier]\nuser = "root"\n')
    assert env.sandbox(load_dataset(same)[0], DEFAULT).spec.exec_users == {}  # one user: no exec user


def test_environment_variables_reach_every_command_and_the_healthcheck_runs_last(make_task: MakeTask) -> None:
    toml = NO_NET + '[environment.env]\nMODE = "strict"\n[environment.healthcheck]\ncommand = "test -f x"\n'
    plan = HarborEnvironment().sandbox(load_dataset(make_task(toml=toml))[0], DEFAULT)
    assert plan.spec.env == {"MODE": "strict"}
    assert plan.setup[-1] == healthcheck_script(HealthcheckConfig(command="test -f x"))
    assert plan.setup_timeout_s >= 600


def _run(hc: HealthcheckConfig, cwd: Path) -> tuple[int, str, float]:
    start = time.monotonic()
    done = subprocess.run(
        ["bash", "-c", healthcheck_script(hc)], cwd=cwd, capture_output=True, text=True, timeout=60
    )
    return done.returncode, done.stdout, time.monotonic() - start


def test_the_healthcheck_follows_harbors_retry_rule(tmp_path: Path) -> None:
    # Fails twice, then passes: within 3 retries it is healthy.
    flaky = "n=$(cat c 2>/dev/null || echo 0); echo $((n+1)) > c; [ $n -ge 2 ]"
    rc, _, _ = _run(HealthcheckConfig(command=flaky, interval_sec=0.05, retries=3), tmp_path)
    assert rc == 0 and (tmp_path / "c").read_text().strip() == "3"
    # Always failing: `retries` consecutive failures fail it, in one line naming the command.
    (tmp_path / "c").unlink()
    rc, out, _ = _run(
        HealthcheckConfig(command=flaky.replace("2", "99"), interval_sec=0.05, retries=2), tmp_path
    )
    assert (
        rc == 1 and out.startswith("health check failed after 2 consecutive retries: ") and flaky[:5] in out
    )
    assert (tmp_path / "c").read_text().strip() == "2"
    # Failures within the start period do not count: 1 s of them, then two counted ones.
    (tmp_path / "c").unlink()
    hc = HealthcheckConfig(command="echo x >> c; false", start_period_sec=1.0, start_interval_sec=0.1,
                           interval_sec=0.05, retries=2)  # fmt: skip
    rc, _, took = _run(hc, tmp_path)
    attempts = len((tmp_path / "c").read_text().split())
    assert rc == 1 and took >= 1.0 and attempts >= 2 + 5, attempts
    # A command past timeout_sec is a failure.
    rc, _, took = _run(
        HealthcheckConfig(command="sleep 30", timeout_sec=0.3, interval_sec=0, retries=1), tmp_path
    )
    assert rc == 1 and took < 10


@pytest.mark.parametrize(
    ("toml", "field"),
    [
        ('[environment]\nnetwork_mode = "no-network"\n[verifier]\nenvironment_mode = "separate"\n'
         '[verifier.environment]\nnetwork_mode = "no-network"\ngpus = 1\n', "[verifier.environment].gpus"),
        ('[environment]\nnetwork_mode = "no-network"\n[verifier.environment]\n',
         "[verifier.environment].network_mode"),
        ('[environment]\nnetwork_mode = "no-network"\n[verifier]\nenvironment_mode = "shared"\n'
         '[verifier.environment]\nnetwork_mode = "no-network"\n',
         "environment_mode='shared' is incompatible"),
        ('artifacts = ["/app/out.txt"]\n[environment]\nnetwork_mode = "no-network"\n', "artifacts: "),
        ('artifacts = [{source = "/x", service = "db"}]\n[environment]\nnetwork_mode = "no-network"\n'
         '[verifier]\nenvironment_mode = "separate"\n', "artifacts[0].service"),
        ('[environment]\nnetwork_mode = "no-network"\n[environment.healthcheck]\ninterval = 3\n',
         "[environment].healthcheck.command"),
    ],
)  # fmt: skip
def test_what_cannot_run_here_is_refused_by_field(make_task: MakeTask, toml: str, field: str) -> None:
    from durable_rollouts.errors import TaskFileError

    with pytest.raises(TaskFileError) as e:
        load_dataset(make_task(toml=toml))
    assert field in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_the_healthcheck_parses_with_harbors_defaults() -> None:
    hc = parse('[environment.healthcheck]\ncommand = "curl -f localhost"\n').environment.healthcheck
    assert hc is not None
    assert (hc.interval_sec, hc.timeout_sec, hc.start_period_sec, hc.start_interval_sec, hc.retries) == (
        5.0, 30.0, 0.0, 5.0, 3,
    )  # fmt: skip
