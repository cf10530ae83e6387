"""The trainer feed: hand complete, fresh groups of a run to a trainer, each group at most once.

Invariants:
- The books balance, in records and in sampled tokens (loss_mask 1): generated = consumed + discarded +
  waiting. Consumed and discarded counts are frozen in the store when a group is marked; waiting and
  generated are counted live, so a record that appeared in a group after it was marked breaks the identity
  and :meth:`Ledger.check` says so.
- A group leaves "waiting" only inside :meth:`TrainerFeed.take`, only when complete (its group record is
  written and it has ``size`` members), and exactly once: marks are insert-once rows keyed by
  (run, group), so a restarted or concurrent feed never consumes a group twice.
- Freshness is judged at consumption time against the trainer's current version: lag = how many publishes
  (rows of the store's ``policies`` table, in order) separate the oldest version that sampled a token of
  the group from the current one. Lag > max_lag, or a version never published, discards the group with its
  reason. Groups sampled by a version newer than the current one stay waiting.
- A batch is made of the first complete groups: the feed never waits for a particular group. Fresh
  groups beyond ``n_groups`` stay waiting for the next batch (oldest group id first, so a group that
  finished late is taken before younger ones): lateness alone never drops or discards a group, only its
  versions can (lag > max_lag). This is what makes over-provisioning (``run.overprovision``: extra groups
  in flight) keep batches unskewed toward short rollouts; :meth:`TrainerFeed.length_mix` shows it.
- An unscorable group (its record's ``unscorable_reason``: ``group.on_infra_failure = "fail-group"``) is
  never handed out: the first take that sees it complete discards it, reason ``unscorable: ...``, so its
  records stay in the books.
- Metrics: :meth:`TrainerFeed.take` counts the groups whose marks it won (``metrics.record_feed``), so
  concurrent feeds never count a group twice.
"""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from durable_rollouts import metrics
from durable_rollouts.records.export import group_record, rollout_record
from durable_rollouts.store.runstore import RunStore


class FeedError(RuntimeError):
    """The feed was asked something it cannot answer (unknown version, unbalanced books); one line."""


@dataclass(frozen=True)
class Count:
    """How many records and how many sampled tokens."""

    records: int = 0
    tokens: int = 0

    def __add__(self, other: Count) -> Count:
        return Count(self.records + other.records, self.tokens + other.tokens)


@dataclass(frozen=True)
class Ledger:
    """The run's books: every generated record is consumed, discarded or waiting."""

    generated: Count
    consumed: Count
    discarded: Count
    waiting: Count

    @property
    def balanced(self) -> bool:
        return self.generated == self.consumed + self.discarded + self.waiting

    def check(self) -> Ledger:
        """Return self; raise FeedError if the books do not balance."""
        if not self.balanced:
            total = self.consumed + self.discarded + self.waiting
            raise FeedError(
                f"books do not balance: generated {self.generated} != consumed+discarded+waiting {total}"
            )
        return self


@dataclass
class FeedGroup:
    """One consumed group: its group record and its rollout records (export format)."""

    group_id: str
    task_id: str
    lag: int
    versions: list[str]
    group: dict[str, Any]
    rollouts: list[dict[str, Any]]


@dataclass(frozen=True)
class Discard:
    """A group taken out of the feed without training on it."""

    group_id: str
    reason: str
    records: int
    tokens: int


@dataclass
class Batch:
    """What one :meth:`TrainerFeed.take` consumed (``groups``) and discarded."""

    batch_id: str | None
    current_version: str
    max_lag: int
    groups: list[FeedGroup] = field(default_factory=list)
    discarded: list[Discard] = field(default_factory=list)

    @property
    def count(self) -> Count:
        return Count(
            sum(len(g.rollouts) for g in self.groups),
            sum(_sampled(r) for g in self.groups for r in g.rollouts),
        )

    def lines(self) -> list[dict[str, Any]]:
        """The batch in export order: every rollout record, then every group record."""
        return [r for g in self.groups for r in g.rollouts] + [g.group for g in self.groups]


def _sampled(rec: dict[str, Any]) -> int:
    return sum(rec["loss_mask"])


@dataclass
class _Candidate:
    group: dict[str, Any]
    rows: list[dict[str, Any]]
    tokens: int


class TrainerFeed:
    """Batches of complete, fresh groups of one run, read from (and marked in) the run store."""

    def __init__(self, store: RunStore, run_id: str) -> None:
        self.store = store
        self.run_id = run_id

    # -- consumption ----------------------------------------------------------------------------------
    def take(
        self,
        n_groups: int,
        current_version: str,
        max_lag: int,
        drop_zero_variance: bool = False,
        logprob_mode: str | None = None,
    ) -> Batch:
        """Consume up to ``n_groups`` complete groups that are fresh for ``current_version``.

        Every complete waiting group is judged: unscorable (its group record says so), stale (lag >
        ``max_lag`` or an unpublished version), with
        ``logprob_mode`` a group whose records declare another logprobs mode than the trainer asks for,
        and with ``drop_zero_variance`` zero-variance groups are discarded with a reason (counted in the
        books); fresh ones are consumed oldest first up to ``n_groups``; the rest keep waiting.

        Raises:
            FeedError: If ``current_version`` was never published, or ``n_groups``/``max_lag`` < 0.
        """
        if n_groups < 0 or max_lag < 0:
            raise FeedError(f"n_groups ({n_groups}) and max_lag ({max_lag}) must be >= 0")
        order = self._order(current_version)
        marks: list[dict[str, Any]] = []
        fresh: dict[str, tuple[_Candidate, int, list[str]]] = {}
        for cand in self._complete_waiting():
            versions = self._versions(cand.rows)
            lag, reason = _judge(versions, current_version, max_lag, order)
            if cand.group.get("unscorable_reason"):  # never trained on, whatever its versions
                reason = f"unscorable: {cand.group['unscorable_reason']}"
            if reason is None and logprob_mode is not None:
                reason = _mode_mismatch(cand.rows, logprob_mode)
            if reason is None and lag is None:
                continue  # sampled by a version newer than current: wait for the trainer to catch up
            if reason is None and drop_zero_variance and cand.group.get("zero_variance"):
                reason = "zero_variance"
            if reason is None and len(fresh) >= n_groups:
                continue
            gid = cand.group["group_id"]
            state = "discarded" if reason else "consumed"
            marks.append({"group_id": gid, "state": state, "reason": reason, "lag": lag,
                          "records": len(cand.rows), "tokens": cand.tokens})  # fmt: skip
            if reason is None:
                fresh[gid] = (cand, lag or 0, sorted({v for v in versions if v is not None}))
        batch_id, written = self.store.put_feed_marks(self.run_id, marks)
        won = set(written)
        batch = Batch(batch_id=batch_id, current_version=current_version, max_lag=max_lag)
        for m in marks:
            if m["group_id"] not in won:
                continue  # marked by a concurrent feed between our read and our write
            if m["state"] == "discarded":
                batch.discarded.append(Discard(m["group_id"], m["reason"], m["records"], m["tokens"]))
            else:
                cand, lag, vs = fresh[m["group_id"]]
                batch.groups.append(self._feed_group(cand, lag, vs))
        metrics.record_feed(  # only what this feed won: a group is counted by the feed that marked it
            [(g.lag, len(g.rollouts), sum(_sampled(r) for r in g.rollouts)) for g in batch.groups],
            [(d.reason, d.records, d.tokens) for d in batch.discarded],
        )
        return batch

    def batch(self, batch_id: str) -> list[dict[str, Any]]:
        """Re-read a consumed batch (export lines), e.g. after a trainer restart."""
        gids = {g for g, m in self.store.feed_marks(self.run_id).items() if m["batch_id"] == batch_id}
        if not gids:
            raise FeedError(f"run {self.run_id}: no batch {batch_id!r}")
        groups = [g for g in self.store.groups(self.run_id) if g["group_id"] in gids]
        rows = [r for r in self.store.rollouts(self.run_id) if r["group_id"] in gids]
        return [rollout_record(self.store, r) for r in rows] + [group_record(g) for g in groups]

    def _order(self, current_version: str) -> dict[str, int]:
        order = {p["version"]: i for i, p in enumerate(self.store.policies())}
        if current_version not in order:
            known = ", ".join(order) or "none"
            raise FeedError(f"current version {current_version!r} was never published (published: {known})")
        return order

    def _complete_waiting(self) -> list[_Candidate]:
        marked = self.store.feed_marks(self.run_id)
        rows_by_group: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for r in self.store.rollouts(self.run_id):
            rows_by_group[r["group_id"]].append(r)
        tokens = self.store.sampled_tokens(self.run_id)
        out = []
        for g in self.store.groups(self.run_id):
            rows = rows_by_group.get(g["group_id"], [])
            if g["group_id"] in marked or len(rows) < g["size"]:
                continue
            out.append(_Candidate(g, rows, sum(tokens.get(r["rollout_id"], 0) for r in rows)))
        return out

    def _versions(self, rows: list[dict[str, Any]]) -> list[str | None]:
        """The version of every sampled token of these rollouts, as the engine reported it."""
        out: list[str | None] = []
        for r in rows:
            for s in self.store.segments(r["rollout_id"]):
                if s.kind == "model":
                    out.extend(s.policy_versions or [None] * len(s.token_ids))
        return out

    def _feed_group(self, cand: _Candidate, lag: int, versions: list[str]) -> FeedGroup:
        recs = [rollout_record(self.store, r) for r in cand.rows]
        return FeedGroup(
            cand.group["group_id"], cand.group["task_id"], lag, versions, group_record(cand.group), recs
        )

    # -- accounting -----------------------------------------------------------------------------------
    def ledger(self) -> Ledger:
        """The books in records and sampled tokens (see the module invariant)."""
        marks = self.store.feed_marks(self.run_id)
        tokens = self.store.sampled_tokens(self.run_id)
        generated = waiting = Count()
        for r in self.store.rollouts(self.run_id):
            one = Count(1, tokens.get(r["rollout_id"], 0))
            generated += one
            if r["group_id"] not in marks:
                waiting += one
        frozen = {"consumed": Count(), "discarded": Count()}
        for m in marks.values():
            frozen[m["state"]] += Count(m["records"], m["tokens"])
        return Ledger(generated, frozen["consumed"], frozen["discarded"], waiting)

    def discard_report(self) -> dict[str, Any]:
        """Task and length mix of discarded records next to all generated ones.

        Returns:
            ``by_reason`` (records per reason), ``by_task`` and ``by_length`` (sampled-token buckets
            ``<=16``, ``<=32``, ...), each mapping to ``{"discarded": n, "generated": m}``, and the mean
            sampled length of ``discarded``, ``consumed`` and ``generated`` records.
        """
        marks = self.store.feed_marks(self.run_id)
        tokens = self.store.sampled_tokens(self.run_id)
        by_reason: Counter[str] = Counter()
        by_task: dict[str, Counter[str]] = defaultdict(Counter)
        by_length: dict[str, Counter[str]] = defaultdict(Counter)
        lengths: dict[str, list[int]] = defaultdict(list)
        for r in self.store.rollouts(self.run_id):
            n = tokens.get(r["rollout_id"], 0)
            mark = marks.get(r["group_id"])
            kinds = ["generated"] + ([mark["state"]] if mark else [])
            for kind in kinds:
                by_task[r["task_id"]][kind] += 1
                by_length[_bucket(n)][kind] += 1
                lengths[kind].append(n)
            if mark and mark["state"] == "discarded":
                by_reason[mark["reason"]] += 1
        return {
            "by_reason": dict(by_reason),
            "by_task": {k: _pair(v) for k, v in sorted(by_task.items())},
            "by_length": {k: _pair(v) for k, v in sorted(by_length.items(), key=lambda kv: int(kv[0][2:]))},
            "mean_length": {k: (sum(v) / len(v) if v else None) for k, v in sorted(lengths.items())},
        }

    def length_mix(self) -> dict[str, dict[str, float | int | None]]:
        """Sampled tokens per rollout of generated, consumed, discarded and waiting records.

        Returns:
            For each of the four: ``groups``, ``rollouts``, and ``mean``, ``p50``, ``p90``, ``p99`` (nearest
            rank) of the rollouts' sampled tokens (None when there are none). Consumed groups shorter than
            generated ones mean the batches were skewed toward short rollouts.
        """
        marks = self.store.feed_marks(self.run_id)
        tokens = self.store.sampled_tokens(self.run_id)
        lengths: dict[str, list[int]] = {k: [] for k in ("generated", "consumed", "discarded", "waiting")}
        groups: dict[str, set[str]] = {k: set() for k in lengths}
        for r in self.store.rollouts(self.run_id):
            mark = marks.get(r["group_id"])
            for kind in ("generated", mark["state"] if mark else "waiting"):
                lengths[kind].append(tokens.get(r["rollout_id"], 0))
                groups[kind].add(r["group_id"])
        return {
            k: {"groups": len(groups[k]), "rollouts": len(v), **length_summary(v)} for k, v in lengths.items()
        }


def length_summary(values: list[int]) -> dict[str, float | int | None]:
    """Mean and nearest-rank p50/p90/p99 of ``values`` (None each when empty)."""
    v = sorted(values)
    out: dict[str, float | int | None] = {"mean": sum(v) / len(v) if v else None}
    for q in (50, 90, 99):
        out[f"p{q}"] = v[max(0, math.ceil(q / 100 * len(v)) - 1)] if v else None
    return out


def _pair(c: Counter[str]) -> dict[str, int]:
    return {"discarded": c["discarded"], "generated": c["generated"]}


def _bucket(n: int) -> str:
    edge = 16
    while n > edge:
        edge *= 2
    return f"<={edge}"


def _mode_mismatch(rows: list[dict[str, Any]], wanted: str) -> str | None:
    """The discard reason of a group with a record whose declared logprobs mode is not ``wanted``."""
    for r in rows:
        declared = json.loads(r.get("sampling_json") or "{}").get("logprob_mode")
        if declared != wanted:
            return f"logprob_mode: {declared}, the trainer asked for {wanted}"
    return None


def _judge(
    versions: list[str | None], current: str, max_lag: int, order: dict[str, int]
) -> tuple[int | None, str | None]:
    """(lag, discard reason) of a group whose sampled tokens have ``versions``.

    Returns (None, None) when a token is newer than ``current`` (keep waiting), (lag, None) when fresh.
    """
    named = {v for v in versions if v is not None}
    if len(named) < len(set(versions)):
        return None, "stale: unversioned tokens"
    unknown = sorted(named - order.keys())
    if unknown:
        return None, f"stale: unknown version {unknown[0]}"
    lags = [order[current] - order[v] for v in named]
    if lags and min(lags) < 0:
        return None, None
    lag = max(lags, default=0)
    if lag > max_lag:
        return lag, f"stale: lag {lag} > max_lag {max_lag}"
    return lag, None
