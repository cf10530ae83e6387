"""Record the workflow histories that every later release must replay (tests/unit/test_replay.py).

Runs, on a real Temporal dev server with an in-process worker and the simulated engine: a math run, a
coding run (real Docker, scripted agent), a rollout that continues as new, and an adaptive run that
continues as new (the server's continue-as-new suggestion is lowered so both happen within seconds). Every
run's and a few members' histories are written as JSON under ``tests/histories/<release>/``.

    python -m tests.histories.record --release 0.2.0

Record a new set whenever a release changes workflow code; keep the old sets: replaying them is how CI
shows that in-flight workflows of the previous release survive a worker upgrade (README, "Upgrades").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import tempfile
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

from durable_rollouts.config.paths import venv_bin
from durable_rollouts.simengine import SimEngine, SimSettings
from durable_rollouts.workflows import search_attributes as sa
from tests.integration.support import CODING_TASKS, coding_config, make_config, run_to_end, worker

HERE = Path(__file__).parent
RANDOM = {"policy": "random", "random_min_tokens": 4, "random_max_tokens": 8}


async def _save(client: Client, out: Path, name: str, workflow_id: str, runs: int = 8) -> int:
    """Every run (continue-as-new segment) of ``workflow_id``, newest first, as ``<name>.<k>.json``."""
    saved = 0
    async for wf in client.list_workflows(f'WorkflowId = "{workflow_id}"', limit=runs):
        history = await client.get_workflow_handle(wf.id, run_id=wf.run_id).fetch_history()
        (out / f"{name}.{saved}.json").write_text(json.dumps(json.loads(history.to_json()), indent=None))
        saved += 1
    return saved


@contextlib.asynccontextmanager
async def dev_server(*extra_args: str) -> AsyncIterator[Client]:
    """A client of a fresh Temporal dev server (the project's binary, its search attributes), shut down
    after; ``extra_args`` go to ``temporal server start-dev``."""
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=str(venv_bin("temporal")),
        data_converter=pydantic_data_converter,
        search_attributes=sa.ALL,
        dev_server_log_level="error",
        dev_server_extra_args=list(extra_args),
    )
    try:
        yield env.client
    finally:
        await env.shutdown()


def main_of(record: Callable[[Path], Coroutine[Any, Any, None]], doc: str | None) -> None:
    """A recorder's command line: ``--release NAME`` records into tests/histories/NAME/."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--release", required=True, help="folder name under tests/histories/")
    asyncio.run(record(HERE / p.parse_args().release))


async def record(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    suggest = ["--dynamic-config-value", "limit.historyCount.suggestContinueAsNew=40"]
    async with dev_server(*suggest) as client:
        with tempfile.TemporaryDirectory() as home:
            async with (
                SimEngine(SimSettings(**RANDOM)).serve(port=0) as math_url,
                SimEngine(SimSettings(tasks=CODING_TASKS, max_model_len=4096)).serve(port=0) as code_url,
                worker(client, "histories", Path(home)),
            ):
                math = make_config([math_url], "histories", run={"num_groups": 2, "group_size": 2},
                                   rollout={"max_turns": 2})  # fmt: skip
                await run_to_end(client, math, "math")
                coding = coding_config(code_url, "histories", groups=1, size=2)
                await run_to_end(client, coding, "coding")
                long = make_config([math_url], "histories", run={"num_groups": 1, "group_size": 1},
                                   rollout={"max_turns": 30, "max_total_tokens": 4096})  # fmt: skip
                await run_to_end(client, long, "long")
                adaptive = make_config(
                    [math_url], "histories",
                    run={"num_groups": 6, "group_size": 2, "groups_per_run_segment": 2,
                         "max_inflight_groups": 2},
                    admission={"enabled": True, "poll_interval_s": 0.3, "admit_window_s": 0.0},
                )  # fmt: skip
                await run_to_end(client, adaptive, "adaptive")
        counts = {
            "math-run": await _save(client, out, "math-run", "math"),
            "math-group": await _save(client, out, "math-group", "math/g000000"),
            "math-rollout": await _save(client, out, "math-rollout", "math/g000000/0"),
            "coding-run": await _save(client, out, "coding-run", "coding"),
            "coding-rollout": await _save(client, out, "coding-rollout", "coding/g000000/0"),
            "long-rollout": await _save(client, out, "long-rollout", "long/g000000/0"),
            "adaptive-run": await _save(client, out, "adaptive-run", "adaptive"),
        }
    print(json.dumps(counts))
    assert counts["long-rollout"] >= 2, "the long rollout did not continue as new"
    assert counts["adaptive-run"] >= 2, "the adaptive run did not continue as new"


if __name__ == "__main__":
    main_of(record, __doc__)
