"""The Temporal dev server's own view of its memory, for the long-run benchmark: its Prometheus endpoint
read beside its RSS.

`server_flags` starts the stack's dev server (``stack.stack.up``) with ``--metrics-port`` and any
``--dynamic-config-value KEY=VALUE`` given, for one benchmark run; `scrape` reads the endpoint and `parse`
keeps the gauges that say where the memory is:

- the Go runtime's (one process serves frontend, history, matching and worker; the server reports the
  process's runtime stats once per service, so the history service's copy is kept): heap allocated, heap in
  use, heap idle and released to the OS, heap objects, goroutine stacks, goroutines;
- the history service's caches: ``cache_usage`` and ``cache_size`` (the bound) per cache type (the
  mutable-state cache counts executions, the events cache bytes), and the mutable-state cache's pinned
  entries (executions a request holds, which the bound cannot evict).

Pure except `scrape` (one HTTP GET on loopback) and `server_flags` (patches the stack's dev-server command
line inside the ``with``).
"""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from durable_rollouts.stack import stack

RUNTIME = {
    "memory_heap": "heap_alloc",
    "memory_heapinuse": "heap_inuse",
    "memory_heapidle": "heap_idle",
    "memory_heapreleased": "heap_released",
    "memory_heap_objects": "heap_objects",
    "memory_stack": "stack_inuse",
    "num_goroutines": "goroutines",
}
"""Go runtime gauges of the dev server (taken from the history service's labels) -> our names."""

CACHES = {"cache_usage": "usage", "cache_size": "size", "cache_pinned_usage": "pinned"}
"""History-service cache gauges -> suffix of our name (``cache_<type>_<suffix>``)."""

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse(text: str) -> dict[str, float]:
    """The runtime and cache gauges of one Prometheus text exposition, by our names; gauges absent from
    the text are absent from the result."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if m is None or line.startswith("#"):
            continue
        name, labels, value = m.group(1), dict(_LABEL.findall(m.group(2) or "")), m.group(3)
        if name in RUNTIME and labels.get("service_name") == "history":
            out[RUNTIME[name]] = float(value)
        elif name in CACHES and labels.get("service_name") == "history" and "cache_type" in labels:
            out[f"cache_{labels['cache_type']}_{CACHES[name]}"] = float(value)
    return out


def scrape(port: int, timeout_s: float = 5.0) -> dict[str, float]:
    """The dev server's gauges now (`parse`); {} when the endpoint does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout_s) as r:
            return parse(r.read().decode())
    except OSError:
        return {}


def dynamic_config(values: Sequence[str]) -> dict[str, str]:
    """``KEY=VALUE`` strings as a mapping; a string without ``=`` is refused in one line."""
    out = {}
    for v in values:
        key, sep, value = v.partition("=")
        if not sep or not key:
            raise ValueError(f"--dynamic-config: {v!r} is not KEY=VALUE")
        out[key] = value
    return out


def extra_argv(metrics_port: int, dynamic: Mapping[str, str]) -> list[str]:
    """Flags added to ``temporal server start-dev``."""
    argv = ["--metrics-port", str(metrics_port)]
    for key, value in dynamic.items():
        argv += ["--dynamic-config-value", f"{key}={value}"]
    return argv


@contextmanager
def server_flags(metrics_port: int, dynamic: Mapping[str, str]) -> Iterator[None]:
    """Inside the ``with``, the stack's dev server starts with `extra_argv` appended."""
    original = stack.temporal_argv

    def patched(home: Path, port: int, ui_port: int, pragmas: Sequence[str] = ()) -> list[str]:
        return [*original(home, port, ui_port, pragmas), *extra_argv(metrics_port, dynamic)]

    stack.temporal_argv = patched
    try:
        yield
    finally:
        stack.temporal_argv = original
