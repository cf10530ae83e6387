"""A cluster on this machine (faults/cluster.py): Temporal behind a TLS proxy that verifies client
certificates, the PostgreSQL store, a simulated engine, two workers and the driver, each in a network
namespace of its own with its own address. The example math run completes while each worker is SIGKILLed
in its namespace and restarted, one record per rollout and the ledger clean; a client without a
certificate, or with one from another CA, is refused in one line; everything made is gone at the end."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import math_env
import pytest

from durable_rollouts.environments.registry import env_queue
from durable_rollouts.faults.cluster import DEV_PORT, STORE_PORT, TLS_PORT, Cluster
from durable_rollouts.faults.netns import namespaces
from tests.integration.support import cluster_missing

pytestmark = pytest.mark.integration

RUN = "multihost"
GROUPS, SIZE = 12, 4


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if why := cluster_missing():
        pytest.skip(why)
    c = Cluster(tmp_path_factory.mktemp("multihost"))
    try:
        c.start_temporal()
        c.start_store()
        c.start_engine("--policy", "random", "--decode-ms-per-token", "60")
        registered = c.rollouts("stack", "search-attributes")  # over mutual TLS, by the temporal CLI
        assert registered.returncode == 0, registered.stderr
        yield c
    finally:
        made = c.net.made
        left = c.close()
        assert left == [] and not set(made) & set(namespaces()), left


def test_each_part_is_a_host_reached_only_by_its_address(cluster: Cluster) -> None:
    hosts = cluster.net.hosts
    assert len({h.address for h in hosts.values()}) == len(hosts) == 6
    assert {h.netns for h in hosts.values()} <= set(namespaces())
    temporal, store = hosts["temporal"].address, hosts["store"].address
    assert cluster.reachable("worker-a", temporal, TLS_PORT) and cluster.reachable(
        "worker-a", store, STORE_PORT
    )
    assert not cluster.reachable("driver", temporal, DEV_PORT)  # the dev server only behind the proxy
    assert cluster.reachable("temporal", "127.0.0.1", DEV_PORT)
    assert not cluster.reachable("driver", "127.0.0.1", TLS_PORT)  # each host its own loopback


def _one_line(done_stderr: str) -> str:
    lines = done_stderr.strip().splitlines()
    assert len(lines) == 1, done_stderr
    return lines[0]


def _proxy_logs(cluster: Cluster, since: int, text: str) -> str:
    """The proxy's log from byte ``since`` once it holds ``text`` (HAProxy writes its line about a refused
    handshake after the client has given up, so this waits for it)."""
    log = cluster.logs / "haproxy.log"
    deadline = time.monotonic() + 20
    while text not in (new := log.read_text()[since:]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return new


def test_a_missing_or_wrong_client_certificate_is_refused_in_one_line(cluster: Cluster) -> None:
    reached = cluster.rollouts("status", "no-such-run")
    assert reached.returncode == 2 and "not found" in _one_line(reached.stderr), reached.stderr
    log = cluster.logs / "haproxy.log"

    bare = cluster.env("driver")
    del bare["TEMPORAL_TLS_CLIENT_CERT_PATH"], bare["TEMPORAL_TLS_CLIENT_KEY_PATH"]
    since = log.stat().st_size
    missing = cluster.rollouts("status", "no-such-run", env=bare)
    line = _one_line(missing.stderr)
    assert missing.returncode == 1 and line.startswith("error: cannot reach Temporal at"), line
    assert "TLS" in line
    proxy = _proxy_logs(cluster, since, "SSL handshake failure")
    assert "SSL handshake failure" in proxy, proxy

    since = log.stat().st_size
    rogue = cluster.rollouts(
        "status", "no-such-run", "--tls-cert-path", str(cluster.certs.rogue_cert),
        "--tls-key-path", str(cluster.certs.rogue_key),
    )  # fmt: skip
    line = _one_line(rogue.stderr)
    # TLS 1.3: the client may see the proxy's alert (UnknownCA) or only the stream closing; the proxy says why
    assert rogue.returncode == 1 and line.startswith("error: cannot reach Temporal at"), line
    proxy = _proxy_logs(cluster, since, "SSL client certificate not trusted")
    assert "SSL client certificate not trusted" in proxy, proxy

    unreadable = cluster.rollouts("status", "no-such-run", "--tls-cert-path", "/nonexistent/client.pem")
    line = _one_line(unreadable.stderr)
    assert unreadable.returncode == 2 and "/nonexistent/client.pem" in line, line


def _recorded(cluster: Cluster) -> int:
    """Records of the run so far (0 before the first worker has made the store's tables)."""
    if cluster.sql("SELECT to_regclass('public.rollouts') IS NULL") == "t":
        return 0
    return int(cluster.sql(f"SELECT count(*) FROM rollouts WHERE run_id = '{RUN}'"))


def _until_recorded(cluster: Cluster, n: int, driver: subprocess.Popen[bytes], log: Path) -> int:
    deadline = time.monotonic() + 120
    while (got := _recorded(cluster)) < n:
        assert time.monotonic() < deadline, f"{got} of {n} rollouts recorded within 120 s"
        assert driver.poll() is None, f"the run's client exited early: {log.read_text()[-2000:]}"
        time.sleep(0.3)
    return got


@pytest.mark.timeout(300)
def test_the_example_math_run_completes_across_worker_kills_with_the_ledger_clean(cluster: Cluster) -> None:
    queue = "multihost"
    math_queue = env_queue(queue, "math", math_env.ENV_VERSION)
    for name in ("worker-a", "worker-b"):
        cluster.start_worker(name, "--task-queue", queue)
    cluster.wait_polled(math_queue, [w.pid for w in cluster.workers.values()])
    sets = {"engine.urls": [cluster.engine_url], "temporal.task_queue": queue}
    overrides = [a for k, v in sets.items() for a in ("--set", f"{k}={json.dumps(v)}")]
    argv = ["run", "math", "--run-id", RUN, "--groups", str(GROUPS), "--group-size", str(SIZE), "--wait"]
    driver_log = cluster.logs / "driver-run.log"
    driver = cluster.net.spawn(
        "driver", [sys.executable, "-m", "durable_rollouts.cli.rollouts", *argv, *overrides],
        env=cluster.env("driver"), log=driver_log,
    )  # fmt: skip
    total, kills = GROUPS * SIZE, []
    for name, at in (("worker-a", 4), ("worker-b", total // 2)):
        seen = _until_recorded(cluster, at, driver, driver_log)
        cluster.net.stop(cluster.workers[name], sig=signal.SIGKILL)
        kills.append((name, seen))
        cluster.wait_polled(math_queue, [cluster.start_worker(name, "--task-queue", queue).pid])
    assert driver.wait(240) == 0, driver_log.read_text()[-3000:]
    assert all(seen < total for _, seen in kills), kills  # each kill landed in the live run

    rows = cluster.sql(
        f"SELECT count(*), count(DISTINCT (group_id, sample_index)), count(DISTINCT group_id) "
        f"FROM rollouts WHERE run_id = '{RUN}'"
    )
    assert rows == f"{total}|{total}|{GROUPS}", rows
    assert int(cluster.sql(f"SELECT count(*) FROM groups WHERE run_id = '{RUN}'")) == GROUPS
    ledger = cluster.rollouts("ledger", RUN, "--no-docker")  # the store's rules and Temporal's, over TLS
    assert ledger.returncode == 0, ledger.stdout + ledger.stderr
    assert f"ledger clean ({GROUPS} groups, {total} records" in ledger.stdout, ledger.stdout
