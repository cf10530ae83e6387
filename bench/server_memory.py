"""The Temporal dev server's memory over a long run, from the long-run benchmark's result: its RSS (the
benchmark's samples) beside its own gauges (``server_metrics``: Go heap, goroutines, the history service's
mutable-state cache), and whether the growth stops where the cache reaches its bound.

Pure: no I/O, no clock. The server reports its Go runtime gauges once a minute (its cache gauges as they
change), so its heap moves in steps while RSS is read at every sample.

Invariant: every figure is stated against rollouts recorded (the run's progress), never against time, so
runs at different speeds compare.
"""

from __future__ import annotations

import itertools
import re
from typing import Any

MIB = 1024 * 1024

CACHE = "cache_mutablestate"
"""The history service's host-level mutable-state cache: one entry per workflow execution it holds
(running or closed), bounded by its ``size`` (``history.hostLevelCacheMaxSize``)."""


def readings(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per reading of the server: rollouts, seconds, RSS and Go heap in MiB, goroutines, and the
    mutable-state cache's entries, bound and pinned entries. Readings without the server's gauges
    (endpoint not answering) are left out."""
    rss = {round(s["t"], 2): s["server_rss"] for s in result.get("samples", [])}
    out: list[dict[str, Any]] = []
    for g in result.get("server_metrics", []):
        if "heap_inuse" not in g:
            continue
        out.append(
            {
                "t": g["t"],
                "rollouts": g["rollouts"],
                "rss_mib": round(rss.get(round(g["t"], 2), 0) / MIB, 1),
                "heap_inuse_mib": round(g["heap_inuse"] / MIB, 1),
                "heap_alloc_mib": round(g.get("heap_alloc", 0.0) / MIB, 1),
                "heap_idle_mib": round(g.get("heap_idle", 0.0) / MIB, 1),
                "heap_released_mib": round(g.get("heap_released", 0.0) / MIB, 1),
                "goroutines": int(g.get("goroutines", 0)),
                "cache_entries": int(g.get(f"{CACHE}_usage", 0)),
                "cache_bound": int(g.get(f"{CACHE}_size", 0)),
                "cache_pinned": int(g.get(f"{CACHE}_pinned", 0)),
            }
        )
    return out


def slope(rows: list[dict[str, Any]], key: str) -> float | None:
    """Least-squares growth of ``key`` per 1,000 rollouts over ``rows``; None for fewer than two rows or
    no spread in rollouts."""
    if len(rows) < 2:
        return None
    xs, ys = [r["rollouts"] for r in rows], [r[key] for r in rows]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return None
    return round(1000 * sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx, 2)


def growth(rows: list[dict[str, Any]], full: float = 0.95) -> dict[str, Any]:
    """Where the memory went, before and after the mutable-state cache filled (its entries reached
    ``full`` of its bound): the reading at which it filled, and the heap's and RSS's growth per 1,000
    rollouts before and after, and over the readings of the last half of the run's rollouts (past the
    warm-up: the server's pools, the garbage collector's target). A cache-bound heap stops growing once
    the cache is full; a leak keeps its slope. {} for no readings."""
    if not rows:
        return {}
    bound = rows[-1]["cache_bound"]
    fill = next((i for i, r in enumerate(rows) if bound and r["cache_entries"] >= full * bound), None)
    before = rows if fill is None else rows[: fill + 1]
    after = [] if fill is None else rows[fill:]
    first, last = rows[0], rows[-1]
    peak = max(rows, key=lambda r: r["heap_inuse_mib"])
    late = [r for r in rows if r["rollouts"] >= last["rollouts"] / 2]
    return {
        "cache_bound_entries": bound,
        "cache_entries_last": last["cache_entries"],
        "cache_pinned_max": max(r["cache_pinned"] for r in rows),
        "cache_full_at_rollouts": rows[fill]["rollouts"] if fill is not None else None,
        "heap_inuse_mib_first_full_last": [
            first["heap_inuse_mib"],
            rows[fill]["heap_inuse_mib"] if fill is not None else None,
            last["heap_inuse_mib"],
        ],
        "heap_inuse_mib_peak": [peak["heap_inuse_mib"], peak["rollouts"]],
        "rss_mib_first_full_last": [
            first["rss_mib"],
            rows[fill]["rss_mib"] if fill is not None else None,
            last["rss_mib"],
        ],
        "goroutines_first_max_last": [
            first["goroutines"],
            max(r["goroutines"] for r in rows),
            last["goroutines"],
        ],
        "heap_inuse_mib_per_1000_rollouts_before_full": slope(before, "heap_inuse_mib"),
        "heap_inuse_mib_per_1000_rollouts_after_full": slope(after, "heap_inuse_mib"),
        "rss_mib_per_1000_rollouts_before_full": slope(before, "rss_mib"),
        "rss_mib_per_1000_rollouts_after_full": slope(after, "rss_mib"),
        "heap_inuse_mib_per_1000_rollouts_last_half": slope(late, "heap_inuse_mib"),
        "rss_mib_per_1000_rollouts_last_half": slope(late, "rss_mib"),
        "readings": len(rows),
        "rollouts_last": last["rollouts"],
    }


def charts(result: dict[str, Any]) -> list[str]:
    """SVG charts of the server's memory against rollouts recorded: RSS and Go heap (MiB), and the
    mutable-state cache's entries against its bound with the goroutines; [] without the server's gauges."""
    from durable_rollouts.records.report import svg

    rows = readings(result)
    if not rows:
        return []
    pal = svg.PALETTE

    def pts(key: str) -> list[tuple[float, float]]:
        return [(float(r["rollouts"]), float(r[key])) for r in rows]

    memory = svg.lines(
        [
            svg.Series("Temporal server RSS", pts("rss_mib"), pal[0], step=False),
            svg.Series("Go heap in use", pts("heap_inuse_mib"), pal[1], step=False),
            svg.Series("Go heap allocated (live + unswept)", pts("heap_alloc_mib"), pal[2], step=False),
        ],
        "Temporal server memory",
        "rollouts recorded",
        "MiB",
    )
    cache = svg.lines(
        [
            svg.Series("mutable-state cache entries", pts("cache_entries"), pal[0], step=False),
            svg.Series("its bound", pts("cache_bound"), pal[3], step=False),
            svg.Series("goroutines", pts("goroutines"), pal[1], right_axis=True, step=False),
        ],
        "history cache and goroutines",
        "rollouts recorded",
        "workflow executions",
        y2_axis="goroutines",
    )
    return [memory, cache]


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """The result's server memory in brief: `growth` of its `readings`, the dynamic config it ran with, and
    with a GC trace (``server_live_heap``: `live_heap`), the live heap's first, peak and last value and its
    growth per 1,000 rollouts over the run's last half."""
    live = result.get("server_live_heap") or []
    late = [r for r in live if live and r["rollouts"] >= live[-1]["rollouts"] / 2]
    return {
        "dynamic_config": result.get("setup", {}).get("temporal_dynamic_config", {}),
        **growth(readings(result)),
        **(
            {
                "live_heap_mib_first_max_last": [
                    live[0]["live_heap_mib"],
                    max(r["live_heap_mib"] for r in live),
                    live[-1]["live_heap_mib"],
                ],
                "live_heap_mib_per_1000_rollouts_last_half": slope(late, "live_heap_mib"),
            }
            if live
            else {}
        ),
    }


_GC = re.compile(r"^gc \d+ @([\d.]+)s .*?(\d+)->(\d+)->(\d+) MB, (\d+) MB goal", re.M)


def gc_trace(text: str) -> list[dict[str, float]]:
    """The Go runtime's collections from a log written with ``GODEBUG=gctrace=1``: seconds since the
    process started, the heap when the collection started, and the **live heap** it marked (what the
    process holds; RSS and heap-in-use add the garbage between collections) with the next goal, in MB."""
    return [
        {"t": float(m[1]), "heap_mb": float(m[2]), "live_mb": float(m[4]), "goal_mb": float(m[5])}
        for m in _GC.finditer(text)
    ]


def live_heap(
    gcs: list[dict[str, float]], samples: list[dict[str, Any]], offset_s: float
) -> list[dict[str, Any]]:
    """Each collection of `gc_trace` placed on the run: the rollouts recorded then (interpolated between
    the samples around it; ``offset_s``: the process's age when the run was submitted, the samples' t=0),
    with its live heap. Collections before the run or after its last sample are left out."""
    pts = sorted((s["t"], s["rollouts"]) for s in samples)
    out = []
    for g in gcs:
        t = g["t"] - offset_s
        for (t0, n0), (t1, n1) in itertools.pairwise(pts):
            if t0 <= t <= t1:
                n = n0 + (n1 - n0) * (t - t0) / (t1 - t0) if t1 > t0 else n1
                out.append({"t": round(t, 2), "rollouts": round(n), "live_heap_mib": g["live_mb"]})
                break
    return out
