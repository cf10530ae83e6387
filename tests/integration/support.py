"""Small factories for integration tests: configs, in-process workers, runs to completion."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator  # type: ignore[import-untyped]
from temporalio.client import Client
from temporalio.worker import Interceptor

from durable_rollouts.config.load import config_hash, load_config
from durable_rollouts.config.models import Config
from durable_rollouts.contracts.types import RunInput, RunProgress
from durable_rollouts.engines.client import EngineClient
from durable_rollouts.environments.fleet import live_pollers
from durable_rollouts.records.export import export_run, iter_run
from durable_rollouts.records.record import RECORDS, committed_schema
from durable_rollouts.sandboxes import DockerBackend
from durable_rollouts.store import RunStore, open_store
from durable_rollouts.workers.worker import build_workers
from durable_rollouts.workflows.run import RunWorkflow
from tests import REPO_ROOT

TASKS = REPO_ROOT / "environments" / "math" / "math_env" / "data" / "addition.jsonl"
CODING_TASKS = REPO_ROOT / "environments" / "coding" / "coding_env" / "data" / "coding.jsonl"


def make_config(engine_urls: list[str], task_queue: str, **sections: dict[str, Any]) -> Config:
    """A run config for tests: the bundled tasks, quick retries, overridable per section."""
    overrides = [
        f"engine.urls={json.dumps(engine_urls)}",
        f"temporal.task_queue={json.dumps(task_queue)}",
        f"run.task_file={json.dumps(str(TASKS))}",
        "engine.retry_initial_s=0.2",
        "engine.retry_max_s=1.0",
        "sampling.max_tokens=8",
    ]
    for section, fields in sections.items():
        overrides += [f"{section}.{k}={json.dumps(v)}" for k, v in fields.items()]
    return load_config(None, overrides)


@asynccontextmanager
async def worker(
    client: Client,
    task_queue: str,
    home: Path,
    sandboxed: bool = True,
    store: str | None = None,
    env_queues: bool = False,
    max_workflow_tasks: int = 64,
    interceptors: Sequence[Interceptor] = (),
) -> AsyncIterator[RunStore]:
    """An in-process worker with its own store (``store``: a store URL, e.g. the ``store_url`` fixture's;
    default: the embedded store in ``home``); yields the store. With ``env_queues`` it also polls the
    queue of every environment it loads, as `rollouts worker` does (for runs started as `rollouts run`
    starts them, environments/fleet.py). ``max_workflow_tasks``: its workflow-task slots; ``interceptors``:
    added to its own."""
    opened = open_store(store or home)
    engine = EngineClient()
    envs = None if env_queues else {}
    try:
        async with contextlib.AsyncExitStack() as stack:
            for w in build_workers(
                client,
                task_queue,
                opened,
                engine,
                sandboxed=sandboxed,
                envs=envs,
                max_workflow_tasks=max_workflow_tasks,
                interceptors=interceptors,
            ):
                await stack.enter_async_context(w)
                if env_queues:  # `rollouts run` submits only once Temporal lists a poller of the run's queue
                    await until_polled(client, w.config()["task_queue"])
            yield opened
    finally:
        await engine.aclose()
        opened.close()


async def until_polled(client: Client, queue: str, timeout_s: float = 90.0) -> None:
    """Wait until a live worker polls ``queue`` (as Temporal's task queue description lists it)."""
    end = time.monotonic() + timeout_s
    while not await live_pollers(client, queue):
        if time.monotonic() > end:
            raise AssertionError(f"no worker polled {queue} within {timeout_s:.0f} s")
        await asyncio.sleep(0.3)


async def start_run(client: Client, cfg: Config, run_id: str):
    return await client.start_workflow(
        RunWorkflow.run,
        RunInput(run_id=run_id, config=cfg, config_hash=config_hash(cfg)),
        id=run_id,
        task_queue=cfg.temporal.task_queue,
    )


async def run_to_end(client: Client, cfg: Config, run_id: str) -> RunProgress:
    handle = await start_run(client, cfg, run_id)
    return await handle.result()


def export(store: RunStore, run_id: str) -> tuple[list[dict], list[dict]]:
    """The run's exported rollout and group records."""
    records = list(iter_run(store, run_id))
    return [r for r in records if r["kind"] == "rollout"], [r for r in records if r["kind"] == "group"]


def export_lines(store: RunStore, run_id: str) -> list[str]:
    """The run's export as the JSONL lines `rollouts export` writes."""
    buf = io.StringIO()
    export_run(store, run_id, buf)
    return buf.getvalue().splitlines()


def assert_schema_valid(lines: Iterable[str | dict[str, Any]]) -> None:
    """Every exported line (JSON text or a parsed object) validates against the committed JSON Schema of
    its kind (records/schema/KIND.json); the first violation is named by line, id and field path."""
    validators = {kind: Draft202012Validator(committed_schema(kind)) for kind in RECORDS}
    for i, line in enumerate(lines):
        obj = json.loads(line) if isinstance(line, str) else line
        kind = obj.get("kind")
        assert kind in validators, f"line {i}: unknown kind {kind!r}"
        errors = sorted(validators[kind].iter_errors(obj), key=lambda e: list(e.absolute_path))
        if errors:
            name, where = obj.get("rollout_id") or obj.get("group_id"), list(errors[0].absolute_path)
            raise AssertionError(f"line {i} ({kind} {name}): {errors[0].message} at {where}")


SANDBOX = {"memory_mb": 512, "workdir_size_mb": 64, "tmp_size_mb": 64, "command_timeout_s": 20}


def coding_config(url: str, task_queue: str, groups: int = 2, size: int = 2, **sections: dict):
    """A coding run on the bundled tasks; section dicts override the defaults field by field."""
    defaults = {
        "run": {"env": "coding", "task_file": str(CODING_TASKS), "num_groups": groups, "group_size": size},
        "sampling": {"max_tokens": 1024},
        "rollout": {"max_turns": 12, "max_total_tokens": 4000},
        "sandbox": SANDBOX,
    }
    merged = {k: {**defaults.get(k, {}), **sections.get(k, {})} for k in defaults.keys() | sections.keys()}
    return make_config([url], task_queue, **merged)


def assert_no_containers(docker: DockerBackend, run_id: str) -> None:
    assert docker.list_containers(run_id) == []


async def wait_for_first_command(store: RunStore, rid: str) -> None:
    """Until the rollout's first tool call has been parsed (its sandbox command is about to run)."""
    for _ in range(600):
        seg = store.get_segment(rid, "t00000.model")
        if seg is not None and "action" in seg.meta:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"rollout {rid} never started its first command")


async def until(check: Callable[[], bool], timeout_s: float, what: str, every_s: float = 0.5) -> None:
    """Poll ``check`` (run in a thread: it may block on Docker or the store) until it holds."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await asyncio.to_thread(check):
            return
        await asyncio.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def cluster_missing(*tools: str) -> str | None:
    """Why a namespace cluster (faults.cluster) cannot be made here, or None: network namespaces, HAProxy,
    PostgreSQL and the ``tools`` named (e.g. ``docker``)."""
    import shutil

    from durable_rollouts.faults.netns import available
    from durable_rollouts.store.local_postgres import postgres_bin

    if why := available():
        return why
    if shutil.which("haproxy") is None:
        return "haproxy is not installed (apt-get install haproxy; .ci/with-services.sh does)"
    if postgres_bin() is None or shutil.which("psql") is None:
        return "PostgreSQL is not installed (apt-get install postgresql; .ci/with-services.sh does)"
    missing = [t for t in tools if shutil.which(t) is None]
    return f"{', '.join(missing)} not installed" if missing else None
