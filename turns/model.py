"""A model turn: the prompt rendered and stored once, a model call on the rollout's stored context, its
sampled tokens stored as the turn's segment, and (environments with inline steps) the environment's step.

Invariants:
- Idempotent on (rollout id, turn): a turn whose segment is stored is never sampled again; a retried call
  finds it and returns it (and its inline step finds what the step recorded, ``turns.step``). The prompt
  is stored once per rollout (segment ``prompt``).
- The call samples what ``turns.budget.turn_budget`` allows; a limit that leaves nothing, or an engine
  that refuses the context as too long, ends the turn without a sample (the rollout ends truncated), and a
  turn that reaches the rollout's token limit is not stepped (``turns.budget.turn_truncation``).
- No sample is stored under a logprobs mode other than the run's, or under a policy version the store
  never saw published (``EngineUnavailable``: retried, failed over or waited out by the workflow).
- Only keys and counts leave (``TurnResult``); token arrays go to the store.
- No Temporal: the caller passes the attempt number (part of the engine request id, recorded with the
  turn) and the seconds its call queued, keeps the turn alive (heartbeats) and maps errors
  (``RolloutError``) to its own.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from durable_rollouts.contracts.activity_io import GenerateInput, PrepareInput
from durable_rollouts.contracts.types import SamplingParams, TruncationReason, TurnResult
from durable_rollouts.environments import registry
from durable_rollouts.environments.base import calling
from durable_rollouts.errors import ContextLengthExceeded, EngineUnavailable, RolloutError
from durable_rollouts.store import RunStore, Segment, model_segment
from durable_rollouts.turns.budget import turn_budget, turn_truncation
from durable_rollouts.turns.clock import StoreClock
from durable_rollouts.turns.engine import Engine, Sampled
from durable_rollouts.turns.step import EnvSteps, stored_task

log = logging.getLogger(__name__)

EMPTY_POLICIES_REREAD_S = 5.0
"""How often a worker whose store holds no published policy looks again (a run outside any publish
history would otherwise read the policies table on every turn)."""
MODE_TTL_S = 30.0
"""How long a worker trusts an engine's reported logprobs mode before asking again (a restarted engine
may come back with another; a failed call forgets it at once)."""


async def call_model(
    engine: Engine,
    url: str,
    model: str,
    context: list[int],
    sampling: SamplingParams,
    max_tokens: int,
    max_total_tokens: int,
    request_id: str,
) -> Sampled | TruncationReason:
    """One model call on ``context`` within the turn's budget: what it sampled, or the limit that left it
    nothing (``token_budget``; ``context_length`` when the engine's window is full). Store-free: the
    workers' turns, ``rollouts reproduce`` and the benchmarks' bare loop all call it."""
    budget = turn_budget(len(context), max_total_tokens, max_tokens)
    if budget.truncated is not None:
        return budget.truncated
    try:
        return await engine.generate(url, model, context, sampling, budget.max_tokens, request_id)
    except ContextLengthExceeded as e:
        log.info("%s: %s", request_id, e)
        return TruncationReason.CONTEXT_LENGTH


def sampled_segment(
    gen: Sampled,
    *,
    name: str,
    turn: int,
    start: int,
    engine_url: str,
    served: str | None,
    attempt: int,
    queued_s: float,
    transfer_s: float,
    **meta: Any,
) -> Segment:
    """The ``model`` segment of one model call's sampled tokens, as every sampled segment is stored (a tool
    harness's turn and a gateway call alike): the tokens, their logprobs and policy versions as the engine
    returned them (never re-tokenized), and where and how they were sampled in ``meta``; ``meta`` adds a
    caller's own keys (the gateway's call index and its time)."""
    return Segment(
        name=name,
        kind="model",
        turn=turn,
        start=start,
        token_ids=gen.token_ids,
        logprobs=gen.logprobs,
        policy_versions=gen.policy_versions,
        meta={
            "engine": engine_url,
            "finish_reason": gen.finish_reason,
            "queue_s": queued_s + gen.queue_s,
            "model_s": gen.model_s,
            "attempt": attempt,
            "transfer_s": transfer_s,
            "logprob_mode": served,
            **meta,
        },
    )


class ModelTurns:
    """The model turns of one worker: the store, the engine, what it learnt of the engines (their logprobs
    modes) and of the store (the published policy versions), and the env steps it runs inline."""

    def __init__(self, store: RunStore, engine: Engine, steps: EnvSteps | None = None) -> None:
        self.store = store
        self.engine = engine
        self.steps = steps
        """Runs the inline env steps (environments with ``inline_steps``); None: this worker runs none."""
        self._known_versions: set[str] = set()
        self._versions_read_at = float("-inf")
        self._modes: dict[str, tuple[str | None, float]] = {}
        """Engine URL -> (logprobs mode it reported, when it was asked)."""
        self._mode_asks: dict[str, asyncio.Future[tuple[str | None, float]]] = {}
        """Engine URL -> the question being asked (every rollout arriving meanwhile awaits its answer)."""

    async def prepare(self, inp: PrepareInput, timed: StoreClock | None = None) -> int:
        """Build the environment's first prompt once and store it as segment 'prompt'; its length."""
        timed = timed or StoreClock()
        ref = inp.ref
        existing = await timed(self.store.get_segment, ref.rollout_id, "prompt")
        if existing is None:
            env = registry.get(ref.env)
            row = await stored_task(self.store, ref.run_id, ref.task_id, timed)
            with calling(env, "validate_task", ref.rollout_id):
                task = env.validate_task(row, where=f"run {ref.run_id} task {ref.task_id}")
            with calling(env, "prompt", ref.rollout_id):
                prompt = env.prompt(task)
            ids = prompt.token_ids
            if ids is None:
                assert prompt.messages is not None
                ids = await self.engine.tokenize_chat(inp.engine_url, ref.model, prompt.messages)
            seg = Segment(name="prompt", kind="prompt", turn=None, start=0, token_ids=ids)
            existing = await timed(self.store.put_segment, ref.rollout_id, seg)
        return len(existing.token_ids)

    async def turn(self, inp: GenerateInput, attempt: int = 1, queued_s: float = 0.0) -> TurnResult:
        """One model turn on the rollout's stored context (see the module's invariants), and its inline
        env step unless the turn was truncated. ``attempt``: of this call (1 = first); ``queued_s``: the
        seconds the call waited to start."""
        timed = StoreClock()
        if inp.prepare is not None:
            await self.prepare(inp.prepare, timed)
        sampled = await self._sample(inp, attempt, queued_s, timed)
        if isinstance(sampled, TurnResult):  # a limit left the turn nothing
            return sampled
        seg, unrecorded = sampled
        versions = [v for v in seg.policy_versions or [] if v is not None]
        env = None
        finish = seg.meta["finish_reason"]
        if inp.env_after is not None and turn_truncation(finish, seg.end, inp.max_total_tokens) is None:
            assert self.steps is not None, "a worker that runs model turns inline runs their env steps"
            step = inp.env_after.model_copy(update={"transfer_s": unrecorded})
            env = await self.steps.step(step, attempt, seg)
        return TurnResult(
            turn=inp.turn,
            start=seg.start,
            end=seg.end,
            finish_reason=finish,
            policy_version=versions[-1] if versions else None,
            env=env,
            attempt=attempt,
        )

    async def _sample(
        self, inp: GenerateInput, attempt: int, queued_s: float, timed: StoreClock
    ) -> tuple[Segment, float] | TurnResult:
        """The turn's stored segment (sampled now unless an earlier attempt stored it) and the store
        seconds its meta does not hold (its own write); or the turn without a sample a limit ended."""
        rid, name = inp.rollout_id, model_segment(inp.turn)
        stored = await timed(self._stored_or_context, rid, name)  # one thread hop, not two
        if isinstance(stored, Segment):
            return stored, 0.0
        context = stored
        if turn_budget(len(context), inp.max_total_tokens, inp.max_tokens).truncated is not None:
            return _no_turn(inp, len(context), TruncationReason.TOKEN_BUDGET)  # no engine asked
        served = await self.served_mode(inp.engine_url, inp.sampling.logprob_mode)
        request_id = f"{rid}/{inp.turn}/{attempt}"
        try:
            gen = await call_model(
                self.engine, inp.engine_url, inp.ref.model, context, inp.sampling,
                inp.max_tokens, inp.max_total_tokens, request_id,
            )  # fmt: skip
        except RolloutError:
            self._modes.pop(inp.engine_url, None)  # it may come back as another engine: ask again
            raise
        if isinstance(gen, TruncationReason):
            return _no_turn(inp, len(context), gen)
        await self.refuse_unknown_versions(inp.engine_url, gen.policy_versions, timed)
        seg = sampled_segment(
            gen, name=name, turn=inp.turn, start=len(context), engine_url=inp.engine_url, served=served,
            attempt=attempt, queued_s=queued_s, transfer_s=timed.seconds,
        )  # fmt: skip
        before = timed.seconds
        seg = await timed(self.store.put_segment, rid, seg)
        return seg, timed.seconds - before

    def _stored_or_context(self, rollout_id: str, name: str) -> Segment | list[int]:
        """The turn's segment if an earlier attempt stored it, else the rollout's context to sample on."""
        seg = self.store.get_segment(rollout_id, name)
        return seg if seg is not None else self.store.token_ids(rollout_id)

    async def served_mode(self, engine_url: str, wanted: str) -> str | None:
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
            cached = await asyncio.shield(ask)
        served = cached[0]
        if served is not None and served != wanted:
            self._modes.pop(engine_url, None)
            raise EngineUnavailable(
                f"engine {engine_url} serves {served}, the run declares {wanted}; refused"
            )
        return served

    async def _ask_mode(self, engine_url: str) -> tuple[str | None, float]:
        """Ask the engine its logprobs mode (watched with the stall timeout of the rollout that asks)."""
        answer = (await self.engine.logprob_mode(engine_url), time.monotonic())
        self._modes[engine_url] = answer
        return answer

    async def refuse_unknown_versions(
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
            raise EngineUnavailable(
                f"engine {engine_url} serves version {', '.join(unknown)}, which was never published "
                f"(known: {', '.join(sorted(self._known_versions))}); refusing its samples"
            )


def _no_turn(inp: GenerateInput, at: int, reason: TruncationReason) -> TurnResult:
    """A turn that sampled nothing because a limit was reached first (the rollout ends truncated)."""
    finish = "context_length" if reason == TruncationReason.CONTEXT_LENGTH else "length"
    return TurnResult(
        turn=inp.turn, start=at, end=at, finish_reason=finish, policy_version=None, truncated_reason=reason
    )
