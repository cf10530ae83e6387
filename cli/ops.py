"""Operating a run: find stuck rollouts in seconds and act on them (``rollouts stuck/cancel/retry/
terminate``; the live view, ``rollouts top``, is ``cli.top``). A process, not workflow code: it calls
Temporal (visibility, describe, query, signal, terminate) and the run store.

Invariants:
- ``stuck`` (and ``top``) change nothing. ``stuck`` finds candidates by the visibility filter on
  ``RolloutProgressAt`` (indexed at most ``PROGRESS_INDEX_INTERVAL_S`` late, so never missing a stalled
  rollout) and keeps those whose exact last progress (the ``state`` query; the indexed time when no worker
  answers) is older than the threshold: exactly the rollouts without progress for that long.
- Every action is written to the run store's manual-actions log, and keeps the books whole: one record per
  rollout id and every group closing with its full size. ``cancel`` signals the rollout (``cancel_for``,
  reason ``manual``: it records itself cancelled), or, given a run id, cancels the run's workflow (its
  groups cancel their members, reason ``run-cancelled``, and close; the run ends cancelled); ``retry``
  asks its group (``GroupWorkflow.retry``: the member is recorded cancelled, reason ``manual-retry``, and
  the slot runs again as ``<i>r<n+1>``);
  ``terminate`` of a rollout lets its group record it (failed, infra); ``terminate`` of a group terminates
  it (its members die with it) and then signals the run ``group_terminated``, which records the members
  and the group from the store and counts the group done. That last step is idempotent: the run also
  notices a group terminated from the web UI or the ``temporal`` CLI by itself (workflows/closed_groups.py)
  and accounts for it once, whichever comes first.
- Bad input (unknown id, a run that does not exist, a workflow that is not running) raises ``OpsError``,
  one line; the CLI prints it and exits 2.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import quote

from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.service import RPCError, RPCStatusCode

from durable_rollouts.contracts.activity_io import TerminatedGroupInput
from durable_rollouts.store.runstore import RunStore
from durable_rollouts.workflows import search_attributes as sa
from durable_rollouts.workflows.group import RETRY_REASON, RUN_CANCEL_REASON, GroupWorkflow, slot_of
from durable_rollouts.workflows.rollout import RolloutWorkflow
from durable_rollouts.workflows.run import RunWorkflow

UI = "http://127.0.0.1:8233"
CANCEL_REASON = "manual"
QUERY_TIMEOUT = timedelta(seconds=3)


class OpsError(Exception):
    """A user mistake: one line for the CLI (exit 2)."""


# -- pure pieces: durations, filters, URLs, formatting ---------------------------------------------

_DURATION = re.compile(r"^(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s?)?$")


def parse_duration(text: str) -> float:
    """Seconds of ``90``, ``90s``, ``2m``, ``1m30s``, ``1h``; anything else raises OpsError."""
    m = _DURATION.match(text.strip())
    if not text.strip() or m is None or not any(m.groups()):
        raise OpsError(f"--for {text!r}: use seconds (60, 60s), minutes (2m) or hours (1h)")
    h, mi, s = (float(g) if g else 0.0 for g in m.groups())
    return h * 3600 + mi * 60 + s


def _quoted(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def utc(ts: datetime | float) -> str:
    """RFC 3339 UTC text (what visibility filters compare Datetime attributes with)."""
    dt = ts if isinstance(ts, datetime) else datetime.fromtimestamp(ts, UTC)
    return dt.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def rollouts_of(run_id: str) -> str:
    """Filter: the rollouts of a run (not its groups, which carry RolloutRun too)."""
    return f'WorkflowType = "RolloutWorkflow" AND RolloutRun = {_quoted(run_id)}'


def running(run_id: str) -> str:
    return f'{rollouts_of(run_id)} AND ExecutionStatus = "Running"'


def stuck_filter(run_id: str, before: datetime | float) -> str:
    """Running rollouts whose indexed last progress is before ``before`` (now minus the threshold)."""
    return f'{running(run_id)} AND RolloutProgressAt < "{utc(before)}"'


def retrying_filter(run_id: str) -> str:
    """Running rollouts whose latest finished engine call needed more than one attempt."""
    return f"{running(run_id)} AND RolloutAttempt > 1"


def replica_filter(run_id: str, engine: str) -> str:
    return f"{running(run_id)} AND RolloutEngine = {_quoted(engine)}"


def phase_filter(run_id: str, phase: str) -> str:
    return f"{running(run_id)} AND RolloutPhase = {_quoted(phase)}"


def failed_filter(run_id: str, reason: str) -> str:
    """Failed rollouts of a run by reason (``reason_key``: ``infra: EngineUnavailable``, ...)."""
    return f'{rollouts_of(run_id)} AND RolloutOutcome = "failed" AND RolloutReason = {_quoted(reason)}'


def ui_url(query: str, base: str = UI, namespace: str = "default") -> str:
    """The web UI's workflow list filtered by ``query`` (URL-encoded, ready to paste)."""
    return (
        f"{base.rstrip('/')}/namespaces/{quote(namespace, safe='')}/workflows?query={quote(query, safe='')}"
    )


def ago(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(max(0.0, seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


@dataclass
class PendingCall:
    """A pending activity of a rollout, from ``describe``."""

    activity: str
    attempt: int
    max_attempts: int
    last_failure: str | None = None
    last_heartbeat: float | None = None
    """Unix time of the last heartbeat (None: none yet)."""


@dataclass
class StuckRollout:
    """One line of ``rollouts stuck``."""

    rollout_id: str
    phase: str
    turn: int
    started: float
    progress_at: float
    engine: str | None = None
    sandbox_host: str | None = None
    attempt: int | None = None
    waiting_on: str | None = None
    pending: list[PendingCall] = field(default_factory=list)


def format_stuck(r: StuckRollout, now: float) -> str:
    """One line: id, phase, turn, elapsed, last progress, engine, sandbox, then the pending call."""
    parts = [
        r.rollout_id,
        f"phase={r.phase}",
        f"turn={r.turn}",
        f"elapsed={ago(now - r.started)}",
        f"last-progress={ago(now - r.progress_at)} ago ({utc(r.progress_at)})",
        f"engine={r.engine or '-'}",
        f"sandbox={r.sandbox_host or '-'}",
    ]
    for p in r.pending:
        call = f"pending={p.activity} attempt={p.attempt}/{p.max_attempts or 'inf'}"
        call += f" heartbeat={ago(now - p.last_heartbeat) + ' ago' if p.last_heartbeat else '-'}"
        if p.last_failure:
            call += f" last-failure={p.last_failure[:120]!r}"
        parts.append(call)
    if not r.pending and r.waiting_on:
        parts.append(f"({r.waiting_on})")
    return "  ".join(parts)


# -- Temporal --------------------------------------------------------------------------------------


def _ts(message: Any) -> float | None:
    """A protobuf Timestamp as unix seconds (None when unset)."""
    return message.ToDatetime(UTC).timestamp() if message is not None and message.seconds else None


async def _describe(client: Client, wid: str) -> Any:
    try:
        return await client.get_workflow_handle(wid).describe()
    except RPCError as e:
        if e.status == RPCStatusCode.NOT_FOUND:
            hint = "a rollout is <run>/g<NNNNNN>/<i>, a group <run>/g<NNNNNN>"
            raise OpsError(f"no workflow {wid!r} ({hint})") from None
        raise


async def check_run(client: Client, run_id: str) -> None:
    """OpsError unless the run's workflow exists."""
    try:
        await client.get_workflow_handle(run_id).describe()
    except RPCError as e:
        if e.status == RPCStatusCode.NOT_FOUND:
            raise OpsError(f"no run {run_id!r}") from None
        raise


async def find_stuck(
    client: Client, run_id: str, for_s: float, now: float | None = None
) -> list[StuckRollout]:
    """The run's rollouts without progress for ``for_s`` seconds, oldest progress first."""
    await check_run(client, run_id)
    now = time.time() if now is None else now
    query = stuck_filter(run_id, now - for_s)
    ids = [w.id async for w in client.list_workflows(query)]
    sem = asyncio.Semaphore(16)

    async def one(wid: str) -> StuckRollout | None:
        async with sem:
            return await _inspect(client, wid, now - for_s)

    found = [r for r in await asyncio.gather(*(one(w) for w in ids)) if r is not None]
    return sorted(found, key=lambda r: (r.progress_at, r.rollout_id))


async def _inspect(client: Client, wid: str, cutoff: float) -> StuckRollout | None:
    handle = client.get_workflow_handle(wid)
    try:
        desc = await handle.describe()
    except RPCError:
        return None
    if desc.status != WorkflowExecutionStatus.RUNNING:
        return None
    attrs = desc.typed_search_attributes
    indexed = attrs.get(sa.PROGRESS_AT)
    row = StuckRollout(
        rollout_id=wid,
        phase=attrs.get(sa.PHASE) or "?",
        turn=attrs.get(sa.TURN) or 0,
        started=desc.start_time.timestamp(),
        progress_at=indexed.timestamp() if indexed else desc.start_time.timestamp(),
        engine=attrs.get(sa.ENGINE),
        sandbox_host=attrs.get(sa.SANDBOX_HOST),
        attempt=attrs.get(sa.ATTEMPT),
    )
    try:  # the exact state, from a worker (the indexed one may be up to the index interval old)
        live = await handle.query(RolloutWorkflow.state, rpc_timeout=QUERY_TIMEOUT)
        row.phase, row.turn = live.get("phase", row.phase), live.get("turn", row.turn)
        row.progress_at = float(live.get("progress_at") or row.progress_at)
        row.engine = live.get("engine") or row.engine
        row.sandbox_host = live.get("sandbox_host") or row.sandbox_host
        row.waiting_on = live.get("waiting_on")
    except Exception:  # no worker answers: the indexed values stand
        pass
    if row.progress_at >= cutoff:
        return None
    for p in desc.raw_description.pending_activities:
        failure = p.last_failure.message if p.HasField("last_failure") else None
        row.pending.append(
            PendingCall(
                activity=p.activity_type.name,
                attempt=p.attempt,
                max_attempts=p.maximum_attempts,
                last_failure=failure or None,
                last_heartbeat=_ts(p.last_heartbeat_time) if p.HasField("last_heartbeat_time") else None,
            )
        )
    return row


# -- actions ---------------------------------------------------------------------------------------


@dataclass
class Target:
    """A rollout or group workflow an action names."""

    workflow_id: str
    kind: str
    """``rollout`` or ``group``."""
    run_id: str
    group_id: str
    status: WorkflowExecutionStatus | None
    inline: bool = False
    """A rollout running inside its group's workflow (``group.inline_rollouts``): no workflow of its own."""


async def resolve(client: Client, wid: str, store: RunStore | None = None) -> Target:
    """What ``wid`` is; OpsError if it is neither a rollout nor a group of a run (nor, given the store, a
    member running inside its group's workflow)."""
    try:
        desc = await _describe(client, wid)
    except OpsError:
        member = await _inline_member(client, store, wid) if store is not None else None
        if member is None:
            raise
        return member
    kinds = {"RolloutWorkflow": "rollout", "GroupWorkflow": "group"}
    if desc.workflow_type not in kinds:
        raise OpsError(f"{wid} is a {desc.workflow_type}, not a rollout or a group")
    attrs = desc.typed_search_attributes
    run_id, group_id = attrs.get(sa.RUN), attrs.get(sa.GROUP)
    if not run_id or not group_id:
        raise OpsError(f"{wid}: not a rollout of a run (no RolloutRun/RolloutGroup attributes)")
    return Target(wid, kinds[desc.workflow_type], run_id, group_id, desc.status)


async def _inline_member(client: Client, store: RunStore, wid: str) -> Target | None:
    """``wid`` as a member running inside its group's workflow: a slot id ``<run>/<group>/<i>[r<n>]`` of a
    running group whose run has ``group.inline_rollouts`` (or ``group.batch_rollouts``: in its group's
    batch) on, without a record yet; None otherwise.

    Read from the store and the group's description, not from the group's ``progress`` query: a group
    whose members hold local calls answers queries only when it next completes a workflow task."""
    parts = wid.rsplit("/", 2)
    if len(parts) != 3 or not re.fullmatch(r"\d+(r\d+)?", parts[2]):
        return None
    run_id, group_id, _ = parts
    run = await asyncio.to_thread(store.get_run, run_id)
    group = json.loads(run["config_json"]).get("group", {}) if run is not None else {}
    if not (group.get("inline_rollouts") or group.get("batch_rollouts")):  # members without a workflow
        return None
    try:
        desc = await client.get_workflow_handle(f"{run_id}/{group_id}").describe()
    except RPCError:
        return None
    if desc.workflow_type != "GroupWorkflow" or await asyncio.to_thread(store.rollout, wid) is not None:
        return None
    return Target(wid, "rollout", run_id, group_id, desc.status, inline=True)


def _status(t: Target) -> str:
    return t.status.name if t.status is not None else "UNKNOWN"


def _in_store(store: RunStore, run_id: str) -> None:
    if store.get_run(run_id) is None:
        raise OpsError(f"run {run_id} is not in the run store at {store.location} (set ROLLOUTS_STORE?)")


def _need(t: Target, kind: str, running_only: bool = True) -> None:
    if t.kind != kind:
        raise OpsError(f"{t.workflow_id} is a {t.kind}, not a {kind}")
    if running_only and t.status != WorkflowExecutionStatus.RUNNING:
        raise OpsError(f"{kind} {t.workflow_id} is not running ({_status(t)})")


async def _await_record(store: RunStore, rollout_id: str, timeout_s: float) -> dict[str, Any] | None:
    deadline = time.monotonic() + timeout_s
    while True:
        rec = await asyncio.to_thread(store.rollout, rollout_id)
        if rec is not None or time.monotonic() >= deadline:
            return rec
        await asyncio.sleep(0.2)


def _said(rec: dict[str, Any] | None) -> str:
    return "no record yet" if rec is None else f"recorded {rec['outcome']} ({rec['reason']})"


async def cancel(client: Client, store: RunStore, rollout_id: str, wait_s: float = 30.0) -> str:
    """Cancel a running rollout (reason ``manual``); it writes its own cancelled record. Given a run id,
    cancel the whole run (`cancel_run`)."""
    with contextlib.suppress(OpsError):  # no workflow: perhaps a member running inline (resolve says)
        if (await _describe(client, rollout_id)).workflow_type == "RunWorkflow":
            return await cancel_run(client, store, rollout_id, wait_s=max(wait_s, 120.0))
    t = await resolve(client, rollout_id, store)
    _need(t, "rollout")
    _in_store(store, t.run_id)
    if t.inline:  # its group tells it (it has no workflow to signal)
        group = client.get_workflow_handle(f"{t.run_id}/{t.group_id}")
        await group.signal(GroupWorkflow.cancel_member, args=[rollout_id, CANCEL_REASON])
    else:
        await client.get_workflow_handle(rollout_id).signal(RolloutWorkflow.cancel_for, CANCEL_REASON)
    store.put_manual_action(t.run_id, rollout_id, "cancel", CANCEL_REASON, {"group": t.group_id})
    return f"cancelled {rollout_id}: {_said(await _await_record(store, rollout_id, wait_s))}"


async def cancel_run(client: Client, store: RunStore, run_id: str, wait_s: float = 120.0) -> str:
    """Cancel a running run as a whole: it starts no more groups, its in-flight rollouts end cancelled
    (reason ``run-cancelled``) with their records, its groups close, and it ends CANCELED (``cancelled`` in
    the store). Waits up to ``wait_s`` for that end."""
    _in_store(store, run_id)
    handle = client.get_workflow_handle(run_id)
    desc = await handle.describe()
    if desc.status != WorkflowExecutionStatus.RUNNING:
        raise OpsError(f"run {run_id} is not running ({desc.status.name if desc.status else 'UNKNOWN'})")
    await handle.cancel()
    store.put_manual_action(run_id, run_id, "cancel", RUN_CANCEL_REASON, {})
    deadline = time.monotonic() + wait_s
    while (desc := await handle.describe()).status == WorkflowExecutionStatus.RUNNING:
        if time.monotonic() >= deadline:
            return f"cancelling run {run_id}: its in-flight rollouts are still ending"
        await asyncio.sleep(0.5)
    counts = dict(await asyncio.to_thread(store.count_rollouts, run_id))
    return f"cancelled run {run_id} ({desc.status.name if desc.status else 'UNKNOWN'}): records {counts}"


async def retry(client: Client, store: RunStore, rollout_id: str, wait_s: float = 30.0) -> str:
    """Run a running rollout's slot again: its group cancels it (``manual-retry``) and starts the slot's
    next attempt."""
    t = await resolve(client, rollout_id, store)
    _need(t, "rollout")
    _in_store(store, t.run_id)
    i, attempt = slot_of(rollout_id)
    nxt = f"{t.run_id}/{t.group_id}/{i}r{attempt + 1}"
    group = client.get_workflow_handle(f"{t.run_id}/{t.group_id}")
    await group.signal(GroupWorkflow.retry, rollout_id)
    store.put_manual_action(t.run_id, rollout_id, "retry", RETRY_REASON, {"group": t.group_id, "next": nxt})
    rec = await _await_record(store, rollout_id, wait_s)
    if rec is not None and not (rec["outcome"] == "cancelled" and rec["reason"] == RETRY_REASON):
        return f"{rollout_id} ended before the retry reached it ({_said(rec)}); its slot stands"
    return f"retrying {rollout_id} as {nxt}: {_said(rec)}"


async def terminate(client: Client, store: RunStore, wid: str, wait_s: float = 60.0) -> str:
    """Terminate a running rollout (its group records it failed, infra) or a group (the run records its
    members and its record, and counts it done)."""
    t = await resolve(client, wid, store)
    _in_store(store, t.run_id)
    if t.kind == "rollout":
        _need(t, "rollout")
        if t.inline:
            raise OpsError(
                f"{wid} runs inside its group's workflow (group.inline_rollouts): cancel it "
                f"(rollouts cancel {wid}), or terminate its group {t.run_id}/{t.group_id}"
            )
        await client.get_workflow_handle(wid).terminate(reason="manual: rollouts terminate")
        store.put_manual_action(t.run_id, wid, "terminate", CANCEL_REASON, {"group": t.group_id})
        return f"terminated {wid}: {_said(await _await_record(store, wid, wait_s))}"
    if t.status not in (WorkflowExecutionStatus.RUNNING, WorkflowExecutionStatus.TERMINATED):
        raise OpsError(f"group {wid} is not running ({_status(t)}): it has reported to its run")
    members = await _group_members(client, t)
    if t.status == WorkflowExecutionStatus.RUNNING:
        await client.get_workflow_handle(wid).terminate(reason="manual: rollouts terminate")
    run = client.get_workflow_handle(t.run_id)
    ask = TerminatedGroupInput(run_id=t.run_id, group_id=t.group_id, members=members, reason=CANCEL_REASON)
    try:
        await run.signal(RunWorkflow.group_terminated, ask)
    except RPCError as e:
        if e.status != RPCStatusCode.NOT_FOUND:
            raise
        raise OpsError(f"group {wid}: its run {t.run_id} is not running ({e.message})") from None
    store.put_manual_action(
        t.run_id, wid, "terminate", CANCEL_REASON, {"group": t.group_id, "members": members}
    )
    deadline = time.monotonic() + wait_s
    while (rec := await asyncio.to_thread(store.group, t.run_id, t.group_id)) is None:
        if time.monotonic() >= deadline:
            return f"terminated group {wid} ({len(members)} running members); the run has not recorded it yet"
        await asyncio.sleep(0.2)
    return f"terminated group {wid}: recorded size {rec['size']}, outcomes {rec['outcomes']}"


async def _group_members(client: Client, t: Target) -> list[str]:
    """The group's members that have not ended by themselves: the group's own list of running members
    (when a worker answers) and visibility's running or terminated members."""
    members: set[str] = set()
    try:
        prog = await client.get_workflow_handle(t.workflow_id).query(
            GroupWorkflow.progress, rpc_timeout=QUERY_TIMEOUT
        )
        members |= set(prog.get("running", []))
    except Exception:  # no worker answers: visibility alone
        pass
    q = (
        f"{rollouts_of(t.run_id)} AND RolloutGroup = {_quoted(t.group_id)}"
        ' AND ExecutionStatus IN ("Running", "Terminated")'
    )
    members |= {w.id async for w in client.list_workflows(q)}
    return sorted(members)
