"""``rollouts chaos RUN...``: a seeded schedule of faults against the stack of ``$ROLLOUTS_HOME`` and the
runs named, each fault logged with its time (JSON lines: the log file and stdout), then the ledger check of
every run (exit 1 on a violation).

Network kinds (``partition:A/B``, ``latency:A``, ...) act on the parts of a cluster of network namespaces,
given as its JSON description with ``--network FILE`` (``faults.cluster.Cluster.network_file``).

Invariant: bad input (an unknown kind, a bad interval, a run not in the store, a part not in the network)
prints one ``error:`` line and exits 2 before any fault fires; a fault that cannot be injected is logged and
the schedule goes on; SIGTERM or Ctrl-C cancels the schedule and every fault in flight is healed first.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from durable_rollouts.cli.common import temporal_client, temporal_options

if TYPE_CHECKING:
    from durable_rollouts.config.temporal import Connection
    from durable_rollouts.faults.netns import Network


def _fail(msg: str, code: int = 2) -> typer.Exit:
    typer.echo(f"error: {msg}", err=True)
    return typer.Exit(code)


def _interval(text: str, what: str) -> tuple[float, float]:
    try:
        lo, _, hi = text.partition(",")
        return float(lo), float(hi or lo)
    except ValueError:
        raise _fail(f"{what} {text!r}: give LOW,HIGH seconds (e.g. 15,30)") from None


@temporal_options
def chaos_command(
    run_ids: Annotated[list[str], typer.Argument(help="Runs to target and check.")],
    kinds: Annotated[str, typer.Option(help="Comma-separated fault kinds (see faults/chaos.py).")] = (
        "worker_kill,worker_freeze,container_kill,container_pause,container_oom"
    ),
    seed: Annotated[int, typer.Option(help="Schedule seed (same seed, same schedule).")] = 0,
    duration: Annotated[float, typer.Option(help="Seconds of schedule.")] = 120.0,
    every: Annotated[str, typer.Option(help="Seconds between faults, LOW,HIGH (uniform).")] = "15,30",
    fault_s: Annotated[str, typer.Option("--fault-s", help="Fault duration, LOW,HIGH seconds.")] = "2,10",
    log: Annotated[Path | None, typer.Option(help="JSON lines log (HOME/chaos/*.jsonl).")] = None,
    image: Annotated[
        str | None, typer.Option(help="Image sandbox_create untags (default: the runs' sandbox image).")
    ] = None,
    weights: Annotated[
        Path | None, typer.Option(help="Weights publish publishes (default: the latest version's).")
    ] = None,
    wait: Annotated[float, typer.Option(help="Seconds to wait for each run to end.")] = 600.0,
    docker: Annotated[bool, typer.Option(help="Check no container of the runs is left.")] = True,
    network: Annotated[
        Path | None,
        typer.Option(help="A network of namespaces (its JSON description) whose parts network kinds name."),
    ] = None,
    conn: Connection | None = None,
) -> None:
    """Fire a seeded fault schedule at the stack and the runs, log each fault, then check the ledger."""
    from durable_rollouts.config.paths import rollouts_home
    from durable_rollouts.errors import ConfigError
    from durable_rollouts.faults.chaos import INSTANT, Chaos, check_kind
    from durable_rollouts.faults.schedule import schedule
    from durable_rollouts.sandboxes.pool import SandboxPool
    from durable_rollouts.store import open_store

    chosen = [k.strip() for k in kinds.split(",") if k.strip()]
    for k in chosen:
        try:
            check_kind(k)
        except ValueError as e:
            raise _fail(f"--kinds: {e}") from None
    net = _network(network, chosen)
    home = rollouts_home()
    try:
        store = open_store()
    except ConfigError as e:
        raise _fail(str(e)) from None
    missing = [r for r in run_ids if store.get_run(r) is None]
    if missing:
        raise _fail(f"run {missing[0]}: not in the store at {store.location}")
    try:
        plan = schedule(seed, chosen, duration, _interval(every, "--every"), _interval(fault_s, "--fault-s"),
                        instant=INSTANT)  # fmt: skip
    except ValueError as e:
        raise _fail(str(e)) from None
    log_path = log or home / "chaos" / time.strftime("%Y%m%d-%H%M%S.jsonl")

    async def go() -> bool:
        client = await temporal_client(conn)
        chaos = Chaos(home, run_ids, log_path, seed=seed, store=store, client=client, image=image,
                      weights=weights, network=net, echo=typer.echo)  # fmt: skip
        typer.echo(f"chaos: {len(plan)} faults over {duration:g} s (seed {seed}); log {log_path}")
        counts = await chaos.run(plan)
        injected = ", ".join(f"{k} {n}" for k, n in sorted(counts.items()))
        typer.echo(f"chaos: injected {injected or 'nothing'}")
        backend = None
        if docker:
            from durable_rollouts.sandboxes import DockerBackend

            backend = DockerBackend()
        reports = await chaos.ledger(wait, backend=backend, pool=SandboxPool(store))
        for rep in reports:
            for line in rep.lines():
                typer.echo(line)
        return all(rep.ok for rep in reports)

    def interrupted(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # SIGTERM cancels the schedule: each fault in flight heals on the way out

    previous = signal.signal(signal.SIGTERM, interrupted)
    try:
        ok = asyncio.run(go())
    finally:
        signal.signal(signal.SIGTERM, previous)
        if net is not None:
            net.close()
    if not ok:
        raise typer.Exit(1)


def _network(path: Path | None, kinds: list[str]) -> Network | None:
    """The network of ``--network`` (attached: its faults injected and healed, nothing else touched); a
    network kind's parts checked against it."""
    from durable_rollouts.faults import netfaults
    from durable_rollouts.faults.netns import NetnsError, Network

    net_kinds = [f for k in kinds if (f := netfaults.parse(k)) is not None]
    if path is None:
        if net_kinds:
            raise _fail(
                f"--kinds {net_kinds[0].kind}:{net_kinds[0].target}: give the network with --network FILE"
            )
        return None
    try:
        net = Network.attach(json.loads(path.read_text()))
    except (OSError, json.JSONDecodeError, NetnsError) as e:
        raise _fail(f"--network {path}: {e}") from None
    for f in net_kinds:
        try:
            f.check(net)
        except ValueError as e:
            raise _fail(f"--kinds {e}") from None
    return net
