"""Pieces shared by the pipeline-vs-bare benchmarks (`pipeline_vs_bare.py`, `orchestration_overhead.py`).

The benchmarks run as scripts (`python bench/NAME.py`), so they import this module as `harness` (bench/ is
the script directory on sys.path).

- `temporal_env`: a real Temporal dev server (in memory, our search attributes) for one benchmark.
- `bare_round`: the run's rollouts with no orchestration, doing the same engine calls the activities do
  (render the environment's prompt via /tokenize once; per turn: generate, detokenize, the environment's
  ``parse``, and for an observation, such as math's retry prompt after a wrong answer, tokenize it and
  append it), with the same dispatch shape as `RunWorkflow`: at most ``run.max_inflight_groups`` groups in
  flight, every member of a group at once.
- `pipeline_round`: the same run through the full durable pipeline (RunWorkflow -> groups -> rollouts).
- `cpu_s` / `rss_bytes` / `child_pids`: process CPU time and resident memory from /proc, for CPU-per-turn
  accounting and memory over a long run.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

from durable_rollouts.config.load import config_hash
from durable_rollouts.config.models import Config
from durable_rollouts.config.paths import venv_bin
from durable_rollouts.contracts.types import RunInput, TruncationReason, group_id, rollout_id, sampling_params
from durable_rollouts.engines.client import EngineClient
from durable_rollouts.environments import registry
from durable_rollouts.environments.base import Step, TurnContext
from durable_rollouts.turns.budget import turn_truncation
from durable_rollouts.turns.model import call_model
from durable_rollouts.workflows import search_attributes as sa
from durable_rollouts.workflows.group import member_seed
from durable_rollouts.workflows.run import RunWorkflow

_CLK_TCK = os.sysconf("SC_CLK_TCK")


@asynccontextmanager
async def temporal_env() -> AsyncIterator[WorkflowEnvironment]:
    """A local Temporal dev server (a child process of this one) with the project's search attributes."""
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=str(venv_bin("temporal")),
        data_converter=pydantic_data_converter,
        search_attributes=sa.ALL,
        dev_server_log_level="error",
    )
    try:
        yield env
    finally:
        await env.shutdown()


@dataclass
class BareRollout:
    """What the bare driver saw of one rollout."""

    wall_s: float = 0.0
    turns: int = 0
    model_s: list[float] = field(default_factory=list)
    """Per turn: the generate HTTP call."""
    env_s: list[float] = field(default_factory=list)
    """Per turn: detokenize, the environment's ``parse``, and its observation's /tokenize."""


async def bare_rollout(engine: EngineClient, url: str, cfg: Config, task: dict, rid: str) -> BareRollout:
    """One rollout of the run's environment with no orchestration, making the same engine calls as the
    pipeline's activities through the same model call (``turns.model.call_model``) and truncation verdict
    (``turns.budget``), and the same environment hooks (``prompt``, ``parse``). For environments whose steps
    need no sandbox (``inline_steps``, e.g. math): a turn that ``parse`` makes an action is refused."""
    env = registry.get(cfg.run.env)
    item = env.validate_task(task)
    out = BareRollout()
    t0 = time.perf_counter()
    base = sampling_params(cfg)
    sampling = base.model_copy(update={"seed": member_seed(base.seed, rid)})
    model = cfg.engine.model
    prompt = env.prompt(item)
    context = prompt.token_ids or await engine.tokenize_chat(url, model, prompt.messages or [])
    total = cfg.rollout.max_total_tokens
    for turn in range(cfg.rollout.max_turns):
        t1 = time.perf_counter()
        gen = await call_model(
            engine, url, model, context, sampling, sampling.max_tokens, total, f"{rid}/{turn}/1"
        )
        if isinstance(gen, TruncationReason):  # a limit left the turn nothing
            break
        t2 = time.perf_counter()
        out.model_s.append(t2 - t1)
        out.turns += 1
        context = context + gen.token_ids
        if turn_truncation(gen.finish_reason, len(context), total) is not None:
            break
        text = await engine.detokenize(url, model, gen.token_ids)
        last = turn + 1 >= cfg.rollout.max_turns
        step = env.parse(TurnContext(task=item, rollout_id=rid, turn=turn, last_turn=last), text)
        if not isinstance(step, Step):
            raise ValueError(f"run.env: {env.name!r} acts in a sandbox; the bare driver steps inline only")
        if step.done or last or step.observation is None:
            out.env_s.append(time.perf_counter() - t2)
            break
        message = {"role": env.observation_role, "content": step.observation}
        context = context + await engine.tokenize_chat(url, model, [message])
        out.env_s.append(time.perf_counter() - t2)
    out.wall_s = time.perf_counter() - t0
    return out


async def bare_round(
    engine: EngineClient, url: str, cfg: Config, tasks: list[dict], tag: str
) -> tuple[float, list[BareRollout]]:
    """Every rollout of the run, groups dispatched like `RunWorkflow` does; returns (wall s, rollouts)."""
    gate = asyncio.Semaphore(cfg.run.max_inflight_groups)

    async def group(g: int) -> list[BareRollout]:
        async with gate:
            task = tasks[g % len(tasks)]
            members = (
                bare_rollout(engine, url, cfg, task, rollout_id(tag, group_id(g), i))
                for i in range(cfg.run.group_size)
            )
            return list(await asyncio.gather(*members))

    t0 = time.perf_counter()
    groups = await asyncio.gather(*(group(g) for g in range(cfg.run.num_groups)))
    return time.perf_counter() - t0, [r for g in groups for r in g]


async def pipeline_round(client: Client, cfg: Config, run_id: str) -> float:
    """Run ``cfg`` through RunWorkflow on the task queue ``cfg.temporal.task_queue``; returns wall seconds."""
    t0 = time.perf_counter()
    handle = await client.start_workflow(
        RunWorkflow.run,
        RunInput(run_id=run_id, config=cfg.model_dump(mode="json"), config_hash=config_hash(cfg)),
        id=run_id,
        task_queue=cfg.temporal.task_queue,
    )
    await handle.result()
    return time.perf_counter() - t0


def cpu_s(pid: int | str = "self") -> float:
    """User + system CPU seconds of one process (0.0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK  # utime, stime (fields 14 and 15 of stat)


def rss_bytes(pid: int | str = "self", field: str = "VmRSS") -> int:
    """Resident set size of one process in bytes (0 if it is gone); ``field`` ``RssAnon`` gives its
    anonymous part only (heap, not the mapped binary and files)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def child_pids(parent: int | None = None) -> list[int]:
    """Direct children of ``parent`` (default: this process), from /proc."""
    parent = os.getpid() if parent is None else parent
    kids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent:
            kids.append(int(entry))
    return kids


def proc_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""
