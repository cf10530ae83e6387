"""A multi-host run on one machine (faults/cluster.py): Temporal behind HAProxy verifying client certificates,
the PostgreSQL store, the simulated engine, two workers, a sandbox host (a worker with a Docker daemon of its
own) and the driver, each in a network namespace of its own with its own address.

1. TLS: the driver reaches Temporal with the cluster's client certificate; without one, and with one from
   another CA, it is refused in one line (the proxy's log says why).
2. A coding run of the bundled example (a simulated engine plays each task's reference solution; its
   sandboxes on the sandbox host's daemon, ``sandbox_pool.placement = "hosts"``) and the math example run
   (a second simulated engine on the same host, a random policy) at the same time; mid-run, worker-a and
   then the sandbox host's worker are SIGKILLed in their namespaces and restarted.
3. Then: one record per rollout slot, the ledger clean (store and Temporal, over TLS), no container of the
   run left on the sandbox host's daemon, and every namespace and process gone after teardown.

    python bench/multihost.py --out bench/results/multihost.json

Invariant: everything it starts is the cluster's and is stopped, and every namespace deleted, however it ends
(the result lists what was left behind: nothing, when it holds).
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from durable_rollouts.config.paths import resolve_path
from durable_rollouts.environments import registry
from durable_rollouts.environments.registry import env_queue
from durable_rollouts.faults.cluster import Cluster
from durable_rollouts.faults.netns import namespaces

CODING_TASKS = resolve_path("coding_env:data/coding.jsonl")
SANDBOX_IMAGE = "durable-rollouts-sandbox:latest"
QUEUE = "multihost"
RUN_ENVS = ("coding", "math")  # the plug-ins the two runs use, whose queues the workers must poll first
MATH_ENGINE_PORT = 8001
"""The math run's engine (a random policy; the coding run's plays reference solutions), same host."""
HOST_TIMEOUT_S = 60.0
"""sandbox_pool.host_timeout_s: longer than the sandbox host's restart, so its rollouts wait for it. A
rollout whose host misses 2 x host_timeout_s gives that host up for good, and with no other host it waits
for a slot until its own timeout."""


def _overrides(sets: dict[str, Any]) -> list[str]:
    return [a for k, v in sets.items() for a in ("--set", f"{k}={json.dumps(v)}")]


def _first_line(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    lines = done.stderr.strip().splitlines()
    return {"exit": done.returncode, "stderr_lines": len(lines), "line": lines[0] if lines else ""}


def tls_checks(c: Cluster) -> dict[str, Any]:
    """The right certificate reaches Temporal; none, or another CA's, is refused in one line."""
    log = c.logs / "haproxy.log"
    out: dict[str, Any] = {"with_certificate": _first_line(c.rollouts("status", "no-such-run"))}
    bare = c.env("driver")
    del bare["TEMPORAL_TLS_CLIENT_CERT_PATH"], bare["TEMPORAL_TLS_CLIENT_KEY_PATH"]
    since = log.stat().st_size
    out["without_certificate"] = _first_line(c.rollouts("status", "no-such-run", env=bare))
    rogue = ["--tls-cert-path", str(c.certs.rogue_cert), "--tls-key-path", str(c.certs.rogue_key)]
    out["certificate_of_another_ca"] = _first_line(c.rollouts("status", "no-such-run", *rogue))
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and "not trusted" not in log.read_text()[since:]:
        time.sleep(0.2)
    out["proxy_log"] = [ln for ln in log.read_text()[since:].splitlines() if "SSL" in ln]
    return out


def _count(c: Cluster, run_id: str) -> int:
    if c.sql("SELECT to_regclass('public.rollouts') IS NULL") == "t":
        return 0
    return int(c.sql(f"SELECT count(*) FROM rollouts WHERE run_id = '{run_id}'"))


def _until(c: Cluster, run_id: str, n: int, timeout: float = 600) -> int:
    deadline = time.monotonic() + timeout
    while (got := _count(c, run_id)) < n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{run_id}: {got} of {n} records within {timeout:.0f} s")
        time.sleep(0.5)
    return got


def run(args: argparse.Namespace, c: Cluster, result: dict[str, Any]) -> None:
    t0 = time.monotonic()

    def at() -> float:
        return round(time.monotonic() - t0, 1)

    c.start_temporal()
    c.start_store()
    c.start_engine("--tasks", str(CODING_TASKS), "--mode", "reference", "--max-model-len", "4096",
                   "--decode-ms-per-token", "2")  # fmt: skip
    c.start_engine("--policy", "random", "--decode-ms-per-token", "20", port=MATH_ENGINE_PORT)
    done = c.rollouts("stack", "search-attributes")
    if done.returncode != 0:
        raise RuntimeError(f"search attributes: {done.stderr.strip()}")
    result["tls"] = tls_checks(c)
    docker_url = c.start_dockerd("sandbox")
    load = subprocess.run(f"docker save {SANDBOX_IMAGE} | docker -H {docker_url} load", shell=True,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    if load.returncode != 0:
        raise RuntimeError(f"loading {SANDBOX_IMAGE} on the sandbox host: {load.stderr.strip()}")
    result["sandbox_host"] = {"docker_host": docker_url, "image": SANDBOX_IMAGE}
    host_args = ["--sandbox-host", "sbx", "--docker-host", docker_url, "--sandbox-slots", str(args.slots)]
    roles = {"worker-a": [], "worker-b": [], "sandbox": host_args}
    for name, extra in roles.items():
        c.start_worker(name, "--task-queue", QUEUE, *extra)
    versions = registry.loadable()  # the versions these workers register (the same installed plug-ins)
    queues = [env_queue(QUEUE, name, versions[name]) for name in RUN_ENVS]
    for q in queues:
        c.wait_polled(q, [w.pid for w in c.workers.values()])
    result["workers_polling_s"] = at()

    common = {"temporal.task_queue": QUEUE}
    coding = {"engine.urls": [c.engine_url], **common}
    math = {"engine.urls": [c.engine_url_at(MATH_ENGINE_PORT)], **common}
    pool = {"sandbox_pool.placement": "hosts", "sandbox_pool.initial_size": 0, "sandbox_pool.max_size": 16,
            "sandbox_pool.host_timeout_s": HOST_TIMEOUT_S}  # fmt: skip
    runs = {
        "mh-coding": ["coding", "--groups", str(args.coding_groups), "--group-size", "2",
                      *_overrides({**coding, **pool})],
        "mh-math": ["math", "--groups", str(args.math_groups), "--group-size", "4", *_overrides(math)],
    }  # fmt: skip
    drivers = {}
    for run_id, argv in runs.items():
        cmd = [sys.executable, "-m", "durable_rollouts.cli.rollouts", "run", *argv[:1], "--run-id", run_id,
               "--wait", *argv[1:]]  # fmt: skip
        drivers[run_id] = c.net.spawn("driver", cmd, env=c.env("driver"), log=c.logs / f"driver-{run_id}.log")
    totals = {"mh-coding": args.coding_groups * 2, "mh-math": args.math_groups * 4}

    kills = []
    for name, threshold in (("worker-a", 2), ("sandbox", totals["mh-coding"] // 2)):
        seen = _until(c, "mh-coding", threshold)
        c.net.stop(c.workers[name], sig=signal.SIGKILL)
        killed_at = at()
        proc = c.start_worker(name, "--task-queue", QUEUE, *roles[name])
        for q in queues:
            c.wait_polled(q, [proc.pid])
        kills.append({"part": name, "address": c.host(name).address, "signal": "SIGKILL", "at_s": killed_at,
                      "records_then": {r: _count(c, r) for r in runs}, "coding_records_seen": seen,
                      "polling_again_at_s": at()})  # fmt: skip
    result["kills"] = kills
    for run_id, proc in drivers.items():
        rc = proc.wait(900)
        if rc != 0:
            raise RuntimeError(
                f"{run_id}: rollouts run exited {rc}: {(c.logs / f'driver-{run_id}.log').read_text()[-800:]}"
            )
    result["runs_done_s"] = at()

    per_run = {}
    for run_id, total in totals.items():
        rows = c.sql(
            f"SELECT count(*), count(DISTINCT (group_id, sample_index)), count(DISTINCT group_id), "
            f"count(*) FILTER (WHERE outcome = 'completed') FROM rollouts WHERE run_id = '{run_id}'"
        ).split("|")
        outcomes = dict(
            line.split("|") for line in c.sql(
                f"SELECT outcome, count(*) FROM rollouts WHERE run_id = '{run_id}' GROUP BY outcome"
            ).splitlines()
        )  # fmt: skip
        ledger = c.rollouts("ledger", run_id, "--no-docker")
        per_run[run_id] = {
            "expected_rollouts": total, "records": int(rows[0]), "distinct_slots": int(rows[1]),
            "groups": int(rows[2]), "outcomes": {k: int(v) for k, v in outcomes.items()},
            "ledger_exit": ledger.returncode, "ledger": ledger.stdout.strip().splitlines(),
        }  # fmt: skip
    label = "label=durable-rollouts.run=mh-coding"
    left = subprocess.run(["docker", "-H", docker_url, "ps", "-aq", "--filter", label],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    per_run["mh-coding"]["containers_left_on_sandbox_host"] = len(left.stdout.split())
    result["runs"] = per_run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--coding-groups", type=int, default=8)
    p.add_argument("--math-groups", type=int, default=16)
    p.add_argument("--slots", type=int, default=4, help="sandboxes the sandbox host runs at once")
    p.add_argument("--out", type=Path, default=Path("bench/results/multihost.json"))
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="multihost-"))
    started = time.monotonic()
    c = Cluster(root, workers=("worker-a", "worker-b", "sandbox"))
    made = [c.net.switch, *(h.netns for h in c.net.hosts.values())]
    result: dict[str, Any] = {
        "command": "python bench/multihost.py " + shlex.join(sys.argv[1:]),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "switch_namespace": c.net.switch,
        "hosts": {h.name: {"netns": h.netns, "address": h.address} for h in c.net.hosts.values()},
        "temporal": {"address": c.temporal_address, "tls": "mutual (HAProxy: verify required, alpn h2)"},
        "store": c.store_url,
        "engine": c.engine_url,
    }
    try:
        run(args, c, result)
    except Exception as e:
        result["error"] = f"{type(e).__name__}: {e}"
    finally:
        result["left_behind"] = c.close()
        result["namespaces_left"] = sorted(set(made) & set(namespaces()))
        result["wall_s"] = round(time.monotonic() - started, 1)
        result["logs"] = str(c.logs)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result, indent=2))
    if "error" in result:
        sys.exit(1)


if __name__ == "__main__":
    main()
