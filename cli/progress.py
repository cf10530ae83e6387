"""Progress display for the CLI: a live bar (done/total by outcome), a final summary table and, where this
machine's store holds the run, its failures by cause (infra, environment; top reasons) and its time
decomposition (totals and shares of wall time, per environment).

Invariant: ``rollouts run --wait`` exits `ENVIRONMENT_FAILURE_EXIT` when more than the run's
``run.max_environment_failure_share`` of its rollouts failed by the environment's fault (`wait_verdict`),
so a buggy environment fails the command instead of passing as a flaky cluster.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHandle, WorkflowQueryFailedError
from temporalio.service import RPCError

from durable_rollouts.contracts.types import RunProgress
from durable_rollouts.workflows.run import RunWorkflow

if TYPE_CHECKING:
    from durable_rollouts.records.timing import Totals
    from durable_rollouts.store.runstore import RunStore

console = Console(stderr=True)

ENVIRONMENT_FAILURE_EXIT = 3
"""Exit code of ``rollouts run --wait`` for a run with too many environment failures (2 is bad input, 1 an
unreachable service)."""
CAUSES = ("environment", "infra")
"""The kinds of failure a reason starts with (``errors``: ``<kind>: <Type>: <message>``)."""


@dataclass(frozen=True)
class FailureCauses:
    """A run's failed rollouts by cause: how many per kind, and per kind its most frequent error types."""

    counts: dict[str, int] = field(default_factory=dict)
    """Kind (``environment``, ``infra``, ``other`` for a reason of neither) -> failed rollouts."""
    top: dict[str, list[tuple[str, int, str]]] = field(default_factory=dict)
    """Kind -> (error type, failed rollouts, its most frequent message), most frequent first."""


def failure_causes(reasons: dict[str, int], top: int = 3) -> FailureCauses:
    """Group failure reasons (``RunStore.failure_reasons``) by kind and error type."""
    counts: Counter[str] = Counter()
    messages: dict[tuple[str, str], Counter[str]] = {}
    for reason, n in reasons.items():
        kind, _, rest = reason.partition(": ")
        if kind not in CAUSES:
            kind, rest = "other", reason
        kind_type, _, message = rest.partition(": ")
        counts[kind] += n
        messages.setdefault((kind, kind_type), Counter())[message] += n
    ranked: dict[str, list[tuple[str, int, str]]] = {}
    for (kind, kind_type), msgs in sorted(messages.items(), key=lambda kv: -kv[1].total()):
        if len(ranked.setdefault(kind, [])) < top:
            ranked[kind].append((kind_type, msgs.total(), msgs.most_common(1)[0][0]))
    return FailureCauses(dict(counts), ranked)


def environment_failure_exit(environment_failures: int, rollouts: int, max_share: float) -> int:
    """The exit code of ``--wait``: `ENVIRONMENT_FAILURE_EXIT` when environment failures are more than
    ``max_share`` of the run's recorded rollouts (0: any at all), else 0."""
    too_many = environment_failures > 0 and environment_failures > max_share * rollouts
    return ENVIRONMENT_FAILURE_EXIT if too_many else 0


def wait_verdict(store: RunStore, run_id: str, max_share: float) -> tuple[int, str]:
    """Exit code and one line for ``rollouts run --wait`` once the run ended; the run's stored config's
    ``run.max_environment_failure_share`` applies (``max_share`` for a run the store does not hold)."""
    run = store.get_run(run_id)
    if run is not None:
        stored = json.loads(run["config_json"]).get("run", {})
        max_share = float(stored.get("max_environment_failure_share", max_share))
    causes = failure_causes(store.failure_reasons(run_id))
    n, total = causes.counts.get("environment", 0), sum(store.count_rollouts(run_id).values())
    code = environment_failure_exit(n, total, max_share)
    worst = ", ".join(f"{t} x{k}" for t, k, _ in causes.top.get("environment", []))
    return code, (
        f"run {run_id}: {n} of {total} rollouts failed by the environment ({worst}), more than "
        f"run.max_environment_failure_share={max_share:g}"
    )


def _outcomes_text(p: RunProgress) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(p.outcomes.items())) or "-"


async def _progress(handle: WorkflowHandle) -> RunProgress | None:
    """The run's progress from its query; None when no worker answers or the query fails (one line
    on stderr for the latter: a query of a closed run replays its history on a worker)."""
    try:
        return await handle.query(RunWorkflow.progress)
    except RPCError:
        return None
    except WorkflowQueryFailedError as e:
        Console(stderr=True).print(f"run {handle.id}: progress query failed: {e}")
        return None


async def follow(handle: WorkflowHandle, store: RunStore | None = None) -> RunProgress:
    """Show a progress bar until the run ends; print and return the final progress (the summary from
    ``store``, else this machine's store)."""
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
    print_summary(final, store)
    return final


def summary_table(
    p: RunProgress, groups: list[dict] | None = None, causes: FailureCauses | None = None
) -> Table:
    """Outcome counts, failures by cause (when the run's records are at hand) and reward and variance
    figures (when its group records are)."""
    table = Table(title=f"run {p.run_id}")
    table.add_column("outcome")
    table.add_column("rollouts", justify="right")
    for k, v in sorted(p.outcomes.items()):
        table.add_row(k, str(v))
    for kind, n in sorted((causes.counts if causes else {}).items()):
        table.add_row(f"failed by {kind}", str(n))
        for kind_type, count, message in causes.top.get(kind, []) if causes else []:
            table.add_row(f"  {kind_type}: {message}"[:100], str(count))
    table.add_row("total", f"{sum(p.outcomes.values())}/{p.rollouts_total}")
    table.add_row("groups", f"{p.groups_done}/{p.total_groups}")
    if p.groups_inflight and not p.done:
        table.add_row("groups in flight", str(p.groups_inflight))
    for gid, why in sorted(p.accounting.items()):  # closed without reporting: the run records them now
        table.add_row(f"accounting for {gid}", f"closed without reporting; members without a record: {why}")
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
    """Per environment (a column each, ``all`` when there are several): summed seconds of each time
    component and its share of the summed wall time (a row each), so the table reads at 80 columns."""
    from durable_rollouts.records.timing import COMPONENTS

    table = Table(title=f"run {run_id}: where the time went")
    table.add_column("summed over rollouts")  # wraps first where columns are short of room
    for env in totals:  # its name whole; one too long for the terminal folds rather than ending in "…"
        table.add_column(env, justify="right", overflow="fold", min_width=len(env))
    table.add_row("rollouts", *(str(t.rollouts) for t in totals.values()))
    table.add_row("wall", *(f"{t.wall_s:.1f}s" if t.timed else "-" for t in totals.values()))
    labels = {k: k.removesuffix("_s") for k in COMPONENTS} | {"other_s": "other (orchestration)"}
    for k, label in labels.items():
        cells = []
        for t in totals.values():
            share = t.shares()[k]
            seconds = t.other_s if k == "other_s" else t.seconds[k]
            cells.append(f"{seconds:.1f}s" + (f" {share:>4.0%}" if share is not None else ""))
        table.add_row(label, *cells)
    waits = (t.mean_trainer_wait_s for t in totals.values())
    table.add_row("trainer wait (mean)", *("-" if w is None else f"{w:.1f}s" for w in waits))
    return table


def run_totals(store: RunStore, run_id: str) -> dict[str, Totals]:
    """The run's time totals per environment (``records/timing.py``)."""
    from durable_rollouts.records.export import rollout_times
    from durable_rollouts.records.timing import totals_by_env

    return totals_by_env((row["env"], t) for row, t in rollout_times(store, run_id))


def print_summary(p: RunProgress, store: RunStore | None = None) -> None:
    """Print the summary, with failures by cause, reward figures and the time decomposition when this
    machine's store (or ``store``) holds the run."""
    from durable_rollouts.store import open_store, store_exists

    if store is None:
        store = open_store() if store_exists() else None
    causes = failure_causes(store.failure_reasons(p.run_id)) if store else None
    Console().print(summary_table(p, store.groups(p.run_id) if store else None, causes))
    totals = run_totals(store, p.run_id) if store else {}
    if totals:
        Console().print(time_table(p.run_id, totals))


async def show_status(client: Client, run_id: str) -> None:
    handle = client.get_workflow_handle_for(RunWorkflow.run, run_id)
    try:
        desc = await handle.describe()
    except RPCError as e:
        console.print(f"error: run {run_id}: {e}")
        raise SystemExit(2) from None
    p: RunProgress | None
    if desc.status == WorkflowExecutionStatus.COMPLETED:  # its result is its final progress: no replay
        p = await handle.result()
    else:
        p = await _progress(handle)
    console.print(f"run {run_id}: workflow {desc.status.name if desc.status else '?'}")
    if p is not None and p.stopped is not None:
        console.print(f"run {run_id}: stopped: {p.stopped}")
    if p is not None:
        print_summary(p)
        _print_dispatch(run_id)


def _print_dispatch(run_id: str, last: int = 5) -> None:
    """The dispatcher's latest decisions (adaptive admission), when this machine's store holds the run."""
    from durable_rollouts.store import open_store, store_exists

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
