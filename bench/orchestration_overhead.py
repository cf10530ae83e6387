"""Orchestration overhead at realistic turn latency: the full Temporal pipeline vs a bare asyncio loop.

Both drivers run the same multi-turn math rollouts against one simulated engine (`simengine`, its own
process) that takes ``--turn-ms`` (default 2000) per model call: the random policy never answers right, so
every rollout takes exactly ``--turns`` turns (generate, detokenize, verify, "Wrong, try again." tokenized
and appended). The pipeline side is RunWorkflow -> GroupWorkflow -> RolloutWorkflow on a real Temporal dev
server with an in-process worker and the run store; the bare side (`harness.bare_round`) makes the same
engine calls with the same dispatch shape (at most ``--inflight-groups`` groups, all members of a group at
once) and nothing else. Rounds alternate (bare, pipeline, pipeline, bare, ...) in one process and the
ratio is taken over the totals. CPU time comes from /proc: this process (the bare driver, or the worker and
client) and the Temporal server; the engine's CPU is reported apart.

Turn latency is per rollout: its wall time (first prompt to record) divided by its turns. For the pipeline
the per-turn breakdown comes from the run store: activity schedule-to-start (``queue_s``), the engine call as
the activity saw it (``model_s``), the env step (``env_s``), and the rest (workflow tasks, local-activity
round trips, child start and finish, spread over the turns). With ``--batched`` the last round's profile is
the batched run's timeline instead (bench/pipeline_profile.py: the groups' starts, their batches, each
group's start to its batch and its batch's end to its close).

    python bench/orchestration_overhead.py --out bench/results/orchestration_overhead.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from harness import bare_round, child_pids, cpu_s, pipeline_round, proc_name, temporal_env
from pipeline_profile import batched_timeline
from temporalio.api.enums.v1 import EventType
from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import Client

from durable_rollouts.config.load import load_config
from durable_rollouts.config.models import Config
from durable_rollouts.engines.client import EngineClient
from durable_rollouts.environments.tasks import load_tasks
from durable_rollouts.stack import procs
from durable_rollouts.store.runstore import RunStore
from durable_rollouts.workers.worker import build_worker

REPO_ROOT = Path(__file__).resolve().parent.parent  # the checkout the benchmark runs from

TASKS = REPO_ROOT / "environments" / "math" / "math_env" / "data" / "addition.jsonl"
MAX_TOKENS = 8


def engine_argv(port: int, turn_ms: float, max_seqs: int) -> list[str]:
    """The simulated engine: random policy, every request held ``turn_ms`` before its tokens."""
    return [
        sys.executable, "-m", "durable_rollouts.simengine", "--port", str(port), "--policy", "random",
        "--prefill-ms", str(turn_ms), "--max-num-seqs", str(max_seqs), "--num-gpu-blocks", "65536",
    ]  # fmt: skip


def make_config(url: str, args: argparse.Namespace, groups: int) -> Config:
    return load_config(
        None,
        [
            f'engine.urls=["{url}"]',
            f'run.task_file="{TASKS}"',
            'run.env="math"',
            f"run.num_groups={groups}",
            f"run.group_size={args.group_size}",
            f"run.max_inflight_groups={args.inflight_groups}",
            f"sampling.max_tokens={MAX_TOKENS}",
            f"rollout.max_turns={args.turns}",
            "rollout.max_total_tokens=4096",
            "admission.enabled=false",  # the fixed group cap: the same dispatch shape as the bare driver
            'temporal.task_queue="overhead"',
            *(["group.batch_rollouts=true"] if args.batched else []),
        ],
    )


class CpuMeter:
    """CPU seconds of this process, the Temporal server and the engine over one round."""

    def __init__(self, server_pid: int | None, engine_pid: int) -> None:
        self.pids = {"self": "self", "temporal_server": server_pid, "engine": engine_pid}

    def read(self) -> dict[str, float]:
        return {k: cpu_s(p) if p else 0.0 for k, p in self.pids.items()}

    @staticmethod
    def diff(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
        return {k: b[k] - a[k] for k in a}


async def pipeline_stats(client: Client, store: RunStore, run_id: str, batched: bool = False) -> dict:
    """Per-rollout wall time (workflow start to close; ``batched``: the record's start to end, as the
    rollouts have no workflow of their own) and the per-turn breakdown from the run store."""
    recs = store.rollouts(run_id)
    turn_lat: list[float] = []
    queue: list[float] = []
    model: list[float] = []
    env: list[float] = []
    turns = 0
    outcomes: dict[str, int] = {}
    for rec in recs:
        outcomes[rec["outcome"]] = outcomes.get(rec["outcome"], 0) + 1
        segs = [s for s in store.segments(rec["rollout_id"]) if s.kind == "model"]
        if batched:
            extra = json.loads(rec["extra_json"])
            wall = float(extra["ended_at"]) - float(extra["started_at"])
        else:
            desc = await client.get_workflow_handle(rec["rollout_id"]).describe()
            assert desc.close_time is not None
            wall = (desc.close_time - desc.start_time).total_seconds()
        turns += len(segs)
        turn_lat.append(wall / max(1, len(segs)))
        for s in segs:
            queue.append(float(s.meta.get("queue_s") or 0.0))
            model.append(float(s.meta.get("model_s") or 0.0))
            env.append(float(s.meta.get("env_s") or 0.0))
    return {
        "rollouts": len(recs),
        "turns": turns,
        "outcomes": outcomes,
        "turn_latency_s": turn_lat,
        "queue_s": queue,
        "model_s": model,
        "env_s": env,
    }


def _t(event: HistoryEvent) -> float:
    return event.event_time.ToNanoseconds() / 1e9


async def _events(client: Client, wf_id: str) -> list[HistoryEvent]:
    return [e async for e in client.get_workflow_handle(wf_id).fetch_history_events()]


async def history_profile(client: Client, store: RunStore, run_id: str) -> dict:
    """Where the pipeline's time goes, from the histories of one round's rollout and group workflows.

    Rollout: workflow-task schedule-to-start and run time, activity schedule-to-start, the gap between one
    model call completing and the next being scheduled (env step + workflow tasks), start to first model
    call (child start, prepare), last model call to close (finalize). Group: start to last member started
    (members are started one after another), last member closed to group closed, and the slot turnover (a
    group's last member closed -> the next group started: how long the admission slot stands idle).
    """
    et = EventType
    wft_s2s: list[float] = []
    wft_run: list[float] = []
    act_s2s: list[float] = []
    gaps: list[float] = []
    head: list[float] = []
    tail: list[float] = []
    wfts: list[int] = []
    group_ids = sorted({r["group_id"] for r in store.rollouts(run_id)})
    spread: list[float] = []
    g_tail: list[float] = []
    g_spans: list[tuple[float, float]] = []
    for gid in group_ids:
        gev = await _events(client, f"{run_id}/{gid}")
        g0 = _t(gev[0])
        started = [_t(e) for e in gev if e.event_type == et.EVENT_TYPE_CHILD_WORKFLOW_EXECUTION_STARTED]
        closed = [_t(e) for e in gev if e.event_type == et.EVENT_TYPE_CHILD_WORKFLOW_EXECUTION_COMPLETED]
        spread.append(max(started) - g0)
        g_tail.append(_t(gev[-1]) - max(closed))
        g_spans.append((g0, max(closed)))
    for rec in store.rollouts(run_id):
        ev = await _events(client, rec["rollout_id"])
        sched: dict[int, float] = {}
        last_done: float | None = None
        n_wft = 0
        for e in ev:
            t = _t(e)
            if e.event_type == et.EVENT_TYPE_WORKFLOW_TASK_SCHEDULED:
                sched[e.event_id] = t
            elif e.event_type == et.EVENT_TYPE_WORKFLOW_TASK_STARTED:
                wft_s2s.append(t - sched[e.workflow_task_started_event_attributes.scheduled_event_id])
                sched[e.event_id] = t
            elif e.event_type == et.EVENT_TYPE_WORKFLOW_TASK_COMPLETED:
                wft_run.append(t - sched[e.workflow_task_completed_event_attributes.started_event_id])
                n_wft += 1
            elif e.event_type == et.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
                sched[e.event_id] = t
                if last_done is None:
                    head.append(t - _t(ev[0]))
                else:
                    gaps.append(t - last_done)
            elif e.event_type == et.EVENT_TYPE_ACTIVITY_TASK_STARTED:
                act_s2s.append(t - sched[e.activity_task_started_event_attributes.scheduled_event_id])
            elif e.event_type == et.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
                last_done = t
        if last_done is not None:
            tail.append(_t(ev[-1]) - last_done)
        wfts.append(n_wft)
    g_spans.sort()
    lags: list[float] = []
    for start, _ in g_spans:
        before = [end for _, end in g_spans if end <= start]
        if before:
            lags.append(start - max(before))
    ms = lambda xs: round(1000 * _mean(xs), 1)  # noqa: E731
    return {
        "rollout_workflow_tasks": round(_mean(wfts), 2),
        "workflow_task_schedule_to_start_ms": ms(wft_s2s),
        "workflow_task_run_ms": ms(wft_run),
        "activity_schedule_to_start_ms": ms(act_s2s),
        "between_model_calls_ms": ms(gaps),
        "rollout_start_to_first_model_call_ms": ms(head),
        "last_model_call_to_rollout_close_ms": ms(tail),
        "group_start_to_last_member_started_ms": ms(spread),
        "last_member_closed_to_group_closed_ms": ms(g_tail),
        "slot_turnover_ms": ms(lags),
    }


def _mean(xs: Sequence[float]) -> float:
    return statistics.fmean(xs) if xs else 0.0


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summarize(rounds: list[dict], kind: str) -> dict:
    mine = [r for r in rounds if r["driver"] == kind]
    wall = sum(r["wall_s"] for r in mine)
    rollouts = sum(r["rollouts"] for r in mine)
    turns = sum(r["turns"] for r in mine)
    lat = [x for r in mine for x in r.pop("_turn_latency_s")]
    model = [x for r in mine for x in r.pop("_model_s")]
    env = [x for r in mine for x in r.pop("_env_s")]
    queue = [x for r in mine for x in r.pop("_queue_s", [])]
    cpu = {k: sum(r["cpu_s"][k] for r in mine) for k in mine[0]["cpu_s"]}
    for r in mine:
        r["cpu_s"] = {k: round(v, 2) for k, v in r["cpu_s"].items()}
    out = {
        "rounds": len(mine),
        "wall_s": round(wall, 2),
        "rollouts": rollouts,
        "turns": turns,
        "loadavg_1m_at_round_ends": [r["loadavg_1m_end"] for r in mine],
        "rollouts_per_s": round(rollouts / wall, 3),
        "turns_per_s": round(turns / wall, 3),
        "mean_turn_latency_s": round(_mean(lat), 4),
        "p50_turn_latency_s": round(_pct(lat, 0.5), 4),
        "p99_turn_latency_s": round(_pct(lat, 0.99), 4),
        "mean_model_call_s": round(_mean(model), 4),
        "mean_env_step_s": round(_mean(env), 4),
        "cpu_s": {k: round(v, 2) for k, v in cpu.items()},
        "cpu_ms_per_turn": {k: round(1000 * v / turns, 2) for k, v in cpu.items()},
    }
    if kind == "pipeline":
        rest = _mean(lat) - _mean(queue) - _mean(model) - _mean(env)
        out["per_turn_breakdown_s"] = {
            "activity_schedule_to_start": round(_mean(queue), 4),
            "activity_schedule_to_start_p99": round(_pct(queue, 0.99), 4),
            "model_call": round(_mean(model), 4),
            "env_step": round(_mean(env), 4),
            "workflow_tasks_and_rest": round(rest, 4),
        }
    return out


async def main(args: argparse.Namespace) -> dict:
    home = Path(tempfile.mkdtemp(prefix="overhead-"))
    os.environ["ROLLOUTS_HOME"] = str(home)
    port = procs.free_port()
    url = f"http://127.0.0.1:{port}"
    concurrency = args.inflight_groups * args.group_size
    engine_pid = procs.spawn("engine", engine_argv(port, args.turn_ms, max(256, 2 * concurrency)), home)
    rounds: list[dict] = []
    pipe_tags: list[str] = []
    try:
        procs.wait_until(lambda: procs.http_ok(f"{url}/health"), 60, "simengine", pid=engine_pid)
        cfg = make_config(url, args, args.groups)
        warm = make_config(url, args, args.inflight_groups)
        tasks = load_tasks(TASKS, "math")
        engine = EngineClient()
        store = RunStore(home / "store")
        async with (
            temporal_env() as env,
            build_worker(env.client, cfg.temporal.task_queue, store, engine, sandboxed=not args.unsandboxed),
        ):
            servers = [p for p in child_pids() if proc_name(p).startswith("temporal")]
            meter = CpuMeter(servers[0] if servers else None, engine_pid)
            await bare_round(engine, url, warm, tasks, "warm-bare")
            await pipeline_round(env.client, warm, "warm-pipe")
            order = [
                d for r in range(args.rounds) for d in (("bare", "pipeline"), ("pipeline", "bare"))[r % 2]
            ]
            for i, driver in enumerate(order):
                tag = f"{driver}-{i}"
                c0 = meter.read()
                if driver == "bare":
                    wall, done = await bare_round(engine, url, cfg, tasks, tag)
                    c1 = meter.read()
                    stats = {
                        "rollouts": len(done),
                        "turns": sum(r.turns for r in done),
                        "_turn_latency_s": [r.wall_s / max(1, r.turns) for r in done],
                        "_model_s": [x for r in done for x in r.model_s],
                        "_env_s": [x for r in done for x in r.env_s],
                    }
                else:
                    pipe_tags.append(tag)
                    wall = await asyncio.wait_for(pipeline_round(env.client, cfg, tag), args.round_timeout_s)
                    c1 = meter.read()
                    p = await pipeline_stats(env.client, store, tag, args.batched)
                    stats = {
                        "rollouts": p["rollouts"],
                        "turns": p["turns"],
                        "outcomes": p["outcomes"],
                        "_turn_latency_s": p["turn_latency_s"],
                        "_model_s": p["model_s"],
                        "_env_s": p["env_s"],
                        "_queue_s": p["queue_s"],
                    }
                cpu = CpuMeter.diff(c0, c1)
                load = round(os.getloadavg()[0], 2)
                rounds.append(
                    {
                        "driver": driver,
                        "wall_s": round(wall, 3),
                        **stats,
                        "cpu_s": cpu,
                        "loadavg_1m_end": load,
                    }
                )
                print(
                    f"{tag}: {wall:.2f} s, {stats['rollouts']} rollouts, {stats['turns']} turns, "
                    f"cpu self {cpu['self']:.2f} s server {cpu['temporal_server']:.2f} s, load {load}",
                    file=sys.stderr,
                    flush=True,
                )
            last = pipe_tags[-1]
            profile = await (batched_timeline if args.batched else history_profile)(env.client, store, last)
        await engine.aclose()
    finally:
        procs.stop_pid(engine_pid)
    bare = summarize(rounds, "bare")
    pipe = summarize(rounds, "pipeline")
    orch = pipe["cpu_ms_per_turn"]["self"] + pipe["cpu_ms_per_turn"]["temporal_server"]
    return {
        "setup": {
            "engine": "simengine, random policy, one process",
            "turn_ms": args.turn_ms,
            "turns_per_rollout": args.turns,
            "max_tokens": MAX_TOKENS,
            "groups_per_round": args.groups,
            "group_size": args.group_size,
            "inflight_groups": args.inflight_groups,
            "concurrent_rollouts": concurrency,
            "rounds_per_driver": args.rounds,
            "batched": args.batched,
            "cpus": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d %H:%M"),
        },
        "bare": bare,
        "pipeline": pipe,
        "ratio_rollouts_per_s": round(pipe["rollouts_per_s"] / bare["rollouts_per_s"], 4),
        "ratio_turns_per_s": round(pipe["turns_per_s"] / bare["turns_per_s"], 4),
        "pipeline_profile_last_round": profile,
        "orchestration_cpu_ms_per_turn": round(orch, 2),
        "orchestration_cpu_ms_per_turn_net_of_bare_driver": round(orch - bare["cpu_ms_per_turn"]["self"], 2),
        "rounds": rounds,
    }


if __name__ == "__main__":
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=fmt)
    parser.add_argument("--turn-ms", type=float, default=2000.0, help="engine time per model call")
    parser.add_argument("--turns", type=int, default=4, help="turns per rollout")
    parser.add_argument("--groups", type=int, default=16, help="groups per round")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--inflight-groups", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2, help="rounds per driver (alternating)")
    parser.add_argument("--round-timeout-s", type=float, default=600.0, help="give up on a stuck round")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--unsandboxed", action="store_true", help="worker without the SDK's workflow sandbox (less CPU)"
    )
    parser.add_argument("--batched", action="store_true", help="the pipeline with group.batch_rollouts")
    a = parser.parse_args()
    result = asyncio.run(main(a))
    print(json.dumps({k: v for k, v in result.items() if k != "rounds"}, indent=2))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=2) + "\n")
