"""Terminal-Bench 2 survey, part 3: each built task's own ``solution/solve.sh``, then its own
``tests/test.sh``, through the durable pipeline.

A real Temporal dev server (`harness.temporal_env`), an in-process worker with the real Docker sandbox
backend, and the simulated engine playing Harbor's oracle (``harbor_env.transcripts``: upload solve.sh,
run it, submit), exactly as ``tests/integration/test_harbor.py`` runs the plug-in's examples. The tasks are
listed in a dataset file with ``network_policy = "no-network"`` (the plug-in's documented override; every
Terminal-Bench 2 task leaves ``network_mode`` at Harbor's default, ``public``). The task directories are
used as published: nothing in them is changed.

Each rollout's outcome, reward and reason come from the run's exported records.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from harness import temporal_env

from durable_rollouts.config.load import config_hash, load_config
from durable_rollouts.contracts.types import RunInput
from durable_rollouts.engines.client import EngineClient
from durable_rollouts.environments import registry
from durable_rollouts.records.export import iter_run
from durable_rollouts.sandboxes.egress_policy import EgressPolicy
from durable_rollouts.simengine import Mode, ModeRule, SimEngine, SimSettings
from durable_rollouts.store import open_store
from durable_rollouts.workers.worker import build_workers
from durable_rollouts.workflows.run import RunWorkflow

QUEUE = "tb2-survey"


def dataset_file(
    path: Path, dirs: list[Path], head: tuple[str, ...] = ('network_policy = "no-network"',)
) -> Path:
    """A Harbor dataset file listing ``dirs``, after the lines ``head`` (default: the no-network policy)."""
    lines = [*head, "tasks = ["]
    lines += [f"  {json.dumps(str(d.resolve()))}," for d in dirs]
    path.write_text("\n".join([*lines, "]", ""]), encoding="utf-8")
    return path


async def run_reference(
    dirs: list[Path],
    work: Path,
    command_timeout_s: int,
    head: tuple[str, ...] | None = None,
    egress: dict[str, Any] | None = None,
    config: dict[str, Any] | None = None,
) -> dict[str, dict[str, Any]]:
    """Run every task in ``dirs`` once by its reference solution; task directory name -> its record's
    outcome, reward and reason (and the rollout's seconds). ``head``: the dataset file's settings
    (default: the no-network policy); ``egress``: the run's ``[sandbox.egress]`` (default: none);
    ``config``: more run config overrides (dotted key -> value)."""
    dataset = dataset_file(work / "dataset.toml", dirs, *(() if head is None else (head,)))
    # The plug-in through the registry and its own command line, as every benchmark treats plug-ins.
    tasks = registry.get("harbor").load_tasks(dataset)
    names = {t.id: Path(t.source).name for t in tasks}  # type: ignore[attr-defined]  # a Harbor task
    transcripts = work / "transcripts.jsonl"
    subprocess.run(
        [sys.executable, "-m", "harbor_env.transcripts", str(dataset), "-o", str(transcripts)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    settings = SimSettings(
        transcripts=transcripts,
        mode_rules=[ModeRule(on="request", prefix="", mode=Mode.REFERENCE)],
        max_model_len=262_144,
    )
    overrides = {
        "run.env": "harbor", "run.task_file": str(dataset), "run.num_groups": len(dirs), "run.group_size": 1,
        "run.max_inflight_groups": 2, "temporal.task_queue": QUEUE, "sampling.max_tokens": 2048,
        "rollout.max_turns": 400, "rollout.max_total_tokens": 250_000,
        "sandbox.command_timeout_s": command_timeout_s,
    }  # fmt: skip
    run_id = f"tb2-survey-{int(time.time())}"
    store = open_store(work / "store")
    engine = EngineClient()
    try:
        async with SimEngine(settings).serve(port=0) as url, temporal_env() as env:
            values = {**overrides, **(config or {}), "engine.urls": [url]}
            cfg = load_config(None, [f"{k}={json.dumps(v)}" for k, v in values.items()])
            if egress is not None:
                policy = EgressPolicy.model_validate(egress)
                cfg = cfg.model_copy(update={"sandbox": cfg.sandbox.model_copy(update={"egress": policy})})
            async with contextlib.AsyncExitStack() as stack:
                for w in build_workers(env.client, QUEUE, store, engine, envs={}):
                    await stack.enter_async_context(w)
                handle = await env.client.start_workflow(
                    RunWorkflow.run,
                    RunInput(run_id=run_id, config=cfg, config_hash=config_hash(cfg)),
                    id=run_id, task_queue=QUEUE,
                )  # fmt: skip
                await handle.result()
        out: dict[str, dict[str, Any]] = {}
        for rec in iter_run(store, run_id):
            if rec["kind"] != "rollout":
                continue
            out[names[rec["task_id"]]] = {
                "outcome": rec["outcome"], "reward": rec["reward"], "reason": rec.get("reason"),
                "turns": len(rec.get("turns") or []),
            }  # fmt: skip
        return out
    finally:
        await engine.aclose()
        store.close()


_FETCH_LINE = re.compile(r"^\s*(apt-get|apt|curl|wget|pip3?|source\s+\$HOME/\.local/bin/env)\b")
_RUNNER = re.compile(r"^\s*(uvx\b.*?\s|)pytest\s+(?P<args>.*)$")


def offline_test_sh(text: str) -> str | None:
    """Diagnostic only, never the survey's count: ``test.sh`` with its downloads made no-ops and its test
    runner (``uvx ... pytest`` or ``pytest``) run as the image's own ``python3 -m pytest`` with the same
    test arguments (less ``--ctrf FILE``, a plug-in that is not installed). None when the script has no
    such runner."""
    logical = re.sub(r"\\\n\s*", " ", text).split("\n")
    out: list[str] = []
    runners = 0
    for line in logical:
        m = _RUNNER.match(line)
        if _FETCH_LINE.match(line):
            out.append(f"true  # survey: offline, was: {line.strip()[:80]}")
        elif m:
            args = re.sub(r"--ctrf\s+\S+\s*", "", m.group("args"))
            out.append(f"python3 -m pytest {args}")
            runners += 1
        else:
            out.append(line)
    return "\n".join(out) if runners else None


def offline_copies(dirs: list[Path], into: Path) -> tuple[list[Path], dict[str, str]]:
    """Copies of ``dirs`` whose ``tests/test.sh`` is `offline_test_sh`'s (the rest unchanged), and the
    names left out with why."""
    copies: list[Path] = []
    skipped: dict[str, str] = {}
    for d in dirs:
        script = offline_test_sh((d / "tests" / "test.sh").read_text(errors="replace"))
        if script is None:
            skipped[d.name] = "test.sh runs no pytest the diagnostic can replace"
            continue
        copy = into / d.name
        shutil.copytree(d, copy)
        (copy / "tests" / "test.sh").write_text(script, encoding="utf-8")
        copies.append(copy)
    return copies, skipped
