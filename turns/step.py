"""The environment's step: a stored model turn in, an observation (stored) or the rollout's end out.

Invariants:
- Any environment, through the interface (``environments.base``): the turn's text goes to ``parse`` (and an
  action to ``act``); a rollout that is done without a reward, or truncated and scored, goes to ``score``.
  Every hook is called through ``environments.base.calling``: an exception of the environment's code fails the
  step as `EnvironmentCodeError` (kind environment), never as infrastructure.
- Idempotent on (rollout id, turn): what a step decided is recorded with the turn (segment meta ``step``)
  and its observation stored once, so a retried step returns what the first attempt did instead of
  acting again (a command is not run twice for one turn once its observation is stored). Before that
  (the worker died mid-command), a retried step acts again, and the environment's sandbox commands keep
  it from running twice: the bundled environments key a turn's command by its turn (``Sandbox.exec``'s
  ``once_key``), so the retry gets the first run's output from the container, waiting for it to end.
- The action a turn parses to is recorded with the turn (meta ``action``) before it runs: recovery
  replays it.
- Times: ``env_s`` (reading the turn, acting, observing), ``reward_s`` (the reward) and ``transfer_s``
  (store reads and writes, timed apart and excluded from ``env_s``, added to what the model call recorded)
  are recorded on the turn's segment; a scoring after the last step adds its times under ``score_*`` keys
  folded into those three, so a retry overwrites rather than adds (``records/timing.py``).
- No Temporal: the caller passes the attempt number (a retry is any attempt after the first) and keeps
  the step alive (an activity heartbeats around it); errors leave as ``RolloutError``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from durable_rollouts.contracts.activity_io import EnvStepInput
from durable_rollouts.contracts.types import EnvStepResult
from durable_rollouts.environments import registry
from durable_rollouts.environments.base import Environment, Sandboxes, Score, Step, TurnContext, calling
from durable_rollouts.errors import StoreError
from durable_rollouts.sandboxes.base import BoundSandbox
from durable_rollouts.store import RunStore, Segment, model_segment, obs_segment
from durable_rollouts.turns.clock import StoreClock
from durable_rollouts.turns.engine import Engine

T = TypeVar("T")
Bound = Callable[[str], Awaitable[BoundSandbox | None]]
"""The live sandbox of a rollout id (None: it has none)."""
Siblings = Callable[[str, str], Sandboxes]
"""A rollout's further sandboxes, by its rollout id and run id."""


class EnvSteps:
    """The env step of every environment; holds the store, the engine (to tokenize) and the sandboxes."""

    def __init__(
        self, store: RunStore, engine: Engine, bound: Bound | None = None, siblings: Siblings | None = None
    ) -> None:
        self.store = store
        self.engine = engine
        self.bound = bound
        """How a step of an environment that uses a sandbox finds it (a worker without sandboxes: None)."""
        self.siblings = siblings
        """The rollout's further sandboxes (``TurnContext.sandboxes``), by rollout id and run id."""

    async def step(self, inp: EnvStepInput, attempt: int = 1, turn: Segment | None = None) -> EnvStepResult:
        """Step the environment with the turn's text, or (``score_only``) score the rollout as it stands.

        ``turn``: the turn's segment as its model call stored it (a step run inline by the turn), so the
        step need not read it back."""
        t0 = time.monotonic()
        timed = StoreClock()
        rid = inp.rollout_id
        seg = turn if turn is not None and not inp.score_only else await timed(self._turn_to_step, inp)
        if seg is None:
            if inp.score_only:
                return EnvStepResult(done=True, reward=None)
            raise StoreError(f"rollout {rid}: turn {inp.turn} was never stored")
        done = _recorded(seg) if not inp.score_only else None
        if done is not None:
            return done
        # Only a retry can find what an earlier attempt did (attempt 1 is the first).
        retry = attempt > 1 and not inp.score_only
        obs = await timed(self.store.get_segment, rid, obs_segment(inp.turn)) if retry else None
        if obs is not None:  # an earlier attempt stepped and observed; only its record was lost
            reason = obs.meta.get("truncated_reason")
            return EnvStepResult(done=False, observation_tokens=len(obs.token_ids), truncated_reason=reason)
        env = registry.get(inp.ref.env)
        ctx = await self._context(env, inp, timed)
        text = await self.engine.detokenize(inp.engine_url, inp.ref.model, seg.token_ids)
        if inp.score_only:
            t1 = time.monotonic()
            with calling(env, "score", rid):
                reward = await env.score(ctx, text)
            times = _Times(t1 - t0 - timed.seconds, time.monotonic() - t1, timed.seconds)
            return await self._done(inp, seg, reward, times)
        with calling(env, "parse", rid):
            parsed = env.parse(ctx, text)
        if isinstance(parsed, Step):
            step = parsed
        else:  # recorded before it runs: a recovery replays it, a test sees it start
            await timed(self.store.update_segment_meta, rid, seg.name, action=parsed)
            with calling(env, "act", rid):
                step = await env.act(ctx, parsed)
        t1 = time.monotonic()
        if step.done:
            reward = step.reward
            if reward is None:
                with calling(env, "score", rid):
                    reward = await env.score(ctx, text)
            times = _Times(t1 - t0 - timed.seconds, time.monotonic() - t1, timed.seconds)
            return await self._done(inp, seg, reward, times)
        n = await self._observe(env, inp, seg, step, timed)
        env_s = time.monotonic() - t0 - timed.seconds
        transfer_s = seg.meta.get("transfer_s", 0.0) + inp.transfer_s + timed.seconds
        await asyncio.to_thread(
            self.store.update_segment_meta, rid, seg.name, env_s=env_s, transfer_s=transfer_s
        )
        return EnvStepResult(done=False, observation_tokens=n, env_s=env_s, truncated_reason=step.truncated)

    async def _context(self, env: Environment, inp: EnvStepInput, timed: StoreClock) -> TurnContext:
        ref = inp.ref
        row = await stored_task(self.store, ref.run_id, ref.task_id, timed)
        with calling(env, "validate_task", ref.rollout_id):
            task = env.validate_task(row, where=f"run {ref.run_id} task {ref.task_id}")
        sandbox, more = None, None
        if env.uses_sandbox:
            assert self.bound is not None, (
                f"rollout {ref.rollout_id}: a sandboxed step on a worker without sandboxes"
            )
            sandbox = await _timed_async(timed, self.bound(ref.rollout_id))
            more = self.siblings(ref.rollout_id, ref.run_id) if self.siblings is not None else None
        return TurnContext(
            task=task, rollout_id=ref.rollout_id, turn=inp.turn, last_turn=inp.last_turn, sandbox=sandbox,
            sandboxes=more,
        )  # fmt: skip

    async def _done(
        self, inp: EnvStepInput, seg: Segment, score: float | Score | None, t: _Times
    ) -> EnvStepResult:
        """Record the end of the rollout with its turn (a retry returns it) and report it; a `Score`'s
        metrics are kept with the turn (meta ``metrics``)."""
        m = seg.meta
        reward = score.reward if isinstance(score, Score) else score
        transfer_s = t.transfer_s + (inp.transfer_s if not inp.score_only else 0.0)
        if inp.score_only:  # the turn's step already recorded its own times: add these beside them
            meta: dict[str, Any] = {
                "score_env_s": t.env_s, "score_reward_s": t.reward_s, "score_transfer_s": transfer_s,
                **{k: m.get(k, 0.0) - m.get(f"score_{k}", 0.0) + v for k, v in (
                    ("env_s", t.env_s), ("reward_s", t.reward_s), ("transfer_s", transfer_s))},
            }  # fmt: skip
        else:
            meta = {"env_s": t.env_s, "reward_s": t.reward_s, "step": {"done": True, "reward": reward},
                    "transfer_s": m.get("transfer_s", 0.0) + transfer_s}  # fmt: skip
        if isinstance(score, Score) and score.metrics:
            meta["metrics"] = dict(score.metrics)
        await asyncio.to_thread(self.store.update_segment_meta, inp.rollout_id, seg.name, **meta)
        return EnvStepResult(done=True, reward=reward, env_s=t.env_s, reward_s=t.reward_s)

    def _turn_to_step(self, inp: EnvStepInput) -> Segment | None:
        if not inp.score_only:
            return self.store.get_segment(inp.rollout_id, model_segment(inp.turn))
        model_turns = [s for s in self.store.segments(inp.rollout_id) if s.kind == "model" and s.token_ids]
        return model_turns[-1] if model_turns else None

    async def _observe(
        self, env: Environment, inp: EnvStepInput, seg: Segment, step: Step, timed: StoreClock
    ) -> int:
        """Store the step's observation as an ``observation_role`` message (loss mask 0); its length.

        Written once (``put_segment`` keeps an observation an earlier attempt stored, and returns it), so
        the step does not read it first: a retry checked already (`step`), and an attempt that finds one
        stored anyway (a worker died after writing it) only tokenizes its text once more."""
        if step.observation is None:
            return 0
        message = {"role": env.observation_role, "content": step.observation}
        ids = await self.engine.tokenize_chat(inp.engine_url, inp.ref.model, [message])
        meta: dict[str, Any] = {"truncated_reason": step.truncated} if step.truncated else {}
        obs = Segment(
            name=obs_segment(inp.turn), kind="observation", turn=inp.turn, start=seg.end, token_ids=ids,
            meta=meta,
        )  # fmt: skip
        stored = await timed(self.store.put_segment, inp.rollout_id, obs)
        return len(stored.token_ids)


@dataclass(frozen=True)
class _Times:
    """A step's disjoint times: the environment (store calls excluded), the reward, the store calls."""

    env_s: float
    reward_s: float
    transfer_s: float


async def stored_task(store: RunStore, run_id: str, task_id: str, timed: StoreClock) -> dict[str, Any]:
    """The run's task: from the store object's cache without a thread hop once read (tasks never
    change), else read in a thread."""
    cached = store.cached_task(run_id, task_id)
    return cached if cached is not None else await timed(store.get_task, run_id, task_id)


async def _timed_async(timed: StoreClock, call: Awaitable[T]) -> T:
    """Await a call that reads the store in its own thread (e.g. the bound sandbox), timed as transfer."""
    t0 = time.monotonic()
    try:
        return await call
    finally:
        timed.seconds += time.monotonic() - t0


def _recorded(seg: Segment) -> EnvStepResult | None:
    """The end an earlier attempt recorded for this turn, if any."""
    step = seg.meta.get("step")
    if not isinstance(step, dict) or not step.get("done"):
        return None
    return EnvStepResult(
        done=True,
        reward=step.get("reward"),
        env_s=seg.meta.get("env_s", 0.0),
        reward_s=seg.meta.get("reward_s", 0.0),
    )
