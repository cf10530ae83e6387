"""The chaos injector: a seeded schedule of faults fired against a live stack and its runs, each logged
with the time it fired, then the ledger check of every run.

Kinds (``KINDS``):

- ``worker_kill``, ``engine_kill``, ``temporal_kill``: SIGKILL the component's process group, leave it down
  for the fault's duration, start the same command line again (``faults.process``); an engine comes back
  under the store's latest published version (``engines.policy.publish`` reloads its weights and label,
  as the stack does at start), Temporal is waited for until it serves;
- ``worker_freeze``, ``engine_freeze``, ``temporal_freeze``: SIGSTOP for the duration, then SIGCONT;
- ``worker_restart``: a graceful stop (SIGTERM) and a start;
- ``container_kill``, ``container_pause`` (for the duration), ``container_oom``: one running sandbox of
  the runs, drawn by the schedule's seed (``faults.containers``);
- ``sandbox_create``: the runs' sandbox image untagged for the duration: every create fails meanwhile
  (the shared default image only when named explicitly: every run on the daemon would feel it);
- ``publish``: a new policy version published to the engines of the latest one, rollouts in flight;
- ``pg_restart``: the store's PostgreSQL server stopped (fast shutdown, by the pid of its data directory's
  ``postmaster.pid``) for the duration, then started again on the same data directory (``faults.pgrestart``);
- network faults between the parts of a cluster of network namespaces (``faults.netfaults``; the network
  given as ``network``, e.g. ``Network.attach`` of a ``Cluster``'s description): ``partition:A/B``,
  ``latency:A[=MS]``, ``loss:A[=PCT]``, ``bandwidth:A[=KBIT]``, each for the duration, then healed.

Components are found by the pid files of the stack home (``<home>/pids/<name>.pid``); the store is the
home's run store. Each event is one JSON line (``fired``, ``cleared``, ``skipped`` with why, ``error``)
in the log file and on stdout.

Invariants: the injector never raises for a fault it could not inject (it logs ``skipped`` or
``error`` and goes on); every fault it fired is cleared before ``run`` returns (thawed, unpaused, tag
restored, process started again, link healed, database server started again), also when the schedule
is cancelled (the heal runs in the fault's ``finally``); target choices are drawn from a
``random.Random`` seeded with the schedule's seed, so a run of the same command against the same stack
draws the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker.errors
import httpx

from durable_rollouts.faults import containers, netfaults, pgrestart, process
from durable_rollouts.faults.ledger import LedgerReport, check_run
from durable_rollouts.faults.schedule import Planned
from durable_rollouts.sandboxes.base import DEFAULT_IMAGE

PROCESS_KINDS = {
    "worker_kill": ("worker", "kill"),
    "worker_freeze": ("worker", "freeze"),
    "worker_restart": ("worker", "restart"),
    "engine_kill": ("engine", "kill"),
    "engine_freeze": ("engine", "freeze"),
    "temporal_kill": ("temporal", "kill"),
    "temporal_freeze": ("temporal", "freeze"),
}
CONTAINER_KINDS = ("container_kill", "container_pause", "container_oom")
KINDS = (*PROCESS_KINDS, *CONTAINER_KINDS, "sandbox_create", "publish", "pg_restart")
"""The kinds named as they are; network kinds carry their parts (``partition:A/B``: `check_kind`)."""
INSTANT = frozenset({"worker_restart", "container_kill", "container_oom", "publish"})
"""Kinds with no duration (the schedule gives them 0)."""
ENGINE_READY_S = 300.0
TEMPORAL_READY_S = 60.0
WORKER_READY_S = 300.0
"""How long a restarted worker is given to poll its queue, started again meanwhile each time it exits."""


def check_kind(kind: str) -> None:
    """Raise ValueError (one line) unless ``kind`` is one of `KINDS` or a network fault's kind."""
    if kind in KINDS or netfaults.parse(kind) is not None:
        return
    raise ValueError(f"unknown {kind}; kinds: {', '.join(KINDS)}, {', '.join(netfaults.FORMS)}")


@dataclass
class Chaos:
    """Injects faults into the stack of ``home`` and the sandboxes of ``run_ids``.

    ``image``: the sandbox image ``sandbox_create`` untags (default: the first run's ``sandbox.image``);
    ``weights``: the directory ``publish`` publishes (default: the latest version's own weights, under a
    new id); ``client``: a Temporal client (for the ledger's Temporal rule and Temporal's readiness);
    ``network``: the `faults.netns.Network` whose parts the network kinds name.
    """

    home: Path
    run_ids: list[str]
    log_path: Path
    seed: int = 0
    store: Any = None
    client: Any = None
    image: str | None = None
    weights: Path | None = None
    network: Any = None
    echo: Callable[[str], None] = print
    counts: Counter[str] = field(default_factory=Counter)
    events: list[dict[str, Any]] = field(default_factory=list)
    _rng: random.Random = field(init=False)
    _t0: float = field(init=False, default=0.0)
    _docker: Any = field(init=False, default=None)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        if self.store is None:
            from durable_rollouts.store import RunStore

            self.store = RunStore(self.home)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)

    # -- logging ---------------------------------------------------------------------------------------

    def _log(self, event: str, p: Planned, **detail: Any) -> dict[str, Any]:
        now = time.time()
        row = {"event": event, "kind": p.kind, "at": round(now, 3), "t": round(now - self._t0, 3),
               "planned_s": p.at_s, "duration_s": p.duration_s, **detail}  # fmt: skip
        self.events.append(row)
        line = json.dumps(row, sort_keys=True)
        with self.log_path.open("a") as f:
            f.write(line + "\n")
        self.echo(line)
        return row

    # -- the schedule ----------------------------------------------------------------------------------

    async def run(self, plan: list[Planned]) -> Counter[str]:
        """Fire ``plan`` (times from now); returns the faults injected by kind, once all are cleared."""
        self._t0 = time.time()
        tasks: list[asyncio.Task[None]] = []
        for p in plan:
            await asyncio.sleep(max(0.0, self._t0 + p.at_s - time.time()))
            tasks.append(asyncio.ensure_future(self._inject(p)))
        await asyncio.gather(*tasks)
        return self.counts

    async def _inject(self, p: Planned) -> None:
        try:
            await self._fire(p)
        except Exception as e:  # a fault that could not be injected is logged, never fatal
            self._log("error", p, error=f"{type(e).__name__}: {e}"[:400])

    async def _fire(self, p: Planned) -> None:
        if p.kind in PROCESS_KINDS:
            await self._process(p, *PROCESS_KINDS[p.kind])
        elif p.kind in CONTAINER_KINDS:
            await self._container(p)
        elif p.kind == "sandbox_create":
            await self._sandbox_create(p)
        elif p.kind == "publish":
            await self._publish(p)
        elif p.kind == "pg_restart":
            await self._pg_restart(p)
        elif (net := netfaults.parse(p.kind)) is not None:
            await self._network(p, net)
        else:
            check_kind(p.kind)

    def _fired(self, p: Planned, **detail: Any) -> None:
        self.counts[p.kind] += 1
        self._log("fired", p, **detail)

    # -- process faults --------------------------------------------------------------------------------

    async def _process(self, p: Planned, component: str, action: str) -> None:
        found = process.targets(self.home, component)
        if not found:
            self._log("skipped", p, why=f"no live {component} in {self.home}/pids")
            return
        t = self._rng.choice(found)
        if action == "freeze":
            with process.frozen(t):
                self._fired(p, target=str(t))
                await asyncio.sleep(p.duration_s)
            self._log("cleared", p, target=str(t))
            return
        if action == "restart":
            self._fired(p, target=str(t))
            await asyncio.to_thread(process.stop, t)
        else:
            await asyncio.to_thread(process.kill, t)
            self._fired(p, target=str(t))
            await asyncio.sleep(p.duration_s)
        new, starts = await self.started_again(t, component)
        self._log("cleared", p, target=str(t), new_pid=new.pid, **({"starts": starts} if starts > 1 else {}))

    async def started_again(self, t: process.Target, component: str) -> tuple[process.Target, int]:
        """Start ``t`` again and wait until it serves (`_ready`); a worker that exits before it polls its
        queue (its store unreachable at that moment: a process's first store connection is not retried) is
        started again, as a supervisor with a restart policy would, for up to `WORKER_READY_S`. Returns the
        serving target and how many starts it took."""
        new = await asyncio.to_thread(process.start, t)
        starts = 1
        if component != "worker":
            await self._ready(component)
            return new, starts
        deadline = time.monotonic() + WORKER_READY_S
        while not await self._worker_polls(new):
            if time.monotonic() > deadline:
                raise process.ProcessFaultError(f"{new}: no poll {WORKER_READY_S:.0f} s after its restart")
            if process.find(self.home, new.name) is None:  # it exited while starting: start it again
                await asyncio.sleep(min(10.0, 2.0 * starts))
                new = await asyncio.to_thread(process.start, new)
                starts += 1
                continue
            await asyncio.sleep(0.5)
        return new, starts

    async def _worker_polls(self, t: process.Target) -> bool:
        """Whether worker ``t`` polls its ``--task-queue`` (as Temporal lists its pollers); without a
        Temporal client or a queue on its command line, whether it runs."""
        queue = t.argv[t.argv.index("--task-queue") + 1] if "--task-queue" in t.argv[:-1] else None
        if self.client is None or queue is None:
            return process.find(self.home, t.name) is not None
        from durable_rollouts.environments.fleet import live_pollers

        try:
            return any(i.startswith(f"{t.pid}@") for i in await live_pollers(self.client, queue))
        except Exception:  # Temporal unreachable meanwhile: not yet
            return False

    async def _ready(self, component: str) -> None:
        """Wait until a restarted component serves again (the engine under the latest version)."""
        if component == "engine":
            await asyncio.to_thread(self._engine_back)
        elif component == "temporal" and self.client is not None:
            deadline = time.monotonic() + TEMPORAL_READY_S
            while time.monotonic() < deadline:
                with contextlib.suppress(Exception):
                    if await self.client.service_client.check_health():
                        return
                await asyncio.sleep(0.5)

    def _engine_back(self) -> None:
        from durable_rollouts.engines.policy import publish

        latest = self._latest_policy()
        if latest is None:
            return
        deadline = time.monotonic() + ENGINE_READY_S
        with httpx.Client(timeout=10) as http:
            for url in latest["engines"]:
                while time.monotonic() < deadline:
                    with contextlib.suppress(httpx.HTTPError):
                        if http.get(f"{url}/health").status_code == 200:
                            break
                    time.sleep(0.5)
        publish(latest["engines"], latest["version"], Path(latest["weights_dir"]), self.store)

    def _latest_policy(self) -> dict[str, Any] | None:
        published = [r for r in self.store.policies() if r["status"] == "published"]
        return published[-1] if published else None

    # -- container faults ------------------------------------------------------------------------------

    def _dc(self) -> Any:
        if self._docker is None:
            self._docker = containers.client()
        return self._docker

    async def _container(self, p: Planned) -> None:
        running = []
        for r in self.run_ids:
            running += await asyncio.to_thread(containers.run_containers, r, self._dc())
        if not running:
            self._log("skipped", p, why="no running sandbox of the runs")
            return
        c = self._rng.choice(running)
        target = f"container {c.name} (rollout {containers.rollout_of(c)})"
        try:
            await self._container_fault(p, c, target)
        except (docker.errors.NotFound, containers.ContainerFaultError) as e:
            if await asyncio.to_thread(_running, c):
                raise
            # its rollout ended (the sandbox removed) or another fault holds it: this one never landed
            self._log("skipped", p, target=target, why=f"the container stopped first ({e})"[:300])

    async def _container_fault(self, p: Planned, c: Any, target: str) -> None:
        if p.kind == "container_kill":
            await asyncio.to_thread(containers.kill, c)
            self._fired(p, target=target)
        elif p.kind == "container_oom":
            oom_killed = await asyncio.to_thread(containers.oom, c)
            self._fired(p, target=target, oom_killed=oom_killed)
        else:  # a failed pause raises ContainerFaultError once the container is thawed (logged as an error)
            await asyncio.to_thread(containers.pause, c)
            try:
                self._fired(p, target=target)
                await asyncio.sleep(p.duration_s)
            finally:  # thawed whatever Docker does (its unpause may hang): how is logged
                healed = await asyncio.to_thread(containers.unpause, c)
            self._log("cleared", p, target=target, healed=healed)

    async def _sandbox_create(self, p: Planned) -> None:
        image = self.image or await asyncio.to_thread(self._run_image)
        if image is None:
            self._log("skipped", p, why="no run with a sandbox image (give --image)")
            return
        if image == DEFAULT_IMAGE and self.image is None:
            why = f"the runs use the shared default image {image}: give it with --image to untag it"
            self._log("skipped", p, why=why)
            return
        ctx = containers.image_unavailable(image, self._dc())
        hold = await asyncio.to_thread(ctx.__enter__)
        try:
            self._fired(p, target=f"image {image}", held_as=hold)
            await asyncio.sleep(p.duration_s)
        finally:
            await asyncio.to_thread(ctx.__exit__, None, None, None)
        self._log("cleared", p, target=f"image {image}")

    def _run_image(self) -> str | None:
        """The image of a running sandbox of the runs, else the first run's ``sandbox.image``."""
        for r in self.run_ids:
            for c in containers.run_containers(r, self._dc()):
                if c.image.tags:
                    return str(c.image.tags[0])
        for r in self.run_ids:
            run = self.store.get_run(r)
            if run is not None and (image := json.loads(run["config_json"]).get("sandbox", {}).get("image")):
                return str(image)
        return None

    # -- publish ---------------------------------------------------------------------------------------

    async def _publish(self, p: Planned) -> None:
        from durable_rollouts.engines.policy import publish

        latest = self._latest_policy()
        if latest is None:
            self._log("skipped", p, why="no published policy in the store (which engines?)")
            return
        weights = self.weights or Path(latest["weights_dir"])
        version = f"chaos-{int(time.time() * 1000)}"
        rec = await asyncio.to_thread(publish, latest["engines"], version, weights, self.store)
        self._fired(p, target=",".join(rec.engines), version=version, steps=[s.step for s in rec.steps])

    # -- network and database faults -------------------------------------------------------------------

    async def _network(self, p: Planned, fault: netfaults.NetFault) -> None:
        if self.network is None:
            self._log("skipped", p, why="no network of namespaces given (rollouts chaos --network FILE)")
            return
        fault.check(self.network)
        ctx = fault.injected(self.network)
        await asyncio.to_thread(ctx.__enter__)
        cut_short = True
        try:
            self._fired(p, target=fault.target)
            await asyncio.sleep(p.duration_s)
            cut_short = False
        finally:  # synchronous: a cancelled schedule heals (and logs it) before it returns
            ctx.__exit__(None, None, None)
            self._log("cleared", p, target=fault.target, **({"cut_short": True} if cut_short else {}))

    async def _pg_restart(self, p: Planned) -> None:
        db: Any = getattr(self.store, "db", None)
        if db is None or db.dialect != "postgresql":
            self._log("skipped", p, why=f"the store at {self.store.location} is not PostgreSQL")
            return
        server = await asyncio.to_thread(pgrestart.find_for, db)
        await asyncio.to_thread(db.close)  # this process's own connections end with the server anyway
        await asyncio.to_thread(pgrestart.stop, server)
        try:
            self._fired(p, target=str(server))
            await asyncio.sleep(p.duration_s)
        except BaseException:  # synchronous: a cancelled schedule starts the server again before it returns
            new = pgrestart.start(server)
            self._log("cleared", p, target=str(server), new_pid=new.pid, cut_short=True)
            raise
        new = await asyncio.to_thread(pgrestart.start, server)
        self._log("cleared", p, target=str(server), new_pid=new.pid)

    # -- the ledger ------------------------------------------------------------------------------------

    async def ledger(
        self, wait_s: float = 600.0, backend: Any = None, pool: Any = None
    ) -> list[LedgerReport]:
        """Wait (up to ``wait_s`` each) for the runs to end, then the ledger check of each."""
        reports = []
        for r in self.run_ids:
            if self.client is not None:
                with contextlib.suppress(Exception):  # a run that fails or outlives the wait: the ledger says
                    await asyncio.wait_for(self.client.get_workflow_handle(r).result(), wait_s)
            reports.append(await check_run(self.store, r, client=self.client, backend=backend, pool=pool))
        return reports


def _running(c: Any) -> bool:
    try:
        c.reload()
    except docker.errors.NotFound:
        return False
    return bool(c.status == "running")
