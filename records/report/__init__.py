"""Run reports: one self-contained HTML file of plots per run (``rollouts report RUN -o report.html``).

``data`` reads what a report shows from the run store (no token blobs), ``svg`` draws inline-SVG charts,
``render`` lays out the page. Invariant: the file needs nothing at view time (no network, no other file).
"""

from __future__ import annotations

from pathlib import Path

from durable_rollouts.records.report.data import ReportError, RunData, load
from durable_rollouts.records.report.render import PLOTS, render
from durable_rollouts.store.runstore import RunStore


def write_report(store: RunStore, run_id: str, path: Path) -> RunData:
    """Render the run's report to ``path``; returns the data it showed.

    Raises:
        ReportError: If the store has no such run or no rollout record of it.
    """
    data = load(store, run_id)
    path.write_text(render(data), encoding="utf-8")
    return data


__all__ = ["PLOTS", "ReportError", "RunData", "load", "render", "write_report"]
