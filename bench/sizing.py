"""What one core of each part sustains: worker, Temporal server and PostgreSQL CPU per rollout and per turn,
measured in one sitting, and the cluster sizes they imply (docs/deployment.md, "Sizing").

One Temporal dev server (a child process, in memory), one simulated engine (random policy, so every rollout
runs exactly its ``rollout.max_turns`` turns and ends truncated), one local PostgreSQL cluster as the run
store (its defaults: every commit flushed), and one worker in this process. Two shapes of math rollouts run
one after the other: 1-turn and ``--turns``-turn. For each, CPU seconds are read from /proc before and after
the run: this process (the worker, and the submission, which is negligible), the dev server, and the
PostgreSQL cluster (its live processes plus what the postmaster has reaped from ended backends).

    python bench/sizing.py --out bench/results/sizing.json [--rollouts 256 --rollouts-long 64 --turns 10]

The cluster sizes are arithmetic on these numbers with the assumptions written beside them in the result
file (``plan``), done by ``sizing_plan.py``, which `tests/unit/bench/test_sizing_plan.py` tests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from harness import child_pids, cpu_s, pipeline_round, proc_name, temporal_env
from sizing_plan import ASSUMPTIONS, NOTES, plan

from durable_rollouts.config.load import load_config
from durable_rollouts.config.models import Config
from durable_rollouts.engines.client import EngineClient
from durable_rollouts.stack import procs
from durable_rollouts.store import open_store
from durable_rollouts.store.local_postgres import local_postgres
from durable_rollouts.workers.worker import build_worker

REPO_ROOT = Path(__file__).resolve().parent.parent  # the checkout the benchmark runs from
TASKS = REPO_ROOT / "environments" / "math" / "math_env" / "data" / "addition.jsonl"
_CLK_TCK = os.sysconf("SC_CLK_TCK")


def tree_cpu_s(root: int) -> float:
    """CPU seconds of ``root`` and its live descendants, plus what ``root`` has reaped from ended children."""
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        total += cpu_s(pid)
        todo += child_pids(pid)
    try:
        with open(f"/proc/{root}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += (int(fields[13]) + int(fields[14])) / _CLK_TCK  # cutime, cstime
    except OSError:
        pass
    return total


def make_config(url: str, rollouts: int, turns: int, queue: str) -> Config:
    groups = rollouts // 4
    return load_config(
        None,
        [
            f'engine.urls=["{url}"]',
            f'run.task_file="{TASKS}"',
            f"run.num_groups={groups}",
            "run.group_size=4",
            "run.max_inflight_groups=32",
            "sampling.max_tokens=8",
            f"rollout.max_turns={turns}",
            "rollout.max_total_tokens=8192",
            "admission.enabled=false",
            f'temporal.task_queue="{queue}"',
        ],
    )


def per_rollout(before: dict[str, float], after: dict[str, float], n: int) -> dict[str, float]:
    return {k: round(1000 * (after[k] - before[k]) / n, 2) for k in before}


async def measure(args: argparse.Namespace) -> dict:
    home = Path(tempfile.mkdtemp(prefix="bench-sizing-"))
    port = procs.free_port()
    argv = [sys.executable, "-m", "durable_rollouts.simengine", "--port", str(port), "--policy", "random",
            "--max-num-seqs", "256", "--num-gpu-blocks", "65536"]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    engine_pid = procs.spawn("engine", argv, home)
    runs: dict[str, dict] = {}
    try:
        procs.wait_until(lambda: procs.http_ok(f"{url}/health"), 60, "simengine", pid=engine_pid)
        with local_postgres(procs.free_port()) as pg:
            store = open_store(pg)
            postmaster = next(p for p in child_pids() if proc_name(p) == "postgres")
            engine = EngineClient()
            async with temporal_env() as env:
                server = next(p for p in child_pids() if proc_name(p).startswith("temporal"))
                parts = {"worker": lambda: cpu_s(), "server": lambda: cpu_s(server),
                         "postgres": lambda: tree_cpu_s(postmaster)}  # fmt: skip
                async with build_worker(env.client, "bench-sizing", store, engine):
                    await pipeline_round(env.client, make_config(url, 32, 1, "bench-sizing"), "warmup")
                    shapes = [("one_turn", args.rollouts, 1), ("long", args.rollouts_long, args.turns)]
                    for name, n, turns in shapes:
                        before = {k: f() for k, f in parts.items()}
                        t0 = time.perf_counter()
                        await pipeline_round(env.client, make_config(url, n, turns, "bench-sizing"), name)
                        wall = time.perf_counter() - t0
                        after = {k: f() for k, f in parts.items()}
                        done = store.count_rollouts(name)
                        assert sum(done.values()) == n, (name, done)
                        runs[name] = {"rollouts": n, "turns": turns, "wall_s": round(wall, 2),
                                      "rollouts_per_s": round(n / wall, 2),
                                      "cpu_ms_per_rollout": per_rollout(before, after, n),
                                      "backends_at_end": len(child_pids(postmaster))}  # fmt: skip
            await engine.aclose()
            store.close()
    finally:
        procs.stop_pid(engine_pid)
    one, long_ = runs["one_turn"]["cpu_ms_per_rollout"], runs["long"]["cpu_ms_per_rollout"]
    extra = {k: round((long_[k] - one[k]) / (args.turns - 1), 2) for k in one}
    return {"one_turn_ms": one, "per_extra_turn_ms": extra, "runs": runs}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rollouts", type=int, default=256, help="rollouts of the 1-turn run")
    p.add_argument("--rollouts-long", type=int, default=64, help="rollouts of the long run")
    p.add_argument("--turns", type=int, default=10, help="turns of each rollout of the long run")
    p.add_argument("--out", type=Path, help="results JSON")
    args = p.parse_args()
    measured = asyncio.run(measure(args))
    result = {
        "benchmark": "sizing",
        "command": "python bench/sizing.py " + " ".join(sys.argv[1:]),
        "load_average": os.getloadavg(),
        "measured": measured,
        "assumptions": ASSUMPTIONS,
        "notes": NOTES,
        "plan": plan(measured),
    }
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
