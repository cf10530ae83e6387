"""The long-run benchmark's arithmetic and its page (bench/long_run.py measures; this file only computes).

Pure: no I/O, no clock. ``Sample`` is one reading of the running stack (time, rollouts recorded so far,
the worker's and the Temporal server's RSS and CPU seconds, the store's and Temporal's bytes on disk);
`deciles` cuts a run's samples into tenths of its rollouts (the time each tenth's last rollout was recorded
interpolated between the two samples around it) and states per tenth: rollouts/s, mean and peak RSS, CPU
share, and bytes per rollout (cumulative and marginal); `acceptance` holds those against the issue's bounds.

Invariant: a tenth is a tenth of the run's rollouts, never of its time; a quantity that needs two samples
inside a tenth (RSS mean) falls back to the sample nearest the tenth's end, so a short run still gives ten
rows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from html import escape
from typing import Any

PARTS = 10
"""Tenths of the run."""

MIN_THROUGHPUT_RATIO = 0.9
"""Last tenth's rollouts/s over the first tenth's, at least (issue 22, item 7)."""

MAX_WORKER_RSS_GROWTH = 0.20
"""Worker RSS growth after warm-up (the first tenth), below this."""

MIB = 1024 * 1024


@dataclass(frozen=True)
class Sample:
    """One reading of the stack during the run."""

    t: float
    """Seconds since the run was submitted."""
    rollouts: int
    """Rollout records in the store so far."""
    worker_rss: int
    server_rss: int
    """Resident bytes of the worker and of the Temporal dev server."""
    worker_cpu_s: float
    server_cpu_s: float
    """Their CPU seconds (user + system) since they started."""
    store_bytes: int
    """The run store's data: the pages its SQLite database uses (committed WAL frames included, free pages
    not) and its blobs."""
    temporal_bytes: int
    """The pages the Temporal dev server's SQLite database uses, likewise."""
    load1: float = 0.0
    """The machine's 1-minute load average (other processes share the CPUs)."""
    store_disk_bytes: int = 0
    temporal_disk_bytes: int = 0
    server_rss_anon: int = 0
    """The Temporal server's anonymous resident bytes (its Go heap; the rest is its mapped binary)."""
    """The same on disk: the SQLite files with their ``-wal`` and ``-shm`` (the WAL stays at its high-water
    mark between checkpoints, so this is noisy at small sizes)."""


def bounds(total: int, parts: int = PARTS) -> list[int]:
    """Rollout counts at which each part ends: ``parts`` cumulative counts, the last one ``total``."""
    if total < parts:
        raise ValueError(f"{total} rollouts cannot be cut into {parts} parts")
    return [round(total * k / parts) for k in range(1, parts + 1)]


def crossing_time(samples: list[Sample], count: int) -> float:
    """When the ``count``-th rollout was recorded, interpolated linearly between the samples around it.

    Raises:
        ValueError: no sample reached ``count``.
    """
    prev: Sample | None = None
    for s in samples:
        if s.rollouts >= count:
            if prev is None or s.rollouts == prev.rollouts:
                return s.t
            return prev.t + (s.t - prev.t) * (count - prev.rollouts) / (s.rollouts - prev.rollouts)
        prev = s
    raise ValueError(f"no sample reached {count} rollouts")


def per_rollout(nbytes: float, rollouts: int) -> float:
    """Bytes per rollout (0 for none)."""
    return nbytes / rollouts if rollouts > 0 else 0.0


def _nearest(samples: list[Sample], t: float) -> Sample:
    return min(samples, key=lambda s: abs(s.t - t))


def _at(samples: list[Sample], t: float, field: str) -> float:
    """A cumulative quantity (CPU seconds, bytes) at time ``t``, interpolated between samples."""
    prev: Sample | None = None
    for s in samples:
        if s.t >= t:
            if prev is None or s.t == prev.t:
                return float(getattr(s, field))
            a, b = float(getattr(prev, field)), float(getattr(s, field))
            return a + (b - a) * (t - prev.t) / (s.t - prev.t)
        prev = s
    return float(getattr(samples[-1], field))


def deciles(samples: list[Sample], total: int, parts: int = PARTS) -> list[dict[str, Any]]:
    """One row per part of the run's ``total`` rollouts (see the module docstring)."""
    samples = sorted(samples, key=lambda s: s.t)
    rows: list[dict[str, Any]] = []
    start_n, start_t = 0, 0.0
    for k, end_n in enumerate(bounds(total, parts), start=1):
        end_t = crossing_time(samples, end_n)
        inside = [s for s in samples if start_t <= s.t <= end_t] or [_nearest(samples, end_t)]
        wall = end_t - start_t
        n = end_n - start_n

        def delta(field: str, t0: float = start_t, t1: float = end_t) -> float:
            return _at(samples, t1, field) - _at(samples, t0, field)

        store_end, temporal_end = _at(samples, end_t, "store_bytes"), _at(samples, end_t, "temporal_bytes")
        rows.append(
            {
                "part": k,
                "rollouts_end": end_n,
                "t_end_s": round(end_t, 2),
                "wall_s": round(wall, 2),
                "rollouts_per_s": round(n / wall, 3) if wall > 0 else math.inf,
                "worker_rss_mib_mean": round(sum(s.worker_rss for s in inside) / len(inside) / MIB, 1),
                "worker_rss_mib_max": round(max(s.worker_rss for s in inside) / MIB, 1),
                "server_rss_mib_mean": round(sum(s.server_rss for s in inside) / len(inside) / MIB, 1),
                "server_rss_mib_max": round(max(s.server_rss for s in inside) / MIB, 1),
                "server_rss_anon_mib_mean": round(
                    sum(s.server_rss_anon for s in inside) / len(inside) / MIB, 1
                ),
                "load1_mean": round(sum(s.load1 for s in inside) / len(inside), 2),
                "worker_cpu_share": round(delta("worker_cpu_s") / wall, 3) if wall > 0 else 0.0,
                "server_cpu_share": round(delta("server_cpu_s") / wall, 3) if wall > 0 else 0.0,
                "worker_cpu_ms_per_rollout": round(1000 * delta("worker_cpu_s") / n, 2),
                "server_cpu_ms_per_rollout": round(1000 * delta("server_cpu_s") / n, 2),
                "store_bytes_end": int(store_end),
                "temporal_bytes_end": int(temporal_end),
                "store_disk_bytes_end": int(_at(samples, end_t, "store_disk_bytes")),
                "temporal_disk_bytes_end": int(_at(samples, end_t, "temporal_disk_bytes")),
                "store_bytes_per_rollout": round(per_rollout(store_end, end_n)),
                "temporal_bytes_per_rollout": round(per_rollout(temporal_end, end_n)),
                "store_bytes_per_rollout_marginal": round(per_rollout(delta("store_bytes"), n)),
                "temporal_bytes_per_rollout_marginal": round(per_rollout(delta("temporal_bytes"), n)),
            }
        )
        start_n, start_t = end_n, end_t
    return rows


def steady_per_rollout(rows: list[dict[str, Any]], key: str) -> float:
    """Bytes per rollout after the first tenth: the growth of ``key`` from the first tenth's end to the
    last's, over the rollouts in between (what each further rollout costs, without the fixed start-up
    bytes: schemas, the task table, Temporal's own tables)."""
    first, last = rows[0], rows[-1]
    return per_rollout(last[key] - first[key], last["rollouts_end"] - first["rollouts_end"])


def acceptance(rows: list[dict[str, Any]], retention_s: float | None = None) -> dict[str, Any]:
    """The issue's bounds against the tenths: last/first throughput, worker RSS growth after warm-up (the
    last tenth's mean RSS over the second's: the first tenth is the warm-up), and bytes per rollout. CPU
    per rollout (worker + server), last tenth over first, is the throughput's measure that other load on
    the machine does not move. With Temporal's retention (``retention_s``: closed workflows are deleted
    that long after they close), the bytes its database levels off at per rollout/s of throughput."""
    first, second, last = rows[0], rows[1], rows[-1]
    ratio = last["rollouts_per_s"] / first["rollouts_per_s"] if first["rollouts_per_s"] else 0.0
    growth = last["worker_rss_mib_mean"] / second["worker_rss_mib_mean"] - 1.0
    server = last["server_rss_mib_mean"] / second["server_rss_mib_mean"] - 1.0
    cpu = lambda r: r["worker_cpu_ms_per_rollout"] + r["server_cpu_ms_per_rollout"]  # noqa: E731
    temporal_steady = steady_per_rollout(rows, "temporal_bytes_end")
    out: dict[str, Any] = {
        "throughput_last_over_first": round(ratio, 3),
        "throughput_ok": ratio >= MIN_THROUGHPUT_RATIO,
        "load1_first_last": [first["load1_mean"], last["load1_mean"]],
        "cpu_ms_per_rollout_first_last": [round(cpu(first), 1), round(cpu(last), 1)],
        "cpu_per_rollout_last_over_first": round(cpu(last) / cpu(first), 3) if cpu(first) else 0.0,
        "worker_rss_growth_after_warmup": round(growth, 3),
        "worker_rss_ok": growth < MAX_WORKER_RSS_GROWTH,
        "server_rss_growth_after_warmup": round(server, 3),
        "store_bytes_per_rollout": last["store_bytes_per_rollout"],
        "temporal_bytes_per_rollout": last["temporal_bytes_per_rollout"],
        "store_bytes_per_rollout_steady": round(steady_per_rollout(rows, "store_bytes_end")),
        "temporal_bytes_per_rollout_steady": round(temporal_steady),
        "store_bytes_per_rollout_marginal_first_last": [
            first["store_bytes_per_rollout_marginal"],
            last["store_bytes_per_rollout_marginal"],
        ],
        "temporal_bytes_per_rollout_marginal_first_last": [
            first["temporal_bytes_per_rollout_marginal"],
            last["temporal_bytes_per_rollout_marginal"],
        ],
    }
    if retention_s:
        out["temporal_retention_s"] = retention_s
        out["temporal_bytes_held_per_rollout_per_s"] = round(temporal_steady * retention_s)
    return out


def segment_summary(segs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's segments (continue-as-new) in brief: how many, the state each carried (first, last,
    largest: flat when nothing in it grows with the run), the longest history, the workflow tasks that
    failed, and the time from a segment's last group start to its continue-as-new (no group starts then)."""
    done = [s for s in segs if s.get("last_start_to_end_s") is not None and s["status"] == "CONTINUED_AS_NEW"]
    gaps = [s["last_start_to_end_s"] for s in done]
    failures: dict[str, int] = {}
    for s in segs:
        for cause, n in s["workflow_task_failures"].items():
            failures[cause] = failures.get(cause, 0) + n
    carried = [s["carried_input_bytes"] for s in segs]
    return {
        "segments": len(segs),
        "carried_input_bytes_first_last_max": [carried[0], carried[-1], max(carried)] if carried else [],
        "history_events_max": max((s["events"] for s in segs), default=0),
        "workflow_task_failures": failures,
        "continue_as_new_gap_s_mean": round(sum(gaps) / len(gaps), 2) if gaps else None,
        "continue_as_new_gap_s_max": max(gaps, default=None),
    }


def sample_dict(s: Sample) -> dict[str, Any]:
    return asdict(s)


TABLE = (
    ("part", "tenth"),
    ("rollouts_per_s", "rollouts/s"),
    ("load1_mean", "load"),
    ("worker_rss_mib_mean", "worker MiB"),
    ("server_rss_mib_mean", "server MiB"),
    ("worker_cpu_ms_per_rollout", "worker CPU ms/rollout"),
    ("server_cpu_ms_per_rollout", "server CPU ms/rollout"),
    ("store_bytes_per_rollout", "store B/rollout"),
    ("temporal_bytes_per_rollout", "Temporal B/rollout"),
    ("rollout_history_events_mean", "rollout events"),
    ("group_history_events_mean", "group events"),
)
"""Columns of the page's table of tenths: (row key, heading)."""

RUN_SERIES = (
    ("carried_input_bytes", "run state carried (bytes)"),
    ("segment_history_events", "run segment history (events)"),
)


def _points(rows: list[dict[str, Any]], key: str) -> list[tuple[float, float]]:
    """(percent of the run, value) of every tenth that has ``key`` (in the row, or its ``run`` view)."""
    out = []
    for r in rows:
        v = r.get(key, (r.get("run") or {}).get(key))
        if isinstance(v, int | float):
            out.append((float(r["part"] * 100 // len(rows)), float(v)))
    return out


def page(result: dict[str, Any], extra: Sequence[str] = ()) -> str:
    """A self-contained HTML page of the result: its acceptance numbers, charts per tenth (throughput,
    RSS, CPU per rollout, bytes per rollout, sampled history lengths, the run's carried state; from
    records/report/svg.py), the ``extra`` charts (SVG) given and a table of the tenths."""
    from durable_rollouts.records.report import svg

    rows = result["deciles"]
    pal = svg.PALETTE

    def chart(label: str, axis: str, series: list[tuple[str, str]]) -> str:
        lines = [
            svg.Series(name, _points(rows, key), pal[i], step=False) for i, (name, key) in enumerate(series)
        ]
        return svg.lines(lines, label, "% of the run's rollouts", axis)

    charts = [
        chart("throughput", "rollouts/s", [("rollouts/s", "rollouts_per_s"), ("load average", "load1_mean")]),
        chart(
            "memory",
            "MiB",
            [("worker RSS", "worker_rss_mib_mean"), ("Temporal server RSS", "server_rss_mib_mean")],
        ),
        chart(
            "CPU",
            "CPU ms per rollout",
            [("worker", "worker_cpu_ms_per_rollout"), ("Temporal server", "server_cpu_ms_per_rollout")],
        ),
        chart(
            "bytes per rollout",
            "bytes per rollout",
            [
                ("store (this tenth)", "store_bytes_per_rollout_marginal"),
                ("Temporal (this tenth)", "temporal_bytes_per_rollout_marginal"),
            ],
        ),
        chart(
            "history",
            "events",
            [
                ("rollout history", "rollout_history_events_mean"),
                ("group history", "group_history_events_mean"),
            ],
        ),
        chart("run", "bytes / events", [(name, key) for key, name in RUN_SERIES]),
    ]
    charts += list(extra)
    acc = {
        **(result.get("acceptance") or {}),
        **result.get("segments_summary", {}),
        **{f"server {k}": v for k, v in (result.get("server_memory") or {}).items()},
    }
    items = "".join(f"<li>{escape(k)}: {escape(str(v))}</li>" for k, v in acc.items())
    head = "".join(f"<th>{escape(h)}</th>" for _, h in TABLE)
    body = "".join(
        "<tr>" + "".join(f"<td>{escape(str(r.get(k, '')))}</td>" for k, _ in TABLE) + "</tr>" for r in rows
    )
    figs = "".join(f"<figure>{c}</figure>" for c in charts)
    title = escape(f"long run: {result.get('rollouts', '?')} rollouts")
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"/>'
        f"<title>{title}</title><style>body{{font-family:sans-serif;max-width:1320px;margin:1em auto}}"
        "figure{margin:1em 0;display:inline-block} td,th{padding:2px 8px;text-align:right}"
        "</style></head><body>"
        f"<h1>{title}</h1><p><code>{escape(result.get('command', ''))}</code></p>"
        f"<ul>{items}</ul>{figs}<table><tr>{head}</tr>{body}</table></body></html>\n"
    )
