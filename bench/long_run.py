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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import server_memory
import server_metrics
from harness import cpu_s, rss_bytes
from long_run_histories import (
    histories,
    history_picks,
    rejected_continue_as_new,
    run_view,
    segments,
    turns_of,
)
from long_run_stats import Sample, acceptance, bounds, deciles, page, sample_dict, segment_summary
from temporalio.api.workflowservice.v1 import DescribeNamespaceRequest
from temporalio.client import Client

from durable_rollouts.config.load import config_hash, load_config
from durable_rollouts.config.models import Config, StackConfig
from durable_rollouts.config.paths import resolve_path
from durable_rollouts.contracts.client import connect
from durable_rollouts.contracts.types import RunInput
from durable_rollouts.stack import procs, stack
from durable_rollouts.store.runstore import RunStore
from durable_rollouts.workflows.run import RunWorkflow

REPO_ROOT = Path(__file__).resolve().parent.parent  # the checkout the benchmark runs from

TASKS = REPO_ROOT / "environments" / "math" / "math_env" / "data" / "addition.jsonl"


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


@dataclass
class Measured:
    """What a run has measured so far (filled in while it runs, so a run stopped early keeps it)."""

    samples: list[Sample] = field(default_factory=list)
    submitted: float = 0.0
    """time.monotonic() when the run was submitted (the samples' t=0)."""
    checks: list[dict[str, Any]] = field(default_factory=list)
    """Each tenth's history samples and run view, as the tenth is reached."""
    server: list[dict[str, Any]] = field(default_factory=list)
    """The dev server's gauges (`server_metrics.parse`) at each sample: ``{"t", "rollouts", ...}``."""


async def measure(
    client: Client,
    store: RunStore,
    cfg: Config,
    run_id: str,
    home: Path,
    pids: dict[str, int],
    every: float,
    metrics_port: int,
    got: Measured,
    stop: asyncio.Event,
    save: Callable[[], None],
    save_s: float,
) -> Any:
    """Submit the run, sample into ``got`` until it ends (or ``stop`` is set: then None), calling ``save``
    every ``save_s`` seconds; returns the run's result."""
    total = cfg.run.num_groups * cfg.run.group_size
    ends = bounds(total)
    tasks, turns = len(resolve_path(cfg.run.task_file).read_text().splitlines()), cfg.rollout.max_turns
    t0 = got.submitted = time.monotonic()
    handle = await client.start_workflow(
        RunWorkflow.run,
        RunInput(run_id=run_id, config=cfg, config_hash=config_hash(cfg)),
        id=run_id,
        task_queue=cfg.temporal.task_queue,
    )
    result = asyncio.ensure_future(handle.result())
    stopped = asyncio.ensure_future(stop.wait())
    got.samples.append(read_sample(0.0, 0, home, pids))
    gauges = await asyncio.to_thread(server_metrics.scrape, metrics_port)
    got.server.append({"t": 0.0, "rollouts": 0, **gauges})
    saved = time.monotonic()
    while True:
        finished = result.done()
        n = sum(store.count_rollouts(run_id).values())
        got.samples.append(read_sample(time.monotonic() - t0, n, home, pids))
        gauges = await asyncio.to_thread(server_metrics.scrape, metrics_port)
        got.server.append({"t": got.samples[-1].t, "rollouts": n, **gauges})
        while len(got.checks) < len(ends) and n >= ends[len(got.checks)]:
            part = len(got.checks) + 1
            check = {
                "part": part,
                "at_rollouts": n,
                **await histories(client, run_id, history_picks(part, cfg.run.num_groups, tasks, turns)),
            }
            check["run"] = await run_view(client, run_id)
            got.checks.append(check)
            print(f"long_run: tenth {part}: {json.dumps(check)}", file=sys.stderr, flush=True)
        if finished or stop.is_set():
            break
        if time.monotonic() - saved >= save_s:
            save()
            saved = time.monotonic()
        s = got.samples[-1]
        print(
            f"long_run: t={s.t:.0f}s rollouts={n}/{total} worker={s.worker_rss >> 20}MiB "
            f"server={s.server_rss >> 20}MiB heap_inuse={int(gauges.get('heap_inuse', 0)) >> 20}MiB "
            f"goroutines={int(gauges.get('goroutines', 0))} store={s.store_bytes >> 20}MiB "
            f"temporal={s.temporal_bytes >> 20}MiB load={s.load1:.2f}",
            file=sys.stderr,
            flush=True,
        )
        await asyncio.wait({result, stopped}, timeout=every, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if not result.done():
        result.cancel()  # stopped early: the run's result is never awaited
        return None
    return result.result()


def setup(args: argparse.Namespace, total: int, retention_s: float | None) -> dict[str, Any]:
    return {
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
        "temporal_dynamic_config": server_metrics.dynamic_config(args.dynamic_config),
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }


def partial(args: argparse.Namespace, total: int, got: Measured, retention_s: float | None) -> dict[str, Any]:
    """The result so far of a run still going (``"partial": true``): its samples, tenths reached and the
    server's gauges; `--rescore` cannot complete it (no segments), the numbers in it are as measured."""
    res = {
        "benchmark": "long_run",
        "partial": True,
        "command": "python bench/long_run.py " + shlex.join(sys.argv[1:]),
        "run_id": args.run_id,
        "setup": setup(args, total, retention_s),
        "rollouts": total,
        "rollouts_recorded": got.samples[-1].rollouts if got.samples else 0,
        "checks": got.checks,
        "server_metrics": got.server,
        "samples": [sample_dict(s) for s in got.samples],
    }
    return {**res, "server_memory": server_memory.summary(res)}


async def main(args: argparse.Namespace) -> dict[str, Any]:
    home = Path(args.home or tempfile.mkdtemp(prefix="long-run-")).resolve()
    home.mkdir(parents=True, exist_ok=True)
    task_queue = "long-run"
    scfg = StackConfig(
        temporal_port=procs.free_port(), ui_port=procs.free_port(), task_queue=task_queue,
        worker_metrics_port=None, worker_sdk_metrics_port=None, start_timeout_s=300,
    )  # fmt: skip
    metrics_port, dynamic = procs.free_port(), server_metrics.dynamic_config(args.dynamic_config)
    task_file, transcripts = write_workload(home, args.turns)
    port = procs.free_port()
    url = f"http://127.0.0.1:{port}"
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)  # stop sampling; the segments so far are still read
    got, retention_s = Measured(), None
    total = (args.rollouts // args.group_size) * args.group_size

    def save() -> None:
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(partial(args, total, got, retention_s)) + "\n")

    engine_pid = procs.spawn("simengine", engine_argv(port, transcripts), home)
    wall0 = time.time()
    try:
        procs.wait_until(lambda: procs.http_ok(f"{url}/health"), 60, "simengine", pid=engine_pid)
        launched = time.monotonic()
        with server_metrics.server_flags(metrics_port, dynamic):
            info = await asyncio.to_thread(stack.up, scfg, home, True, ("temporal", "worker"))
        print(f"long_run: stack up in {home} ({info.ready_s})", file=sys.stderr, flush=True)
        cfg = make_config(url, task_file, task_queue, args)
        client = await connect(info.temporal_address)
        ns = await client.workflow_service.describe_namespace(DescribeNamespaceRequest(namespace="default"))
        retention_s = ns.config.workflow_execution_retention_ttl.ToSeconds()
        store = RunStore(home)
        progress = await measure(
            client, store, cfg, args.run_id, home, info.pids, args.sample_s, metrics_port, got, stop, save,
            args.save_s,
        )  # fmt: skip
        outcomes = store.count_rollouts(args.run_id)
        segs = await segments(client, args.run_id)
    finally:
        await asyncio.to_thread(stack.down, home)
        procs.stop_pid(engine_pid)
        procs.pid_path(home, "simengine").unlink(missing_ok=True)
    recorded = sum(outcomes.values())
    if progress is None:  # stopped early: tenths of what its samples saw recorded, without history checks
        seen = got.samples[-1].rollouts
        rows = tenths(got.samples, [], seen - seen % 10) if seen >= 10 else []
    else:
        rows = tenths(got.samples, got.checks, total)
    res = {
        "benchmark": "long_run",
        "command": "python bench/long_run.py " + shlex.join(sys.argv[1:]),
        "run_id": args.run_id,
        "setup": setup(args, total, retention_s),
        "rollouts": total,
        **({"stopped_early": True, "rollouts_recorded": recorded} if progress is None else {}),
        "outcomes": outcomes,
        "run_segments": len(segs),
        "rejected_continue_as_new": rejected_continue_as_new(segs),
        "run_result": progress.model_dump(mode="json") if progress is not None else None,
        "wall_s": round(time.time() - wall0, 1),
        "acceptance": acceptance(rows, retention_s) if rows else None,
        "segments_summary": segment_summary(segs),
        "deciles": rows,
        **({"checks": got.checks} if progress is None else {}),
        "segments": segs,
        "server_metrics": got.server,
        "samples": [sample_dict(s) for s in got.samples],
    }
    log = procs.log_path(home, "temporal")  # with GODEBUG=gctrace=1: the server's live heap at each GC
    gcs = server_memory.gc_trace(log.read_text(errors="replace")) if log.is_file() else []
    if gcs:
        res["server_live_heap"] = server_memory.live_heap(gcs, res["samples"], got.submitted - launched)
    return {**res, "server_memory": server_memory.summary(res)}


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
        picks = range(1, 11) if whole(result) else range(0)  # a run stopped early: its segments only
        hist = [await histories(client, run_id, history_picks(k, groups, tasks, turns)) for k in picks]
    finally:
        await asyncio.to_thread(stack.down, home.resolve())
    rows = result["deciles"]
    if hist:
        rows = [{**row, **h} for row, h in zip(rows, hist, strict=True)]
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


def whole(result: dict[str, Any]) -> bool:
    """Whether a saved result is of a run that ended (not one stopped early, nor the result so far)."""
    return not (result.get("stopped_early") or result.get("partial"))


def rescore(result: dict[str, Any]) -> dict[str, Any]:
    """A saved result with its tenths, acceptance and server memory computed again from its samples (after
    a change to long_run_stats.py or server_memory.py); the history samples and run views are kept. A run
    stopped early (or the result so far) gets the tenths of the rollouts its samples saw recorded."""
    samples = [Sample(**s) for s in result["samples"]]
    seen = samples[-1].rollouts
    total = result["rollouts"] if whole(result) else seen - seen % 10
    rows: list[dict[str, Any]] = []
    if total >= 10:
        computed = deciles(samples, total)
        keep = [
            {k: v for k, v in row.items() if k not in computed[0] or k == "part"}
            for row in (result["deciles"] if whole(result) else [])
        ]
        rows = tenths(samples, keep, total)
    return {
        **result,
        "deciles": rows,
        "acceptance": acceptance(rows, result["setup"].get("temporal_retention_s")) if rows else None,
        "server_memory": server_memory.summary(result),
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
    p.add_argument(
        "--save-s", type=float, default=60.0, help="seconds between writes of the result so far to --out"
    )
    p.add_argument(
        "--dynamic-config",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a dynamic config value of the dev server (temporal server start-dev --dynamic-config-value)",
    )
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
        a.html.write_text(page(res, server_memory.charts(res)))
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
