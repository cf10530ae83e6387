"""Activities of a rollout: the run's tasks, the prompt, model calls, records.

Invariants:
- Idempotent on keys that survive retries: the run id, the rollout id, and (rollout id, turn). A retried
  activity finds what an earlier attempt wrote and returns it, so no sample is produced twice or lost.
- Inputs and results are small (keys, counts, scalars); token arrays go to the store, never to history.
- Environment-specific work goes through the environment interface (``envs.base``), never a name test.
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

import metrics
from activities.calls import Options, options
from activities.environment import EnvironmentActivities
from activities.heartbeat import heartbeating
from activities.transfer import StoreClock
from contracts.types import (
    EnvTraits,
    FinalizeGroupInput,
    FinalizeRolloutInput,
    GenerateInput,
    LoadRunInput,
    LoadRunResult,
    Outcome,
    PrepareInput,
    PrepareResult,
    RetrySettings,
    StoredOutcome,
    TruncationReason,
    TurnResult,
)
from engines.client import EngineClient
from engines.watchdog import watching
from envs import registry
from envs.base import calling
from errors import (
    ConfigError,
    ContextLengthExceeded,
    EngineBadRequest,
    EngineUnavailable,
    RolloutError,
    TaskFileError,
    names,
)
from gateway.turn import sequence_starts
from records.export import rollout_lineage
from store import RunStore, Segment, model_segment

EMPTY_POLICIES_REREAD_S = 5.0
"""How often a worker whose store holds no published policy looks again (a run outside any publish
history would otherwise read the policies table on every turn)."""
MODE_TTL_S = 30.0
"""How long a worker trusts an engine's reported logprobs mode before asking again (a restarted engine
may come back with another; a failed call forgets it at once)."""
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
        self.env_steps = env_steps
        self._known_versions: set[str] = set()
        self._versions_read_at = float("-inf")
        self._modes: dict[str, tuple[str | None, float]] = {}
        """Engine URL -> (logprobs mode it reported, when it was asked)."""
        self._mode_asks: dict[str, asyncio.Future[tuple[str | None, float]]] = {}
        """Engine URL -> the question being asked (every rollout arriving meanwhile awaits its answer)."""
        """Runs the inline env steps of ``generate_turn`` (environments with ``inline_steps``)."""

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
            with calling(env, "load_tasks", inp.run_id):
                tasks = [] if uploaded else await asyncio.to_thread(env.load_tasks, inp.task_file)
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
        """Build the environment's first prompt once and store it as segment 'prompt'."""
        with watching(inp.stall_timeout_s):
            return await self._prepare(inp, StoreClock())

    async def _prepare(self, inp: PrepareInput, timed: StoreClock) -> PrepareResult:
        existing = await timed(self.store.get_segment, inp.rollout_id, "prompt")
        if existing is None:
            try:
                env = registry.get(inp.env)
                row = await timed(self.store.get_task, inp.run_id, inp.task_id)
                with calling(env, "validate_task", inp.rollout_id):
                    task = env.validate_task(row, where=f"run {inp.run_id} task {inp.task_id}")
                with calling(env, "prompt", inp.rollout_id):
                    prompt = env.prompt(task)
                ids = prompt.token_ids
                if ids is None:
                    assert prompt.messages is not None
                    ids = await self.engine.tokenize_chat(inp.engine_url, inp.model, prompt.messages)
            except RolloutError as e:
                raise e.to_application_error() from e
            seg = Segment(name="prompt", kind="prompt", turn=None, start=0, token_ids=ids)
            existing = await timed(self.store.put_segment, inp.rollout_id, seg)
        return PrepareResult(prompt_tokens=len(existing.token_ids), engine=inp.engine_url)

    # start-to-close is derived from engine.request_timeout_s by the caller; retry from [engine]
    @options(Options(timedelta(minutes=5), heartbeat=timedelta(seconds=10), wait_cancellation=True))
    @activity.defn
    async def generate_turn(self, inp: GenerateInput) -> TurnResult:
        """One model call on the rollout's stored context; the sampled tokens are stored, not returned.

        Its store calls are timed (meta ``transfer_s``; the segment's own write is handed to the inline
        env step, which records it, or goes uncounted). Its engine calls are watched for a stalled engine
        (``engine.stall_timeout_s``, ``engines.watchdog``): a hung engine fails the call as EngineStalled
        within seconds, not after request_timeout_s, and it is not retried in place.
        """
        with watching(inp.stall_timeout_s):
            return await self._generate_turn(inp)

    async def _generate_turn(self, inp: GenerateInput) -> TurnResult:
        name = model_segment(inp.turn)
        timed = StoreClock()
        if inp.prepare is not None:
            await self._prepare(inp.prepare, timed)
        seg = await timed(self.store.get_segment, inp.rollout_id, name)
        unrecorded = 0.0  # store seconds the stored meta does not hold
        if seg is None:
            context = await timed(self.store.token_ids, inp.rollout_id)
            room = inp.max_total_tokens - len(context) if inp.max_total_tokens else inp.max_tokens
            if room <= 0:  # the prompt alone fills the rollout's token budget
                return _no_turn(inp, len(context), "length", TruncationReason.TOKEN_BUDGET)
            max_tokens = min(inp.max_tokens, room)
            info = activity.info()
            queued = max(0.0, (info.started_time - info.current_attempt_scheduled_time).total_seconds())
            request_id = f"{inp.rollout_id}/{inp.turn}/{info.attempt}"
            served = await self._served_mode(inp.engine_url, inp.sampling.logprob_mode)
            try:
                gen = await heartbeating(
                    self.engine.generate(
                        inp.engine_url, inp.model, context, inp.sampling, max_tokens, request_id
                    )
                )
            except ContextLengthExceeded as e:
                activity.logger.info("rollout %s turn %d: %s", inp.rollout_id, inp.turn, e)
                return _no_turn(inp, len(context), "context_length", TruncationReason.CONTEXT_LENGTH)
            except RolloutError as e:
                self._modes.pop(inp.engine_url, None)  # it may come back as another engine: ask again
                raise e.to_application_error() from e
            await self._refuse_unknown_versions(inp.engine_url, gen.policy_versions, timed)
            meta = {
                "engine": inp.engine_url,
                "finish_reason": gen.finish_reason,
                "queue_s": queued + gen.queue_s,
                "model_s": gen.model_s,
                "attempt": info.attempt,
                "transfer_s": timed.seconds,
                "logprob_mode": served,
            }
            seg = Segment(
                name=name,
                kind="model",
                turn=inp.turn,
                start=len(context),
                token_ids=gen.token_ids,
                logprobs=gen.logprobs,
                policy_versions=gen.policy_versions,
                meta=meta,
            )
            before = timed.seconds
            seg = await timed(self.store.put_segment, inp.rollout_id, seg)
            unrecorded = timed.seconds - before
        versions = [v for v in seg.policy_versions or [] if v is not None]
        env = None
        limit = inp.max_total_tokens or seg.end + 1
        over_budget = seg.meta["finish_reason"] == "length" and seg.end >= limit
        if inp.env_after is not None and not over_budget:
            assert self.env_steps is not None, "a worker registers generate_turn with its env steps"
            env = await self.env_steps.env_step(inp.env_after.model_copy(update={"transfer_s": unrecorded}))
        return TurnResult(
            turn=inp.turn,
            start=seg.start,
            end=seg.end,
            finish_reason=seg.meta["finish_reason"],
            policy_version=versions[-1] if versions else None,
            env=env,
            attempt=activity.info().attempt,
        )

    async def _served_mode(self, engine_url: str, wanted: str) -> str | None:
        """The logprobs mode the engine really serves (asked at most every MODE_TTL_S per engine, and
        again after it failed a call); an engine whose mode differs from the run's is refused as
        EngineUnavailable (the rollout fails over, or waits for an engine that serves the right mode), so
        no sample's declared meaning is wrong. None: the engine cannot tell (not in dev mode)."""
        cached = self._modes.get(engine_url)
        if cached is None or time.monotonic() - cached[1] > MODE_TTL_S:
            # One question per engine at a time: the rollouts arriving meanwhile await its answer (vLLM's
            # /server_info dumps its whole config, and gathers system info on its first call), and its
            # failure, so a stalled engine fails them all within one stall timeout, not one after another.
            ask = self._mode_asks.get(engine_url)
            if ask is None or ask.done():
                ask = self._mode_asks[engine_url] = asyncio.ensure_future(self._ask_mode(engine_url))
            try:
                cached = await asyncio.shield(ask)
            except RolloutError as e:
                raise e.to_application_error() from e
        served = cached[0]
        if served is not None and served != wanted:
            self._modes.pop(engine_url, None)
            err = EngineUnavailable(
                f"engine {engine_url} serves {served}, the run declares {wanted}; refused"
            )
            raise err.to_application_error()
        return served

    async def _ask_mode(self, engine_url: str) -> tuple[str | None, float]:
        """Ask the engine its logprobs mode (watched with the stall timeout of the rollout that asks)."""
        answer = (await self.engine.logprob_mode(engine_url), time.monotonic())
        self._modes[engine_url] = answer
        return answer

    async def _refuse_unknown_versions(
        self, engine_url: str, versions: list[str | None], timed: StoreClock
    ) -> None:
        """A turn sampled under a version label the store never saw published (or being published) is not
        stored: an engine restarted from its files reports a label such as ``default`` for weights nobody
        can name. The call fails as EngineUnavailable (retried, failed over, or waited out) until the
        engine serves a known version again (``rollouts policy publish``). A store with no policy at all
        (a run outside any publish history) labels nothing and checks nothing.

        The known labels are cached per worker and reread from the store only on a miss.
        """
        seen = {v for v in versions if v is not None}
        if seen <= self._known_versions:
            return
        if not self._known_versions and time.monotonic() - self._versions_read_at < EMPTY_POLICIES_REREAD_S:
            return  # the store had no policy a moment ago: nothing to check against, no reread per turn
        self._versions_read_at = time.monotonic()
        rows = await timed(self.store.policies)
        self._known_versions = {r["version"] for r in rows}
        unknown = sorted(seen - self._known_versions)
        if unknown and self._known_versions:
            err = EngineUnavailable(
                f"engine {engine_url} serves version {', '.join(unknown)}, which was never published "
                f"(known: {', '.join(sorted(self._known_versions))}); refusing its samples"
            )
            raise err.to_application_error()

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
        segs = await timed(self.store.segments, inp.rollout_id)
        run = await timed(self.store.get_run, inp.run_id)
        handle = await timed(self.store.get_sandbox, inp.rollout_id)
        image = handle.spec.image if handle is not None else None
        extra = {
            **_extras(inp),
            **_times(inp, timed.seconds, time.monotonic() - t0),
            "lineage": rollout_lineage(run, inp.env, segs, image),
        }
        if starts := sequence_starts(segs):  # a harness rewrote its history: where and why
            extra["sequences"] = starts
        prompt_len = segs[0].end if segs and segs[0].kind == "prompt" else 0
        rec = {
            "rollout_id": inp.rollout_id,
            "run_id": inp.run_id,
            "group_id": inp.group_id,
            "task_id": inp.task_id,
            "sample_index": inp.sample_index,
            "env": inp.env,
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
        inserted = await asyncio.to_thread(self.store.put_rollout, rec)
        if inserted:  # the record's first write: a retried finalize never counts it (or its turns) twice
            metrics.record_rollout(
                inp.env,
                inp.outcome.value,
                inp.reason,
                segs,
                inp.state.sandbox_slot_waits if inp.uses_sandbox else 0,
            )
        row = await asyncio.to_thread(self.store.rollout, inp.rollout_id)
        assert row is not None
        return StoredOutcome(
            outcome=Outcome(row["outcome"]),
            reason=row["reason"],
            reward=row["reward"],
            scorable=bool(row["scorable"]),
            wasted_tokens=int(json.loads(row["extra_json"]).get("wasted_tokens", 0)),
            inserted=inserted,
        )

    @options(Options(timedelta(seconds=60), RECORD_RETRY, local=True))
    @activity.defn
    async def finalize_group(self, inp: FinalizeGroupInput) -> bool:
        """Write the group record, its members' advantages and what the close says of its members (the
        superseded attempts, an unscorable group's members); idempotent on run + group id."""
        rec = inp.record
        await asyncio.to_thread(self.store.set_advantages, inp.advantages)
        await asyncio.to_thread(self.store.mark_members, inp.superseded, inp.unscorable)
        return await asyncio.to_thread(
            self.store.put_group, rec.run_id, rec.group_id, rec.task_id, rec.model_dump(mode="json")
        )

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


def _no_turn(inp: GenerateInput, at: int, finish: str, reason: TruncationReason) -> TurnResult:
    """A turn that sampled nothing because a limit was reached first (the rollout ends truncated)."""
    return TurnResult(
        turn=inp.turn, start=at, end=at, finish_reason=finish, policy_version=None, truncated_reason=reason
    )
