"""Adaptive admission vs a fixed cap vs synchronous batches, on a simulated vLLM fleet under agent rollouts.

This bench isolates the admission policy: a bare asyncio driver (not Temporal, no sandboxes: tool calls are
sleeps) plays multi-turn rollouts over real HTTP against in-process simulated engines (`simengine` with its
timing model: continuous batching, a finite KV block pool, prefix caching, recompute preemption; step costs
of an 8B model on an H100). Each turn is one token-in/token-out ``/inference/v1/generate`` call through
`EngineClient` whose prompt is the whole context so far; a rollout stays on the replica it was admitted to.

Workload (seeded; the same rollouts in the same order for every policy): groups of ``--group-size`` share a
task prompt behind a system prompt shared by all; ``--min-turns``..``--max-turns`` turns of heavy-tailed
length (median ``--median-tokens``; 2% of rollouts generate ten times longer turns and mostly end cut at
``--max-model-len``); after each turn a log-normal tool wait (median ``--tool-median-s``) and a 64-384 token
tool result. Policies, each on a fresh fleet for the same simulated budget:

- adaptive: every 5 s it reads every engine's /metrics (`fetch_reading`), runs `AdmissionController.step`
  (the default ``probe`` preset), admits what it allows and cancels what it names;
- prime-rl: the same loop with ``preset = "prime-rl"`` (the prime-rl orchestrator's rules and constants);
- fixed: the same loop with ``min_inflight == max_inflight == KV capacity / max_model_len``;
- sync: admit that many rollouts at once, wait for all of them to end, repeat.

``--fixed-cap`` replaces that cap (KV capacity / max_model_len) of fixed and sync by a hand-picked one.
``--tail-fraction`` sets the share of ten-times-longer turns; ``--drift-from-tokens``/``--drift-to-tokens``
make turn lengths drift during the run as a training policy's would: a turn is cut (and the rollout goes on)
at a per-turn limit that grows linearly in simulated time from the first value to the second.
``bench/admission_family.py`` runs a family of such workloads with a sweep of fixed caps (the oracle).

Length-aware groups (``--length-aware``, Seer-style; the policy is `bench/length_aware.py`): the controlled
policies (adaptive, prime-rl, fixed) route the controller's admit count through `LengthAwareScheduler`:
a new group starts ``--probe`` members, its other members wait until one of its members finished (or its
first wave all failed), then start longest predicted first (``--la-predictor``: max or mean of the
finished siblings' lengths), before new groups' probes; ``--la-release progress`` releases them already
after a first-wave member's first turn (its tokens so far as the prediction); ``--la-long-factor`` sends
members predicted that many times the mean finished length to the replica holding the fewest context
tokens. Without the flag rollouts are admitted one at a time in group order, as before; sync always is.
``--step-groups N`` makes the controlled policies synchronous RL steps (Seer's setting): N groups are
offered, admitted under the controller's cap, and the next N only once all N are complete (checked at each
poll); it reports each step's time. Sibling lengths correlate only with ``--task-sigma`` > 0 (a per-task
log-normal length scale, simengine's ``random_task_sigma``; ``--tail-key task`` draws the 10x tail
per task instead of per rollout).

What a run reports is `fleet_report.py`'s (its docstring lists it).

Invariant: every admitted rollout ends exactly once: accepted, cancelled, failed, or unfinished when the
budget runs out (unfinished ones are neither accepted nor wasted); per group, its started members are its
ended plus its unfinished ones, and with ``--length-aware`` the members it never started are the
scheduler's held ones.

    python bench/admission_fleet.py --out bench/results/admission_fleet.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from fleet_groups import GroupBook, group_stats  # bench/ is on sys.path as a script
from fleet_report import fleet_stats, ratios, summarize, table
from fleet_workload import Rollout, Workload
from length_aware import GroupOffer, LengthAwareConfig, LengthAwareScheduler, Outcome

from durable_rollouts.admission.controller import AdmissionConfig, AdmissionController, Inflight
from durable_rollouts.contracts.types import SamplingParams
from durable_rollouts.engines.client import EngineClient
from durable_rollouts.engines.metrics import fetch_reading
from durable_rollouts.simengine import PolicyName, SimEngine, SimSettings, TimingSettings
from durable_rollouts.simengine.clock import PacedClock
from durable_rollouts.turns.budget import turn_budget, turn_truncation

MODEL = "tiny"
POLICIES = ("adaptive", "prime-rl", "fixed", "sync")
POLL_S = 5.0
"""Simulated seconds between /metrics polls: the reference's interval, which its poll-counted rules assume."""


@dataclass
class Live:
    rollout: Rollout
    replica: int
    admitted_at: float
    group: int
    member: int
    tokens: int = 0
    context: int = 0
    """Its context's length (prompt, sampled and tool tokens): the KV footprint it ends with."""
    task: asyncio.Task[None] | None = None


@dataclass
class Tally:
    admitted: int = 0
    accepted: int = 0
    truncated: int = 0
    cancelled: int = 0
    cancelled_tokens: int = 0
    failed: int = 0
    unfinished: int = 0
    accepted_tokens: int = 0
    """Tokens sampled in the turns of accepted rollouts."""
    unfinished_tokens: int = 0
    """Tokens sampled in the returned turns of rollouts unfinished at the end of the budget."""
    errors: list[str] = field(default_factory=list)


class Driver:
    """Runs rollouts on the fleet; admission decisions come from outside. Time is the shared `PacedClock`."""

    def __init__(
        self, args: argparse.Namespace, urls: list[str], workload: Workload, clock: PacedClock
    ) -> None:
        """Turn limits drift from ``args.drift_from_tokens`` to ``args.drift_to_tokens`` when both are set."""
        self.args, self.urls, self.workload, self.clock = args, urls, workload, clock
        self.clients = [EngineClient(timeout_s=600) for _ in urls]
        self.live: dict[str, Live] = {}
        self.tally = Tally()
        self.groups: dict[int, GroupBook] = {}
        la = length_aware_config(args)
        self.sched = LengthAwareScheduler(la) if la.enabled else None
        self._next = 0
        self._next_group = 0
        self._step = (0, args.step_groups or 1 << 40, 0.0)
        """Synchronous steps (``--step-groups``): the groups [first, end) of the step running, its start."""
        self.steps: list[float] = []
        """Each completed step's time: its last group's completion - its start."""
        self._t0 = clock.now()
        self.complete = (0, 0)
        """Rollouts finished since the controller last saw them, and their summed final contexts."""

    def now(self) -> float:
        """Simulated seconds since the start."""
        return self.clock.now() - self._t0

    async def sleep_until(self, t: float) -> None:
        await self.clock.sleep_until(self._t0 + t)

    def turn_limit(self) -> int | None:
        """The drifting per-turn token limit now (None: no drift)."""
        a = self.args
        if a.drift_from_tokens is None or a.drift_to_tokens is None:
            return None
        f = min(1.0, self.now() / a.budget_s)
        return max(1, round(a.drift_from_tokens + f * (a.drift_to_tokens - a.drift_from_tokens)))

    def next_step(self) -> None:
        """With ``--step-groups``: once every group of the step is complete, the next step's groups open."""
        first, end, began = self._step
        if not self.args.step_groups:
            return
        books = [self.groups.get(g) for g in range(first, end)]
        if all(b is not None and b.ended == self.args.group_size for b in books):
            self.steps.append(max(b.last_end for b in books if b is not None) - began)
            self._step = (end, end + self.args.step_groups, self.now())

    def admit(self, n: int) -> list[asyncio.Task[None]]:
        """Start the next ``n`` rollouts in order (a group's members may span two calls), within the step."""
        tasks = []
        n = min(n, self._step[1] * self.args.group_size - self._next)
        for _ in range(n):
            g, m = divmod(self._next, self.args.group_size)
            self._next += 1
            tasks.append(self._start(g, m))
        return tasks

    def admit_length_aware(self, n: int) -> None:
        """Start what `LengthAwareScheduler.plan` picks for ``n`` (at most ``n`` new groups are offered)."""
        assert self.sched is not None
        size = self.args.group_size
        last = min(self._next_group + n, self._step[1])
        offered = [GroupOffer(group_id=f"g{g:05d}", size=size) for g in range(self._next_group, last)]
        load: dict[str, float] | None = None
        if self.sched.config.long_factor is not None:
            load = {f"e{i}": 0.0 for i in range(len(self.urls))}
            for x in self.live.values():
                load[f"e{x.replica}"] += len(x.rollout.prompt) + x.tokens
        plan = self.sched.plan(n, offered, load)
        self._next_group += len(plan.admitted)
        for s in plan.starts:
            self._start(int(s.group_id[1:]), s.member, int(s.replica[1:]) if s.replica else None)

    def _start(self, g: int, m: int, replica: int | None = None) -> asyncio.Task[None]:
        rollout = self.workload.rollout(g * self.args.group_size + m)
        if replica is None:
            load = Counter(x.replica for x in self.live.values())
            replica = min(range(len(self.urls)), key=load.__getitem__)
        live = Live(rollout, replica, self.now(), g, m)
        live.task = asyncio.create_task(self._run(live))
        self.live[rollout.rid] = live
        self.tally.admitted += 1
        self.groups.setdefault(g, GroupBook(self.now())).started += 1
        return live.task

    def _ended(self, live: Live, outcome: Outcome) -> None:
        book = self.groups[live.group]
        book.ended += 1
        book.last_end = self.now()
        if outcome == "finished":
            book.accepted_tokens.append(live.tokens)
        if self.sched is not None:
            self.sched.end(f"g{live.group:05d}", live.member, outcome, live.tokens)

    def cancel(self, rid: str) -> None:
        live = self.live.pop(rid, None)
        if live is not None and live.task is not None:
            live.task.cancel()
            self.tally.cancelled += 1
            self.tally.cancelled_tokens += live.tokens
            self._ended(live, "cancelled")

    def inflight(self) -> list[Inflight]:
        return [
            Inflight(rollout_id=r, admitted_at=x.admitted_at, tokens=x.tokens) for r, x in self.live.items()
        ]

    async def stop(self) -> None:
        """End of budget: the rollouts still running are unfinished."""
        tasks = [x.task for x in self.live.values() if x.task is not None]
        self.tally.unfinished += len(self.live)
        self.tally.unfinished_tokens += sum(x.tokens for x in self.live.values())
        self.live.clear()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for c in self.clients:
            await c.aclose()

    async def _run(self, live: Live) -> None:
        try:
            truncated = await self._turns(live)
        except Exception as e:  # a failed rollout is data, not a crash of the run
            if self.live.pop(live.rollout.rid, None) is not None:
                self.tally.failed += 1
                self.tally.errors.append(f"{type(e).__name__}: {e}"[:200])
                self._ended(live, "failed")
            return
        if self.live.pop(live.rollout.rid, None) is not None:
            self.tally.accepted += 1
            self.tally.accepted_tokens += live.tokens
            self.tally.truncated += truncated
            self.complete = (self.complete[0] + 1, self.complete[1] + live.context)
            self._ended(live, "finished")

    async def _turns(self, live: Live) -> bool:
        """Play the rollout; True when it was cut at the context length."""
        a, r = self.args, live.rollout
        url, client = self.urls[live.replica], self.clients[live.replica]
        sampling = SamplingParams(
            temperature=1.0, top_p=1.0, top_k=-1, max_tokens=a.max_model_len, seed=r.seed, logprob_mode="raw"
        )
        context = list(r.prompt)
        window = a.max_model_len  # these rollouts run until the context is full: the window is their limit
        for t, (tool, wait_s) in enumerate(r.turns):
            if turn_budget(len(context), window, window).truncated is not None:
                return True
            limit = self.turn_limit()
            ask = turn_budget(len(context), window, window if limit is None else limit).max_tokens
            gen = await client.generate(url, MODEL, context, sampling, ask, f"{r.rid}/{t}")
            live.tokens += len(gen.token_ids)
            if self.sched is not None:
                self.sched.progress(f"g{live.group:05d}", live.member, live.tokens)
            context += gen.token_ids
            live.context = len(context)
            if turn_truncation(gen.finish_reason, len(context), window) is not None:
                return True
            if t + 1 < len(r.turns):
                await self.sleep_until(self.now() + wait_s)
                context += tool
                live.context = len(context)
        return False


def engine_settings(args: argparse.Namespace) -> SimSettings:
    return SimSettings(
        model=MODEL,
        policy=PolicyName.RANDOM,
        tasks=None,
        max_model_len=args.max_model_len,
        num_gpu_blocks=args.kv_blocks,
        block_size=16,
        random_length="heavy_tail",
        random_median_tokens=args.median_tokens,
        random_length_sigma=0.5,
        random_tail_fraction=args.tail_fraction,
        random_tail_factor=10.0,
        random_tail_key=args.tail_key,
        random_task_sigma=args.task_sigma,
        timing=TimingSettings(time_scale=args.time_scale),  # the 8B-on-H100 step costs
    )


def length_aware_config(args: argparse.Namespace) -> LengthAwareConfig:
    return LengthAwareConfig(
        enabled=args.length_aware,
        probe=args.probe,
        predictor=args.la_predictor,
        release=args.la_release,
        long_factor=args.la_long_factor,
        max_held=args.la_max_held,
    )


def fixed_cap(args: argparse.Namespace) -> int:
    """The cap of fixed and sync: summed KV capacity / max_model_len, unless --fixed-cap overrides it."""
    return args.fixed_cap or max(1, args.replicas * args.kv_blocks * 16 // args.max_model_len)


async def controlled(
    driver: Driver, cfg: AdmissionConfig, group_size: int, budget: float, trace: list[Any]
) -> None:
    """Adaptive or fixed: poll the engines' /metrics and follow `AdmissionController.step`."""
    ctrl = AdmissionController(cfg, group_size=group_size)
    async with httpx.AsyncClient(timeout=10) as http:
        while (now := driver.now()) < budget:
            polls = (fetch_reading(http, url, f"e{i}", now) for i, url in enumerate(driver.urls))
            readings = await asyncio.gather(*polls)
            (ended, ended_tokens), driver.complete = driver.complete, (0, 0)
            d = ctrl.step(now, readings, driver.inflight(), ended, ended_tokens)
            for rid in d.cancel:
                driver.cancel(rid)
            driver.next_step()
            if driver.sched is not None:
                driver.admit_length_aware(d.admit)
            else:
                driver.admit(d.admit)
            trace.append([round(now, 1), d.cap, len(driver.live), round(d.kv_usage or 0.0, 3), d.reasons])
            await driver.sleep_until(min(now + POLL_S, budget))


async def synchronous(driver: Driver, cap: int, budget: float, trace: list[Any]) -> None:
    """Admit ``cap`` rollouts, wait for all of them, repeat."""
    timer = asyncio.create_task(driver.sleep_until(budget))
    trace.append([0.0, cap, cap, None, []])
    try:
        while not timer.done():
            pending: set[asyncio.Future[Any]] = set(driver.admit(cap))
            while pending and not timer.done():
                _, pending = await asyncio.wait(pending | {timer}, return_when=asyncio.FIRST_COMPLETED)
                pending.discard(timer)
    finally:
        timer.cancel()


async def sample_inflight(
    driver: Driver, engines: list[SimEngine], samples: list[int], storms: list[float]
) -> None:
    """Rollouts in flight, and storm polls from the engines' own counters, every poll interval (the same
    sampling for every policy; the storm test is `AdmissionConfig`'s, rule P1)."""
    cfg = AdmissionConfig()
    last: list[int | None] = [None] * len(engines)
    while True:
        samples.append(len(driver.live))
        storming = False
        for i, e in enumerate(engines):
            if e.steps is None:
                continue
            sched = e.steps.scheduler
            total = sched.stats.preemptions
            prev = last[i]
            new = total - prev if prev is not None else 0
            last[i] = total
            storming |= new >= cfg.storm_min_preemptions and new > cfg.storm_fraction * sched.running
        if storming:
            storms.append(driver.now())
        await driver.sleep_until(driver.now() + POLL_S)


async def run_policy(name: str, args: argparse.Namespace, workload: Workload) -> dict[str, Any]:
    cap = fixed_cap(args)
    trace: list[Any] = []
    inflight: list[int] = []
    storms: list[float] = []
    clock = PacedClock(args.time_scale)
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(clock.aclose)
        engines = [SimEngine(engine_settings(args), clock) for _ in range(args.replicas)]
        urls = [await stack.enter_async_context(e.serve(port=0)) for e in engines]
        clock.start()
        driver = Driver(args, urls, workload, clock)
        sampler = asyncio.create_task(sample_inflight(driver, engines, inflight, storms))
        wall0 = asyncio.get_running_loop().time()
        # A starved process reaches the simulated budget late; past --max-wall-s it stops where it got.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(args.max_wall_s):
                if name == "sync":
                    await synchronous(driver, cap, args.budget_s, trace)
                else:
                    bounds: dict[str, Any] = {"min_inflight": cap, "max_inflight": cap}
                    if name != "fixed":
                        bounds = {"preset": "probe" if name == "adaptive" else "prime-rl"}
                    cfg = AdmissionConfig(max_model_len=args.max_model_len, **bounds)
                    await controlled(driver, cfg, args.group_size, args.budget_s, trace)
        sampler.cancel()
        sim_s, wall_s = driver.now(), asyncio.get_running_loop().time() - wall0
        fleet = fleet_stats(engines, sim_s)
        fleet.update(
            clock_paused_s=clock.paused_s, sim_s=sim_s, wall_s=wall_s, trace=trace, inflight=inflight
        )
        fleet["storm_polls"] = len(storms)
        held = driver.sched.held() if driver.sched is not None else None
        await driver.stop()
    fleet["groups"] = group_stats(
        driver.groups, driver.tally, driver.args.group_size, driver.steps, sim_s, held
    )
    label = f"{name}+la" if driver.sched is not None else name
    return summarize(label, driver.tally, fleet)


async def run_all(args: argparse.Namespace) -> dict[str, Any]:
    workload = Workload(args)
    results = {}
    for name in args.policies:
        results[name] = await run_policy(name, args, workload)
        r = results[name]
        print(
            f"{name}: {r['accepted']} accepted in {r['sim_s']:.0f} simulated s ({r['wall_s']:.0f} s)",
            flush=True,
        )
    return {"config": {k: v for k, v in vars(args).items() if k != "out"}, "results": results}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--kv-blocks", type=int, default=1536, help="KV blocks of 16 tokens per replica")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--time-scale", type=float, default=25.0, help="simulated seconds per wall second")
    p.add_argument("--budget-s", type=float, default=900.0, help="simulated seconds per policy")
    p.add_argument("--max-wall-s", type=float, default=60.0, help="wall seconds per policy at most")
    p.add_argument(
        "--fixed-cap", type=int, default=None, help="cap of fixed and sync (default: KV / max len)"
    )
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--min-turns", type=int, default=4)
    p.add_argument("--max-turns", type=int, default=10)
    p.add_argument("--median-tokens", type=int, default=150, help="median turn length")
    p.add_argument("--tool-median-s", type=float, default=2.0, help="median tool wait (simulated s)")
    p.add_argument("--tail-fraction", type=float, default=0.02, help="share of 10x longer turns")
    p.add_argument("--drift-from-tokens", type=int, default=None, help="per-turn limit at the start")
    p.add_argument("--drift-to-tokens", type=int, default=None, help="per-turn limit at the budget's end")
    p.add_argument("--task-sigma", type=float, default=0.0, help="per-task log-normal length scale spread")
    p.add_argument("--tail-key", choices=["request", "rollout", "task"], default="rollout", help="tail per")
    la = p.add_argument_group("length-aware groups (bench/length_aware.py)")
    p.add_argument("--step-groups", type=int, default=None, help="synchronous steps of this many groups")
    la.add_argument("--length-aware", action="store_true", help="start groups in waves, longest first")
    la.add_argument("--probe", type=int, default=1, help="first-wave members per group")
    la.add_argument("--la-predictor", choices=["max", "mean"], default="max")
    la.add_argument("--la-release", choices=["finish", "progress"], default="finish")
    la.add_argument("--la-long-factor", type=float, default=None, help="replica hint threshold")
    la.add_argument("--la-max-held", type=int, default=None, help="members held behind unreleased groups")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    report = asyncio.run(run_all(args))
    report["ratios"] = ratios(report["results"])
    print(table(report["results"]))
    for k, v in report["ratios"].items():
        print(f"accepted rollouts per second, {k}: {v:.2f}x")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
