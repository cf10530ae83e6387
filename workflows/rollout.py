"""RolloutWorkflow: one trajectory from first prompt to termination, returned as one record.

Invariants:
- Deterministic: every side effect is an activity with an explicit timeout and retry policy.
- Exactly one record per rollout: whatever ends the rollout (completion, a limit, an infrastructure or
  environment failure, cancellation), the finalize activity writes its record, keyed by rollout id.
- Only keys and counters cross history; the token sequence lives in the run store.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import TypeVar

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from errors import failure_kind
    from workflows import search_attributes as sa
    from workflows.admission import CANCEL_REASON
    from workflows.coding import CodingSteps
    from workflows.dispatch import replica_order
    from workflows.types import (
        EnvStepInput,
        EnvStepResult,
        FailureKind,
        FinalizeRolloutInput,
        GenerateInput,
        Outcome,
        Phase,
        PrepareInput,
        PrepareResult,
        RolloutInput,
        RolloutResult,
        StoredOutcome,
        TruncationReason,
        TurnResult,
    )

T = TypeVar("T")
FINALIZE_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=30))
ENV_RETRY = RetryPolicy(maximum_attempts=3, non_retryable_error_types=["EnvironmentFailure"])


def rollout_replicas(inp: RolloutInput) -> list[str]:
    """The rollout's replicas in preference order: the dispatcher's choice for its group first, then the
    rest in the rollout's own hash order (its failovers)."""
    order = replica_order(inp.engine.urls, inp.rollout_id)
    if inp.preferred_engine in order:
        order.remove(inp.preferred_engine)
        order.insert(0, inp.preferred_engine)
    return order


def pick_engine(urls: list[str], key: str) -> str:
    """Sticky replica of a rollout without a dispatcher's choice: every turn goes to the same replica."""
    return replica_order(urls, key)[0]


class _Ended(Exception):
    """Raised inside the turn loop when a limit or the environment ends the rollout."""

    def __init__(self, outcome: Outcome, reason: str | None = None, reward: float | None = None) -> None:
        super().__init__(reason)
        self.outcome, self.reason, self.reward = outcome, reason, reward


@workflow.defn(name="RolloutWorkflow")
class RolloutWorkflow:
    def __init__(self) -> None:
        self._phase = Phase.PREPARE
        self._turn = 0
        self._tokens = 0
        self._version: str | None = None
        self._coding: CodingSteps | None = None
        self._indexed: dict[str, object] = {}
        self._order: list[str] = []
        self._engine = ""
        self._failovers = self._reprefill = 0
        self._sampled = self._step_sampled = self._partial_steps = 0
        self._cancel_reason: str | None = None
        self._task: asyncio.Task[None] | None = None

    @workflow.signal
    def cancel_for(self, reason: str) -> None:
        """Cancel the rollout with a reason (the dispatcher sends ``admission``); it still gets its record."""
        if self._cancel_reason is None:
            self._cancel_reason = reason[:200]
        if self._task is not None and not self._task.done():
            self._task.cancel()

    @workflow.query
    def state(self) -> dict:
        """Live state: phase, turn, tokens so far and the policy version of the last turn."""
        return {
            "phase": self._phase.value,
            "turn": self._turn,
            "tokens": self._tokens,
            "version": self._version,
        }

    def _enter(self, phase: Phase, index: bool = True, outcome: Outcome | None = None) -> None:
        """Show the phase live; with index, also upsert the search attributes that changed.

        Upserts cost history bytes and a visibility write on the server, so they are sent only when the
        phase, the policy version or the outcome changes (the turn rides along; a math rollout, whose phase
        stays "generate", indexes its turn at start and end only, while the live details and the ``state``
        query always show it), and instant phases (a math env step) show in the current-details text only.
        """
        changed_phase = phase != self._phase
        self._phase = phase
        if index and (
            changed_phase or outcome is not None or self._version != self._indexed.get(sa.POLICY_VERSION.name)
        ):
            wanted = {
                sa.PHASE: phase.value,
                sa.TURN: self._turn,
                sa.POLICY_VERSION: self._version,
                sa.OUTCOME: outcome.value if outcome else None,
            }
            changed = {k: v for k, v in wanted.items() if v is not None and self._indexed.get(k.name) != v}
            if changed:
                workflow.upsert_search_attributes([k.value_set(v) for k, v in changed.items()])  # type: ignore[attr-defined]
                self._indexed.update({k.name: v for k, v in changed.items()})
        workflow.set_current_details(
            f"phase={phase.value} turn={self._turn} tokens={self._tokens} version={self._version}"
        )

    @workflow.run
    async def run(self, inp: RolloutInput) -> RolloutResult:
        self._turn, self._tokens = inp.turns_done, inp.num_tokens
        started = inp.started_at if inp.started_at is not None else workflow.now().timestamp()
        self._order = rollout_replicas(inp)
        self._failovers, self._reprefill = inp.engine_failovers, inp.reprefill_tokens
        self._sampled = inp.sampled_tokens
        self._step_sampled, self._partial_steps = inp.step_sampled, inp.partial_steps
        self._engine = self._order[min(inp.engine_failovers, len(self._order) - 1)]
        if inp.env == "coding":
            self._coding = CodingSteps(inp, self._engine)
            self._coding.replays = inp.sandbox_replays
        remaining = inp.timeout_s - (workflow.now().timestamp() - started)
        try:
            if remaining <= 0:
                raise TimeoutError
            self._task = asyncio.ensure_future(self._loop(inp, started))
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
            timed_out = workflow.now().timestamp() - started >= inp.timeout_s
            ended = _Ended(Outcome.TRUNCATED, TruncationReason.TIMEOUT.value) if timed_out else _failure(e)
        return await self._finalize(inp, ended)

    async def _loop(self, inp: RolloutInput, started: float) -> None:
        if self._turn == 0 and self._tokens == 0 and self._coding is not None:
            # A math rollout's prompt is rendered by its first model call's activity (one step less).
            self._enter(Phase.PREPARE)
            await self._coding.create()
            prep: PrepareResult = await self._with_failover(inp, self._prepare_on)
            self._tokens = prep.prompt_tokens
        while True:
            if self._turn >= inp.max_turns:
                raise await self._score_truncated(inp, TruncationReason.MAX_TURNS)
            if inp.step_token_budget and self._step_sampled >= inp.step_token_budget:
                await self._await_newer_policy(inp)
            budget = inp.max_total_tokens - self._tokens
            if budget <= 0:
                raise await self._score_truncated(inp, TruncationReason.TOKEN_BUDGET)
            last = self._turn + 1 >= inp.max_turns
            turn = await self._generate(inp, min(budget, inp.sampling.max_tokens), last)
            if turn.truncated_reason is not None:
                raise await self._score_truncated(inp, turn.truncated_reason)
            if turn.finish_reason == "length" and turn.end >= inp.max_total_tokens:
                raise await self._score_truncated(inp, TruncationReason.TOKEN_BUDGET)
            step = turn.env if turn.env is not None else await self._env_step(inp, last=last)
            self._turn += 1
            if step.done:
                raise _Ended(Outcome.COMPLETED, None, step.reward)
            self._tokens += step.observation_tokens
            if step.truncated_reason is not None:
                raise await self._score_truncated(inp, step.truncated_reason)
            if workflow.info().is_continue_as_new_suggested():
                await workflow.wait_condition(workflow.all_handlers_finished)
                workflow.continue_as_new(
                    inp.model_copy(
                        update={
                            "turns_done": self._turn,
                            "num_tokens": self._tokens,
                            "started_at": started,
                            "sandbox_replays": self._coding.replays if self._coding else 0,
                            "engine_failovers": self._failovers,
                            "reprefill_tokens": self._reprefill,
                            "sampled_tokens": self._sampled,
                            "step_sampled": self._step_sampled,
                            "partial_steps": self._partial_steps,
                        }
                    )
                )

    async def _await_newer_policy(self, inp: RolloutInput) -> None:
        """Partial rollouts: wait (durable timers, no engine resources held) for the next publish."""
        self._enter(Phase.PAUSED)
        seen = await self._latest_policy()
        while (latest := await self._latest_policy()) == seen:
            workflow.set_current_details(
                f"phase=paused turn={self._turn} tokens={self._tokens}: waiting for a version after {seen}"
            )
            await workflow.sleep(inp.partial_poll_s)
        self._partial_steps += 1
        self._step_sampled = 0
        workflow.logger.info("rollout %s: resumes under %s (was %s)", inp.rollout_id, latest, seen)

    async def _latest_policy(self) -> str | None:
        return await workflow.execute_local_activity(
            "latest_policy_version",
            result_type=str,
            start_to_close_timeout=timedelta(seconds=30),
            retry_policy=RetryPolicy(maximum_interval=timedelta(seconds=10)),
        )

    async def _generate(self, inp: RolloutInput, max_tokens: int, last: bool) -> TurnResult:
        return await self._with_failover(
            inp, lambda i, engine: self._generate_on(i, engine, max_tokens, last)
        )

    async def _with_failover(self, inp: RolloutInput, call: Callable[[RolloutInput, str], Awaitable[T]]) -> T:
        """Run an engine step; an engine unreachable past its retries moves the rollout on a replica."""
        while True:
            try:
                return await call(inp, self._engine)
            except (ActivityError, ApplicationError) as e:
                cause = e.cause if isinstance(e, ActivityError) else e
                gone = isinstance(cause, ApplicationError) and cause.type == "EngineUnavailable"
                if not (gone and inp.engine.failover and self._failovers + 1 < len(self._order)):
                    raise
            self._failovers += 1
            self._reprefill += self._tokens  # the new replica prefills the whole context again
            self._engine = self._order[self._failovers]
            if self._coding is not None:
                self._coding.engine = self._engine
            workflow.logger.warning("rollout %s: failing over to %s", inp.rollout_id, self._engine)

    def _prepare_input(self, inp: RolloutInput, engine: str) -> PrepareInput:
        return PrepareInput(
            run_id=inp.run_id,
            rollout_id=inp.rollout_id,
            task_id=inp.task_id,
            engine_url=engine,
            model=inp.engine.model,
            env=inp.env,
        )

    async def _prepare_on(self, inp: RolloutInput, engine: str) -> PrepareResult:
        return await workflow.execute_local_activity(
            "prepare_rollout",
            self._prepare_input(inp, engine),
            result_type=PrepareResult,
            start_to_close_timeout=timedelta(seconds=30),
            retry_policy=_engine_retry(inp),
        )

    async def _generate_on(self, inp: RolloutInput, engine: str, max_tokens: int, last: bool) -> TurnResult:
        self._enter(Phase.GENERATE)
        # The math env step (detokenize, verify, maybe one observation) rides in the model call's
        # activity: one workflow task per turn instead of two. Sandboxed envs step in their own activities.
        env_after = self._math_step_input(inp, last) if self._coding is None else None
        prepare = self._prepare_input(inp, engine) if self._coding is None and self._tokens == 0 else None
        turn: TurnResult = await workflow.execute_activity(
            "generate_turn",
            GenerateInput(
                rollout_id=inp.rollout_id,
                turn=self._turn,
                engine_url=engine,
                model=inp.engine.model,
                sampling=inp.sampling,
                max_tokens=max_tokens,
                env_after=env_after,
                max_total_tokens=inp.max_total_tokens,
                prepare=prepare,
            ),
            result_type=TurnResult,
            start_to_close_timeout=timedelta(seconds=inp.engine.request_timeout_s + 30),
            heartbeat_timeout=timedelta(seconds=10),
            retry_policy=_engine_retry(inp),
        )
        self._tokens = turn.end
        self._sampled += turn.end - turn.start
        self._step_sampled += turn.end - turn.start
        if turn.policy_version is not None:
            self._version = turn.policy_version
        return turn

    async def _env_step(self, inp: RolloutInput, last: bool, score_only: bool = False) -> EnvStepResult:
        self._enter(Phase.ENV, index=self._coding is not None)
        if self._coding is not None:
            return await self._coding.step(self._turn, score_only=score_only)
        # Scoring a truncated rollout: the math env step as a local activity (one marker event).
        return await workflow.execute_local_activity(
            "env_step",
            self._math_step_input(inp, last, score_only),
            result_type=EnvStepResult,
            start_to_close_timeout=timedelta(seconds=30),
            retry_policy=ENV_RETRY,
        )

    def _math_step_input(self, inp: RolloutInput, last: bool, score_only: bool = False) -> EnvStepInput:
        return EnvStepInput(
            run_id=inp.run_id,
            rollout_id=inp.rollout_id,
            task_id=inp.task_id,
            env=inp.env,
            turn=self._turn,
            last_turn=last,
            score_only=score_only,
            engine_url=self._engine,
            model=inp.engine.model,
        )

    async def _score_truncated(self, inp: RolloutInput, reason: TruncationReason) -> _Ended:
        """A truncated rollout, scored by the environment only if the run asks for it."""
        if not inp.score_truncated:
            return _Ended(Outcome.TRUNCATED, reason.value)
        step = await self._env_step(inp, last=True, score_only=True)
        return _Ended(Outcome.TRUNCATED, reason.value, step.reward)

    async def _finalize(self, inp: RolloutInput, ended: _Ended) -> RolloutResult:
        self._enter(Phase.FINALIZE, index=False)
        extra: dict = {}
        if self._coding is not None:
            await self._coding.destroy()
            extra["sandbox_replays"] = self._coding.replays
            if self._coding.slot_waits:
                extra["sandbox_slot_waits"] = self._coding.slot_waits
        if self._partial_steps:
            extra["partial_steps"] = self._partial_steps
        if self._failovers:
            extra.update(engine_failovers=self._failovers, reprefill_tokens=self._reprefill)
        if ended.outcome == Outcome.TRUNCATED:
            extra["score_truncated"] = inp.score_truncated  # whether this run scores truncated rollouts
        if ended.reason == CANCEL_REASON:
            extra["wasted_tokens"] = self._sampled
        scorable = ended.reward is not None and ended.outcome in (Outcome.COMPLETED, Outcome.TRUNCATED)
        stored: StoredOutcome = await workflow.execute_local_activity(
            "finalize_rollout",
            FinalizeRolloutInput(
                run_id=inp.run_id,
                group_id=inp.group_id,
                rollout_id=inp.rollout_id,
                task_id=inp.task_id,
                sample_index=inp.sample_index,
                env=inp.env,
                outcome=ended.outcome,
                reason=ended.reason,
                reward=ended.reward if scorable else None,
                scorable=scorable,
                sampling=inp.sampling,
                turns=self._turn,
                extra=extra,
            ),
            result_type=StoredOutcome,
            start_to_close_timeout=timedelta(seconds=60),
            retry_policy=FINALIZE_RETRY,
        )
        if (stored.outcome, stored.reason) != (ended.outcome, ended.reason):
            workflow.logger.warning(
                "rollout %s: ended %s (%s) but its record already says %s (%s); the record stands",
                inp.rollout_id, ended.outcome.value, ended.reason, stored.outcome.value, stored.reason,
            )  # fmt: skip
        self._enter(Phase.DONE, outcome=stored.outcome)
        return RolloutResult(
            rollout_id=inp.rollout_id,
            sample_index=inp.sample_index,
            outcome=stored.outcome,
            reason=stored.reason,
            reward=stored.reward,
            scorable=stored.scorable,
            num_tokens=self._tokens,
            turns=self._turn,
            wasted_tokens=stored.wasted_tokens,
        )


def _engine_retry(inp: RolloutInput) -> RetryPolicy:
    return RetryPolicy(
        initial_interval=timedelta(seconds=inp.retry.initial_s),
        maximum_interval=timedelta(seconds=inp.retry.max_s),
        maximum_attempts=inp.retry.max_attempts,
        non_retryable_error_types=["EngineBadRequest", "TaskFileError", "EnvironmentFailure"],
    )


def _failure(e: ActivityError | ApplicationError) -> _Ended:
    """Attribute a finally-failed activity: environment errors vs everything else (infrastructure)."""
    cause = e.cause if isinstance(e, ActivityError) else e
    err_type = cause.type if isinstance(cause, ApplicationError) else type(cause).__name__
    message = cause.message if isinstance(cause, ApplicationError) else str(cause)
    kind = FailureKind(failure_kind(e))
    return _Ended(Outcome.FAILED, f"{kind.value}: {err_type}: {message}"[:500])
