"""Sandbox latency benchmark: create, exec (`true`) and destroy through the Docker backend.

For each concurrency level, N sandboxes are created, each runs `true` a few times, then all are destroyed;
every phase is timed separately (p50/p95 per call, calls per second over the phase). Every container the
benchmark creates is removed before it exits, also on failure.

    python bench/sandbox_latency.py --out /tmp/sandbox_latency.json [--levels 1 8 32] [--sandboxes 32]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from durable_rollouts.sandboxes import DockerBackend, SandboxSpec

T = TypeVar("T")
R = TypeVar("R")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, help="path of the JSON report")
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 8, 32], help="thread counts")
    parser.add_argument("--sandboxes", type=int, default=32, help="sandboxes per level")
    parser.add_argument("--execs", type=int, default=4, help="`true` execs per sandbox")
    parser.add_argument("--image", default=None, help="sandbox image (default: the project's)")
    return parser.parse_args(argv)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile of `values` (q in [0, 100])."""
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


def timed_phase(pool: Executor, fn: Callable[[T], R], items: Sequence[T]) -> dict[str, Any]:
    """Run `fn` over `items` on `pool`; return per-call p50/p95 (ms) and calls per second."""
    import time

    def one(item: T) -> tuple[float, R]:
        start = time.perf_counter()
        result = fn(item)
        return time.perf_counter() - start, result

    start = time.perf_counter()
    outcomes = list(pool.map(one, items))
    wall = time.perf_counter() - start
    latencies = [latency for latency, _ in outcomes]
    return {
        "calls": len(items),
        "p50_ms": round(percentile(latencies, 50) * 1000, 1),
        "p95_ms": round(percentile(latencies, 95) * 1000, 1),
        "per_s": round(len(items) / wall, 1),
        "wall_s": round(wall, 2),
        "results": [result for _, result in outcomes],
    }


def run_level(
    backend: DockerBackend, spec: SandboxSpec, run_id: str, threads: int, sandboxes: int, execs: int
) -> dict[str, Any]:
    """Create, exec and destroy `sandboxes` sandboxes with `threads` threads; return the phase stats."""
    from concurrent.futures import ThreadPoolExecutor

    keys = [f"{run_id}/c{threads}/{i}" for i in range(sandboxes)]
    with ThreadPoolExecutor(max_workers=threads) as pool:
        created = timed_phase(pool, lambda key: backend.create(key, run_id, spec), keys)
        handles = created.pop("results")
        executed = timed_phase(pool, lambda handle: backend.exec(handle, "true"), handles * execs)
        failures = [r for r in executed.pop("results") if r.exit_code != 0]
        if failures:
            raise RuntimeError(f"{len(failures)} execs failed, first: {failures[0]}")
        destroyed = timed_phase(pool, backend.destroy, keys)
        destroyed.pop("results")
    return {"threads": threads, "create": created, "exec": executed, "destroy": destroyed}


def print_table(levels: list[dict[str, Any]]) -> None:
    header = f"{'threads':>7} | {'op':<7} | {'calls':>5} | {'p50 ms':>8} | {'p95 ms':>8} | {'calls/s':>8}"
    print(header)
    print("-" * len(header))
    for level in levels:
        for op in ("create", "exec", "destroy"):
            row = level[op]
            print(
                f"{level['threads']:>7} | {op:<7} | {row['calls']:>5} | {row['p50_ms']:>8} | "
                f"{row['p95_ms']:>8} | {row['per_s']:>8}"
            )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import os
    import platform
    import uuid

    from durable_rollouts.sandboxes import DockerBackend, SandboxSpec

    backend = DockerBackend(max_pool_size=max(args.levels) + 8)
    spec = SandboxSpec(
        memory_mb=256, workdir_size_mb=64, tmp_size_mb=16, **({"image": args.image} if args.image else {})
    )
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    try:
        levels = [run_level(backend, spec, run_id, t, args.sandboxes, args.execs) for t in args.levels]
    finally:
        leftovers = backend.reap(run_id=run_id)
    version = backend.api.version()
    report = {
        "run_id": run_id,
        "sandboxes_per_level": args.sandboxes,
        "execs_per_sandbox": args.execs,
        "spec": spec.model_dump(),
        "host": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "docker": {"version": version.get("Version"), "api": version.get("ApiVersion")},
        "levels": levels,
        "leftover_containers_reaped": len(leftovers),
    }
    print_table(levels)
    with open(args.out, "w") as fh:
        json.dump(report, fh, indent=2)
    print(f"report written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
