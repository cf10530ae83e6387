"""The commands that operate on a running run (``rollouts stuck``, ``top``, ``cancel``, ``retry``,
``terminate``): thin views of ``cli.ops``, mounted on the ``rollouts`` app by ``cli.rollouts``.

Invariant: as for every ``rollouts`` command, a user mistake (an ``OpsError``) is one line and exit 2, an
unreachable service one line and exit 1.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Annotated, Any

import typer

from durable_rollouts.cli.common import run_store, temporal_client, temporal_options

if TYPE_CHECKING:
    from durable_rollouts.config.temporal import Connection


def _ops(work: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run an operating command (``cli.ops``): its OpsError is one line and exit 2."""
    from durable_rollouts.cli.ops import OpsError

    error = None
    try:
        asyncio.run(work())  # Ctrl-C (how `top` ends) propagates: exit 130 (stack.interrupt)
    except OpsError as e:
        error = str(e)  # raised below, so no traceback keeps the client alive into interpreter shutdown
    if error is not None:  # one line, exit 2 (main() leaves without finalizing: stack.procs.exit_now)
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(2)


@temporal_options
def stuck(
    run_id: str,
    for_: Annotated[str, typer.Option("--for", help="Without progress for this long (60s, 2m).")] = "60s",
    url: Annotated[bool, typer.Option("--url", help="Print only the web UI URL of this filter.")] = False,
    ui: Annotated[str, typer.Option(help="Web UI base URL.")] = "http://127.0.0.1:8233",
    conn: Connection | None = None,
) -> None:
    """List the run's rollouts without progress for --for: phase, turn, elapsed, last progress, engine,
    sandbox, and the pending call (attempt, heartbeat, last failure); one line each."""
    import time

    from durable_rollouts.cli import ops

    async def go() -> None:
        seconds = ops.parse_duration(for_)
        now = time.time()
        if url:
            typer.echo(ops.ui_url(ops.stuck_filter(run_id, now - seconds), ui))
            return
        client = await temporal_client(conn)
        rows = await ops.find_stuck(client, run_id, seconds, now)
        for r in rows:
            typer.echo(ops.format_stuck(r, now))
        typer.echo(f"{len(rows)} rollouts of run {run_id} without progress for {for_}", err=True)

    _ops(go)


@temporal_options
def top(
    run_id: str,
    interval: Annotated[float, typer.Option(help="Seconds between refreshes.")] = 1.5,
    conn: Connection | None = None,
) -> None:
    """Live view of the run's in-flight rollouts by phase and replica (Ctrl-C exits)."""
    from durable_rollouts.cli import top as live

    async def go() -> None:
        await live.top(await temporal_client(conn), run_id, interval_s=max(0.5, interval))

    _ops(go)


def _act(action: str, target: str, conn: Connection | None) -> None:
    from durable_rollouts.cli import ops

    async def go() -> None:
        client = await temporal_client(conn)
        typer.echo(await getattr(ops, action)(client, run_store(), target))

    _ops(go)


@temporal_options
def cancel(target: str, conn: Connection | None = None) -> None:
    """Cancel a running rollout (recorded cancelled, reason manual), or a whole run given its id (its
    in-flight rollouts recorded cancelled, reason run-cancelled; its groups close); logged in the store."""
    _act("cancel", target, conn)


@temporal_options
def retry(rollout_id: str, conn: Connection | None = None) -> None:
    """Run a running rollout's group slot again: it is recorded cancelled (manual-retry) and the slot
    restarts as <i>r<n+1>."""
    _act("retry", rollout_id, conn)


@temporal_options
def terminate(target: str, conn: Connection | None = None) -> None:
    """Terminate a rollout (its group records it failed, infra) or a group (the run records its members and
    the group, and counts it done); also accounts for a group terminated from the web UI."""
    _act("terminate", target, conn)


COMMANDS: list[Callable[..., None]] = [stuck, top, cancel, retry, terminate]
"""Mounted on the app in this order."""
