"""The stale-queue workbench: the same trainer capacity under different admission and queue limits.

A trainer consumes ``--batch-groups`` (B) complete groups per step, trains for ``--step-s`` (T) simulated
seconds, then publishes a new policy version; it takes its groups from the real `trainer.feed.TrainerFeed`
(``take(need, current_version, max_lag)``) over a real `RunStore` in which every finished rollout is written
as the pipeline writes it (prompt segment, one model segment with the engine's per-token versions, the
rollout row, the group row once every member is in) and every version is published in the store's
``policies`` table in order. While it has fewer than B groups for a step it waits (trainer idle).

Generation comes from a simulated fleet in virtual time: ``--replicas`` engines, each simengine's
`StepScheduler` (continuous batching over a finite KV block pool, prefix caching, recompute preemption;
the 8B-on-H100 step costs of `simengine.timing`), stepped in simulated-time order by this file (no HTTP,
no wall clock, fully deterministic). Every token is labelled with the version published when its step
began, so a rollout that spans a publish records both versions, as vLLM reports them. A group's members run
on one replica. The workload is seeded and identical for every policy: groups of ``--group-size`` share a
task prompt behind a shared system prompt; output lengths are log-normal (median ``--median-tokens``) with
a ``--tail-fraction`` of rollouts ``--tail-factor`` times longer.

Admission policies (each admits whole groups, never more rollouts than the fleet runs at once,
``replicas × max_num_seqs``):

- ``baseline``: as fast as the fleet allows (unbounded queue);
- ``fixed-Q``: only while waiting + in-flight groups < Q (Q = multiples of B, ``--fixed``);
- ``adaptive``: only while waiting + in-flight groups < what the trainer will consume within the lag window:
  the rest of the current step's batch plus ``max_lag × B`` (a group admitted now is sampled by the current
  version, which stays fresh for that many more groups), capped by what the run has left to consume;
- ``sync``: only while waiting + in-flight groups < the rest of the current step's batch (nothing generates
  while the trainer trains; the trainer waits for the slowest group of its batch).

Over-provisioning (``--overprovision K``, as ``run.overprovision``): a limit plus K groups. The feed takes
the first complete groups and keeps the late ones for the next batch (``sync +K``, ``fixed-B +K``); ``sync
+K drop`` does what over-provisioning usually does: once a batch is full the groups still generating are
aborted (members are written only once the whole group is in, so an aborted group is no record; its tokens
are ``aborted_tokens``). The length mix (mean, p90 sampled tokens per rollout) of the consumed groups
against every admitted group's shows the skew.

Invariant (checked for every policy): the books balance in records and sampled tokens, generated = consumed
+ discarded + waiting (`Ledger.check`), and the feed's books equal this file's own tally of every take.
Rollouts still generating when the trainer finishes its last step are not records; their tokens are
reported apart (``in_flight_tokens``).

    python bench/stale_queue.py --out bench/results/stale_queue.json
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from durable_rollouts.simengine.settings import TimingSettings
from durable_rollouts.simengine.timing import Seq, StepScheduler
from durable_rollouts.store.runstore import RunStore, Segment, model_segment
from durable_rollouts.trainer.feed import Count, TrainerFeed, length_summary

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling, run as a script or imported
from stale_queue_report import Result, asdict_count, mix_table, summary, table
from stale_queue_workload import Fleet, Plan, Trainer, Workload

RUN = "stale-queue"


# -- the simulation ---------------------------------------------------------------------------------------
@dataclass
class _Engine:
    sched: StepScheduler
    t: float = 0.0
    stalled: bool = False


@dataclass
class _Group:
    gid: str
    task_id: str
    replica: int
    seqs: list[Seq]
    done: int = 0


class Sim:
    """One policy on a fresh fleet, trainer and store."""

    def __init__(self, plan: Plan, workload: Workload, fleet: Fleet, trainer: Trainer, root: Path) -> None:
        self.policy, self.limit, self.extra, self.drop = plan.policy, plan.limit, plan.extra, plan.drop
        self.w, self.fleet, self.tr = workload, fleet, trainer
        self.store = RunStore(root)
        cfg = {**asdict(plan), "workload": asdict(self.w), "fleet": asdict(self.fleet),
               "trainer": asdict(self.tr)}  # fmt: skip
        self.store.register_run(RUN, json.dumps(cfg), "bench")
        self.feed = TrainerFeed(self.store, RUN)
        timing = TimingSettings()
        self.engines = [
            _Engine(StepScheduler(timing, fleet.kv_blocks, fleet.block_size, fleet.max_num_seqs))
            for _ in range(fleet.replicas)
        ]
        self.now = 0.0
        self.k = 0  # current version index
        self._publish()
        self.inflight: dict[str, _Group] = {}
        self.waiting: set[str] = set()  # complete groups not yet consumed or discarded
        self.completions: list[tuple[float, int, str, int]] = []
        self._tie = 0
        self.next_group = 0
        self.consumed_groups = 0
        self.need = trainer.batch_groups
        self.train_end: float | None = None
        self.steps_done = 0
        self.gather_since = 0.0
        self.idle_s = 0.0
        self.tally = {"consumed": Count(), "discarded": Count()}
        self.lags: list[int] = []
        self.reasons: dict[str, int] = {}
        self.admitted_lengths: list[int] = []  # every member of every admitted group, finished or not
        self.aborted: list[str] = []
        self.aborted_tokens = 0

    # -- versions and admission ---------------------------------------------------------------------------
    @property
    def version(self) -> str:
        return f"v{self.k}"

    def _publish(self) -> None:
        v = self.version
        self.store.put_policy(v, f"sim-{v}", f"/sim/{v}", [f"sim://{i}" for i in range(self.fleet.replicas)])
        self.store.finish_policy(v, [f"sim://{i}" for i in range(self.fleet.replicas)])

    def _budget(self) -> float:
        """Most groups waiting + in flight this policy allows now (its limit plus the over-provisioning)."""
        if self.policy == "baseline":
            return math.inf
        if self.policy == "fixed":
            assert self.limit is not None
            return self.limit + self.extra
        left = self.tr.steps * self.tr.batch_groups - self.consumed_groups
        window = 0 if self.policy == "sync" else self.tr.max_lag * self.tr.batch_groups
        return min(self.need + window, left) + self.extra

    def _admit(self) -> None:
        slots = self.fleet.replicas * self.fleet.max_num_seqs
        running = sum(len(g.seqs) - g.done for g in self.inflight.values())
        while (
            len(self.waiting) + len(self.inflight) < self._budget() and running + self.w.group_size <= slots
        ):
            self._start_group()
            running += self.w.group_size

    def _start_group(self) -> None:
        i = self.next_group
        self.next_group += 1
        gid = f"g{i:06d}"
        prompt, lengths = self.w.group(i)
        self.admitted_lengths += lengths
        replica = min(range(len(self.engines)), key=lambda r: self._load(r))
        eng = self.engines[replica]
        seqs = []
        for m, n in enumerate(lengths):
            out = list(random.Random(f"{self.w.seed}:out:{i}:{m}").randbytes(n))
            seq = Seq(request_id=f"{RUN}/{gid}/{m}", tokens=prompt + out, prompt_len=len(prompt))
            eng.sched.add(seq)
            seqs.append(seq)
        eng.stalled = False  # an idle engine's next tick starts now (see run)
        self.inflight[gid] = _Group(gid, f"task-{i % 64:03d}", replica, seqs)

    def _load(self, r: int) -> int:
        s = self.engines[r].sched
        return s.running + s.waiting

    # -- records ------------------------------------------------------------------------------------------
    def _record(self, gid: str, m: int) -> None:
        """Write member ``m`` of ``gid`` as the pipeline does (with ``drop``: once all are in, since an
        aborted group is no record); the group record once all are in."""
        if gid not in self.inflight:
            return  # its group was aborted after this member finished
        g = self.inflight[gid]
        g.done += 1
        if not self.drop:
            self._write_member(g, m)
        elif g.done == len(g.seqs):
            for k in range(len(g.seqs)):
                self._write_member(g, k)
        if g.done == len(g.seqs):
            self._write_group(g)

    def _write_member(self, g: _Group, m: int) -> None:
        seq = g.seqs[m]
        rid = seq.request_id
        out = seq.tokens[seq.prompt_len :]
        versions: list[str | None] = [None] * len(out)
        for span in seq.spans:
            versions[span["start"] : span["end"]] = [span["version"]] * (span["end"] - span["start"])
        prompt = seq.tokens[: seq.prompt_len]
        self.store.put_segment(
            rid, Segment(name="prompt", kind="prompt", turn=None, start=0, token_ids=prompt)
        )
        self.store.put_segment(rid, Segment(name=model_segment(0), kind="model", turn=0, start=len(prompt),
                                            token_ids=out, logprobs=[-1.0] * len(out),
                                            policy_versions=versions))  # fmt: skip
        reward = float(random.Random(f"{self.w.seed}:reward:{rid}").random() < 0.5)
        self.store.put_rollout({
            "rollout_id": rid, "run_id": RUN, "group_id": g.gid, "task_id": g.task_id, "sample_index": m,
            "env": "math", "outcome": "completed", "reason": None, "reward": reward, "scorable": 1,
            "advantage": None, "prompt_length": len(prompt), "num_tokens": len(seq.tokens),
            "sampling_json": "{}", "extra_json": "{}",
        })  # fmt: skip

    def _write_group(self, g: _Group) -> None:
        gid = g.gid
        rewards = [float(random.Random(f"{self.w.seed}:reward:{s.request_id}").random() < 0.5)
                   for s in g.seqs]  # fmt: skip
        mean = sum(rewards) / len(rewards)
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
        self.store.put_group(RUN, gid, g.task_id, {
            "run_id": RUN, "group_id": gid, "task_id": g.task_id, "size": len(g.seqs),
            "scorable": len(g.seqs), "failed": 0, "reward_mean": mean, "reward_std": std,
            "zero_variance": std == 0.0, "outcomes": {"completed": len(g.seqs)},
        })  # fmt: skip
        del self.inflight[gid]
        self.waiting.add(gid)

    # -- the trainer --------------------------------------------------------------------------------------
    def _take(self) -> None:
        if self.need == 0 or not self.waiting:
            return
        batch = self.feed.take(self.need, self.version, self.tr.max_lag)
        for fg in batch.groups:
            self.waiting.discard(fg.group_id)
            self.lags.append(fg.lag)
            self.tally["consumed"] += Count(len(fg.rollouts), sum(sum(r["loss_mask"]) for r in fg.rollouts))
        for d in batch.discarded:
            self.waiting.discard(d.group_id)
            self.tally["discarded"] += Count(d.records, d.tokens)
            key = d.reason.split(" > ")[0] if d.reason.startswith("stale: lag") else d.reason
            self.reasons[key] = self.reasons.get(key, 0) + 1
        self.consumed_groups += len(batch.groups)
        self.need -= len(batch.groups)
        if self.need == 0:
            self.idle_s += self.now - self.gather_since
            self.train_end = self.now + self.tr.step_s
            if self.drop:
                self._abort_late()

    def _abort_late(self) -> None:
        """``drop``: the batch is full, so every group still generating is aborted (no record)."""
        for gid, g in sorted(self.inflight.items()):
            for seq in g.seqs:
                self.engines[g.replica].sched.abort(seq)  # a finished one is in no queue: a no-op
            self.aborted_tokens += sum(seq.generated for seq in g.seqs)
            self.aborted.append(gid)
        self.inflight.clear()

    def _finish_step(self) -> None:
        assert self.train_end is not None
        self.now, self.train_end = self.train_end, None
        self.steps_done += 1
        self.k += 1
        self._publish()
        self.need = self.tr.batch_groups
        self.gather_since = self.now

    # -- the event loop -----------------------------------------------------------------------------------
    def run(self) -> None:
        while self.steps_done < self.tr.steps:
            self._take()
            self._admit()
            events: list[tuple[float, int, int]] = []  # (time, kind, index): 0 completion, 1 publish, 2 tick
            if self.completions:
                events.append((self.completions[0][0], 0, 0))
            if self.train_end is not None:
                events.append((self.train_end, 1, 0))
            for r, e in enumerate(self.engines):
                if e.sched.has_work() and not e.stalled:
                    events.append((max(e.t, self.now), 2, r))
            if not events:
                raise RuntimeError(
                    f"{self.policy}: nothing to do at {self.now:.1f}s with the trainer waiting"
                )
            t, kind, r = min(events)
            if kind == 0:
                self.now, _, gid, m = heapq.heappop(self.completions)
                self._record(gid, m)
            elif kind == 1:
                self._finish_step()
            else:
                self._tick(r, t)

    def _tick(self, r: int, t: float) -> None:
        e = self.engines[r]
        self.now = t
        tick = e.sched.tick(self.version)
        if tick.steps == 0:
            e.stalled = True  # nothing schedulable until a request arrives
            return
        e.t = t + tick.duration_s
        for seq in tick.finished:
            gid, m = seq.request_id.rsplit("/", 2)[1:]
            self._tie += 1
            heapq.heappush(self.completions, (e.t, self._tie, gid, int(m)))

    # -- results ------------------------------------------------------------------------------------------
    def result(self, wall_s: float) -> Result:
        ledger = self.feed.ledger()
        ledger.check()
        for state in ("consumed", "discarded"):  # the feed's frozen books equal this file's tally of takes
            if getattr(ledger, state) != self.tally[state]:
                raise RuntimeError(
                    f"{self.policy}: feed {state} {getattr(ledger, state)} != {self.tally[state]}"
                )
        in_flight = sum(s.generated for g in self.inflight.values() for s in g.seqs
                        if s.generated < s.output_len)  # fmt: skip
        gen = ledger.generated
        label = {"baseline": "none", "adaptive": f"need + {self.tr.max_lag}×B", "sync": "need"}.get(
            self.policy, str(self.limit)
        )
        name = f"fixed-{self.limit}" if self.policy == "fixed" else self.policy
        if self.extra:
            name, label = f"{name} +{self.extra}{' drop' if self.drop else ''}", f"{label} + {self.extra}"
        sampled = gen.tokens + self.aborted_tokens
        return Result(
            policy=name,
            max_lag=self.tr.max_lag,
            limit=label,
            generated=asdict_count(gen),
            consumed=asdict_count(ledger.consumed),
            discarded=asdict_count(ledger.discarded),
            waiting=asdict_count(ledger.waiting),
            balanced=ledger.balanced,
            tokens_reaching_update=ledger.consumed.tokens / sampled if sampled else 0.0,
            in_flight_tokens=in_flight,
            in_flight_groups=len(self.inflight),
            groups_complete=len(self.store.groups(RUN)),
            groups_admitted=self.next_group,
            trainer_steps=self.steps_done,
            sim_s=self.now,
            trainer_idle_s=self.idle_s,
            trainer_idle_fraction=self.idle_s / self.now if self.now else 0.0,
            mean_consumed_lag=sum(self.lags) / len(self.lags) if self.lags else 0.0,
            preemptions=sum(e.sched.stats.preemptions for e in self.engines),
            discard_reasons=dict(sorted(self.reasons.items())),
            overprovision=self.extra,
            drop_late=self.drop,
            aborted_groups=len(self.aborted),
            aborted_tokens=self.aborted_tokens,
            admitted_mix=length_summary(self.admitted_lengths),
            consumed_mix=self.feed.length_mix()["consumed"],
            wall_s=wall_s,
        )


def run_policy(plan: Plan, workload: Workload, fleet: Fleet, trainer: Trainer, root: Path) -> Result:
    """One plan on a fresh store under ``root``; returns its books and metrics."""
    t0 = time.monotonic()
    sim = Sim(plan, workload, fleet, trainer, root)
    sim.run()
    return sim.result(time.monotonic() - t0)


def run_all(
    workload: Workload,
    fleet: Fleet,
    trainer: Trainer,
    fixed: list[int],
    work_dir: Path,
    overprovision: tuple[int, ...] = (),
) -> list[Result]:
    """Baseline, every fixed limit (multiples of B) and adaptive, each on its own store under ``work_dir``;
    with ``overprovision``: sync, and for each K sync +K, sync +K drop and fixed-B +K."""
    b = trainer.batch_groups
    plans = [Plan("baseline"), *(Plan("fixed", f * b) for f in fixed), Plan("adaptive")]
    plans += [Plan("sync")] if overprovision else []
    for k in overprovision:
        plans += [Plan("sync", None, k), Plan("sync", None, k, drop=True), Plan("fixed", b, k)]
    out = []
    for p in plans:
        over = f"-x{p.extra}{'d' if p.drop else ''}" if p.extra else ""
        root = work_dir / f"{p.policy}-{p.limit or 0}{over}-lag{trainer.max_lag}"
        out.append(run_policy(p, workload, fleet, trainer, root))
    return out


# -- report -----------------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="results JSON")
    p.add_argument("--max-lag", type=int, nargs="+", default=[1])
    p.add_argument("--steps", type=int, default=Trainer.steps)
    p.add_argument("--batch-groups", type=int, default=Trainer.batch_groups)
    p.add_argument("--step-s", type=float, default=Trainer.step_s)
    p.add_argument("--fixed", type=int, nargs="*", default=[1, 2, 4], help="fixed limits, multiples of B")
    p.add_argument(
        "--overprovision", type=int, nargs="*", default=[4], help="extra groups (K) of the sync/fixed-B runs"
    )
    p.add_argument("--group-size", type=int, default=Workload.group_size)
    p.add_argument("--median-tokens", type=int, default=Workload.median_tokens)
    p.add_argument("--tail-fraction", type=float, default=Workload.tail_fraction)
    p.add_argument("--tail-factor", type=float, default=Workload.tail_factor)
    p.add_argument("--replicas", type=int, default=Fleet.replicas)
    p.add_argument("--kv-blocks", type=int, default=Fleet.kv_blocks)
    p.add_argument("--max-num-seqs", type=int, default=Fleet.max_num_seqs)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work-dir", type=Path, help="keep the run stores here (default: a temp dir, removed)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    workload = Workload(group_size=args.group_size, median_tokens=args.median_tokens,
                        tail_fraction=args.tail_fraction, tail_factor=args.tail_factor,
                        seed=args.seed)  # fmt: skip
    fleet = Fleet(replicas=args.replicas, kv_blocks=args.kv_blocks, max_num_seqs=args.max_num_seqs)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="stale-queue-"))
    results: list[Result] = []
    try:
        for lag in args.max_lag:
            trainer = Trainer(
                batch_groups=args.batch_groups, step_s=args.step_s, steps=args.steps, max_lag=lag
            )
            results += run_all(workload, fleet, trainer, args.fixed, work, tuple(args.overprovision))
    finally:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"{table(results)}\n\n{mix_table(results)}\n\n" + "\n".join(summary(results)))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "command": " ".join(
                ["python", "bench/stale_queue.py", *(argv if argv is not None else sys.argv[1:])]
            ),
            "workload": asdict(workload),
            "fleet": asdict(fleet),
            "trainer": {"batch_groups": args.batch_groups, "step_s": args.step_s, "steps": args.steps},
            "results": [asdict(r) for r in results],
        }
        args.out.write_text(json.dumps(payload, indent=2) + "\n")
    return 0 if all(r.balanced for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
