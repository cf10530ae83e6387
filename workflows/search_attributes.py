"""Custom search attributes: how a person finds a rollout in the Temporal web UI.

Invariant: the names and types here are the ones the stack registers on the server and the workflows upsert.
Example filters: ``RolloutPhase = "generate"``, ``RolloutRun = "run-1" AND RolloutOutcome = "failed"``.

Operating attributes (issue 11), set on every rollout:
- ``RolloutProgressAt`` (Datetime): workflow time of the rollout's last indexed progress (its start, a phase
  change, a completed turn). Phase changes carry it at once; progress without a phase change (a turn of an
  environment with inline steps) is indexed at most once per ``PROGRESS_INDEX_INTERVAL_S``, so it is never
  more than that older than the real last progress (``rollouts stuck`` reads the exact time live).
- ``RolloutEngine`` (Keyword): the replica the rollout's turns go to (changes on failover).
- ``RolloutSandboxHost`` (Keyword): the Docker daemon running its sandbox (sandboxed environments only).
- ``RolloutReason`` (Keyword): a finished rollout's reason, up to its error type (``reason_key``):
  ``infra: EngineUnavailable``, ``environment: EnvironmentFailure``, ``max_turns``, ``admission``, ``manual``.
- ``RolloutAttempt`` (Int): attempts the rollout's latest finished engine call took (1 = first try; a call
  that failed over counts its failed attempts plus the new replica's). The workflow learns attempts only
  from finished activities, so a call retrying right now shows in ``rollouts stuck`` (from ``describe``)
  and, once it lands, here: ``RolloutAttempt > 1`` lists the rollouts whose engine made them retry lately.
"""

from __future__ import annotations

from datetime import UTC, datetime

from temporalio.common import SearchAttributeIndexedValueType, SearchAttributeKey

from durable_rollouts.contracts.types import Phase

RUN = SearchAttributeKey.for_keyword("RolloutRun")
GROUP = SearchAttributeKey.for_keyword("RolloutGroup")
TASK = SearchAttributeKey.for_keyword("RolloutTask")
ENV = SearchAttributeKey.for_keyword("RolloutEnv")
PHASE = SearchAttributeKey.for_keyword("RolloutPhase")
TURN = SearchAttributeKey.for_int("RolloutTurn")
POLICY_VERSION = SearchAttributeKey.for_keyword("RolloutPolicyVersion")
OUTCOME = SearchAttributeKey.for_keyword("RolloutOutcome")
PROGRESS_AT = SearchAttributeKey.for_datetime("RolloutProgressAt")
ENGINE = SearchAttributeKey.for_keyword("RolloutEngine")
SANDBOX_HOST = SearchAttributeKey.for_keyword("RolloutSandboxHost")
ATTEMPT = SearchAttributeKey.for_int("RolloutAttempt")
REASON = SearchAttributeKey.for_keyword("RolloutReason")

ALL = (
    RUN, GROUP, TASK, ENV, PHASE, TURN, POLICY_VERSION, OUTCOME, PROGRESS_AT, ENGINE, SANDBOX_HOST, ATTEMPT,
    REASON,
)  # fmt: skip
"""Within the dev server's SQLite visibility limits (10 Keyword, 3 Int, 3 Datetime custom attributes)."""

PROGRESS_INDEX_INTERVAL_S = 5.0
"""Least workflow time between two upserts that only carry progress (turn, progress time, attempt): a
rollout adds at most one upsert event per this many seconds on top of its phase changes, in the workflow
task it runs anyway (never a workflow task of its own)."""

_KINDS = {
    SearchAttributeIndexedValueType.INT: "Int",
    SearchAttributeIndexedValueType.DATETIME: "Datetime",
    SearchAttributeIndexedValueType.KEYWORD: "Keyword",
}

# Name -> type as `temporal server start-dev --search-attribute Name=Type` expects it.
DEFINITIONS: dict[str, str] = {key.name: _KINDS[key.indexed_value_type] for key in ALL}


def reason_key(reason: str) -> str:
    """The indexed part of a rollout's reason: ``kind: ErrorType`` of a failure (the message dropped, so
    one filter finds them all), any other reason as it is (at most 100 characters)."""
    kind, sep, rest = reason.partition(": ")
    if sep and kind in ("infra", "environment"):
        return f"{kind}: {rest.split(':', 1)[0].strip()}"[:100]
    return reason[:100]


def progress_due(
    last_indexed: float | None, now: float, interval_s: float = PROGRESS_INDEX_INTERVAL_S
) -> bool:
    """Whether progress seen at ``now`` (workflow seconds) may be indexed: never indexed yet, or at least
    ``interval_s`` since the last progress upsert."""
    return last_indexed is None or now - last_indexed >= interval_s


def utc_text(ts: float) -> str:
    """Workflow seconds as the UTC text the live details and ``rollouts stuck`` show."""
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def waiting_on(phase: Phase, turn: int, engine: str, sandbox_host: str | None) -> str:
    """What a rollout in ``phase`` waits on, in words (the live details' first part)."""
    where = f" on {sandbox_host}" if sandbox_host else ""
    return {
        Phase.PREPARE: f"waiting on its sandbox{where} and prompt",
        Phase.GENERATE: f"waiting on model call (turn {turn}, {engine})",
        Phase.ENV: f"waiting on env step (turn {turn}{where})",
        Phase.PAUSED: "waiting for a newer policy version",
        Phase.FINALIZE: "writing its record",
        Phase.DONE: "done",
    }.get(phase, f"in {phase.value}")
