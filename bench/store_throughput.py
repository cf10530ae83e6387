"""Run-store throughput: token segments written and read per second, SQLite versus PostgreSQL, one run.

At each concurrency level, that many threads share one store object (as a worker's activity threads
do; each thread has its own connection) and together write ``--segments`` model-turn segments (``--tokens``
token ids, float32 logprobs and policy versions each, every thread on rollouts of its own), then read
each back by name. Backends, each on a fresh store:

- ``sqlite``: the embedded store in a temporary directory (WAL, ``synchronous=NORMAL``: a commit is not
  flushed to disk on its own; a power loss may drop the last commits, never corrupt the file).
- ``postgres``: a local PostgreSQL cluster (store/local_postgres.py, started and stopped by pid) with its
  defaults: every commit flushed (``synchronous_commit=on``).
- ``postgres_async``: the same cluster, a database with ``synchronous_commit=off`` (the durability
  SQLite's setting gives: the last commits may be lost on a crash, never half of one).

    python bench/store_throughput.py --out bench/results/store_throughput.json [--levels 1 8 32]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from durable_rollouts.stack.procs import free_port  # noqa: E402
from durable_rollouts.store import RunStore, Segment, model_segment, open_store  # noqa: E402
from durable_rollouts.store.local_postgres import database_url, local_postgres  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, help="path of the JSON report")
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 8, 32], help="thread counts")
    parser.add_argument("--segments", type=int, default=4096, help="segments written (and read) per level")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per segment")
    return parser.parse_args(argv)


def _segment(turn: int, tokens: int) -> Segment:
    return Segment(
        name=model_segment(turn),
        kind="model",
        turn=turn,
        start=turn * tokens,
        token_ids=[(turn * 7919 + i) % 150_000 for i in range(tokens)],
        logprobs=[-0.001 * (i % 1000) for i in range(tokens)],
        policy_versions=["v0"] * tokens,
        meta={"engine": "http://127.0.0.1:8000", "finish_reason": "stop"},
    )


def _phase(threads: int, work: Any) -> float:
    """Seconds for ``threads`` threads to run ``work(thread index)`` from a common start."""
    barrier = threading.Barrier(threads + 1)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        barrier.wait()
        try:
            work(i)
        except BaseException as e:  # re-raised below, in the main thread
            errors.append(e)

    pool = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in pool:
        t.join()
    elapsed = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return elapsed


def measure(store: RunStore, level: int, segments: int, tokens: int) -> dict[str, Any]:
    """Writes and reads per second at ``level`` threads (rollouts of this level only)."""
    per_thread = max(1, segments // level)
    segs = [_segment(turn, tokens) for turn in range(per_thread)]

    def write(i: int) -> None:
        for s in segs:
            store.put_segment(f"bench/c{level}/r{i}", s)

    def read(i: int) -> None:
        for s in segs:
            got = store.get_segment(f"bench/c{level}/r{i}", s.name)
            assert got is not None and got.token_ids == s.token_ids
        assert len(store.token_ids(f"bench/c{level}/r{i}")) == per_thread * tokens

    n = per_thread * level
    write_s = _phase(level, write)
    read_s = _phase(level, read)
    return {
        "concurrency": level,
        "segments": n,
        "write_s": round(write_s, 3),
        "read_s": round(read_s, 3),
        "writes_per_s": round(n / write_s, 1),
        "reads_per_s": round(n / read_s, 1),
    }


def _backend(name: str, store: RunStore, args: argparse.Namespace) -> dict[str, Any]:
    rows = [measure(store, level, args.segments, args.tokens) for level in args.levels]
    for r in rows:
        print(
            f"{name:15s} c={r['concurrency']:<3d}"
            f" writes/s {r['writes_per_s']:9.1f}  reads/s {r['reads_per_s']:9.1f}"
        )
    store.close()
    return {"backend": name, "store": store.location, "levels": rows}


def main(argv: list[str] | None = None) -> None:
    import psycopg

    args = parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="store-bench-") as tmp:
        results.append(_backend("sqlite", open_store(Path(tmp) / "home"), args))
        with local_postgres(free_port()) as server:
            with psycopg.connect(server, autocommit=True) as conn:
                conn.execute("CREATE DATABASE bench")
                conn.execute("CREATE DATABASE bench_async")
                conn.execute("ALTER DATABASE bench_async SET synchronous_commit = off")
                version = conn.execute("SHOW server_version").fetchone()[0]  # type: ignore[index]
            results.append(_backend("postgres", open_store(database_url(server, "bench")), args))
            results.append(_backend("postgres_async", open_store(database_url(server, "bench_async")), args))
    by = {r["backend"]: {row["concurrency"]: row for row in r["levels"]} for r in results}
    ratios = {
        f"{b}_vs_sqlite": {
            c: {
                "writes": round(by[b][c]["writes_per_s"] / by["sqlite"][c]["writes_per_s"], 2),
                "reads": round(by[b][c]["reads_per_s"] / by["sqlite"][c]["reads_per_s"], 2),
            }
            for c in args.levels
        }
        for b in ("postgres", "postgres_async")
    }
    report = {
        "command": "python bench/store_throughput.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "workload": {"segments_per_level": args.segments, "tokens_per_segment": args.tokens},
        "machine": {"cpus": _cpus(), "python": platform.python_version(), "postgres": version},
        "results": results,
        "ratios": ratios,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0))


if __name__ == "__main__":
    main()
