"""Rollouts per second: the full durable pipeline vs a bare asyncio loop, same vLLM server, same work.

Both sides run the same math rollouts (render prompt via /tokenize, one token-in/token-out call, detokenize,
verify) at the same concurrency against one vLLM-CPU engine serving the bundled policy. The pipeline side
adds everything durability costs: a real Temporal dev server, workflows, activities, the run store.
Rounds alternate (bare, pipeline, bare, ...) in one process, and the ratio is taken over the totals; each
pipeline round is one run, and each driver has one untimed warm-up round first.
With ``--batched`` each round also runs the pipeline with ``group.batch_rollouts`` (a group's rollouts in
one activity), after the default pipeline, and its ratio to the bare loop is reported beside the default's;
``--no-default`` leaves the default pipeline out, ``--variant NAME:KEY=VALUE,...`` adds another pipeline.

Shape: by default every group of a round is in flight at once (``--groups`` of ``--group-size``), so a
round is one burst and the pipeline's round also holds its run's start and end. ``--inflight-groups N``
keeps N groups in flight in both drivers (the run's ``run.max_inflight_groups``, the bare loop's gate), so
a round of more groups measures the steady state: groups turning over in their slots.

``--profile [INTERVAL_S]`` adds, per round, the CPU seconds of this process (the bare loop, or the worker),
the Temporal server and the engine, the engine's request latencies (and, every INTERVAL_S, its requests
running; 0: none, as each sample costs the engine CPU) and, for batched rounds, the run's timeline
(bench/pipeline_profile.py).

    python bench/pipeline_vs_bare.py --groups 16 --group-size 4 --rounds 2 --out bench/results/pipeline.json
    python bench/pipeline_vs_bare.py --batched --out bench/results/pipeline_batched.json
    python bench/pipeline_vs_bare.py --groups 64 --inflight-groups 16 --batched --no-default --profile 0
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from collections.abc import Awaitable
from pathlib import Path

from harness import bare_round, child_pids, cpu_s, pipeline_round, proc_name, temporal_env
from pipeline_profile import Occupancy, batched_timeline, tree_cpu_s
from temporalio.testing import WorkflowEnvironment

from durable_rollouts.config.load import load_config
from durable_rollouts.config.models import StackConfig
from durable_rollouts.engines.client import EngineClient
from durable_rollouts.environments.tasks import load_tasks
from durable_rollouts.stack import procs
from durable_rollouts.store.runstore import RunStore
from durable_rollouts.workers.worker import build_worker

REPO_ROOT = Path(__file__).resolve().parent.parent  # the checkout the benchmark runs from

TASKS = REPO_ROOT / "environments" / "math" / "math_env" / "data" / "addition.jsonl"


class Rounds:
    """Runs and times the rounds of one sitting; with ``profile``, each round's engine occupancy, CPU (this
    process: the bare loop or the worker; the Temporal server; the engine) and, for batched rounds, the
    timeline (bench/pipeline_profile.py)."""

    def __init__(
        self, env: WorkflowEnvironment, store: RunStore, url: str, engine_pid: int, profile: float | None
    ):
        self.env, self.store, self.engine_pid = env, store, engine_pid
        self.server = next((p for p in child_pids() if proc_name(p).startswith("temporal")), None)
        self.occ = Occupancy(url, profile) if profile is not None else None
        self.profiles: list[dict] = []

    def _cpu(self) -> tuple[float, float, float]:
        return cpu_s(), cpu_s(self.server) if self.server else 0.0, tree_cpu_s(self.engine_pid)

    async def timed(self, kind: str, tag: str, round_: Awaitable[float], batched: bool = False) -> float:
        if self.occ is None:
            return await round_
        c0 = self._cpu()
        await self.occ.start()
        wall = await round_
        occupancy = await self.occ.stop()
        c1 = self._cpu()
        cpu = {
            k: round(b - a, 2) for k, a, b in zip(("self", "temporal_server", "engine"), c0, c1, strict=True)
        }
        prof = {"driver": kind, "tag": tag, "wall_s": round(wall, 3), "cpu_s": cpu, "engine": occupancy}
        if batched:
            prof["timeline_s"] = await batched_timeline(self.env.client, self.store, tag)
        prof["loadavg_1m"] = round(os.getloadavg()[0], 2)
        self.profiles.append(prof)
        print(json.dumps(prof), file=sys.stderr, flush=True)
        return wall

    async def aclose(self) -> None:
        if self.occ is not None:
            await self.occ.aclose()


async def main(args: argparse.Namespace) -> dict:
    home = Path(tempfile.mkdtemp(prefix="bench-pipeline-"))
    stack = StackConfig(engine_port=procs.free_port(), model_dir=str(REPO_ROOT / "engines" / "tiny-policy"))
    url = f"http://127.0.0.1:{stack.engine_port}"
    pid = procs.spawn("engine", procs.engine_argv(stack), home, env=procs.engine_env(stack))
    n = args.groups * args.group_size
    base = [
        f'engine.urls=["{url}"]',
        f'run.task_file="{TASKS}"',
        f"run.num_groups={args.groups}",
        f"run.group_size={args.group_size}",
        f"run.max_inflight_groups={args.inflight_groups or args.groups}",
        "sampling.max_tokens=8",
        'temporal.task_queue="bench"',
    ]
    cfg = load_config(None, base)
    pipelines = {} if args.no_default else {"pipeline": cfg}
    if args.batched:
        pipelines["batched"] = load_config(None, [*base, "group.batch_rollouts=true"])
    for v in args.variant:
        name, _, rest = v.partition(":")
        pipelines[name] = load_config(None, [*base, *filter(None, rest.split(","))])
    walls: dict[str, list[float]] = {"bare": [], **{k: [] for k in pipelines}}
    try:
        procs.wait_until(lambda: procs.http_ok(f"{url}/health"), 300, "vLLM", pid=pid)
        procs.set_weight_version(url, "v0")
        tasks = load_tasks(TASKS, "math")
        engine = EngineClient()
        store = RunStore(home / "store")
        async with (
            temporal_env() as env,
            build_worker(env.client, "bench", store, engine, sandboxed=not args.unsandboxed),
        ):
            rounds = Rounds(env, store, url, pid, args.profile)
            await bare_round(engine, url, cfg, tasks, "warmup")  # first requests compile kernels
            for name, c in pipelines.items():  # imports and first workflow runs, outside the timed rounds
                await pipeline_round(env.client, c, f"warmup-{name}")
            for r in range(args.rounds):
                bare = bare_round(engine, url, cfg, tasks, f"bare-{r}")
                walls["bare"].append(await rounds.timed("bare", f"bare-{r}", first(bare)))
                for name, c in pipelines.items():
                    tag = f"{name}-{r}"
                    round_ = pipeline_round(env.client, c, tag)
                    walls[name].append(await rounds.timed(name, tag, round_, c.group.batch_rollouts))
            await rounds.aclose()
        await engine.aclose()
    finally:
        procs.stop_pid(pid)
    return summary(n, args.rounds, walls, rounds.profiles)


async def first(round_: Awaitable[tuple[float, object]]) -> float:
    return (await round_)[0]


def summary(n: int, rounds: int, walls: dict[str, list[float]], profiles: list[dict]) -> dict:
    """Rollouts per second of each driver and its ratio to the bare loop's (the keys of earlier files:
    ``pipeline_*`` for the default pipeline, ``batched_*`` for the batched one)."""
    bare_rps = n * rounds / sum(walls["bare"])
    out: dict = {"rollouts_per_round": n, "rounds": rounds, "bare_s": walls["bare"]}
    out["bare_rollouts_per_s"] = round(bare_rps, 2)
    for name, w in walls.items():
        if name == "bare":
            continue
        rps = n * rounds / sum(w)
        out |= {
            f"{name}_s": w,
            f"{name}_rollouts_per_s": round(rps, 2),
            f"ratio_{name}_over_bare": round(rps / bare_rps, 3),
        }
    if profiles:
        out["profiles"] = profiles
    return out


if __name__ == "__main__":
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=fmt)
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument(
        "--inflight-groups",
        type=int,
        default=None,
        help="groups in flight at once, in both drivers (default: --groups, every group of a round at once)",
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--batched", action="store_true", help="also run the pipeline with group.batch_rollouts"
    )
    parser.add_argument("--no-default", action="store_true", help="leave out the default pipeline's rounds")
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        help="NAME:KEY=VALUE,... another pipeline (config overrides on the default's), run each round",
    )
    parser.add_argument(
        "--profile",
        type=float,
        nargs="?",
        const=0.05,
        default=None,
        metavar="INTERVAL_S",
        help="per round: CPU, the engine's occupancy (its /metrics every INTERVAL_S, default 0.05; 0: only"
        " its latency histograms) and the batched pipeline's timeline",
    )
    parser.add_argument(
        "--unsandboxed", action="store_true", help="worker without the SDK's workflow sandbox (less CPU)"
    )
    parser.add_argument("--out", type=Path, default=None)
    a = parser.parse_args()
    result = asyncio.run(main(a))
    print(json.dumps(result, indent=2))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=2) + "\n")
