"""Rollouts per second: the full durable pipeline vs a bare asyncio loop, same vLLM server, same work.

Both sides run the same math rollouts (render prompt via /tokenize, one token-in/token-out call, detokenize,
verify) at the same concurrency against one vLLM-CPU engine serving the bundled policy. The pipeline side
adds everything durability costs: a real Temporal dev server, workflows, activities, the run store.
Rounds alternate (bare, pipeline, bare, ...) in one process, and the ratio is taken over the totals.
With ``--batched`` each round also runs the pipeline with ``group.batch_rollouts`` (a group's rollouts in
one activity), after the default pipeline, and its ratio to the bare loop is reported beside the default's.

    python bench/pipeline_vs_bare.py --groups 16 --group-size 4 --rounds 2 --out bench/results/pipeline.json
    python bench/pipeline_vs_bare.py --batched --out bench/results/pipeline_batched.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path

from harness import bare_round, pipeline_round, temporal_env

from durable_rollouts.config.load import load_config
from durable_rollouts.config.models import StackConfig
from durable_rollouts.engines.client import EngineClient
from durable_rollouts.environments.tasks import load_tasks
from durable_rollouts.stack import procs
from durable_rollouts.store.runstore import RunStore
from durable_rollouts.workers.worker import build_worker

REPO_ROOT = Path(__file__).resolve().parent.parent  # the checkout the benchmark runs from

TASKS = REPO_ROOT / "environments" / "math" / "math_env" / "data" / "addition.jsonl"


async def main(args: argparse.Namespace) -> dict:
    home = Path(tempfile.mkdtemp(prefix="bench-pipeline-"))
    stack = StackConfig(engine_port=procs.free_port(), model_dir=str(REPO_ROOT / "engines" / "tiny-policy"))
    url = f"http://127.0.0.1:{stack.engine_port}"
    pid = procs.spawn("engine", procs.engine_argv(stack), home, env=procs.engine_env(stack))
    n = args.groups * args.group_size
    cfg = load_config(
        None,
        [
            f'engine.urls=["{url}"]',
            f'run.task_file="{TASKS}"',
            f"run.num_groups={args.groups}",
            f"run.group_size={args.group_size}",
            f"run.max_inflight_groups={args.groups}",
            "sampling.max_tokens=8",
            'temporal.task_queue="bench"',
        ],
    )
    batched = cfg.model_copy(update={"group": cfg.group.model_copy(update={"batch_rollouts": True})})
    bare_s: list[float] = []
    pipe_s: list[float] = []
    batch_s: list[float] = []
    try:
        procs.wait_until(lambda: procs.http_ok(f"{url}/health"), 300, "vLLM", pid=pid)
        procs.set_weight_version(url, "v0")
        tasks = load_tasks(TASKS, "math")
        engine = EngineClient()
        async with temporal_env() as env, build_worker(env.client, "bench", RunStore(home / "store"), engine):
            await bare_round(engine, url, cfg, tasks, "warmup")  # first requests compile kernels
            for r in range(args.rounds):
                bare_s.append((await bare_round(engine, url, cfg, tasks, f"bare-{r}"))[0])
                pipe_s.append(await pipeline_round(env.client, cfg, f"pipe-{r}"))
                if args.batched:
                    batch_s.append(await pipeline_round(env.client, batched, f"batched-{r}"))
        await engine.aclose()
    finally:
        procs.stop_pid(pid)
    bare_rps = n * args.rounds / sum(bare_s)
    pipe_rps = n * args.rounds / sum(pipe_s)
    out = {
        "rollouts_per_round": n,
        "rounds": args.rounds,
        "bare_s": bare_s,
        "pipeline_s": pipe_s,
        "bare_rollouts_per_s": round(bare_rps, 2),
        "pipeline_rollouts_per_s": round(pipe_rps, 2),
        "ratio_pipeline_over_bare": round(pipe_rps / bare_rps, 3),
    }
    if batch_s:
        batch_rps = n * args.rounds / sum(batch_s)
        out |= {
            "batched_s": batch_s,
            "batched_rollouts_per_s": round(batch_rps, 2),
            "ratio_batched_over_bare": round(batch_rps / bare_rps, 3),
        }
    return out


if __name__ == "__main__":
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=fmt)
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--batched", action="store_true", help="also run the pipeline with group.batch_rollouts"
    )
    parser.add_argument("--out", type=Path, default=None)
    a = parser.parse_args()
    result = asyncio.run(main(a))
    print(json.dumps(result, indent=2))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=2) + "\n")
