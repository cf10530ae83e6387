"""The ledger check: after a run (with or without faults), the promise held, or one line per violation.

What it checks, from the run store (and, when given, Temporal and the sandbox backend):

- every group of the run closed, with its full size (``run.num_groups`` groups of ``run.group_size``);
- every slot ``<run>/<group>/<i>`` has exactly one final record: earlier attempts of a slot (``<i>r<n>``)
  are cancelled (reason admission or manual) or failed for infrastructure and marked superseded by the
  next attempt (``rollout.infra_retries``), the last is not, and no attempt is missing;
- with a Temporal client: every RolloutWorkflow of the run has a record;
- failed or cancelled members are not scorable, carry no reward and no advantage; no infra failure is
  recorded as a reward;
- the group records agree with their members (scorable and failed counts);
- the trainer feed's books balance;
- with a sandbox backend and pool: no container and no pool slot of the run is left behind;
- no gateway socket of the run's rollouts is left listening (``sandboxes.base.gateway_dir``), and no
  image build a rollout of the run claimed is left ``building`` in the store;
- at least one rollout succeeded (completed with a reward): a chaos run with zero successes has failed;
- with a Temporal client: every GroupWorkflow of the run has a group record.

A run cancelled as a whole (store status ``cancelled``, or ``stopped`` by a streak of environment failures)
is held to the same rules for the groups it started (those with a group record or member records: each
closed with its full size, every slot one final record); groups it never started have no records and are
no violation, and it need not have a success (it may have been cancelled before any rollout ended).

`tally` sums reports by kind of rollout (math, coding, Harbor, ...): runs, records, and the violations as
lost, duplicated or leaked (`LOST`, `DUPLICATED`, `LEAKED`; any other rule is counted under ``other``).

Invariant: the check only reads. It never raises on a violation; it returns them (``Violation.line``).
"""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from durable_rollouts.store import RunStore
from durable_rollouts.trainer.feed import TrainerFeed

_ATTEMPT = re.compile(r"^(?P<slot>\d+)(?:r(?P<n>\d+))?$")
LOST = frozenset({"missing-group", "missing-record", "missing-run", "group-size"})
DUPLICATED = frozenset({"duplicate", "unknown-rollout", "unknown-group"})
LEAKED = frozenset({"leaked-container", "leaked-slot", "leaked-socket", "leaked-build"})


@dataclass(frozen=True)
class Violation:
    """One broken promise."""

    rule: str
    """Short name: missing-group, group-size, missing-record, duplicate, unknown-workflow, scored-failure,
    group-counts, feed-books, leaked-container, leaked-slot, leaked-socket, leaked-build, no-success."""
    detail: str

    @property
    def line(self) -> str:
        return f"{self.rule}: {self.detail}"


@dataclass(frozen=True)
class LedgerReport:
    """What the check found: the violations, and the counts it checked them against."""

    run_id: str
    rollouts: int
    groups: int
    successes: int
    violations: list[Violation]

    @property
    def ok(self) -> bool:
        return not self.violations

    def lines(self) -> list[str]:
        """One line per violation, or one line saying the ledger is clean."""
        if self.ok:
            return [
                f"run {self.run_id}: ledger clean ({self.groups} groups, {self.rollouts} records, "
                f"{self.successes} successes)"
            ]
        return [f"run {self.run_id}: {v.line}" for v in self.violations]


def check_store(store: RunStore, run_id: str) -> LedgerReport:
    """Every rule that the run store alone can decide."""
    run = store.get_run(run_id)
    if run is None:
        return LedgerReport(run_id, 0, 0, 0, [Violation("missing-run", f"run {run_id} is not in the store")])
    cfg = json.loads(run["config_json"])
    num_groups, size = int(cfg["run"]["num_groups"]), int(cfg["run"]["group_size"])
    cancelled = run.get("status") in ("cancelled", "stopped")
    rows = store.rollouts(run_id)
    groups = {g["group_id"]: g for g in store.groups(run_id)}
    out: list[Violation] = []
    by_group: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_group[r["group_id"]].append(r)
    for i in range(num_groups):
        gid = f"g{i:06d}"
        g = groups.get(gid)
        if cancelled and g is None and gid not in by_group:
            continue  # never started: the run was cancelled first
        if g is None:
            out.append(Violation("missing-group", f"group {gid} has no record"))
        elif g["size"] != size:
            out.append(Violation("group-size", f"group {gid} closed with size {g['size']}, not {size}"))
        out += _slots(run_id, gid, size, by_group.get(gid, []))
        if g is not None:
            out += _group_counts(gid, g, by_group.get(gid, []))
    for gid in sorted(set(by_group) - {f"g{i:06d}" for i in range(num_groups)}):
        out.append(Violation("unknown-group", f"records of group {gid}, which the run never started"))
    for r in rows:
        out += _record(r)
    ledger = TrainerFeed(store, run_id).ledger()
    if not ledger.balanced:
        total = ledger.consumed + ledger.discarded + ledger.waiting
        out.append(
            Violation("feed-books", f"generated {ledger.generated} != consumed+discarded+waiting {total}")
        )
    successes = sum(1 for r in rows if r["outcome"] == "completed" and r["reward"] is not None)
    if rows and successes == 0 and not cancelled:
        out.append(Violation("no-success", "not one rollout completed with a reward"))
    return LedgerReport(run_id, len(rows), len(groups), successes, out)


def _slots(run_id: str, gid: str, size: int, rows: list[dict[str, Any]]) -> list[Violation]:
    """Each slot: attempts 0..n, all but the last cancelled, the last final."""
    out: list[Violation] = []
    attempts: dict[int, dict[int, dict[str, Any]]] = defaultdict(dict)
    prefix = f"{run_id}/{gid}/"
    for r in rows:
        m = (
            _ATTEMPT.match(r["rollout_id"].removeprefix(prefix))
            if r["rollout_id"].startswith(prefix)
            else None
        )
        if m is None:
            out.append(Violation("unknown-rollout", f"record {r['rollout_id']} is no slot of {gid}"))
            continue
        attempts[int(m["slot"])][int(m["n"] or 0)] = r
    for i in range(size):
        tried = attempts.get(i, {})
        if not tried:
            out.append(Violation("missing-record", f"slot {prefix}{i} has no record"))
            continue
        last = max(tried)
        if sorted(tried) != list(range(last + 1)):
            out.append(Violation("missing-record", f"slot {prefix}{i}: attempts {sorted(tried)} have a gap"))
        for n, r in sorted(tried.items()):
            if n < last and r["outcome"] != "cancelled" and not _superseded(r, f"{prefix}{i}r{n + 1}"):
                out.append(
                    Violation("duplicate", f"{r['rollout_id']} is {r['outcome']} but slot {i} ran again")
                )
    for i in sorted(set(attempts) - set(range(size))):
        out.append(Violation("unknown-rollout", f"slot {prefix}{i} is beyond the group size {size}"))
    return out


def _superseded(r: dict[str, Any], by: str) -> bool:
    """Whether ``r`` failed for infrastructure and its group marked it superseded by attempt ``by``."""
    infra = r["outcome"] == "failed" and (r["reason"] or "").startswith("infra:")
    return infra and json.loads(r.get("extra_json") or "{}").get("superseded_by") == by


def _record(r: dict[str, Any]) -> list[Violation]:
    rid, outcome = r["rollout_id"], r["outcome"]
    if outcome in ("failed", "cancelled") and (r["scorable"] or r["reward"] is not None):
        return [
            Violation("scored-failure", f"{rid} is {outcome} ({r['reason']}) but has reward {r['reward']}")
        ]
    if outcome in ("failed", "cancelled") and r["advantage"] is not None:
        return [Violation("scored-failure", f"{rid} is {outcome} but has advantage {r['advantage']}")]
    if (r["reason"] or "").startswith("infra") and r["reward"] is not None:
        return [Violation("scored-failure", f"{rid}: infra failure recorded with reward {r['reward']}")]
    return []


def _group_counts(gid: str, g: dict[str, Any], rows: list[dict[str, Any]]) -> list[Violation]:
    final = {}
    for r in sorted(rows, key=lambda r: r["rollout_id"]):
        final[(r["sample_index"])] = r  # attempts sort before their later attempts
    scorable = sum(1 for r in final.values() if r["scorable"])
    if g["scorable"] != scorable:
        return [
            Violation("group-counts", f"group {gid} says {g['scorable']} scorable, its records {scorable}")
        ]
    return []


async def check_temporal(client: Any, store: RunStore, run_id: str) -> list[Violation]:
    """Every RolloutWorkflow of the run (Temporal visibility) has a record in the store."""
    out = []
    query = f'RolloutRun = "{run_id}" AND WorkflowType = "RolloutWorkflow"'
    async for wf in client.list_workflows(query):
        if store.rollout(wf.id) is None:
            out.append(Violation("missing-record", f"workflow {wf.id} ({wf.status.name}) has no record"))
    query = f'RolloutRun = "{run_id}" AND WorkflowType = "GroupWorkflow"'
    async for wf in client.list_workflows(query):
        gid = wf.id.rsplit("/", 1)[-1]
        if store.group(run_id, gid) is None:
            out.append(Violation("missing-group", f"workflow {wf.id} ({wf.status.name}) has no group record"))
    return out


def check_sockets(rollout_ids: Iterable[str]) -> list[Violation]:
    """No gateway socket of the rollouts left in their folders (the gateway unlinks it when it stops;
    ``DR_GATEWAY_DIR`` of this process names the root, as it does for the workers it started)."""
    from durable_rollouts.gateway.server import SOCKET_NAME
    from durable_rollouts.sandboxes.base import gateway_dir

    out = []
    for rid in rollout_ids:
        path = os.path.join(gateway_dir(rid), SOCKET_NAME)
        if os.path.exists(path):
            out.append(Violation("leaked-socket", f"gateway socket {path} of {rid} is left"))
    return out


def check_builds(store: RunStore, rollout_ids: Iterable[str]) -> list[Violation]:
    """No image build claimed by one of the rollouts still ``building`` (its builder gone, nobody finishing
    it): a run that ended must have finished or released every build it started."""
    ids = set(rollout_ids)
    rows = store.db.execute("SELECT host, tag, owner FROM image_builds WHERE state = 'building'").fetchall()
    return [
        Violation("leaked-build", f"image {r['tag']} on {r['host']} still building for {r['owner']}")
        for r in rows
        if r["owner"] in ids
    ]


def check_leftovers(
    run_id: str, rollout_ids: list[str], backend: Any = None, pool: Any = None
) -> list[Violation]:
    """No container of the run on the backend (a `SandboxBackend`), no pool slot held by its rollouts."""
    out = []
    if backend is not None:
        for c in backend.list_containers(run_id):
            out.append(Violation("leaked-container", f"container {c.name} ({c.state}) of {c.key} is left"))
    if pool is not None:
        held = set(pool.holders()) & set(rollout_ids)
        out += [Violation("leaked-slot", f"pool slot held by {k}") for k in sorted(held)]
    return out


async def check_run(
    store: RunStore, run_id: str, client: Any = None, backend: Any = None, pool: Any = None
) -> LedgerReport:
    """The whole ledger: the store's rules, then Temporal's and the sandboxes' when given."""
    report = check_store(store, run_id)
    extra: list[Violation] = []
    if client is not None:
        extra += await check_temporal(client, store, run_id)
    ids = [r["rollout_id"] for r in store.rollouts(run_id)]
    extra += check_leftovers(run_id, ids, backend, pool)
    extra += check_sockets(ids) + check_builds(store, ids)
    return LedgerReport(
        report.run_id, report.rollouts, report.groups, report.successes, report.violations + extra
    )


@dataclass
class KindTally:
    """One kind of rollout's runs, records and violations, by class."""

    runs: int = 0
    rollouts: int = 0
    successes: int = 0
    lost: int = 0
    duplicated: int = 0
    leaked: int = 0
    other: int = 0
    """Violations of any other rule (scored-failure, group-counts, feed-books, no-success, ...)."""

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


def violation_class(rule: str) -> str:
    """``lost``, ``duplicated``, ``leaked`` or ``other``: what a violation of ``rule`` means."""
    for name, rules in (("lost", LOST), ("duplicated", DUPLICATED), ("leaked", LEAKED)):
        if rule in rules:
            return name
    return "other"


def tally(reports: Iterable[LedgerReport], kind_of: Callable[[str], str]) -> dict[str, KindTally]:
    """The reports summed per kind of rollout (``kind_of`` maps a run id to its kind), kinds sorted."""
    out: dict[str, KindTally] = {}
    for rep in reports:
        t = out.setdefault(kind_of(rep.run_id), KindTally())
        t.runs += 1
        t.rollouts += rep.rollouts
        t.successes += rep.successes
        for v in rep.violations:
            cls = violation_class(v.rule)
            setattr(t, cls, getattr(t, cls) + 1)
    return dict(sorted(out.items()))
