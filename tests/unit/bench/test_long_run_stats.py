"""The long-run benchmark's arithmetic (bench/long_run_stats.py) on synthetic samples: tenths of the
rollouts (not of the time), crossing times interpolated between samples, bytes per rollout with and
without the fixed start-up bytes, and the issue's acceptance bounds. The long run itself is not run here."""

from __future__ import annotations

import time
import xml.etree.ElementTree as ET

import pytest

from bench import server_memory, server_metrics
from bench.long_run_stats import (
    MIB,
    Sample,
    acceptance,
    bounds,
    crossing_time,
    deciles,
    page,
    per_rollout,
    segment_summary,
)


def _run(
    total: int,
    rate: float,
    *,
    slow_after: int | None = None,
    rss_growth: float = 0.0,
    step_s: float = 1.0,
) -> list[Sample]:
    """Samples every ``step_s`` of a run recording ``rate`` rollouts/s (half that once ``slow_after`` are
    recorded); the worker's RSS grows linearly by ``rss_growth`` over the run; the store holds 1 MiB plus
    2,000 bytes per rollout, Temporal 4 MiB plus 30,000; CPU 0.1 s (worker) and 0.3 s (server) per rollout."""
    out, t, n = [], 0.0, 0.0
    while True:
        k = min(total, int(n))
        out.append(
            Sample(
                t=t,
                rollouts=k,
                worker_rss=int(100 * MIB * (1 + rss_growth * k / total)),
                server_rss=200 * MIB,
                worker_cpu_s=0.1 * k,
                server_cpu_s=0.3 * k,
                store_bytes=MIB + 2_000 * k,
                temporal_bytes=4 * MIB + 30_000 * k,
                load1=1.5,
            )
        )
        if k >= total:
            return out
        t += step_s
        n += step_s * (rate / 2 if slow_after is not None and n >= slow_after else rate)


def test_bounds_are_tenths_of_the_rollouts() -> None:
    assert bounds(2000) == [200, 400, 600, 800, 1000, 1200, 1400, 1600, 1800, 2000]
    assert bounds(25)[-1] == 25 and len(bounds(25)) == 10
    with pytest.raises(ValueError, match="9 rollouts"):
        bounds(9)


def test_crossing_time_interpolates_between_the_samples_around_it() -> None:
    s = [
        Sample(0.0, 0, 0, 0, 0, 0, 0, 0),
        Sample(10.0, 100, 0, 0, 0, 0, 0, 0),
        Sample(20.0, 100, 0, 0, 0, 0, 0, 0),
    ]
    assert crossing_time(s, 50) == pytest.approx(5.0)
    assert crossing_time(s, 100) == pytest.approx(10.0)
    with pytest.raises(ValueError):
        crossing_time(s, 101)


def test_per_rollout_bytes() -> None:
    assert per_rollout(3_000, 4) == 750
    assert per_rollout(3_000, 0) == 0.0


def test_a_flat_run_is_flat_in_every_tenth_and_states_its_bytes_per_rollout() -> None:
    rows = deciles(_run(2000, 10.0), 2000)
    assert [r["part"] for r in rows] == list(range(1, 11))
    assert [r["rollouts_end"] for r in rows] == bounds(2000)
    for r in rows:
        assert r["rollouts_per_s"] == pytest.approx(10.0, rel=0.01)
        assert r["worker_cpu_ms_per_rollout"] == pytest.approx(100.0, rel=0.01)
        assert r["server_cpu_ms_per_rollout"] == pytest.approx(300.0, rel=0.01)
        assert r["store_bytes_per_rollout_marginal"] == pytest.approx(2_000, rel=0.01)
        assert r["temporal_bytes_per_rollout_marginal"] == pytest.approx(30_000, rel=0.01)
    # cumulative bytes per rollout include the fixed start-up bytes; the steady figure does not
    assert rows[-1]["store_bytes_per_rollout"] == pytest.approx(2_000 + MIB / 2000, rel=0.01)
    acc = acceptance(rows)
    assert acc["store_bytes_per_rollout_steady"] == pytest.approx(2_000, rel=0.01)
    assert acc["temporal_bytes_per_rollout_steady"] == pytest.approx(30_000, rel=0.01)
    assert acc["throughput_ok"] and acc["worker_rss_ok"]
    assert acc["throughput_last_over_first"] == pytest.approx(1.0, rel=0.02)
    assert acc["cpu_per_rollout_last_over_first"] == pytest.approx(1.0, rel=0.02)


def test_a_run_that_slows_down_or_grows_fails_the_bounds() -> None:
    slow = acceptance(deciles(_run(2000, 10.0, slow_after=1800), 2000))
    assert slow["throughput_last_over_first"] == pytest.approx(0.5, rel=0.02)
    assert not slow["throughput_ok"] and slow["worker_rss_ok"]
    leak = acceptance(deciles(_run(2000, 10.0, rss_growth=0.5), 2000))
    # the last tenth's mean RSS (~1.475x) over the second tenth's (~1.075x): growth after warm-up ~37 %
    assert leak["worker_rss_growth_after_warmup"] == pytest.approx(1.475 / 1.075 - 1, abs=0.01)
    assert leak["throughput_ok"] and not leak["worker_rss_ok"]


def test_sparse_samples_still_give_ten_rows() -> None:
    rows = deciles(_run(200, 10.0, step_s=7.0), 200)  # about three tenths per sample
    assert len(rows) == 10
    assert all(r["worker_rss_mib_mean"] == pytest.approx(100.0) for r in rows)


def test_temporal_retention_gives_the_bytes_held_per_rollout_per_s() -> None:
    acc = acceptance(deciles(_run(2000, 10.0), 2000), retention_s=86_400)
    # 30,000 bytes per rollout kept for a day: 2.592 GB per rollout/s of throughput
    assert acc["temporal_bytes_held_per_rollout_per_s"] == pytest.approx(30_000 * 86_400, rel=0.01)
    assert "temporal_bytes_held_per_rollout_per_s" not in acceptance(deciles(_run(2000, 10.0), 2000))


def test_the_page_is_well_formed_and_escapes_the_command() -> None:
    rows = deciles(_run(400, 10.0), 400)
    for r in rows:
        r["rollout_history_events_mean"] = 25.0
        r["run"] = {"carried_input_bytes": 2600, "segment_history_events": 300}
    result = {"rollouts": 400, "command": "python bench/long_run.py --run-id '<x>&'", "deciles": rows}
    result["acceptance"] = acceptance(rows)
    html = page(result)
    root = ET.fromstring(html.split("\n", 1)[1])  # the page past its doctype is XML
    svgs = root.findall(".//svg")
    assert len(svgs) == 6
    assert not any("no data" in "".join(s.itertext()) for s in svgs)  # every chart found its series
    assert len(root.findall(".//tr")) == 11  # a heading and ten tenths
    assert "--run-id &#x27;&lt;x&gt;&amp;&#x27;" in html


def _segment(i: int, status: str, carried: int, gap: float | None, failures: dict[str, int]) -> dict:
    return {
        "segment": i,
        "status": status,
        "events": 200 + i,
        "carried_input_bytes": carried,
        "workflow_task_failures": failures,
        "last_start_to_end_s": gap,
    }


def test_segment_summary_states_the_carried_state_failures_and_continue_as_new_gaps() -> None:
    segs = [
        _segment(0, "CONTINUED_AS_NEW", 2600, 4.0, {}),
        _segment(1, "CONTINUED_AS_NEW", 3700, 16.0, {"UNHANDLED_COMMAND": 3}),
        _segment(2, "CONTINUED_AS_NEW", 3000, 2.0, {"UNHANDLED_COMMAND": 1}),
        _segment(3, "COMPLETED", 3900, 30.0, {}),  # the last segment waits for its groups: not a gap
    ]
    out = segment_summary(segs)
    assert out["segments"] == 4
    assert out["carried_input_bytes_first_last_max"] == [2600, 3900, 3900]
    assert out["history_events_max"] == 203
    assert out["workflow_task_failures"] == {"UNHANDLED_COMMAND": 4}
    assert out["continue_as_new_gap_s_mean"] == pytest.approx(22.0 / 3, abs=0.01)
    assert out["continue_as_new_gap_s_max"] == 16.0
    assert segment_summary([])["segments"] == 0


EXPOSITION = """# HELP memory_heapinuse memory_heapinuse
# TYPE memory_heapinuse gauge
memory_heapinuse{service_name="frontend"} 2.3281664e+07
memory_heapinuse{service_name="history"} 2.3011328e+07
memory_heap{service_name="history"} 1.9897408e+07
num_goroutines{service_name="history"} 2326
cache_size{cache_type="mutablestate",service_name="history"} 8096
cache_usage{cache_type="mutablestate",service_name="history"} 4
cache_pinned_usage{cache_type="mutablestate",service_name="history"} 0
cache_size{cache_type="events",service_name="history"} 524288
cache_size{cache_type="nexus_endpoint_registry_readthrough",service_name="frontend"} 100
cache_requests{cache_type="events",namespace_id="x",operation="EventsCachePutEvent",service_name="history"} 2
"""
"""Lines as the dev server (Temporal 1.32) writes them: runtime gauges once per service, caches by type."""


def test_parse_keeps_the_history_services_runtime_and_cache_gauges() -> None:
    got = server_metrics.parse(EXPOSITION)
    assert got == {
        "heap_inuse": 23011328.0,  # the history service's copy, not the frontend's
        "heap_alloc": 19897408.0,
        "goroutines": 2326.0,
        "cache_mutablestate_size": 8096.0,
        "cache_mutablestate_usage": 4.0,
        "cache_mutablestate_pinned": 0.0,
        "cache_events_size": 524288.0,
    }
    assert server_metrics.parse("# only comments\n") == {}


def test_dynamic_config_values_and_the_flags_they_become() -> None:
    dyn = server_metrics.dynamic_config(["history.hostLevelCacheMaxSize=256", "a.b=x=y"])
    assert dyn == {"history.hostLevelCacheMaxSize": "256", "a.b": "x=y"}
    assert server_metrics.extra_argv(9000, dyn) == [
        "--metrics-port", "9000",
        "--dynamic-config-value", "history.hostLevelCacheMaxSize=256",
        "--dynamic-config-value", "a.b=x=y",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="--dynamic-config: 'nokey' is not KEY=VALUE"):
        server_metrics.dynamic_config(["nokey"])


def test_the_real_dev_server_takes_the_flags_and_reports_its_heap_and_cache_bound(tmp_path) -> None:
    """The stack's dev server started inside `server_flags`: its endpoint answers with the runtime gauges,
    and the mutable-state cache's bound is the dynamic config value given (not the dev server's 8096)."""
    from durable_rollouts.config.models import StackConfig
    from durable_rollouts.stack import procs, stack

    cfg = StackConfig(temporal_port=procs.free_port(), ui_port=procs.free_port(), start_timeout_s=120)
    port = procs.free_port()
    try:
        with server_metrics.server_flags(port, {"history.hostLevelCacheMaxSize": "300"}):
            stack.up(cfg, tmp_path, True, ("temporal",))
        assert stack.temporal_argv is not None and "--metrics-port" not in stack.temporal_argv(tmp_path, 1, 2)
        deadline = time.monotonic() + 60
        got = server_metrics.scrape(port)
        while not got.get("cache_mutablestate_size") and time.monotonic() < deadline:
            time.sleep(1.0)  # the history service records the cache's gauges once it has started
            got = server_metrics.scrape(port)
    finally:
        stack.down(tmp_path)
    assert got["cache_mutablestate_size"] == 300
    assert got["heap_inuse"] > 1_000_000 and got["goroutines"] > 10
    assert server_metrics.scrape(port, timeout_s=1.0) == {}  # stopped: nothing answers


def _gauges(t: float, n: int, heap_mib: float, entries: int, bound: int = 1000) -> dict:
    return {
        "t": t,
        "rollouts": n,
        "heap_inuse": heap_mib * MIB,
        "heap_alloc": heap_mib * MIB * 0.9,
        "goroutines": 4000.0,
        "cache_mutablestate_usage": float(entries),
        "cache_mutablestate_size": float(bound),
        "cache_mutablestate_pinned": 3.0,
    }


def _memory_result(leak_mib_per_1000: float) -> dict:
    """A run of 4,000 rollouts read every 100: the cache gains 1 entry per rollout up to its bound of 1,000
    and the heap 0.1 MiB per entry (20 MiB at the start), plus ``leak_mib_per_1000`` all along."""
    gauges, samples = [], []
    for i in range(41):
        n, t = 100 * i, 10.0 * i
        entries = min(n, 1000)
        heap = 20 + 0.1 * entries + leak_mib_per_1000 * n / 1000
        gauges.append(_gauges(t, n, heap, entries))
        samples.append({"t": t, "server_rss": int((heap + 100) * MIB)})
    return {"server_metrics": gauges, "samples": samples, "setup": {"temporal_dynamic_config": {}}}


def test_a_cache_bound_heap_stops_growing_when_the_cache_is_full() -> None:
    rows = server_memory.readings(_memory_result(0.0))
    assert len(rows) == 41
    assert rows[5] == {
        "t": 50.0, "rollouts": 500, "rss_mib": 170.0, "heap_inuse_mib": 70.0, "heap_alloc_mib": 63.0,
        "heap_idle_mib": 0.0, "heap_released_mib": 0.0, "goroutines": 4000, "cache_entries": 500,
        "cache_bound": 1000, "cache_pinned": 3,
    }  # fmt: skip
    out = server_memory.growth(rows)
    assert out["cache_full_at_rollouts"] == 1000  # 95 % of the bound: 950 entries, first read at 1,000
    assert out["heap_inuse_mib_first_full_last"] == [20.0, 120.0, 120.0]
    assert out["heap_inuse_mib_per_1000_rollouts_before_full"] == pytest.approx(100.0)
    assert out["heap_inuse_mib_per_1000_rollouts_after_full"] == pytest.approx(0.0)
    assert out["rss_mib_per_1000_rollouts_after_full"] == pytest.approx(0.0)
    assert out["heap_inuse_mib_per_1000_rollouts_last_half"] == pytest.approx(0.0)  # readings 2,000-4,000


def test_a_leak_keeps_its_slope_after_the_cache_is_full() -> None:
    out = server_memory.summary(_memory_result(5.0))
    assert out["heap_inuse_mib_per_1000_rollouts_after_full"] == pytest.approx(5.0)
    assert out["rss_mib_per_1000_rollouts_last_half"] == pytest.approx(5.0)
    assert out["heap_inuse_mib_first_full_last"][2] == pytest.approx(20 + 100 + 20.0)
    assert out["dynamic_config"] == {}


def test_no_gauges_no_figures_and_a_cache_never_full() -> None:
    assert server_memory.growth([]) == {}
    assert server_memory.charts({"server_metrics": [{"t": 0.0, "rollouts": 0}]}) == []
    result = _memory_result(0.0)
    result["server_metrics"] = [g for g in result["server_metrics"] if g["rollouts"] <= 800]
    result["server_metrics"].append({"t": 90.0, "rollouts": 900})  # the endpoint did not answer
    out = server_memory.growth(server_memory.readings(result))
    assert out["cache_full_at_rollouts"] is None
    assert out["heap_inuse_mib_per_1000_rollouts_after_full"] is None
    assert out["heap_inuse_mib_per_1000_rollouts_before_full"] == pytest.approx(100.0)
    assert server_memory.slope(server_memory.readings(result)[:1], "heap_inuse_mib") is None


def test_the_page_carries_the_server_memory_charts() -> None:
    rows = deciles(_run(400, 10.0), 400)
    result = {"rollouts": 400, "command": "x", "deciles": rows, **_memory_result(0.0)}
    result["server_memory"] = server_memory.summary(result)
    html = page(result, server_memory.charts(result))
    root = ET.fromstring(html.split("\n", 1)[1])
    svgs = root.findall(".//svg")
    assert len(svgs) == 8  # the six per tenth and the server's two
    assert "Temporal server memory" in html and "mutable-state cache entries" in html
    assert "server cache_full_at_rollouts: 1000" in html


_TAIL = " 3.0+5.2/412/87+0.008 ms cpu, {} MB goal, 8 MB stacks, 0 MB globals, 2 P"
GCTRACE = "\n".join(
    [
        "2026-12-07 01:50:52 start: temporal server start-dev",
        "gc 12 @25.772s 3%: 1.5+794+0.004 ms clock," + _TAIL.format("103->109->56 MB, 116"),
        'time=2026-12-07T01:51:20 level=WARN msg="something else"',
        "gc 13 @30.619s 3%: 2.5+964+0.059 ms clock," + _TAIL.format("112->119->58 MB, 122"),
        "gc 14 @90.000s 3%: 2.5+964+0.059 ms clock," + _TAIL.format("112->119->60 MB, 122"),
    ]
)
"""A dev server's log with ``GODEBUG=gctrace=1`` (Go 1.24's format), other lines between."""


def test_gc_trace_reads_the_live_heap_and_places_it_on_the_run() -> None:
    gcs = server_memory.gc_trace(GCTRACE)
    assert gcs == [
        {"t": 25.772, "heap_mb": 103.0, "live_mb": 56.0, "goal_mb": 116.0},
        {"t": 30.619, "heap_mb": 112.0, "live_mb": 58.0, "goal_mb": 122.0},
        {"t": 90.0, "heap_mb": 112.0, "live_mb": 60.0, "goal_mb": 122.0},
    ]
    samples = [{"t": 0.0, "rollouts": 0}, {"t": 10.0, "rollouts": 100}, {"t": 20.0, "rollouts": 300}]
    # the run was submitted when the server was 12 s old: the first collection at 13.77 s of the run
    # (between the 100th and 300th rollout), the second at 18.62 s, the third after the last sample
    live = server_memory.live_heap(gcs, samples, offset_s=12.0)
    assert live == [
        {"t": 13.77, "rollouts": 175, "live_heap_mib": 56.0},
        {"t": 18.62, "rollouts": 272, "live_heap_mib": 58.0},
    ]
    out = server_memory.summary({"server_live_heap": live})
    assert out["live_heap_mib_first_max_last"] == [56.0, 58.0, 58.0]
    assert out["live_heap_mib_per_1000_rollouts_last_half"] == pytest.approx(2000 / 97, abs=0.01)
    assert "live_heap_mib_first_max_last" not in server_memory.summary({})
