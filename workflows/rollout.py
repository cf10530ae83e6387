"""RolloutWorkflow: one trajectory from first prompt to termination, returned as one record.

Invariants:
- Deterministic: every side effect is an activity with an explicit timeout and retry policy.
- Exactly one record per rollout: whatever ends the rollout (completion, a limit, an infrastructure or
  environment failure, cancellation), the finalize activity writes its record, keyed by rollout id.
- Only keys and counters cross history; the token sequence lives in the run store.
- Search attributes are upserted only inside workflow tasks the rollout runs anyway (never a task of their
  own): on a phase, version, outcome, replica or sandbox-host change, and for progress alone (a turn, the
  attempt count) at most once per ``search_attributes.PROGRESS_INDEX_INTERVAL_S`` of workflow time. The
  operating attributes (progress time, replica, sandbox host, attempt) are always indexed (their patch,
  ``ops-search-attributes``, is retired: ``workflows/patches.py``).
- The live details say what the rollout waits on and since when (UTC), e.g.
  ``waiting on model call (turn 3, http://e:8000) since 2026-12-01T10:00:00Z | phase=generate ...``.
- A rollout run inside its group's workflow (``RolloutInput.in_group``, ``group.inline_rollouts``) is the
  same code on the group's history: it upserts no search attributes and sets no live details (both are
  the group's), never continues as new, and is told to cancel by a call, not a signal; its ``state`` is
  what the group's ``progress`` query lists.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from temporalio import workflow
from temporalio.common import SearchAttributeKey
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from durable_rollouts.activities.environment import EnvironmentActivities
    from durable_rollouts.activities.members import rollout_replicas
    from durable_rollouts.activities.rollout import RolloutActivities, engine_retry
    from durable_rollouts.admission.replicas import replica_order
    from durable_rollouts.contracts.activity_io import (
        EnvStepInput,
        GenerateInput,
        PrepareInput,
        StoredOutcome,
    )
    from durable_rollouts.contracts.types import (
        EnvStepResult,
        Outcome,
        Phase,
        PrepareResult,
        RolloutInput,
        RolloutRef,
        RolloutResult,
        RolloutState,
        TruncationReason,
        TurnResult,
    )
    from durable_rollouts.errors import EngineUnavailable, failure_details, failure_reason, is_error
    from durable_rollouts.turns.sequence import (
        Ended,
        outage_wait,
        run_turns,
        score_truncated,
    )
    from durable_rollouts.workflows import search_attributes as sa
    from durable_rollouts.workflows.calls import call
    from durable_rollouts.workflows.harness_steps import HarnessSteps
    from durable_rollouts.workflows.patches import OPS, TASK_TIMEOUT
    from durable_rollouts.workflows.rollout_record import finalize_rollout_input
    from durable_rollouts.workflows.sandbox_steps import SandboxSteps
    from durable_rollouts.workflows.search_attributes import utc_text, waiting_on

T = TypeVar("T")


def pick_engine(urls: list[str], key: str) -> str:
    """Sticky replica of a rollout without a dispatcher's choice: every turn goes to the same replica."""
    return replica_order(urls, key)[0]


_Ended = Ended  # raised by the turn sequence (turns.sequence) and by the harness's end


@workflow.defn(name="RolloutWorkflow")
class RolloutWorkflow:
    def __init__(self) -> None:
        self._s = RolloutState()
        self._phase = Phase.PREPARE
        self._indexed: dict[str, object] = {}
        self._order: list[str] = []
        self._engine = ""
        self._ref: RolloutRef | None = None
        """Who the rollout is: built once at its start, carried by each of its activity inputs."""
        self._sandbox: SandboxSteps | None = None
        self._cancel_reason: str | None = None
        self._task: asyncio.Task[None] | None = None
        self._progress_at = 0.0
        """Workflow time of the last progress (start, phase change, finished turn)."""
        self._progress_upserted: float | None = None
        """Workflow time of the last upsert that carried the progress time."""
        self._since = 0.0
        """Workflow time the current wait began (the live details' "since")."""
        self._attempt = 1
        self._failed_attempts = 0
        """Attempts of engine calls that failed over, not yet folded into ``_attempt``."""
        self._sandbox_host: str | None = None
        self._harness: HarnessSteps | None = None
        self._calls: set[int] = set()  # harness calls waiting at the gateway (gateway_call signals)
        self._in_group = False
        """Run inside its group's workflow: the search attributes and live details are the group's."""

    @workflow.signal
    def cancel_for(self, reason: str) -> None:
        """Cancel the rollout with a reason (the dispatcher sends ``admission``); it still gets its record."""
        if self._cancel_reason is None:
            self._cancel_reason = reason[:200]
        if self._task is not None and not self._task.done():
            self._task.cancel()

    @workflow.signal
    def gateway_call(self, index: int) -> None:
        """The rollout's harness made model call ``index`` (its request is in the store)."""
        self._calls.add(index)

    @workflow.query
    def state(self) -> dict:
        """Live state: phase, turn, tokens so far and the policy version of the last turn."""
        return {
            "phase": self._phase.value,
            "turn": self._s.turn,
            "tokens": self._s.tokens,
            "version": self._s.version,
            "progress_at": self._progress_at,
            "since": self._since,
            "waiting_on": waiting_on(self._phase, self._s.turn, self._engine, self._sandbox_host),
            "engine": self._engine,
            "sandbox_host": self._sandbox_host,
            "attempt": self._attempt,
        }

    def _enter(
        self, phase: Phase, index: bool = True, outcome: Outcome | None = None, reason: str | None = None
    ) -> None:
        """Show the phase live; with index, also upsert the search attributes that changed.

        Upserts cost history bytes and a visibility write on the server, so they are sent only when the
        phase, the policy version, the outcome, the replica or the sandbox host changes (the turn and the
        progress time ride along), and for progress alone (a turn of a rollout whose phase stays
        "generate", as with inline env steps) at most once per ``PROGRESS_INDEX_INTERVAL_S``; the live
        details and the ``state`` query always show the exact turn. Instant phases (an inline env step)
        show in the current-details text only.
        """
        s = self._s
        now = workflow.now().timestamp()
        changed_phase = phase != self._phase
        self._phase = phase
        if changed_phase or self._since == 0.0 or phase == Phase.GENERATE:
            self._since = now  # a new wait begins (each turn's model call is one)
        if changed_phase:
            self._progress_at = now
        idx = self._indexed
        forced = changed_phase or outcome is not None or s.version != idx.get(sa.POLICY_VERSION.name)
        forced = forced or (self._engine or None) != idx.get(sa.ENGINE.name)
        forced = forced or self._sandbox_host != idx.get(sa.SANDBOX_HOST.name)
        progress = self._progress_at > (self._progress_upserted or 0.0) and sa.progress_due(
            self._progress_upserted, now
        )
        if index and (forced or progress) and not self._in_group:
            wanted: dict[SearchAttributeKey[Any], Any] = {
                sa.PHASE: phase.value,
                sa.TURN: s.turn,
                sa.POLICY_VERSION: s.version,
                sa.OUTCOME: outcome.value if outcome else None,
                sa.ENGINE: self._engine or None,
                sa.SANDBOX_HOST: self._sandbox_host,
                sa.ATTEMPT: self._attempt,
                sa.PROGRESS_AT: datetime.fromtimestamp(self._progress_at, UTC),
                sa.REASON: sa.reason_key(reason) if reason else None,
            }
            changed = {k: v for k, v in wanted.items() if v is not None and idx.get(k.name) != v}
            if changed:
                workflow.upsert_search_attributes([k.value_set(v) for k, v in changed.items()])
                idx.update({k.name: v for k, v in changed.items()})
                if sa.PROGRESS_AT in changed:
                    self._progress_upserted = now
        waits = waiting_on(phase, s.turn, self._engine, self._sandbox_host)
        self._details(
            f"{waits} since {utc_text(self._since)} | phase={phase.value} turn={s.turn} tokens={s.tokens}"
            f" version={s.version} attempt={self._attempt} progress={utc_text(self._progress_at or now)}"
        )

    def _details(self, text: str) -> None:
        """The workflow's live details (a rollout inside its group leaves the group's alone)."""
        if not self._in_group:
            workflow.set_current_details(text)

    @workflow.run
    async def run(self, inp: RolloutInput) -> RolloutResult:
        s = self._s = inp.state.model_copy() if inp.state is not None else RolloutState()
        self._in_group = inp.in_group
        if s.started_at is None:
            s.started_at = workflow.now().timestamp()
        started = s.started_at
        self._ref = inp.ref()
        if inp.revision < 1:  # retired: 0.2.0 and later always index them; revision 1 skips its marker
            workflow.deprecate_patch(OPS.id)
        self._progress_at = workflow.now().timestamp()
        self._sandbox_host = s.sandbox_host
        self._order = rollout_replicas(inp)
        self._engine = self._order[min(s.engine_failovers, len(self._order) - 1)]
        if inp.env.uses_sandbox:
            self._sandbox = SandboxSteps(inp, s, self._ref)
            if inp.env.harness:
                steps = (self._sandbox, self._calls, self._with_failover)
                self._harness = HarnessSteps(inp, self._ref, s, *steps)
        remaining = inp.timeout_s - (workflow.now().timestamp() - started)
        try:
            if remaining <= 0:
                raise TimeoutError
            self._task = asyncio.ensure_future(self._loop(inp))
            if self._cancel_reason is not None:  # told to cancel before the loop existed
                self._task.cancel()
            await asyncio.wait_for(self._task, timeout=remaining)
            raise AssertionError("turn loop returned without an outcome")
        except _Ended as end:
            ended = end
        except TimeoutError:
            ended = await self._score_truncated(inp, TruncationReason.TIMEOUT)
        except asyncio.CancelledError:
            ended = _Ended(Outcome.CANCELLED, self._cancel_reason or "cancelled")
        except (ActivityError, ApplicationError) as e:
            if self._cancel_reason is not None:  # the cancelled activity surfaced as its failure
                ended = _Ended(Outcome.CANCELLED, self._cancel_reason)
                return await self._finalize(inp, ended)
            # A local activity's failure can arrive unwrapped (ApplicationError, no ActivityError).
            # The wall-clock limit cancels the in-flight activity, which may surface as its failure.
            now = workflow.now().timestamp()
            timed_out = now - started >= inp.timeout_s or (
                s.task_deadline is not None and now >= s.task_deadline
            )
            ended = _Ended(Outcome.TRUNCATED, TruncationReason.TIMEOUT.value) if timed_out else _failure(e)
        return await self._finalize(inp, ended)

    async def _loop(self, inp: RolloutInput) -> None:
        s = self._s
        if s.turn == 0 and s.tokens == 0 and self._sandbox is not None:
            # Without a sandbox the prompt is built by the first model call's activity (one step less).
            self._enter(Phase.PREPARE)
            self._sandbox_host = await self._sandbox.create(self._engine)
            if self._harness is None:  # a harness writes its own prompt (its first call's)
                prep: PrepareResult = await self._with_failover(inp, self._prepare_on)
                s.tokens = prep.prompt_tokens
        deadline = s.task_deadline
        if deadline is not None and workflow.patched(TASK_TIMEOUT.id):
            left = deadline - workflow.now().timestamp()
            if left <= 0:
                raise TimeoutError
            await asyncio.wait_for(self._drive(inp), timeout=left)  # TimeoutError: truncated (timeout)
        else:
            await self._drive(inp)

    async def _drive(self, inp: RolloutInput) -> None:
        """The turn loop, or the harness with its calls served (workflows/harness_steps.py)."""
        if self._harness is None:
            return await self._turns(inp)
        self._enter(Phase.GENERATE)
        reason = await self._harness.run()
        if reason is not None:
            raise await self._score_truncated(inp, reason)
        raise _Ended(Outcome.COMPLETED, None, (await self._env_step(inp, True, score_only=True)).reward)

    async def _turns(self, inp: RolloutInput) -> None:
        """The turn sequence (``turns.sequence``), each step an activity of this workflow."""
        await run_turns(inp, self._s, self)

    # The steps of the turn sequence (turns.sequence.TurnSteps).

    async def generate(self, inp: RolloutInput, max_tokens: int, last: bool) -> TurnResult:
        return await self._generate(inp, max_tokens, last)

    async def env_step(self, inp: RolloutInput, last: bool, score_only: bool = False) -> EnvStepResult:
        return await self._env_step(inp, last, score_only)

    async def await_newer_policy(self, inp: RolloutInput) -> None:
        await self._await_newer_policy(inp)

    async def turn_done(self, inp: RolloutInput) -> None:
        """Continue as new when the server suggests it (never inside a group: its history is the group's)."""
        if not self._in_group and workflow.info().is_continue_as_new_suggested():
            await workflow.wait_condition(workflow.all_handlers_finished)
            workflow.continue_as_new(inp.model_copy(update={"state": self._s}))

    async def _await_newer_policy(self, inp: RolloutInput) -> None:
        """Partial rollouts: wait (durable timers, no engine resources held) for the next publish."""
        s = self._s
        self._enter(Phase.PAUSED)
        seen = await call(RolloutActivities.latest_policy_version)
        while (latest := await call(RolloutActivities.latest_policy_version)) == seen:
            self._details(f"phase=paused turn={s.turn} tokens={s.tokens}: waiting for a version after {seen}")
            await workflow.sleep(inp.partial_poll_s)
        s.partial_steps += 1
        s.step_sampled = 0
        workflow.logger.info("rollout %s: resumes under %s (was %s)", inp.rollout_id, latest, seen)

    async def _generate(self, inp: RolloutInput, max_tokens: int, last: bool) -> TurnResult:
        return await self._with_failover(
            inp, lambda i, engine: self._generate_on(i, engine, max_tokens, last)
        )

    async def _with_failover(self, inp: RolloutInput, step: Callable[[RolloutInput, str], Awaitable[T]]) -> T:
        """Run an engine step; an engine unreachable past its retries moves the rollout on a replica, or,
        with no replica left to move to, waits the outage out (durable timers, capped back-off) until
        ``engine.outage_budget_s`` has passed since the outage began: a restart of the only engine delays
        rollouts instead of failing them."""
        s = self._s
        while True:
            try:
                result = await step(inp, self._engine)
                self._stop_if_cancelled()
                s.outage_since = None
                return result
            except (ActivityError, ApplicationError) as e:
                if not is_error(e, EngineUnavailable):
                    raise
                self._failed_attempts += inp.retry.max_attempts
                if not (inp.engine.failover and s.engine_failovers + 1 < len(self._order)):
                    await self._ride_out_outage(inp, e)
                    continue
            s.engine_failovers += 1
            s.reprefill_tokens += s.tokens  # the new replica prefills the whole context again
            self._engine = self._order[s.engine_failovers]
            workflow.logger.warning("rollout %s: failing over to %s", inp.rollout_id, self._engine)

    async def _ride_out_outage(self, inp: RolloutInput, e: BaseException) -> None:
        """Wait for the engine to come back, or re-raise ``e`` once the outage budget is spent."""
        s = self._s
        wait = outage_wait(s, inp.engine.outage_budget_s, workflow.now().timestamp())
        if wait is None:
            raise e
        delay, left = wait
        self._details(
            f"engine {self._engine} unavailable since {s.outage_since:.0f} (wait {s.outage_waits}, "
            f"{left:.0f}s of the outage budget left): retrying in {delay:.0f}s"
        )
        workflow.logger.warning(
            "rollout %s: engine %s unavailable; retrying in %.0fs", inp.rollout_id, self._engine, delay
        )
        await workflow.sleep(delay)

    def _prepare_input(self, inp: RolloutInput, engine: str) -> PrepareInput:
        assert self._ref is not None
        return PrepareInput(ref=self._ref, engine_url=engine, stall_timeout_s=inp.engine.stall_timeout_s)

    async def _prepare_on(self, inp: RolloutInput, engine: str) -> PrepareResult:
        return await call(
            RolloutActivities.prepare_rollout, self._prepare_input(inp, engine), retry=engine_retry(inp.retry)
        )

    async def _generate_on(self, inp: RolloutInput, engine: str, max_tokens: int, last: bool) -> TurnResult:
        s = self._s
        self._enter(Phase.GENERATE)
        # An environment with inline steps is stepped inside the model call's activity: one workflow task
        # per turn instead of two. Others step in their own activity.
        env_after = self._step_input(inp, last) if inp.env.inline_steps else None
        prepare = self._prepare_input(inp, engine) if self._sandbox is None and s.tokens == 0 else None
        turn: TurnResult = await call(
            RolloutActivities.generate_turn,
            GenerateInput(
                ref=self._ref,
                turn=s.turn,
                engine_url=engine,
                sampling=inp.sampling,
                max_tokens=max_tokens,
                env_after=env_after,
                max_total_tokens=inp.max_total_tokens,
                prepare=prepare,
                stall_timeout_s=inp.engine.stall_timeout_s,
            ),
            retry=engine_retry(inp.retry),
            start_to_close=timedelta(seconds=inp.engine.request_timeout_s + 30),
            local=inp.local_model_calls,  # never set with a sandbox (rollout_template)
        )
        self._progress_at = workflow.now().timestamp()  # a finished model call is progress
        self._attempt, self._failed_attempts = self._failed_attempts + turn.attempt, 0
        s.tokens = turn.end
        s.sampled_tokens += turn.end - turn.start
        s.step_sampled += turn.end - turn.start
        if turn.policy_version is not None:
            s.version = turn.policy_version
        return turn

    async def _env_step(self, inp: RolloutInput, last: bool, score_only: bool = False) -> EnvStepResult:
        self._enter(Phase.ENV, index=not inp.env.inline_steps)
        step = self._step_input(inp, last, score_only)
        if self._sandbox is None:
            result = await call(EnvironmentActivities.env_step, step)
        else:
            sandbox = self._sandbox
            run = lambda: sandbox.on_host(EnvironmentActivities.env_step, step)  # noqa: E731
            # a harness's process cannot be replayed into a new sandbox: its loss fails the rollout (infra)
            result = await (run() if self._harness else sandbox.recovering(self._engine, self._s.turn, run))
        self._stop_if_cancelled()
        return result

    def _stop_if_cancelled(self) -> None:
        """End the turn loop if ``cancel_for`` arrived while a step ran: an activity awaited until its
        cancellation completes may finish with its result instead, and the loop must not go on."""
        if self._cancel_reason is not None:
            raise asyncio.CancelledError

    def _step_input(self, inp: RolloutInput, last: bool, score_only: bool = False) -> EnvStepInput:
        assert self._ref is not None
        return EnvStepInput(
            ref=self._ref, turn=self._s.turn, last_turn=last, score_only=score_only, engine_url=self._engine
        )

    async def _score_truncated(self, inp: RolloutInput, reason: TruncationReason) -> _Ended:
        """A truncated rollout, scored by the environment only if the run asks for it."""
        return await score_truncated(inp, self, reason)

    async def _finalize(self, inp: RolloutInput, ended: _Ended) -> RolloutResult:
        self._enter(Phase.FINALIZE, index=False)
        s = self._s
        if self._sandbox is not None:
            await self._sandbox.destroy()
        record = finalize_rollout_input(
            inp, ended.outcome, ended.reason, ref=self._ref, reward=ended.reward, state=s,
            ended_at=workflow.now().timestamp(), failure=ended.details,
        )  # fmt: skip
        stored: StoredOutcome = await call(RolloutActivities.finalize_rollout, record)
        if (stored.outcome, stored.reason) != (ended.outcome, ended.reason):
            workflow.logger.warning(
                "rollout %s: ended %s (%s) but its record already says %s (%s); the record stands",
                inp.rollout_id, ended.outcome.value, ended.reason, stored.outcome.value, stored.reason,
            )  # fmt: skip
        self._enter(Phase.DONE, outcome=stored.outcome, reason=stored.reason)
        return RolloutResult(
            rollout_id=inp.rollout_id,
            sample_index=inp.sample_index,
            outcome=stored.outcome,
            reason=stored.reason,
            reward=stored.reward,
            scorable=stored.scorable,
            num_tokens=s.tokens,
            turns=s.turn,
            wasted_tokens=stored.wasted_tokens,
        )


def _failure(e: ActivityError | ApplicationError) -> _Ended:
    """Attribute a finally-failed activity: environment errors vs everything else (infrastructure); an
    exception of the environment's own code keeps its type, message and last frames (``errors``)."""
    return _Ended(Outcome.FAILED, failure_reason(e), details=failure_details(e))
