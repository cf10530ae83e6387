"""Activities of a rollout: the run's tasks, the prompt, model turns, records.

The prompt and the model turn are thin wrappers of ``turns.model`` (where their logic and invariants
live): options, heartbeats, the attempt number and queue time from ``activity.info()``, errors mapped to
``ApplicationError``.

Invariants:
- Idempotent on keys that survive retries: the run id, the rollout id, and (rollout id, turn). A retried
  activity finds what an earlier attempt wrote and returns it, so no sample is produced twice or lost.
- Inputs and results are small (keys, counts, scalars); token arrays go to the store, never to history.
- Environment-specific work goes through the environment interface (``environments.base``), never a name test.
- Errors leave as ``ApplicationError`` whose type names the boundary (see ``errors``).
- Metrics: a record and its turns are counted when its first write lands (``metrics.record_rollout``
  from the segments finalize already read), never again on a retry.
"""

from __future__ import annotations

import asyncio
import json
import time
from datetime import timedelta
from typing import Any

from temporalio import activity
from temporalio.common import RetryPolicy

from durable_rollouts import metrics
from durable_rollouts.activities.calls import Options, options
from durable_rollouts.activities.environment import EnvironmentActivities
from durable_rollouts.activities.heartbeat import heartbeating
from durable_rollouts.config.paths import resolve_path
from durable_rollouts.contracts.activity_io import (
    FinalizeGroupInput,
    FinalizeRolloutInput,
    GenerateInput,
    LoadRunInput,
    LoadRunResult,
    PrepareInput,
    StoredOutcome,
)
from durable_rollouts.contracts.types import EnvTraits, Outcome, PrepareResult, RetrySettings, TurnResult
from durable_rollouts.engines.client import EngineClient
from durable_rollouts.engines.rejoin import EngineGate
from durable_rollouts.engines.watchdog import watching
from durable_rollouts.environments import registry
from durable_rollouts.environments.base import calling
from durable_rollouts.environments.tasks import read_tasks
from durable_rollouts.errors import ConfigError, EngineBadRequest, RolloutError, TaskFileError, names
from durable_rollouts.gateway.turn import sequence_starts
from durable_rollouts.records.export import rollout_lineage
from durable_rollouts.sandboxes.base import SandboxSpec
from durable_rollouts.store import RunStore
from durable_rollouts.turns.clock import StoreClock
from durable_rollouts.turns.model import ModelTurns

RECORD_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=30))
"""Writing a record retries until it lands: a record is never lost to a store hiccup."""


def engine_retry(retry: RetrySettings) -> RetryPolicy:
    """Retry policy of every activity that calls an engine (from the run's ``[engine]`` section)."""
    return RetryPolicy(
        initial_interval=timedelta(seconds=retry.initial_s),
        maximum_interval=timedelta(seconds=retry.max_s),
        maximum_attempts=retry.max_attempts,
        non_retryable_error_types=names(EngineBadRequest, TaskFileError, ConfigError),
    )  # an environment failure is final by its own flag, unless the environment declared it transient


def env_traits(env: str) -> EnvTraits:
    """What the workflows need to know of the environment registered as ``env``."""
    e = registry.get(env)
    return EnvTraits(name=e.name, uses_sandbox=e.uses_sandbox, inline_steps=e.inline_steps, harness=e.harness)


class RolloutActivities:
    """The activities a worker registers for runs and rollouts; holds the store and engine client."""

    def __init__(
        self, store: RunStore, engine: EngineClient, env_steps: EnvironmentActivities | None = None
    ) -> None:
        self.store = store
        self.engine = engine
        self.turns = ModelTurns(store, engine, env_steps.steps if env_steps is not None else None)
        """The model turns (``turns.model``), with the env steps they run inline."""
        self.gate = EngineGate(store)
        """Holds a turn back from an engine that serves an older policy version than the current one
        (``engines.rejoin``: restarted, or a new replica) and starts its re-publish."""

    @options(
        Options(
            timedelta(minutes=5),
            RetryPolicy(maximum_attempts=3, non_retryable_error_types=names(TaskFileError, ConfigError)),
        )
    )
    @activity.defn
    async def load_run(self, inp: LoadRunInput) -> LoadRunResult:
        """Record the run with its resolved config and store its tasks; returns their number and the env.

        Tasks `rollouts run` uploaded into the store at submit are used as they are (a worker on another
        host needs no access to the submitter's files); otherwise the task file is read here."""
        try:
            traits = env_traits(inp.env)
            uploaded = await asyncio.to_thread(self.store.task_count, inp.run_id)
            env = registry.get(inp.env)
            sandbox = SandboxSpec.model_validate(json.loads(inp.config_json).get("sandbox") or {})
            with calling(env, "load_tasks", inp.run_id):
                tasks = (
                    []
                    if uploaded
                    else await asyncio.to_thread(read_tasks, env, resolve_path(inp.task_file), sandbox)
                )
        except RolloutError as e:
            raise e.to_application_error() from e
        await asyncio.to_thread(self.store.register_run, inp.run_id, inp.config_json, inp.config_hash)
        if uploaded:
            return LoadRunResult(num_tasks=uploaded, env=traits)
        dumped = [t.model_dump(mode="json") for t in tasks]
        return LoadRunResult(
            num_tasks=await asyncio.to_thread(self.store.put_tasks, inp.run_id, dumped), env=traits
        )

    @options(Options(timedelta(seconds=30), local=True))
    @activity.defn
    async def task_ids_at(self, run_id: str, idxs: list[int]) -> list[str]:
        """The ids of the run's tasks at these indexes (a local activity of the run workflow)."""
        tasks = await asyncio.to_thread(lambda: [self.store.task_at(run_id, i) for i in idxs])
        return [t["id"] for t in tasks]

    @options(Options(timedelta(seconds=30), RetryPolicy(maximum_interval=timedelta(seconds=10)), local=True))
    @activity.defn
    async def latest_policy_version(self) -> str | None:
        """The most recently published policy version in the store (None before the first)."""
        rows = await asyncio.to_thread(self.store.policies)
        published = [r["version"] for r in rows if r["status"] == "published"]
        return published[-1] if published else None

    @options(Options(timedelta(seconds=30), local=True))  # callers pass the engine retry policy
    @activity.defn
    async def prepare_rollout(self, inp: PrepareInput) -> PrepareResult:
        """Build the environment's first prompt once and store it as segment 'prompt' (``turns.model``)."""
        with watching(inp.stall_timeout_s):
            try:
                n = await self.turns.prepare(inp)
            except RolloutError as e:
                raise e.to_application_error() from e
        return PrepareResult(prompt_tokens=n, engine=inp.engine_url)

    # start-to-close is derived from engine.request_timeout_s by the caller; retry from [engine]
    @options(Options(timedelta(minutes=5), heartbeat=timedelta(seconds=10), wait_cancellation=True))
    @activity.defn
    async def generate_turn(self, inp: GenerateInput) -> TurnResult:
        """One model turn on the rollout's stored context, and its inline env step (``turns.model``); the
        sampled tokens are stored, not returned.

        Its store calls are timed (meta ``transfer_s``; the segment's own write is handed to the inline
        env step, which records it, or goes uncounted). Its engine calls are watched for a stalled engine
        (``engine.stall_timeout_s``, ``engines.watchdog``): a hung engine fails the call as EngineStalled
        within seconds, not after request_timeout_s, and it is not retried in place.

        No turn goes to an engine held out of rotation (``engines.rejoin``): the call fails as
        EngineUnavailable (retried, failed over or waited out) until it serves the current version.
        """
        info = activity.info()
        queued = max(0.0, (info.started_time - info.current_attempt_scheduled_time).total_seconds())
        with watching(inp.stall_timeout_s):
            try:
                await self.gate.admit(inp.engine_url)
                return await heartbeating(self.turns.turn(inp, info.attempt, queued))
            except RolloutError as e:
                self.gate.forget(inp.engine_url)  # it may come back restarted: asked before its next turn
                raise e.to_application_error() from e

    @options(Options(timedelta(seconds=60), RECORD_RETRY, local=True))
    @activity.defn
    async def finalize_rollout(self, inp: FinalizeRolloutInput) -> StoredOutcome:
        """Write the rollout's record once (keyed by rollout id); returns the record as stored.

        The workflow reports what this returns, not what it asked to write, so the group's statistics
        always agree with the store even when a retried workflow task decided differently the second time.

        The record carries its lineage (policy versions, config hash, env/verifier versions, sandbox image;
        see ``records.export.rollout_lineage``) in ``extra_json["lineage"]``, and its per-rollout time
        entries (``started_at``, ``ended_at``, ``sandbox_s``, ``record_transfer_s``: its own store reads).
        """
        t0 = time.monotonic()
        timed = StoreClock()
        ref = inp.ref
        segs, run, handle = await timed(  # the record's reads in one thread hop
            lambda: (
                self.store.segments(ref.rollout_id),
                self.store.get_run(ref.run_id),
                self.store.get_sandbox(ref.rollout_id),
            )
        )
        image = handle.spec.image if handle is not None else None
        extra = {
            **_extras(inp),
            **_times(inp, timed.seconds, time.monotonic() - t0),
            "lineage": rollout_lineage(run, ref.env, segs, image),
        }
        if starts := sequence_starts(segs):  # a harness rewrote its history: where and why
            extra["sequences"] = starts
        prompt_len = segs[0].end if segs and segs[0].kind == "prompt" else 0
        rec = {
            "rollout_id": ref.rollout_id,
            "run_id": ref.run_id,
            "group_id": ref.group_id,
            "task_id": ref.task_id,
            "sample_index": ref.sample_index,
            "env": ref.env,
            "outcome": inp.outcome.value,
            "reason": inp.reason,
            "reward": inp.reward,
            "scorable": int(inp.scorable),
            "advantage": None,
            "prompt_length": prompt_len,
            "num_tokens": segs[-1].end if segs else 0,
            "sampling_json": inp.sampling.model_dump_json(),
            "extra_json": json.dumps(extra),
        }
        inserted, row = await asyncio.to_thread(self._put_and_read, rec)
        if inserted:  # the record's first write: a retried finalize never counts it (or its turns) twice
            metrics.record_rollout(
                ref.env,
                inp.outcome.value,
                inp.reason,
                segs,
                inp.state.sandbox_slot_waits if inp.uses_sandbox else 0,
            )
        return StoredOutcome(
            outcome=Outcome(row["outcome"]),
            reason=row["reason"],
            reward=row["reward"],
            scorable=bool(row["scorable"]),
            wasted_tokens=int(json.loads(row["extra_json"]).get("wasted_tokens", 0)),
            inserted=inserted,
        )

    def _put_and_read(self, rec: dict[str, Any]) -> tuple[bool, dict[str, Any]]:
        """Write the record once; whether this call wrote it, and the record as stored."""
        inserted = self.store.put_rollout(rec)
        row = self.store.rollout(rec["rollout_id"])
        assert row is not None
        return inserted, row

    @options(Options(timedelta(seconds=60), RECORD_RETRY, local=True))
    @activity.defn
    async def finalize_group(self, inp: FinalizeGroupInput) -> bool:
        """Write the group record, its members' advantages and what the close says of its members (the
        superseded attempts, an unscorable group's members); idempotent on run + group id."""
        rec = inp.record

        def write() -> bool:  # one thread hop; each write is its own idempotent transaction, as before
            self.store.set_advantages(inp.advantages)
            self.store.mark_members(inp.superseded, inp.unscorable)
            return self.store.put_group(rec.run_id, rec.group_id, rec.task_id, rec.model_dump(mode="json"))

        return await asyncio.to_thread(write)

    @options(Options(timedelta(seconds=60), RECORD_RETRY))
    @activity.defn
    async def finish_run(self, run_id: str, status: str = "finished") -> None:
        """Mark the run ended in the store (``finished``, or ``cancelled`` for a run cancelled as a whole)."""
        await asyncio.to_thread(self.store.finish_run, run_id, status)

    def all(self) -> list:
        """Every activity of this class, for ``Worker(activities=...)``."""
        return [
            self.load_run,
            self.task_ids_at,
            self.latest_policy_version,
            self.prepare_rollout,
            self.generate_turn,
            self.finalize_rollout,
            self.finalize_group,
            self.finish_run,
        ]


def _extras(inp: FinalizeRolloutInput) -> dict[str, Any]:
    """The record's optional counters, as stored (only those that say something)."""
    s = inp.state
    out: dict[str, Any] = {}
    if inp.uses_sandbox:
        out["sandbox_replays"] = s.sandbox_replays
        if s.sandbox_slot_waits:
            out["sandbox_slot_waits"] = s.sandbox_slot_waits
    if s.partial_steps:
        out["partial_steps"] = s.partial_steps
    if s.engine_failovers:
        out.update(engine_failovers=s.engine_failovers, reprefill_tokens=s.reprefill_tokens)
    if inp.score_truncated is not None:
        out["score_truncated"] = inp.score_truncated  # whether this run scores truncated rollouts
    if inp.wasted_tokens is not None:
        out["wasted_tokens"] = inp.wasted_tokens
    if inp.failure is not None:  # an environment exception's type, hook and last frames
        out["failure"] = inp.failure
    return out


def _times(inp: FinalizeRolloutInput, transfer_s: float, reads_s: float) -> dict[str, float | None]:
    """The record's per-rollout time entries (``records/timing.py``): wall-time bounds, sandbox, transfer.

    The wall time ends when the record's reads end (``reads_s`` after this activity started, on top of the
    workflow's time at scheduling it): those reads count as transfer, so they must lie inside the wall time.
    """
    s = inp.state
    return {
        "started_at": s.started_at,
        "ended_at": inp.ended_at + reads_s if inp.ended_at is not None else None,
        "sandbox_s": s.sandbox_s,
        "record_transfer_s": transfer_s,
    }
