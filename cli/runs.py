"""`rollouts runs`: the runs of this home's run store, newest first, with their state, counts and start
time (``--json`` for scripts).

Invariant: it reads the store only (``RunStore.runs``, ``count_rollouts``); Temporal is not asked, so it
answers with the stack down. A run's state is the one its run workflow wrote to the store.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:
    from durable_rollouts.store.runstore import RunStore


def run_rows(store: RunStore) -> list[dict[str, Any]]:
    """One dict per run of ``store``, newest first: the shape ``rollouts runs --json`` prints."""
    rows = []
    for run in store.runs():
        cfg = json.loads(run["config_json"]).get("run", {})
        num_groups, group_size = cfg.get("num_groups"), cfg.get("group_size")
        outcomes = dict(sorted(store.count_rollouts(run["run_id"]).items()))
        rows.append({
            "run_id": run["run_id"],
            "state": run["status"],
            "env": cfg.get("env"),
            "started_at": _iso(run["created_at"]),
            "finished_at": _iso(run["finished_at"]),
            "outcomes": outcomes,
            "rollouts_recorded": sum(outcomes.values()),
            "rollouts_total": num_groups * group_size if num_groups and group_size else None,
            "groups_done": run["groups_done"],
            "total_groups": num_groups,
        })  # fmt: skip
    return rows


def _iso(ts: float | None) -> str | None:
    return None if ts is None else datetime.fromtimestamp(ts, UTC).isoformat(timespec="seconds")


def _of(done: int, total: int | None) -> str:
    return f"{done}/{total}" if total is not None else str(done)


def format_rows(rows: list[dict[str, Any]]) -> list[str]:
    """The text table: a header and one line per run, columns aligned; start times in local time."""
    table = [("run", "state", "env", "rollouts", "groups", "started (local)", "outcomes")]
    for r in rows:
        started = datetime.fromisoformat(r["started_at"]).astimezone().strftime("%Y-%m-%d %H:%M:%S")
        outcomes = " ".join(f"{k}={v}" for k, v in r["outcomes"].items()) or "-"
        rollouts, groups = (
            _of(r["rollouts_recorded"], r["rollouts_total"]),
            _of(r["groups_done"], r["total_groups"]),
        )
        table.append((r["run_id"], r["state"], r["env"] or "-", rollouts, groups, started, outcomes))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]) - 1)]
    return [
        "  ".join([*(c.ljust(w) for c, w in zip(row, widths, strict=False)), row[-1]]).rstrip()
        for row in table
    ]


def runs_command(
    json_: Annotated[
        bool, typer.Option("--json", help="Print a JSON list instead (the same fields, times in UTC).")
    ] = False,
) -> None:
    """List the runs of this home's run store ($ROLLOUTS_STORE, else $ROLLOUTS_HOME), newest first: state,
    environment, rollouts recorded of the run's total, groups done, start time and rollouts by outcome.
    A run's state is what its run workflow wrote to the store: running (not ended in the store: in
    progress, or terminated or lost before it could end; `rollouts status RUN` asks Temporal), finished
    (every group ended), cancelled (`rollouts cancel RUN`), stopped (a streak of environment failures).
    Temporal is not asked, so it works with the stack down."""
    from durable_rollouts.cli.common import run_store
    from durable_rollouts.store import store_exists, store_url

    rows = run_rows(run_store()) if store_exists() else []
    if json_:
        typer.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        typer.echo(f"no runs in the store at {store_url()}", err=True)
        return
    for line in format_rows(rows):
        typer.echo(line)
