"""Network faults and a database restart under live runs, on a cluster of network namespaces
(faults/cluster.py: Temporal behind mutual TLS, the PostgreSQL store, simulated engines, workers, a sandbox
host's worker and its Docker daemon on a host of its own, the driver), each fault scheduled by
``rollouts chaos`` from the driver host:

1. a 30 s partition of a worker from Temporal (a math run on that worker's queue);
2. a 30 s partition of a sandbox host (its Docker daemon, over TCP) from its worker, under a coding run whose
   sandboxes live on that host;
3. a 30 s partition of the store (PostgreSQL) from a worker (a math run on that worker's queue);
4. the store's PostgreSQL server stopped and started again under a math run.

The three partitions cut disjoint pairs, so their runs (each on its own queue, worker and engine) run at the
same time, to keep the file short; the restart, which every part feels, runs alone after them. Each run
completes with one final record per rollout slot and ``rollouts chaos``'s ledger check clean, and each test
shows its fault landed mid-run: the run's engine was serving its turns when the schedule started, not all
rollouts were recorded before the fault fired, and some were recorded after it was healed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from durable_rollouts.config.paths import resolve_path
from durable_rollouts.environments import registry
from durable_rollouts.environments.registry import env_queue
from durable_rollouts.faults.cluster import ENGINE_PORT, Cluster
from durable_rollouts.faults.netns import namespaces
from tests.integration.support import cluster_missing

pytestmark = pytest.mark.integration

PARTITION_S = 30.0
RESTART_DOWN_S = 10.0
MATH_GROUPS, MATH_SIZE = 8, 4
CODING_GROUPS, CODING_SIZE = 4, 2
DOCKER_PORT = 2375
SANDBOX_IMAGE = "durable-rollouts-sandbox:latest"
CODING_TASKS = resolve_path("coding_env:data/coding.jsonl")
MATH_ENGINE = ("--policy", "random", "--decode-ms-per-token", "100")
"""A math turn: 64 tokens (median) at 100 ms each, so a fault fired a second in lands mid-turn."""


@dataclass(frozen=True)
class Part:
    """One run under one fault: its queue's worker, its engine, what chaos fires."""

    run_id: str
    queue: str
    worker: str
    engine_port: int
    kind: str
    fault_s: float


TEMPORAL = Part("nf-temporal", "nf-t", "worker-t", ENGINE_PORT, "partition:worker-t/temporal", PARTITION_S)
STORE = Part("nf-store", "nf-s", "worker-s", ENGINE_PORT + 2, "partition:worker-s/store", PARTITION_S)
SANDBOX = Part(
    "nf-sandbox", "nf-c", "sbx-worker", ENGINE_PORT + 1, "partition:sbx-worker/sandbox", PARTITION_S
)
RESTART = Part("nf-pg-restart", "nf-t", "worker-t", ENGINE_PORT, "pg_restart", RESTART_DOWN_S)


def _env_queue(p: Part) -> str:
    env = "coding" if p is SANDBOX else "math"
    return env_queue(p.queue, env, registry.loadable()[env])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if why := cluster_missing("docker"):
        pytest.skip(why)
    c = Cluster(
        tmp_path_factory.mktemp("netfaults"), workers=("worker-t", "worker-s", "sbx-worker", "sandbox")
    )
    try:
        c.start_temporal()
        c.start_store()
        registered = c.rollouts("stack", "search-attributes")
        assert registered.returncode == 0, registered.stderr
        c.start_engine(*MATH_ENGINE, port=TEMPORAL.engine_port)
        c.start_engine(*MATH_ENGINE, port=STORE.engine_port)
        c.start_engine("--tasks", str(CODING_TASKS), "--mode", "reference", "--max-model-len", "4096",
                       "--decode-ms-per-token", "20", port=SANDBOX.engine_port)  # fmt: skip
        docker = c.start_dockerd("sandbox", tcp_port=DOCKER_PORT)
        host = ["--sandbox-host", "sbx", "--docker-host", c.docker_tcp_url("sandbox", DOCKER_PORT),
                "--sandbox-slots", "8"]  # fmt: skip
        procs = {p: c.start_worker(p.worker, "--task-queue", p.queue) for p in (TEMPORAL, STORE)}
        procs[SANDBOX] = c.start_worker(SANDBOX.worker, "--task-queue", SANDBOX.queue, *host)
        # the sandbox image loads on the host's daemon while the workers start
        load = subprocess.run(f"docker save {SANDBOX_IMAGE} | docker -H {docker} load", shell=True,
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        assert load.returncode == 0, f"loading {SANDBOX_IMAGE} on the sandbox host: {load.stderr.strip()}"
        queues = {p: _env_queue(p) for p in procs}
        with ThreadPoolExecutor(len(procs)) as pool:
            for f in [pool.submit(c.wait_polled, queues[p], [proc.pid]) for p, proc in procs.items()]:
                f.result()
        yield c
    finally:
        made = c.net.made
        left = c.close()
        assert left == [] and not set(made) & set(namespaces()), left


def _engine_busy(c: Cluster, port: int) -> bool:
    """Whether the engine on ``port`` is serving turns now (its running requests, asked from the driver)."""
    url = c.engine_url_at(port)
    done = c.net.run("driver", ["curl", "-sf", "--max-time", "5", f"{url}/metrics"], timeout=15)
    for line in done.stdout.splitlines():
        if line.startswith("vllm:num_requests_running"):
            return float(line.split()[-1]) > 0
    return False


@dataclass
class Started:
    """A run and the chaos schedule aimed at it, both running (then both ended)."""

    part: Part
    total: int
    group_size: int
    driver: subprocess.Popen[bytes]
    driver_log: Path
    chaos: subprocess.Popen[bytes] | None = None
    chaos_out: Path | None = None
    chaos_log: Path | None = None


def _start_run(c: Cluster, p: Part, run_args: list[str]) -> Started:
    sets = {"temporal.task_queue": p.queue, "engine.urls": [c.engine_url_at(p.engine_port)]}
    overrides = [a for k, v in sets.items() for a in ("--set", f"{k}={json.dumps(v)}")]
    log = c.logs / f"driver-{p.run_id}.log"
    argv = [sys.executable, "-m", "durable_rollouts.cli.rollouts", "run", *run_args[:1], "--run-id", p.run_id,
            "--wait", *run_args[1:], *overrides]  # fmt: skip
    size = int(run_args[run_args.index("--group-size") + 1])
    total = int(run_args[run_args.index("--groups") + 1]) * size
    return Started(p, total, size, c.net.spawn("driver", argv, env=c.env("driver"), log=log), log)


def _start_chaos(c: Cluster, s: Started) -> None:
    """Once the run's engine serves its turns: ``rollouts chaos`` firing the part's fault a second later."""
    deadline = time.monotonic() + 120
    while not _engine_busy(c, s.part.engine_port):
        assert s.driver.poll() is None, f"the run's client exited early: {s.driver_log.read_text()[-2000:]}"
        assert time.monotonic() < deadline, f"{s.part.run_id}: its engine served no turn within 120 s"
        time.sleep(0.3)
    s.chaos_log, s.chaos_out = c.logs / f"chaos-{s.part.run_id}.jsonl", c.logs / f"chaos-{s.part.run_id}.out"
    fault = f"{s.part.fault_s:g},{s.part.fault_s:g}"
    argv = [sys.executable, "-m", "durable_rollouts.cli.rollouts", "chaos", s.part.run_id, "--kinds",
            s.part.kind, "--network", str(c.network_file), "--duration", "1.5", "--every", "1,1", "--fault-s",
            fault, "--wait", "240", "--no-docker", "--log", str(s.chaos_log)]  # fmt: skip
    s.chaos = c.net.spawn("driver", argv, env=c.env("driver"), log=s.chaos_out)


def _ended(s: Started) -> None:
    assert s.chaos is not None and s.chaos_out is not None
    rc = s.chaos.wait(360)
    out = s.chaos_out.read_text()
    assert rc == 0, out[-3000:]  # the ledger clean (store and Temporal), every fault cleared
    assert "ledger clean" in out, out[-2000:]
    assert s.driver.wait(60) == 0, s.driver_log.read_text()[-3000:]


def _check(c: Cluster, s: Started) -> str:
    """The run's records and the fault's times: one final record per slot, the fault landed mid-run; the
    chaos command's output."""
    _ended(s)
    assert s.chaos_log is not None and s.chaos_out is not None
    run_id, kind = s.part.run_id, s.part.kind
    events = [json.loads(line) for line in s.chaos_log.read_text().splitlines()]
    assert [(e["event"], e["kind"]) for e in events] == [("fired", kind), ("cleared", kind)], events
    fired, cleared = events[0]["at"], events[1]["at"]
    assert cleared - fired >= s.part.fault_s

    def count(where: str) -> int:
        return int(c.sql(f"SELECT count(*) FROM rollouts WHERE run_id = '{run_id}' AND {where}"))

    # one final record per slot; an attempt that failed for infrastructure is kept, marked superseded by the
    # slot's next attempt (rollout.infra_retries), which the ledger checked
    rows = c.sql(
        f"SELECT count(*) FILTER (WHERE extra_json::jsonb->>'superseded_by' IS NULL), "
        f"count(DISTINCT (group_id, sample_index)), count(DISTINCT group_id) "
        f"FROM rollouts WHERE run_id = '{run_id}'"
    )
    attempts = c.sql(
        f"SELECT outcome, coalesce(reason, ''), count(*) FROM rollouts WHERE run_id = '{run_id}' "
        f"GROUP BY 1, 2 ORDER BY 3 DESC"
    )
    print(f"{run_id} under {kind}: records by outcome and reason:\n{attempts}")
    assert rows == f"{s.total}|{s.total}|{s.total // s.group_size}", (rows, attempts)
    created = float(c.sql(f"SELECT created_at FROM runs WHERE run_id = '{run_id}'"))
    assert created < fired, (created, fired)
    assert count(f"finished_at < {fired}") < s.total, f"all {s.total} rollouts were recorded before the fault"
    assert count(f"finished_at > {cleared}") >= 1, "no rollout was recorded after the fault was healed"
    return s.chaos_out.read_text()


def _math_args() -> list[str]:
    return ["math", "--groups", str(MATH_GROUPS), "--group-size", str(MATH_SIZE)]


@pytest.fixture(scope="module")
def partitions(cluster: Cluster) -> dict[str, Started]:
    """The three partitions' runs, started together, each with its chaos schedule; all ended on return."""
    pool = {"sandbox_pool.placement": "hosts", "sandbox_pool.initial_size": 0, "sandbox_pool.max_size": 8,
            "sandbox_pool.host_timeout_s": 60.0}  # fmt: skip
    coding = ["coding", "--groups", str(CODING_GROUPS), "--group-size", str(CODING_SIZE)]
    coding += [a for k, v in pool.items() for a in ("--set", f"{k}={json.dumps(v)}")]
    started = {
        TEMPORAL.run_id: _start_run(cluster, TEMPORAL, _math_args()),
        STORE.run_id: _start_run(cluster, STORE, _math_args()),
        SANDBOX.run_id: _start_run(cluster, SANDBOX, coding),
    }
    for s in started.values():
        _start_chaos(cluster, s)
    for s in started.values():  # all end before any test reads them
        assert s.chaos is not None
        s.chaos.wait(360)
    return started


@pytest.mark.timeout(600)
def test_a_run_completes_across_a_30s_partition_of_its_worker_from_temporal(
    cluster: Cluster, partitions: dict[str, Started]
) -> None:
    _check(cluster, partitions[TEMPORAL.run_id])


@pytest.mark.timeout(120)
def test_a_run_completes_across_a_30s_partition_of_the_store_from_its_worker(
    cluster: Cluster, partitions: dict[str, Started]
) -> None:
    _check(cluster, partitions[STORE.run_id])


@pytest.mark.timeout(120)
def test_a_coding_run_completes_across_a_30s_partition_of_its_sandbox_host_from_its_worker(
    cluster: Cluster, partitions: dict[str, Started]
) -> None:
    _check(cluster, partitions[SANDBOX.run_id])
    label = f"label=durable-rollouts.run={SANDBOX.run_id}"
    url = cluster.docker_tcp_url("sandbox", DOCKER_PORT)
    left = cluster.net.run("driver", ["docker", "-H", url, "ps", "-aq", "--filter", label], timeout=60)
    assert left.returncode == 0 and left.stdout.split() == [], left.stdout + left.stderr


@pytest.mark.timeout(300)
def test_a_run_completes_across_a_restart_of_the_stores_postgresql(
    cluster: Cluster, partitions: dict[str, Started]
) -> None:
    """After the partitions (it needs them ended: every part feels a restart of the store)."""
    before = cluster.sql("SELECT pg_postmaster_start_time()")
    s = _start_run(cluster, RESTART, _math_args())
    _start_chaos(cluster, s)
    out = _check(cluster, s)
    assert cluster.sql("SELECT pg_postmaster_start_time()") != before  # a new server, on the same data
    assert '"target": "postgres pid' in out
    # the store's writes rode the restart out (store.db: reconnect_s): no rollout failed for the store
    where = f"run_id = '{RESTART.run_id}' AND reason LIKE '%Store%'"
    failed = cluster.sql(f"SELECT count(*) FROM rollouts WHERE {where}")
    assert failed == "0", failed
