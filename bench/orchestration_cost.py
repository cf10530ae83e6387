"""What orchestration costs per rollout, and per extra turn, measured apart from the model: CPU of the
worker(s) and of the Temporal server, history events and workflow tasks, and the most rollouts/s one host
accepts with one worker process and with two; for the current code and an older commit in one sitting.

The stack is driven as processes, so either code can be measured: a Temporal dev server on its SQLite file
(`stack.stack.up`, temporal only, of this checkout: the search attributes are the same), worker processes
(``python -P -m workers.worker``) and the run submitted with the CLI (``python -P -m cli.rollouts run``;
``workers.cli`` in commits before the ``cli`` package), both from the code under test (``PYTHONPATH`` = its
root; an older commit is extracted with ``git archive`` into a temporary directory, as
tests/integration/test_upgrade.py does), all from this virtual environment. The engine
is the simulated one (`simengine`, one process for the whole sitting) answering at once, or after
``--turn-ms``. The environment is math, scripted as in bench/long_run.py (no Docker): every task of a shape
takes exactly its turns (``k - 1`` wrong answers, each answered by the retry observation, then the right
one), so a rollout of the 10-turn shape is a 10-turn agent loop with one model call per turn; there is no
tool-running environment without Docker, so this is what "10-turn tool rollouts" means here.

Per code version: one worker, a warm-up run, then one run per shape (1 turn, 10 turns); then two workers, a
warm-up run and the 1-turn run again. Each run has ``--inflight-groups`` groups in flight (fixed cap,
admission off: enough to saturate this host). For each run: CPU seconds of every worker, the Temporal server
and the engine from /proc before and after (submit to result), RSS after, the accepted rate (rollouts
closed per second between the 10th and 90th percentile of their close times, from Temporal's visibility),
and the histories (events by type, workflow tasks) of a sample of rollouts and groups and of the whole run,
added up per rollout. The arithmetic is in ``cost_stats.py`` (unit-tested); this script is not run by CI.

    python bench/orchestration_cost.py --old cb3230d --out bench/results/orchestration_cost.json

The batched path (``group.batch_rollouts``) against the default, in one sitting:

    python bench/orchestration_cost.py --variant batched:group.batch_rollouts=true \
        --out bench/results/orchestration_cost_batched.json

CPU-seconds and events per rollout do not depend on what else runs on the machine; rates do.
Invariant: it stops everything it started (workers and engine by pid, the Temporal server by its pid file)
however it ends, and removes the extracted checkout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from code_versions import Code, checkout, git, import_path, module
from code_versions import cli_module as cli_module  # re-exported: other benchmarks import it from here
from cost_stats import (
    accepted_rate,
    add_counts,
    compare,
    count_events,
    cpu_ms_per_rollout,
    mean_counts,
    per_extra_turn,
    per_rollout,
)
from harness import cpu_s, rss_bytes
from long_run import TASKS, engine_argv
from temporalio.api.enums.v1 import EventType, TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest
from temporalio.client import Client

from durable_rollouts.config.models import StackConfig
from durable_rollouts.contracts.client import connect
from durable_rollouts.contracts.types import group_id, rollout_id
from durable_rollouts.stack import procs, stack
from durable_rollouts.store import RunStore

REPO_ROOT = Path(__file__).resolve().parent.parent  # the checkout the benchmark runs from

QUEUE = "cost"
SHAPES = {"1-turn": 1, "10-turn": 10}
ROLLOUT_SAMPLE, GROUP_SAMPLE = 6, 3


def python(code: Code, home: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": import_path(code.root), "ROLLOUTS_HOME": str(home)}
    return subprocess.run(
        [sys.executable, "-P", *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def write_workload(home: Path) -> tuple[dict[str, Path], Path]:
    """One task file per shape (its tasks' ids prefixed by the shape, named in the prompt) and one transcripts
    file for the engine: a task of a shape of ``k`` turns answers wrong ``k - 1`` times, then right."""
    base = [json.loads(line) for line in TASKS.read_text().splitlines()]
    files, scripts = {}, []
    for shape, k in SHAPES.items():
        tasks = [{**t, "id": f"{shape}-{t['id']}"} for t in base]
        files[shape] = home / f"cost_{shape}.jsonl"
        files[shape].write_text(
            "".join(json.dumps({**t, "prompt": f"Task id: {t['id']}\n{t['prompt']}"}) + "\n" for t in tasks)
        )
        scripts += [
            {"task_id": t["id"], "mode": "reference", "turns": ["wrong"] * (k - 1) + [t["answer"]]}
            for t in tasks
        ]
    transcripts = home / "cost_transcripts.jsonl"
    transcripts.write_text("".join(json.dumps(s) + "\n" for s in scripts))
    return files, transcripts


async def wait_for_workers(client: Client, pids: list[int], timeout_s: float = 120) -> None:
    """Until every worker in ``pids`` polls the task queue's workflow side (identity ``pid@host``)."""
    req = DescribeTaskQueueRequest(
        namespace="default",
        task_queue=TaskQueue(name=QUEUE),
        task_queue_type=TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW,
    )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        res = await client.workflow_service.describe_task_queue(req)
        polling = {p.identity.split("@", 1)[0] for p in res.pollers}
        if all(str(p) in polling for p in pids):
            return
        if not all(procs.pid_alive(p) for p in pids):
            raise RuntimeError(f"a worker exited before polling {QUEUE} (see its log)")
        await asyncio.sleep(0.5)
    raise RuntimeError(f"workers {pids} not polling {QUEUE} after {timeout_s}s")


async def history(client: Client, wf_id: str, run_id: str | None = None) -> dict[str, Any]:
    handle = client.get_workflow_handle(wf_id, run_id=run_id)
    return count_events([EventType.Name(e.event_type) async for e in handle.fetch_history_events()])


async def run_histories(
    client: Client, rid: str, groups: int, size: int, inline: bool = False
) -> dict[str, Any]:
    """Counts of a sample of rollouts and groups (spread over the run) and of every segment of the run;
    ``inline``: the groups run their rollouts inline (``group.inline_rollouts``) or in a batch activity
    (``group.batch_rollouts``); such rollouts have no history of their own (every event is the group's)."""
    picks = sorted({groups * j // ROLLOUT_SAMPLE for j in range(ROLLOUT_SAMPLE)})
    if inline:
        rollouts = [count_events([])]
    else:
        rollouts = [await history(client, rollout_id(rid, group_id(g), g % size)) for g in picks]
    gpicks = sorted({groups * j // GROUP_SAMPLE for j in range(GROUP_SAMPLE)})
    grps = [await history(client, f"{rid}/{group_id(g)}") for g in gpicks]
    segs = [w async for w in client.list_workflows(f"WorkflowId = '{rid}'")]
    run = add_counts([await history(client, rid, w.run_id) for w in segs])
    return {
        "rollout": mean_counts(rollouts),
        "group": mean_counts(grps),
        "run": {**run, "segments": len(segs)},
    }


def stored_close_times(home: Path, rid: str) -> list[float]:
    """Close times of the run's rollouts from their records (rollouts without a workflow of their own)."""
    store = RunStore(home)
    try:
        return [float(r["finished_at"]) for r in store.rollouts(rid)]
    finally:
        store.close()


async def close_times(client: Client, rid: str, n: int) -> list[float]:
    """Close times (epoch s) of the run's ``n`` rollout workflows, from visibility (it may lag a moment)."""
    query = "WorkflowType = 'RolloutWorkflow' AND ExecutionStatus != 'Running'"
    for _ in range(40):
        ts = [
            w.close_time.timestamp()
            async for w in client.list_workflows(query)
            if w.id.startswith(f"{rid}/") and w.close_time is not None
        ]
        if len(ts) >= n:
            return ts
        await asyncio.sleep(0.5)
    return ts


class Sitting:
    """One code version on a fresh Temporal server: its workers, its runs."""

    def __init__(self, code: Code, home: Path, args: argparse.Namespace, url: str, tasks: dict[str, Path]):
        self.code, self.home, self.args, self.url, self.tasks = code, home, args, url, tasks
        self.workers: list[int] = []
        self.pids: dict[str, int] = {}
        self.address = ""
        self.client: Client | None = None

    async def start_workers(self, n: int) -> None:
        argv = [
            sys.executable,
            "-P",
            "-m",
            module(self.code.root, "workers.worker"),
            "--address",
            self.address,
            "--task-queue",
            QUEUE,
        ]
        if self.args.unsandboxed:
            argv.append("--unsandboxed")
        env = {"PYTHONPATH": import_path(self.code.root), "ROLLOUTS_HOME": str(self.home)}
        self.workers = [
            procs.spawn(f"worker-{i}", self._profiled(argv, n, i), self.home, env=env) for i in range(n)
        ]
        assert self.client is not None
        await wait_for_workers(self.client, self.workers)

    def _profiled(self, argv: list[str], n: int, i: int) -> list[str]:
        """``argv`` of worker ``i`` of ``n``, under bench/sampler.py with ``--profile-dir``."""
        where = self.args.profile_dir
        if where is None:
            return argv
        where.mkdir(parents=True, exist_ok=True)
        out = where / f"{self.code.label}-{n}w-{i}.json"
        exact = ["--cprofile"] if self.args.cprofile else []
        return [argv[0], "-P", str(REPO_ROOT / "bench" / "sampler.py"), "--out", str(out), *exact, *argv[2:]]

    def stop_workers(self) -> None:
        for i, pid in enumerate(self.workers):
            procs.stop_pid(pid)
            procs.pid_path(self.home, f"worker-{i}").unlink(missing_ok=True)
        self.workers = []

    def cpu(self) -> dict[str, float]:
        pids = {f"worker_{i}": p for i, p in enumerate(self.workers)}
        return {k: cpu_s(p) for k, p in {**pids, **self.pids}.items()}

    async def run(self, rid: str, shape: str, rollouts: int, measure: bool = True) -> dict[str, Any]:
        a, turns = self.args, SHAPES[shape]
        sets = {
            "engine.urls": [self.url], "temporal.address": self.address, "temporal.task_queue": QUEUE,
            "run.task_file": str(self.tasks[shape]), "run.env": "math",
            "run.num_groups": rollouts // a.group_size, "run.group_size": a.group_size,
            "run.max_inflight_groups": a.inflight_groups,
            "sampling.max_tokens": 16, "rollout.max_turns": turns, "admission.enabled": False,
            **dict(self.code.sets),
        }  # fmt: skip
        overrides = [x for k, v in sets.items() for x in ("--set", f"{k}={json.dumps(v)}")]
        assert self.client is not None
        load0, c0, t0 = os.getloadavg()[0], self.cpu(), time.time()
        sub = await asyncio.to_thread(
            python, self.code, self.home, "-m", self.code.cli, "run", "--run-id", rid, *overrides
        )
        if sub.returncode != 0:
            raise RuntimeError(f"run {rid}: submit exited {sub.returncode}: {sub.stderr.strip()[-500:]}")
        result = await asyncio.wait_for(self.client.get_workflow_handle(rid).result(), a.run_timeout_s)
        wall, c1, load1 = time.time() - t0, self.cpu(), os.getloadavg()[0]
        print(
            f"cost: {self.code.label} {rid}: {rollouts} rollouts in {wall:.1f}s", file=sys.stderr, flush=True
        )
        if not measure:
            return {}
        sets = dict(self.code.sets)  # members without a workflow of their own: inline, or in a batch
        inline = bool(sets.get("group.inline_rollouts") or sets.get("group.batch_rollouts"))
        hist = await run_histories(self.client, rid, rollouts // a.group_size, a.group_size, inline)
        if inline:
            closes = await asyncio.to_thread(stored_close_times, self.home, rid)
        else:
            closes = await close_times(self.client, rid, rollouts)
        return {
            "run_id": rid,
            "shape": shape,
            "turns": turns,
            "workers": len(self.workers),
            "rollouts": rollouts,
            "outcomes": result.get("outcomes") if isinstance(result, dict) else None,
            "wall_s": round(wall, 2),
            "accepted_per_s": accepted_rate(closes),
            "overall_per_s": round(rollouts / wall, 2),
            "loadavg_1m": [round(load0, 2), round(load1, 2)],
            "cpu_s": {k: round(c1[k] - c0[k], 2) for k in c0},
            "cpu_ms_per_rollout": cpu_ms_per_rollout(c0, c1, rollouts),
            "rss_mib": {k: round(rss_bytes(p) / 2**20) for k, p in self.pids.items()}
            | {f"worker_{i}": round(rss_bytes(p) / 2**20) for i, p in enumerate(self.workers)},
            "histories": hist,
            "per_rollout": per_rollout(hist["rollout"], hist["group"], hist["run"], a.group_size, rollouts),
        }

    async def go(self, engine_pid: int) -> dict[str, Any]:
        a = self.args
        run_module = module(self.code.root, "workflows.run")
        where = python(self.code, self.home, "-c", f"import {run_module} as w; print(w.__file__)")
        if Path(where.stdout.strip()).resolve() != (self.code.root / "workflows" / "run.py").resolve():
            raise RuntimeError(f"{self.code.label}: imports {where.stdout.strip()!r} {where.stderr[-300:]}")
        scfg = StackConfig(
            temporal_port=procs.free_port(), ui_port=procs.free_port(), task_queue=QUEUE,
            worker_metrics_port=None, worker_sdk_metrics_port=None, start_timeout_s=300,
        )  # fmt: skip
        info = await asyncio.to_thread(stack.up, scfg, self.home, True, ("temporal",))
        try:
            self.address = info.temporal_address
            self.pids = {"temporal_server": info.pids["temporal"], "engine": engine_pid}
            self.client = await connect(self.address)
            runs = []
            for n in (1, 2):
                await self.start_workers(n)
                try:
                    await self.run(f"warm-{n}", "1-turn", a.warm_rollouts, measure=False)
                    for shape in SHAPES if n == 1 else ("1-turn",):
                        size = a.rollouts if SHAPES[shape] == 1 else a.rollouts_long
                        runs.append(await self.run(f"{shape}-w{n}", shape, size))
                finally:
                    self.stop_workers()
            return {"commit": self.code.commit, "runs": runs, "summary": summarize(runs)}
        finally:
            self.stop_workers()
            await asyncio.to_thread(stack.down, self.home)


def summarize(runs: list[dict[str, Any]]) -> dict[str, float]:
    """The flat numbers of one code version: CPU ms, events and workflow tasks per rollout for each shape
    (one worker) and per extra turn, and the accepted rate with one and with two workers."""
    one = {(r["shape"], r["workers"]): r for r in runs}
    out: dict[str, float] = {}
    priced: dict[str, dict[str, float]] = {}
    for shape in SHAPES:
        r = one[(shape, 1)]
        cpu = r["cpu_ms_per_rollout"]
        priced[shape] = {
            "cpu_ms": cpu["orchestration"], "worker_cpu_ms": cpu["workers"],
            "server_cpu_ms": cpu["temporal_server"],
            "events": r["per_rollout"]["events"], "workflow_tasks": r["per_rollout"]["workflow_tasks"],
        }  # fmt: skip
        out.update({f"{k}_per_rollout_{shape}": v for k, v in priced[shape].items()})
    (short, t_short), (long, t_long) = list(SHAPES.items())
    extra = per_extra_turn(priced[short], priced[long], t_short, t_long)
    out.update({f"{k}_per_extra_turn": v for k, v in extra.items()})
    for n in (1, 2):
        out[f"accepted_rollouts_per_s_{n}_worker{'s' if n > 1 else ''}"] = one[("1-turn", n)][
            "accepted_per_s"
        ]
    return out


def _variant(text: str) -> tuple[str, tuple[tuple[str, Any], ...]]:
    """``local:rollout.local_model_calls=true`` -> ("local", (("rollout.local_model_calls", True),))."""
    label, sep, rest = text.partition(":")
    pairs = [kv.partition("=") for kv in rest.split(",")] if sep else []
    if not label or not pairs or any(not k or not eq for k, eq, _ in pairs):
        raise argparse.ArgumentTypeError(f"--variant {text!r}: expected LABEL:KEY=VALUE[,KEY=VALUE]")
    return label, tuple((k, json.loads(v)) for k, _, v in pairs)


async def main(args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="orchestration-cost-"))
    if args.new:  # a commit of its own, extracted as the old one is (a checkout others are editing)
        rev = git("rev-parse", args.new)
        codes = [Code("new", rev, checkout(rev, tmp / f"code-new-{rev[:8]}"))]
    else:
        head = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
        codes = [Code("new", head + ("+dirty" if dirty else ""), REPO_ROOT)]
    if args.old:
        old = git("rev-parse", args.old)
        codes.insert(0, Code("old", old, checkout(old, tmp / f"code-{old[:8]}")))
    new = codes[-1]
    for label, sets in args.variant:
        if args.old and args.old_variants:  # the same overrides on the old code, measured just before
            codes.append(Code(f"old-{label}", codes[0].commit, codes[0].root, sets))
        codes.append(Code(label, new.commit, new.root, sets))
    if args.variants_only:  # the defaults' sittings left out (the old code's checkout still serves)
        codes = [c for c in codes if c.sets]
    tasks, transcripts = write_workload(tmp)
    port = procs.free_port()
    url = f"http://127.0.0.1:{port}"
    argv = engine_argv(port, transcripts) + (["--prefill-ms", str(args.turn_ms)] if args.turn_ms else [])
    engine = procs.spawn("simengine", argv, tmp)
    sittings: dict[str, Any] = {}
    try:
        procs.wait_until(lambda: procs.http_ok(f"{url}/health"), 60, "simengine", pid=engine)
        for code in codes:
            home = tmp / f"home-{code.label}"
            home.mkdir()
            sittings[code.label] = await Sitting(code, home, args, url, tasks).go(engine)
    finally:
        procs.stop_pid(engine)
        for code in codes:
            if code.root != REPO_ROOT:
                shutil.rmtree(code.root, ignore_errors=True)
    out: dict[str, Any] = {
        "benchmark": "orchestration_cost",
        "command": "python bench/orchestration_cost.py " + shlex.join(sys.argv[1:]),
        "commits": {c.label: c.commit for c in codes},
        "setup": {
            "stack": "Temporal dev server (SQLite), stack.stack.up; workers and CLI from the code measured",
            "engine": f"simengine, scripted from transcripts, {args.turn_ms} ms per model call",
            "environment": "math, scripted: k-1 wrong answers, then the right one (k: the shape's turns)",
            "shapes": SHAPES,
            "rollouts": args.rollouts,
            "rollouts_10_turn": args.rollouts_long,
            "group_size": args.group_size,
            "inflight_groups": args.inflight_groups,
            "admission": False,
            "sandboxed": not args.unsandboxed,
            "warm_rollouts": args.warm_rollouts,
            "cpus": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d %H:%M"),
        },
        "sittings": sittings,
    }
    if "old" in sittings:
        out["before_after"] = compare(sittings["old"]["summary"], sittings["new"]["summary"])
    for label, _ in args.variant:  # a variant against the old code, and against the current default
        base = "old" if "old" in sittings else "new"
        if base in sittings:
            out[f"{base}_vs_{label}"] = compare(sittings[base]["summary"], sittings[label]["summary"])
        if f"old-{label}" in sittings:  # the variant's own before/after
            out[f"old-{label}_vs_{label}"] = compare(
                sittings[f"old-{label}"]["summary"], sittings[label]["summary"]
            )
    shutil.rmtree(tmp, ignore_errors=True)
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", help="an older commit to measure first in the same sitting (e.g. cb3230d)")
    p.add_argument(
        "--new",
        help="measure this commit as the current code instead of the checkout's working tree (extracted "
        "like --old)",
    )
    p.add_argument("--rollouts", type=int, default=400, help="rollouts of each 1-turn run")
    p.add_argument("--rollouts-long", type=int, default=120, help="rollouts of the 10-turn run")
    p.add_argument("--warm-rollouts", type=int, default=64, help="rollouts of the warm-up run per worker set")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--inflight-groups", type=int, default=32, help="fixed cap (enough to saturate)")
    p.add_argument("--turn-ms", type=float, default=0.0, help="engine latency per model call (default 0)")
    p.add_argument("--unsandboxed", action="store_true", help="workers without the SDK's workflow sandbox")
    p.add_argument("--run-timeout-s", type=float, default=1200.0)
    p.add_argument(
        "--variant",
        type=_variant,
        action="append",
        default=[],
        metavar="LABEL:KEY=VALUE[,KEY=VALUE]",
        help="also measure the current code with these run-config overrides (JSON values), as sitting LABEL",
    )
    p.add_argument(
        "--old-variants",
        action="store_true",
        help="also measure each --variant on the --old commit (sitting old-LABEL), for the variant's own "
        "before/after",
    )
    p.add_argument(
        "--variants-only",
        action="store_true",
        help="measure the --variant sittings (and their --old-variants) without the current default's",
    )
    p.add_argument(
        "--profile-dir",
        type=Path,
        help="run every worker under bench/sampler.py, its profile written here as LABEL-Nw-I.json",
    )
    p.add_argument(
        "--cprofile", action="store_true", help="with --profile-dir: also cProfile each worker's main thread"
    )
    p.add_argument("--out", type=Path, help="results JSON")
    return p


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM stops what it started, as Ctrl-C does


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _interrupt)
    a = _parser().parse_args()
    for flag in ("rollouts", "rollouts_long", "warm_rollouts"):
        n = getattr(a, flag)
        if n % a.group_size or n < 3 * a.group_size:
            sys.exit(
                f"--{flag.replace('_', '-')}: {n} is not a multiple of --group-size {a.group_size} "
                "(at least 3 groups)"
            )
    res = asyncio.run(main(a))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(res, indent=2) + "\n")
    print(
        json.dumps(
            {k: res.get(k) for k in ("commits", "before_after")}
            | {"summaries": {k: v["summary"] for k, v in res["sittings"].items()}},
            indent=2,
        )
    )
