"""Pipeline rollouts per second on each store backend: the same runs through the full durable pipeline,
one worker on a SQLite store and one on a PostgreSQL store, rounds alternating in one process.

One Temporal dev server, one simulated engine (random policy, ``--turn-ms`` per model call, so every
rollout takes exactly ``--turns`` turns and writes 2 segments per turn plus its prompt and record), and two
workers in this process, each on its own task queue and store: ``sqlite`` (a temporary home) and
``postgres`` (a local cluster, store/local_postgres.py, with its defaults: every commit flushed). Rounds
alternate (sqlite, postgres, sqlite, ...) and each backend's rate is taken over its totals.

    python bench/store_pipeline.py --out bench/results/store_pipeline.json [--groups 8 --group-size 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

from harness import pipeline_round, temporal_env

from durable_rollouts.config.load import load_config
from durable_rollouts.config.models import Config
from durable_rollouts.engines.client import EngineClient
from durable_rollouts.stack import procs
from durable_rollouts.store import open_store
from durable_rollouts.store.local_postgres import local_postgres
from durable_rollouts.workers.worker import build_worker

REPO_ROOT = Path(__file__).resolve().parent.parent  # the checkout the benchmark runs from

TASKS = REPO_ROOT / "environments" / "math" / "math_env" / "data" / "addition.jsonl"


def make_config(url: str, args: argparse.Namespace, queue: str) -> Config:
    return load_config(
        None,
        [
            f'engine.urls=["{url}"]',
            f'run.task_file="{TASKS}"',
            f"run.num_groups={args.groups}",
            f"run.group_size={args.group_size}",
            f"run.max_inflight_groups={args.groups}",
            "sampling.max_tokens=8",
            f"rollout.max_turns={args.turns}",
            "rollout.max_total_tokens=4096",
            "admission.enabled=false",
            f'temporal.task_queue="{queue}"',
        ],
    )


async def main(args: argparse.Namespace) -> dict:
    home = Path(tempfile.mkdtemp(prefix="bench-store-pipeline-"))
    port = procs.free_port()
    argv = [sys.executable, "-m", "durable_rollouts.simengine", "--port", str(port), "--policy", "random",
            "--prefill-ms", str(args.turn_ms), "--max-num-seqs", "256",
            "--num-gpu-blocks", "65536"]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    engine_pid = procs.spawn("engine", argv, home)
    seconds: dict[str, list[float]] = {"sqlite": [], "postgres": []}
    try:
        procs.wait_until(lambda: procs.http_ok(f"{url}/health"), 60, "simengine", pid=engine_pid)
        with local_postgres(procs.free_port()) as pg:
            stores = {"sqlite": open_store(home / "store"), "postgres": open_store(pg)}
            cfgs = {name: make_config(url, args, f"bench-{name}") for name in stores}
            engine = EngineClient()
            async with temporal_env() as env:
                workers = [build_worker(env.client, f"bench-{n}", s, engine) for n, s in stores.items()]
                async with workers[0], workers[1]:
                    for name in stores:  # warm-up: connections, the engine, workflow caches
                        await pipeline_round(env.client, cfgs[name], f"warmup-{name}")
                    for r in range(args.rounds):
                        for name in stores:
                            seconds[name].append(await pipeline_round(env.client, cfgs[name], f"{name}-{r}"))
            await engine.aclose()
            for name, store in stores.items():
                done = store.count_rollouts(f"{name}-0")
                assert sum(done.values()) == args.groups * args.group_size, (name, done)
                store.close()
    finally:
        procs.stop_pid(engine_pid)
    n = args.groups * args.group_size
    rps = {name: round(n * args.rounds / sum(s), 2) for name, s in seconds.items()}
    return {
        "command": "python bench/store_pipeline.py " + " ".join(sys.argv[1:]),
        "workload": {
            "rollouts_per_round": n,
            "turns_per_rollout": args.turns,
            "turn_ms": args.turn_ms,
            "rounds": args.rounds,
            "engine": "simengine, random policy, one process",
        },
        "round_s": {k: [round(x, 2) for x in v] for k, v in seconds.items()},
        "rollouts_per_s": rps,
        "ratio_postgres_over_sqlite": round(rps["postgres"] / rps["sqlite"], 3),
    }


if __name__ == "__main__":
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=fmt)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--turn-ms", type=float, default=50.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    a = parser.parse_args()
    result = asyncio.run(main(a))
    print(json.dumps(result, indent=2))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=2) + "\n")
