"""``rollouts top``: the run's in-flight rollouts by replica and phase, refreshed until Ctrl-C. Changes
nothing: it reads visibility (the rollouts' phase and replica search attributes), the run's ``progress``
query and the count of rollouts without progress (``cli.ops.stuck_filter``)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Iterable
from typing import Any

from temporalio.client import Client

from durable_rollouts.cli.ops import QUERY_TIMEOUT, ago, check_run, running, stuck_filter, utc
from durable_rollouts.workflows import search_attributes as sa
from durable_rollouts.workflows.run import RunWorkflow

PHASES = ("queued", "prepare", "generate", "env", "paused", "finalize")


def tally(rows: Iterable[tuple[str, str]]) -> dict[str, Counter[str]]:
    """(phase, engine) pairs -> per engine, a count by phase (what ``top`` shows)."""
    out: dict[str, Counter[str]] = {}
    for phase, engine in rows:
        out.setdefault(engine, Counter())[phase] += 1
    return out


async def inflight(client: Client, run_id: str) -> list[tuple[str, str]]:
    """(phase, engine) of every running rollout of the run, from visibility."""
    out = []
    async for w in client.list_workflows(running(run_id)):
        attrs = w.typed_search_attributes
        out.append((attrs.get(sa.PHASE) or "?", attrs.get(sa.ENGINE) or "-"))
    return out


def render_top(run_id: str, rows: list[tuple[str, str]], progress: Any, stuck: int, stuck_s: float) -> Any:
    """The ``top`` table: in-flight rollouts by replica (rows) and phase (columns), with the run's
    progress and how many are stuck in the title."""
    from rich.table import Table

    by_engine = tally(rows)
    phases = [p for p in PHASES if any(c[p] for c in by_engine.values())] + sorted(
        {p for c in by_engine.values() for p in c} - set(PHASES)
    )
    done = f"{sum(progress.outcomes.values())}/{progress.rollouts_total} done" if progress else "progress -"
    table = Table(
        title=f"run {run_id}: {len(rows)} in flight, {done}, {stuck} without progress for {ago(stuck_s)}",
        caption=f"{utc(time.time())}  (Ctrl-C exits)",
    )
    table.add_column("replica")
    for p in phases:
        table.add_column(p, justify="right")
    table.add_column("total", justify="right")
    for engine in sorted(by_engine):
        c = by_engine[engine]
        table.add_row(engine, *(str(c[p]) for p in phases), str(sum(c.values())))
    if by_engine:
        total = sum(by_engine.values(), Counter())
        table.add_row("all", *(str(total[p]) for p in phases), str(len(rows)), style="bold")
    return table


async def top(client: Client, run_id: str, interval_s: float = 1.5, stuck_s: float = 60.0) -> None:
    """Refresh the ``top`` table every ``interval_s`` until cancelled (Ctrl-C). On a terminal the table
    is redrawn in place; piped to a file or a log, every refresh is printed in turn (as ``top -b``)."""
    from rich.console import Console
    from rich.live import Live

    await check_run(client, run_id)
    run = client.get_workflow_handle(run_id)
    console = Console()
    live = Live(render_top(run_id, [], None, 0, stuck_s), console=console, auto_refresh=False)
    with live if console.is_terminal else contextlib.nullcontext():
        while True:
            rows = await inflight(client, run_id)
            try:
                progress = await run.query(RunWorkflow.progress, rpc_timeout=QUERY_TIMEOUT)
            except Exception:  # the run closed, or no worker answers
                progress = None
            stuck = (await client.count_workflows(stuck_filter(run_id, time.time() - stuck_s))).count
            table = render_top(run_id, rows, progress, stuck, stuck_s)
            if console.is_terminal:
                live.update(table, refresh=True)
            else:
                console.print(table)
            await asyncio.sleep(interval_s)
