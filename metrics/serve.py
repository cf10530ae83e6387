"""Serving the metrics: prometheus_client's HTTP server, the Temporal SDK's runtime metrics, the in-flight
interceptor a worker installs.

Invariants:
- Off unless asked: nothing binds a port unless a port is given (in-process test workers serve nothing).
- Two endpoints per worker: ``rollouts_*`` (and the Python process collectors) on the metrics port; the
  SDK's own ``temporal_*`` series (task slots, poll and schedule-to-start latencies, sticky cache, ...)
  are served by the SDK's Rust core on its own port, from a :class:`temporalio.runtime.Runtime` that the
  worker's client must be created with (one runtime per process and port).
- ``rollouts_inflight`` is incremented when an activity starts on this worker and decremented when it
  ends, however it ends; inline env steps run inside ``generate_turn`` and count as ``generate``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from prometheus_client import REGISTRY, start_http_server
from temporalio import activity
from temporalio.runtime import PrometheusConfig, Runtime, TelemetryConfig
from temporalio.worker import ActivityInboundInterceptor, ExecuteActivityInput, Interceptor

from durable_rollouts.metrics import INFLIGHT, phase_of


@contextmanager
def serve_metrics(port: int | None, host: str = "127.0.0.1") -> Iterator[int | None]:
    """Serve the process's metrics on ``host:port`` (0 = a free port) while the block runs; yields the port
    it bound, or None (and serves nothing) when ``port`` is None."""
    if port is None:
        yield None
        return
    server, thread = start_http_server(port, addr=host, registry=REGISTRY)
    try:
        yield server.server_port
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def temporal_runtime(port: int | None, host: str = "127.0.0.1") -> Runtime | None:
    """A Temporal runtime whose SDK metrics Prometheus scrapes at ``host:port``; None when ``port`` is None
    (the client then uses the SDK's default runtime, without metrics)."""
    if port is None:
        return None
    prom = PrometheusConfig(
        bind_address=f"{host}:{port}", counters_total_suffix=True, durations_as_seconds=True
    )
    return Runtime(telemetry=TelemetryConfig(metrics=prom))


class ActivitiesInFlight(Interceptor):
    """Keeps ``rollouts_inflight{phase, activity}``: the activities executing now on this worker."""

    def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
        return _InFlight(next)


class _InFlight(ActivityInboundInterceptor):
    async def execute_activity(self, input: ExecuteActivityInput) -> Any:
        name = activity.info().activity_type
        gauge = INFLIGHT.labels(phase_of(name), name)
        gauge.inc()
        try:
            return await self.next.execute_activity(input)
        finally:
            gauge.dec()
