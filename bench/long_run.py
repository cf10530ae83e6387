"""A long run, measured: ONE run of ``--rollouts`` rollouts on the embedded stack, and whether throughput,
memory and bytes per rollout stay flat from its first tenth to its last.

The stack is `stack.stack.up` without its vLLM engine: a Temporal dev server on its SQLite file and one
worker, separate processes from one home, as `rollouts stack up` starts them; the engine is the simulated
one (`simengine`, its own process) answering at once. The environment is math, scripted multi-turn: a task
file of the bundled additions whose prompts carry a ``Task id:`` line, and a transcripts file from which the
simulated engine plays each task's turns: ``k - 1`` wrong answers (each answered by the environment's retry
observation), then the right one, ``k`` cycling 1..``--turns`` over the tasks. Every rollout ends completed
with reward 1 after its task's number of turns, so the work per rollout is the same all run long. No Docker.

Every ``--sample-s`` it reads the rollouts recorded in the store, the worker's and the Temporal server's RSS
and CPU (/proc of their pids), the store's bytes (``store.sqlite`` with its WAL, and ``blobs/``) and the
Temporal database's (``temporal.sqlite`` with its WAL). Each time a tenth of the rollouts is recorded it
also samples a few rollouts' and groups' histories of that tenth (events and bytes, via the client) and the
run workflow's own: its segment (continue-as-new count), the current segment's history length, the size of
the state it carries (its input) and its search attributes. The per-tenth arithmetic is in
``long_run_stats.py``; the result (``--out``) holds the command line, every sample, the tenths and the
acceptance numbers; ``--html`` writes a page of charts.

    python bench/long_run.py --rollouts 20000 --out bench/results/long_run.json \
        --html bench/results/long_run.html

Invariant: it stops everything it started (the stack by its pid files, the engine by its pid) however it
ends; the long run itself is never run by the tests (tests/unit/bench/test_long_run_stats.py covers the
arithmetic).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import sqlite3
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from harness import cpu_s, rss_bytes
from long_run_stats import Sample, acceptance, bounds, deciles, page, sample_dict, segment_summary
from temporalio.api.enums.v1 import EventType, WorkflowTaskFailedCause
from temporalio.api.workflowservice.v1 import DescribeNamespaceRequest
from temporalio.client import Client, WorkflowHandle

from durable_rollouts.config.load import config_hash, load_config
from durable_rollouts.config.models import Config, StackConfig
from durable_rollouts.config.paths import resolve_path
from durable_rollouts.contracts.client import connect
from durable_rollouts.contracts.types import RunInput, group_id, rollout_id
from durable_rollouts.stack import procs, stack
from durable_rollouts.store.runstore import RunStore
from durable_rollouts.workflows.run import RunWorkflow

REPO_ROOT = Path(__file__).resolve().parent.parent  # the checkout the benchmark runs from

TASKS = REPO_ROOT / "environments" / "math" / "math_env" / "data" / "addition.jsonl"
HISTORY_SAMPLES = 3
"""Groups per tenth whose histories (the group's and its first member's) are read."""


def write_workload(home: Path, turns: int) -> tuple[Path, Path]:
    """The scripted math workload: a task file whose prompts name their task id, and the transcripts the
    simulated engine plays (``k - 1`` wrong answers, then the right one; ``k`` cycles 1..``turns``)."""
    tasks, scripts = [], []
    for i, line in enumerate(TASKS.read_text().splitlines()):
        t = json.loads(line)
        tasks.append({**t, "prompt": f"Task id: {t['id']}\n{t['prompt']}"})
        k = turns_of(i, turns)
        scripts.append(
            {"task_id": t["id"], "mode": "reference", "turns": ["wrong"] * (k - 1) + [t["answer"]]}
        )
    task_file, transcripts = home / "long_run_tasks.jsonl", home / "long_run_transcripts.jsonl"
    task_file.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    transcripts.write_text("".join(json.dumps(s) + "\n" for s in scripts))
    return task_file, transcripts


def turns_of(task_index: int, turns: int) -> int:
    """Turns the scripted rollouts of the ``task_index``-th task take."""
    return 1 + task_index % turns


def engine_argv(port: int, transcripts: Path) -> list[str]:
    return [
        sys.executable, "-m", "durable_rollouts.simengine", "--port", str(port), "--policy", "scripted",
        "--transcripts", str(transcripts), "--max-num-seqs", "512", "--num-gpu-blocks", "65536",
    ]  # fmt: skip


def make_config(url: str, task_file: Path, task_queue: str, args: argparse.Namespace) -> Config:
    return load_config(
        None,
        [
            f"engine.urls={json.dumps([url])}",
            f"run.task_file={json.dumps(str(task_file))}",
            'run.env="math"',
            f"run.num_groups={args.rollouts // args.group_size}",
            f"run.group_size={args.group_size}",
            f"run.max_inflight_groups={args.inflight_groups}",
            f"run.groups_per_run_segment={args.segment_groups}",
            "sampling.max_tokens=16",
            f"rollout.max_turns={args.turns}",
            f"admission.enabled={'true' if args.admission else 'false'}",
            f"temporal.task_queue={json.dumps(task_queue)}",
        ],
    )


def disk_bytes(*paths: Path) -> int:
    """Bytes on disk of the files given (with their SQLite ``-wal`` and ``-shm``) and of every file under
    the directories given; missing paths count 0."""
    total = 0
    for p in paths:
        if p.is_dir():
            total += sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
            continue
        for f in (p, p.with_name(p.name + "-wal"), p.with_name(p.name + "-shm")):
            if f.is_file():
                total += f.stat().st_size
    return total


def db_bytes(path: Path) -> int:
    """The bytes of pages an SQLite database uses, as a reader sees it now (committed WAL frames in, free
    pages out); 0 if it cannot be read."""
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=2.0)
        try:
            size = db.execute("PRAGMA page_size").fetchone()[0]
            used = (
                db.execute("PRAGMA page_count").fetchone()[0]
                - db.execute("PRAGMA freelist_count").fetchone()[0]
            )
            return int(size * used)
        finally:
            db.close()
    except sqlite3.Error:
        return 0


def read_sample(t: float, rollouts: int, home: Path, pids: dict[str, int]) -> Sample:
    w, s = pids["worker"], pids["temporal"]
    return Sample(
        t=round(t, 2),
        rollouts=rollouts,
        worker_rss=rss_bytes(w),
        server_rss=rss_bytes(s),
        worker_cpu_s=cpu_s(w),
        server_cpu_s=cpu_s(s),
        store_bytes=db_bytes(home / "store.sqlite") + disk_bytes(home / "blobs"),
        temporal_bytes=db_bytes(home / "temporal.sqlite"),
        load1=round(os.getloadavg()[0], 2),
        store_disk_bytes=disk_bytes(home / "store.sqlite", home / "blobs"),
        temporal_disk_bytes=disk_bytes(home / "temporal.sqlite"),
        server_rss_anon=rss_bytes(s, "RssAnon"),
    )


async def history_size(client: Client, wf_id: str, run_id: str | None = None) -> tuple[int, int]:
    """(events, bytes) of one workflow execution's history."""
    n = size = 0
    async for e in client.get_workflow_handle(wf_id, run_id=run_id).fetch_history_events():
        n += 1
        size += e.ByteSize()
    return n, size


async def run_view(client: Client, run_id: str) -> dict[str, Any]:
    """The run workflow now (its latest segment): the segment's number, history and carried state (its
    input), and the run's search attributes."""
    handle: WorkflowHandle = client.get_workflow_handle(run_id)  # no run id: the latest segment
    desc = await handle.describe()
    n = size = state = 0
    async for e in client.get_workflow_handle(handle.id, run_id=desc.run_id).fetch_history_events():
        if n == 0:
            state = e.workflow_execution_started_event_attributes.input.ByteSize()
        n += 1
        size += e.ByteSize()
    progress = None
    if desc.status is not None and desc.status.name == "RUNNING":
        progress = await handle.query(RunWorkflow.progress)
    return {
        "segment": progress.segment if progress is not None else None,
        "groups_inflight": progress.groups_inflight if progress is not None else None,
        "segment_history_events": n,
        "segment_history_bytes": size,
        "carried_input_bytes": state,
        "search_attributes": len(
            desc.raw_description.workflow_execution_info.search_attributes.indexed_fields
        ),
        "memo_bytes": desc.raw_description.workflow_execution_info.memo.ByteSize(),
    }


def history_picks(part: int, groups: int, tasks: int, turns: int) -> list[int]:
    """``HISTORY_SAMPLES`` groups spread over tenth ``part`` (1-based), each the first from its point on
    whose task takes the most turns, so every tenth samples the same work."""
    lo, hi = groups * (part - 1) // 10, groups * part // 10
    picks = set()
    for j in range(HISTORY_SAMPLES):
        p = lo + (hi - lo) * (j + 1) // (HISTORY_SAMPLES + 1)
        picks.add(next((g for g in range(p, hi) if turns_of(g % tasks, turns) == turns), p))
    return sorted(picks)


async def histories(client: Client, run_id: str, picks: list[int]) -> dict[str, Any]:
    """Histories of the groups ``picks`` and of each one's member 0."""
    r_events, r_bytes, g_events, g_bytes = [], [], [], []
    for g in picks:
        gid = group_id(g)
        n, b = await history_size(client, rollout_id(run_id, gid, 0))
        r_events.append(n)
        r_bytes.append(b)
        n, b = await history_size(client, f"{run_id}/{gid}")
        g_events.append(n)
        g_bytes.append(b)
    mean = lambda xs: round(sum(xs) / len(xs), 1)  # noqa: E731
    return {
        "sampled_groups": [group_id(g) for g in picks],
        "rollout_history_events_mean": mean(r_events),
        "rollout_history_bytes_mean": mean(r_bytes),
        "group_history_events_mean": mean(g_events),
        "group_history_bytes_mean": mean(g_bytes),
    }


async def segments(client: Client, run_id: str) -> list[dict[str, Any]]:
    """Every segment (execution) of the run, oldest first: its history (events, bytes), the state it
    was started with (its input's bytes), the groups it started and the group_done signals it took, its
    workflow tasks that failed (by cause), and the time from its last group start to its last event (the
    continue-as-new; no group starts meanwhile)."""
    runs = sorted(
        [w async for w in client.list_workflows(f"WorkflowId = '{run_id}'")], key=lambda w: w.start_time
    )
    out = []
    for i, w in enumerate(runs):
        events = [e async for e in client.get_workflow_handle(run_id, run_id=w.run_id).fetch_history_events()]
        t = lambda e: e.event_time.ToNanoseconds() / 1e9  # noqa: E731
        starts = [
            t(e)
            for e in events
            if e.event_type == EventType.EVENT_TYPE_START_CHILD_WORKFLOW_EXECUTION_INITIATED
        ]
        failed = Counter(
            WorkflowTaskFailedCause.Name(e.workflow_task_failed_event_attributes.cause).removeprefix(
                "WORKFLOW_TASK_FAILED_CAUSE_"
            )
            for e in events
            if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED
        )
        out.append(
            {
                "segment": i,
                "status": w.status.name if w.status is not None else None,
                "start_s": round((w.start_time - runs[0].start_time).total_seconds(), 2),
                "duration_s": round(t(events[-1]) - t(events[0]), 2),
                "events": len(events),
                "history_bytes": sum(e.ByteSize() for e in events),
                "carried_input_bytes": events[0].workflow_execution_started_event_attributes.input.ByteSize(),
                "groups_started": len(starts),
                "group_done_signals": sum(
                    1 for e in events if e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED
                ),
                "workflow_task_failures": dict(failed),
                "last_start_to_end_s": round(t(events[-1]) - max(starts), 2) if starts else None,
            }
        )
    return out


def rejected_continue_as_new(segs: list[dict[str, Any]]) -> int:
    """Workflow tasks of the run's segments that the server rejected for an event that arrived while they
    were in flight (``UNHANDLED_COMMAND``): in a segment that continued as new, only the task carrying the
    continue-as-new can be (the run's other tasks issue no closing command)."""
    return sum(
        s["workflow_task_failures"].get("UNHANDLED_COMMAND", 0)
        for s in segs
        if s["status"] == "CONTINUED_AS_NEW"
    )


async def measure(
    client: Client, store: RunStore, cfg: Config, run_id: str, home: Path, pids: dict[str, int], every: float
) -> tuple[list[Sample], list[dict[str, Any]], Any]:
    """Submit the run, sample until it ends; returns (samples, per-tenth checks, the run's result)."""
    total = cfg.run.num_groups * cfg.run.group_size
    ends = bounds(total)
    tasks, turns = len(resolve_path(cfg.run.task_file).read_text().splitlines()), cfg.rollout.max_turns
    t0 = time.monotonic()
    handle = await client.start_workflow(
        RunWorkflow.run,
        RunInput(run_id=run_id, config=cfg, config_hash=config_hash(cfg)),
        id=run_id,
        task_queue=cfg.temporal.task_queue,
    )
    result = asyncio.ensure_future(handle.result())
    samples: list[Sample] = [read_sample(0.0, 0, home, pids)]
    checks: list[dict[str, Any]] = []
    while True:
        finished = result.done()
        n = sum(store.count_rollouts(run_id).values())
        samples.append(read_sample(time.monotonic() - t0, n, home, pids))
        while len(checks) < len(ends) and n >= ends[len(checks)]:
            part = len(checks) + 1
            check = {
                "part": part,
                "at_rollouts": n,
                **await histories(client, run_id, history_picks(part, cfg.run.num_groups, tasks, turns)),
            }
            check["run"] = await run_view(client, run_id)
            checks.append(check)
            print(f"long_run: tenth {part}: {json.dumps(check)}", file=sys.stderr, flush=True)
            partial = {"samples": [sample_dict(s) for s in samples], "checks": checks}
            (home / "long_run_partial.json").write_text(json.dumps(partial))
        if finished:
            break
        s = samples[-1]
        print(
            f"long_run: t={s.t:.0f}s rollouts={n}/{total} worker={s.worker_rss >> 20}MiB "
            f"server={s.server_rss >> 20}MiB store={s.store_bytes >> 20}MiB "
            f"temporal={s.temporal_bytes >> 20}MiB load={s.load1:.2f}",
            file=sys.stderr,
            flush=True,
        )
        await asyncio.wait({result}, timeout=every)
    return samples, checks, result.result()


async def main(args: argparse.Namespace) -> dict[str, Any]:
    home = Path(args.home or tempfile.mkdtemp(prefix="long-run-")).resolve()
    home.mkdir(parents=True, exist_ok=True)
    task_queue = "long-run"
    scfg = StackConfig(
        temporal_port=procs.free_port(), ui_port=procs.free_port(), task_queue=task_queue,
        worker_metrics_port=None, worker_sdk_metrics_port=None, start_timeout_s=300,
    )  # fmt: skip
    task_file, transcripts = write_workload(home, args.turns)
    port = procs.free_port()
    url = f"http://127.0.0.1:{port}"
    engine_pid = procs.spawn("simengine", engine_argv(port, transcripts), home)
    wall0 = time.time()
    try:
        procs.wait_until(lambda: procs.http_ok(f"{url}/health"), 60, "simengine", pid=engine_pid)
        info = await asyncio.to_thread(stack.up, scfg, home, True, ("temporal", "worker"))
        print(f"long_run: stack up in {home} ({info.ready_s})", file=sys.stderr, flush=True)
        cfg = make_config(url, task_file, task_queue, args)
        client = await connect(info.temporal_address)
        ns = await client.workflow_service.describe_namespace(DescribeNamespaceRequest(namespace="default"))
        retention_s = ns.config.workflow_execution_retention_ttl.ToSeconds()
        store = RunStore(home)
        samples, checks, progress = await measure(
            client, store, cfg, args.run_id, home, info.pids, args.sample_s
        )
        outcomes = store.count_rollouts(args.run_id)
        segs = await segments(client, args.run_id)
    finally:
        await asyncio.to_thread(stack.down, home)
        procs.stop_pid(engine_pid)
        procs.pid_path(home, "simengine").unlink(missing_ok=True)
    total = cfg.run.num_groups * cfg.run.group_size
    rows = tenths(samples, checks, total)
    return {
        "benchmark": "long_run",
        "command": "python bench/long_run.py " + shlex.join(sys.argv[1:]),
        "run_id": args.run_id,
        "setup": {
            "stack": "stack.stack.up: Temporal dev server (SQLite) + one worker, separate processes",
            "engine": "simengine, scripted policy from a transcripts file, no delay",
            "environment": f"math, scripted: k-1 wrong answers, then the right one; k = 1..{args.turns}",
            "rollouts": total,
            "group_size": args.group_size,
            "inflight_groups": args.inflight_groups,
            "groups_per_run_segment": args.segment_groups,
            "admission": args.admission,
            "sample_s": args.sample_s,
            "turns": args.turns,
            "temporal_retention_s": retention_s,
            "cpus": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d %H:%M"),
        },
        "rollouts": total,
        "outcomes": outcomes,
        "run_segments": len(segs),
        "rejected_continue_as_new": rejected_continue_as_new(segs),
        "run_result": progress.model_dump(mode="json"),
        "wall_s": round(time.time() - wall0, 1),
        "acceptance": acceptance(rows, retention_s),
        "segments_summary": segment_summary(segs),
        "deciles": rows,
        "segments": segs,
        "samples": [sample_dict(s) for s in samples],
    }


async def read_back(home: Path, result: dict[str, Any], turns: int, run_id: str) -> dict[str, Any]:
    """What a run whose stack is down left in its Temporal database (its dev server started again on it):
    its `segments` and each tenth's history samples (picked as `history_picks` does)."""
    cfg = StackConfig(temporal_port=procs.free_port(), ui_port=procs.free_port())
    run_id, groups = result.get("run_id", run_id), result["rollouts"] // result["setup"]["group_size"]
    tasks = len((home / "long_run_tasks.jsonl").read_text().splitlines())
    try:
        info = await asyncio.to_thread(stack.up, cfg, home.resolve(), True, ("temporal",))
        client = await connect(info.temporal_address)
        segs = await segments(client, run_id)
        hist = [await histories(client, run_id, history_picks(k, groups, tasks, turns)) for k in range(1, 11)]
    finally:
        await asyncio.to_thread(stack.down, home.resolve())
    rows = [{**row, **h} for row, h in zip(result["deciles"], hist, strict=True)]
    return {
        **result,
        "deciles": rows,
        "rejected_continue_as_new": rejected_continue_as_new(segs),
        "segments_summary": segment_summary(segs),
        "segments": segs,
    }


def tenths(samples: list[Sample], checks: list[dict[str, Any]], total: int) -> list[dict[str, Any]]:
    """The per-tenth rows with each tenth's history samples and run view merged in."""
    rows = deciles(samples, total)
    for row, check in zip(rows, checks, strict=False):
        row.update({k: v for k, v in check.items() if k != "part"})
    return rows


def rescore(result: dict[str, Any]) -> dict[str, Any]:
    """A saved result with its tenths and acceptance computed again from its samples (after a change to
    long_run_stats.py); the history samples and run views are kept."""
    samples = [Sample(**s) for s in result["samples"]]
    computed = deciles(samples, result["rollouts"])
    keep = [
        {k: v for k, v in row.items() if k not in computed[0] or k == "part"} for row in result["deciles"]
    ]
    rows = tenths(samples, keep, result["rollouts"])
    return {
        **result,
        "deciles": rows,
        "acceptance": acceptance(rows, result["setup"].get("temporal_retention_s")),
    }


def _parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(description=__doc__, formatter_class=fmt)
    p.add_argument("--rollouts", type=int, default=20_000, help="rollouts in the one run")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--inflight-groups", type=int, default=8)
    p.add_argument("--turns", type=int, default=3, help="turns of the longest scripted rollout")
    p.add_argument("--segment-groups", type=int, default=500, help="run.groups_per_run_segment")
    p.add_argument("--admission", action="store_true", help="adaptive admission (default: the fixed cap)")
    p.add_argument("--sample-s", type=float, default=5.0, help="seconds between samples")
    p.add_argument("--run-id", default="long-run")
    p.add_argument(
        "--home", help="stack home (default: a fresh temporary directory; with --rescore: read its segments)"
    )
    p.add_argument("--out", type=Path, help="results JSON")
    p.add_argument("--html", type=Path, help="a page of charts of the result")
    p.add_argument("--rescore", type=Path, help="recompute a saved result (its samples) instead of running")
    return p


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM stops the stack and the engine like Ctrl-C does


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _interrupt)
    a = _parser().parse_args()
    if a.rescore:
        res = json.loads(a.rescore.read_text())
        res = rescore(asyncio.run(read_back(Path(a.home), res, a.turns, a.run_id)) if a.home else res)
        res["rescore_command"] = "python bench/long_run.py " + shlex.join(sys.argv[1:])
    elif a.rollouts % a.group_size or a.rollouts < 10 * a.group_size:
        sys.exit(
            f"--rollouts: {a.rollouts} is not a multiple of --group-size {a.group_size} (at least 10 groups)"
        )
    else:
        res = asyncio.run(main(a))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(res, indent=2) + "\n")
    if a.html:
        a.html.parent.mkdir(parents=True, exist_ok=True)
        a.html.write_text(page(res))
    print(
        json.dumps(
            {
                k: res.get(k)
                for k in (
                    "rollouts",
                    "outcomes",
                    "run_segments",
                    "rejected_continue_as_new",
                    "wall_s",
                    "acceptance",
                )
            },
            indent=2,
        )
    )
