"""Progress display for the CLI: a live bar (done/total by outcome), a final summary table and, where this
machine's store holds the run, its time decomposition (totals and shares of wall time, per environment).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from temporalio.client import Client, WorkflowHandle
from temporalio.service import RPCError

from contracts.types import RunProgress
from workflows.run import RunWorkflow

if TYPE_CHECKING:
    from records.timing import Totals
    from store.runstore import RunStore

console = Console(stderr=True)


def _outcomes_text(p: RunProgress) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(p.outcomes.items())) or "-"


async def _progress(handle: WorkflowHandle) -> RunProgress | None:
    try:
        return await handle.query(RunWorkflow.progress)
    except RPCError:
        return None


async def follow(handle: WorkflowHandle) -> RunProgress:
    """Show a progress bar until the run ends; print and return the final progress."""
    result_task = asyncio.ensure_future(handle.result())
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("rollouts", total=None)
        while not result_task.done():
            p = await _progress(handle)
            if p is not None:
                done = sum(p.outcomes.values())
                bar.update(task, total=p.rollouts_total, completed=done, description=_outcomes_text(p))
            await asyncio.wait({result_task}, timeout=0.5)
    final = result_task.result()
    print_summary(final)
    return final


def summary_table(p: RunProgress, groups: list[dict] | None = None) -> Table:
    """Outcome counts, and (when the run's group records are at hand) reward and variance figures."""
    table = Table(title=f"run {p.run_id}")
    table.add_column("outcome")
    table.add_column("rollouts", justify="right")
    for k, v in sorted(p.outcomes.items()):
        table.add_row(k, str(v))
    table.add_row("total", f"{sum(p.outcomes.values())}/{p.rollouts_total}")
    table.add_row("groups", f"{p.groups_done}/{p.total_groups}")
    if p.cap is not None:
        table.add_row("admission cap (rollouts)", str(p.cap))
    if p.admission_cancelled:
        table.add_row("cancelled for admission", f"{p.admission_cancelled} ({p.wasted_tokens} tokens wasted)")
    if p.stopped is not None:
        table.add_row("stopped", p.stopped)
    if p.breaker is not None or p.breaker_opened:
        table.add_row("circuit breaker", p.breaker or f"closed (opened {p.breaker_opened}x)")
    if groups:
        scored = [(g["reward_mean"], g["scorable"]) for g in groups if g["reward_mean"] is not None]
        n = sum(k for _, k in scored)
        if n:
            table.add_row("mean reward", f"{sum(m * k for m, k in scored) / n:.3f}")
        table.add_row("zero-variance groups", f"{sum(1 for g in groups if g['zero_variance'])}/{len(groups)}")
    return table


def time_table(run_id: str, totals: dict[str, Totals]) -> Table:
    """Per environment: summed seconds of each time component and its share of the summed wall time."""
    from records.timing import COMPONENTS

    table = Table(title=f"run {run_id}: where the time went")
    table.add_column("env")
    table.add_column("rollouts", justify="right")
    table.add_column("wall", justify="right")
    for k in (*COMPONENTS, "other_s"):
        table.add_column(k.removesuffix("_s"), justify="right")
    table.add_column("trainer wait (mean)", justify="right")
    for env, t in totals.items():
        shares = t.shares()
        vals = {**t.seconds, "other_s": t.other_s}
        cells = [
            f"{vals[k]:.1f}s" + (f" {shares[k]:.0%}" if shares[k] is not None else "")
            for k in (*COMPONENTS, "other_s")
        ]
        wait = t.mean_trainer_wait_s
        wall = f"{t.wall_s:.1f}s" if t.timed else "-"
        table.add_row(env, str(t.rollouts), wall, *cells, "-" if wait is None else f"{wait:.1f}s")
    return table


def run_totals(store: RunStore, run_id: str) -> dict[str, Totals]:
    """The run's time totals per environment (``records/timing.py``)."""
    from records.export import rollout_times
    from records.timing import totals_by_env

    return totals_by_env((row["env"], t) for row, t in rollout_times(store, run_id))


def print_summary(p: RunProgress) -> None:
    """Print the summary, with reward figures and the time decomposition when this machine's store holds
    the run."""
    from store import open_store, store_exists

    store = open_store() if store_exists() else None
    Console().print(summary_table(p, store.groups(p.run_id) if store else None))
    totals = run_totals(store, p.run_id) if store else {}
    if totals:
        Console().print(time_table(p.run_id, totals))


async def show_status(client: Client, run_id: str) -> None:
    handle = client.get_workflow_handle(run_id)
    try:
        desc = await handle.describe()
    except RPCError as e:
        console.print(f"error: run {run_id}: {e}")
        raise SystemExit(2) from None
    p = await _progress(handle)
    console.print(f"run {run_id}: workflow {desc.status.name if desc.status else '?'}")
    if p is not None and p.stopped is not None:
        console.print(f"run {run_id}: stopped: {p.stopped}")
    if p is not None:
        print_summary(p)
        _print_dispatch(run_id)


def _print_dispatch(run_id: str, last: int = 5) -> None:
    """The dispatcher's latest decisions (adaptive admission), when this machine's store holds the run."""
    from store import open_store, store_exists

    log = open_store().dispatch_log(run_id)[-last:] if store_exists() else []
    for e in log:
        usage = "-" if e["kv_usage"] is None else f"{e['kv_usage']:.2f}"
        pool = e.get("pool")
        pool_text = f" pool {pool['in_use']}/{pool['ready']}+{pool['starting']}" if pool else ""
        why = "; ".join(e["reasons"]) or "-"
        console.print(
            f"poll {e['seq']}: cap {e['cap']} inflight {e['inflight']} admitted {e['admitted']} "
            f"cancelled {e['cancelled']} kv {usage}{pool_text}: {why}"
        )
