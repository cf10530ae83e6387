"""Activities of a rollout: every side effect of the pipeline (engine HTTP, the run store, task files).

Invariants:
- Idempotent on keys that survive retries: the run id, the rollout id, and (rollout id, turn). A retried
  activity finds what an earlier attempt wrote and returns it, so no sample is produced twice or lost.
- Inputs and results are small (keys, counts, scalars); token arrays go to the store, never to history.
- Errors leave as ``ApplicationError`` whose type names the boundary (see ``errors``).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import TypeVar

from temporalio import activity

from activities.heartbeat import heartbeating
from engines.client import EngineClient
from envs import coding as coding_env
from envs import math as math_env
from envs.tasks import load_tasks
from errors import ContextLengthExceeded, EnvironmentFailure, RolloutError
from records.export import rollout_lineage
from store.runstore import RunStore, Segment, model_segment, obs_segment
from workflows.types import (
    EnvStepInput,
    EnvStepResult,
    FinalizeGroupInput,
    FinalizeRolloutInput,
    GenerateInput,
    LoadRunInput,
    Outcome,
    PrepareInput,
    PrepareResult,
    StoredOutcome,
    TruncationReason,
    TurnResult,
)

T = TypeVar("T")


def _edge(e: RolloutError) -> Exception:
    return e.to_application_error()


class RolloutActivities:
    """The activities a worker registers; holds the worker's store and engine client."""

    def __init__(self, store: RunStore, engine: EngineClient) -> None:
        self.store = store
        self.engine = engine

    @activity.defn(name="load_run")
    async def load_run(self, inp: LoadRunInput) -> int:
        """Record the run with its resolved config and store its tasks; returns the number of tasks."""
        try:
            tasks = await asyncio.to_thread(load_tasks, inp.task_file, inp.env)
        except RolloutError as e:
            raise _edge(e) from e
        await asyncio.to_thread(self.store.register_run, inp.run_id, inp.config_json, inp.config_hash)
        return await asyncio.to_thread(self.store.put_tasks, inp.run_id, tasks)

    @activity.defn(name="task_ids_at")
    async def task_ids_at(self, run_id: str, idxs: list[int]) -> list[str]:
        """The ids of the run's tasks at these indexes (a local activity of the run workflow)."""
        tasks = await asyncio.to_thread(lambda: [self.store.task_at(run_id, i) for i in idxs])
        return [t["id"] for t in tasks]

    @activity.defn(name="latest_policy_version")
    async def latest_policy_version(self) -> str | None:
        """The most recently published policy version in the store (None before the first)."""
        rows = await asyncio.to_thread(self.store.policies)
        published = [r["version"] for r in rows if r["status"] == "published"]
        return published[-1] if published else None

    @activity.defn(name="prepare_rollout")
    async def prepare_rollout(self, inp: PrepareInput) -> PrepareResult:
        """Render the task prompt through the chat template once and store it as segment 'prompt'."""
        existing = await asyncio.to_thread(self.store.get_segment, inp.rollout_id, "prompt")
        if existing is None:
            task = await asyncio.to_thread(self.store.get_task, inp.run_id, inp.task_id)
            messages = (
                coding_env.first_messages(task)
                if inp.env == "coding"
                else [{"role": "user", "content": task["prompt"]}]
            )
            try:
                ids = await self.engine.tokenize_chat(inp.engine_url, inp.model, messages)
            except RolloutError as e:
                raise _edge(e) from e
            seg = Segment(name="prompt", kind="prompt", turn=None, start=0, token_ids=ids)
            existing = await asyncio.to_thread(self.store.put_segment, inp.rollout_id, seg)
        return PrepareResult(prompt_tokens=len(existing.token_ids), engine=inp.engine_url)

    @activity.defn(name="generate_turn")
    async def generate_turn(self, inp: GenerateInput) -> TurnResult:
        """One model call on the rollout's stored context; the sampled tokens are stored, not returned."""
        name = model_segment(inp.turn)
        if inp.prepare is not None:
            await self.prepare_rollout(inp.prepare)
        seg = await asyncio.to_thread(self.store.get_segment, inp.rollout_id, name)
        if seg is None:
            context = await asyncio.to_thread(self.store.token_ids, inp.rollout_id)
            room = inp.max_total_tokens - len(context) if inp.max_total_tokens else inp.max_tokens
            if room <= 0:  # the prompt alone fills the rollout's token budget
                return _no_turn(inp, len(context), "length", TruncationReason.TOKEN_BUDGET)
            max_tokens = min(inp.max_tokens, room)
            info = activity.info()
            queued = max(0.0, (info.started_time - info.current_attempt_scheduled_time).total_seconds())
            request_id = f"{inp.rollout_id}/{inp.turn}/{info.attempt}"
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
                raise _edge(e) from e
            meta = {
                "engine": inp.engine_url,
                "finish_reason": gen.finish_reason,
                "queue_s": queued + gen.queue_s,
                "model_s": gen.model_s,
                "attempt": info.attempt,
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
            seg = await asyncio.to_thread(self.store.put_segment, inp.rollout_id, seg)
        versions = [v for v in seg.policy_versions or [] if v is not None]
        env = None
        limit = inp.max_total_tokens or seg.end + 1
        over_budget = seg.meta["finish_reason"] == "length" and seg.end >= limit
        if inp.env_after is not None and not over_budget:
            env = await self.env_step(inp.env_after)
        return TurnResult(
            turn=inp.turn,
            start=seg.start,
            end=seg.end,
            finish_reason=seg.meta["finish_reason"],
            policy_version=versions[-1] if versions else None,
            env=env,
        )

    @activity.defn(name="env_step")
    async def env_step(self, inp: EnvStepInput) -> EnvStepResult:
        """Score the turn, or store the observation that continues the rollout."""
        if inp.env != "math":
            raise _edge(EnvironmentFailure(f"rollout {inp.rollout_id}: unknown env {inp.env!r}"))
        t0 = time.monotonic()
        seg = await asyncio.to_thread(self._turn_to_score, inp)
        task = await asyncio.to_thread(self.store.get_task, inp.run_id, inp.task_id)
        if seg is None:
            if inp.score_only:
                return EnvStepResult(done=True, reward=None)
            raise _edge(EnvironmentFailure(f"rollout {inp.rollout_id}: turn {inp.turn} was never stored"))
        try:
            text = await self.engine.detokenize(inp.engine_url, inp.model, seg.token_ids)
            t1 = time.monotonic()
            reward = math_env.verify(_strip_stop(text), task["answer"])
            reward_s = time.monotonic() - t1
            if reward == 1.0 or inp.last_turn or inp.score_only:
                await asyncio.to_thread(
                    self.store.update_segment_meta, inp.rollout_id, seg.name, env_s=t1 - t0, reward_s=reward_s
                )
                return EnvStepResult(done=True, reward=reward, env_s=t1 - t0, reward_s=reward_s)
            obs = await self._store_observation(inp, seg.end, math_env.RETRY_PROMPT)
        except RolloutError as e:
            raise _edge(e) from e
        env_s = time.monotonic() - t0
        await asyncio.to_thread(self.store.update_segment_meta, inp.rollout_id, seg.name, env_s=env_s)
        return EnvStepResult(done=False, observation_tokens=obs, env_s=env_s)

    def _turn_to_score(self, inp: EnvStepInput) -> Segment | None:
        if not inp.score_only:
            return self.store.get_segment(inp.rollout_id, model_segment(inp.turn))
        model_turns = [s for s in self.store.segments(inp.rollout_id) if s.kind == "model" and s.token_ids]
        return model_turns[-1] if model_turns else None

    async def _store_observation(self, inp: EnvStepInput, start: int, content: str) -> int:
        name = obs_segment(inp.turn)
        existing = await asyncio.to_thread(self.store.get_segment, inp.rollout_id, name)
        if existing is None:
            ids = await self.engine.tokenize_chat(
                inp.engine_url, inp.model, [{"role": "user", "content": content}]
            )
            seg = Segment(name=name, kind="observation", turn=inp.turn, start=start, token_ids=ids)
            existing = await asyncio.to_thread(self.store.put_segment, inp.rollout_id, seg)
        return len(existing.token_ids)

    @activity.defn(name="finalize_rollout")
    async def finalize_rollout(self, inp: FinalizeRolloutInput) -> StoredOutcome:
        """Write the rollout's record once (keyed by rollout id); returns the record as stored.

        The workflow reports what this returns, not what it asked to write, so the group's statistics
        always agree with the store even when a retried workflow task decided differently the second time.

        The record carries its lineage (policy versions, config hash, env/verifier versions, sandbox image;
        see ``records.export.rollout_lineage``) in ``extra_json["lineage"]``.
        """
        segs = await asyncio.to_thread(self.store.segments, inp.rollout_id)
        run = await asyncio.to_thread(self.store.get_run, inp.run_id)
        extra = {**inp.extra, "lineage": rollout_lineage(run, inp.env, segs)}
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

    @activity.defn(name="finalize_group")
    async def finalize_group(self, inp: FinalizeGroupInput) -> bool:
        """Write the group record and its members' advantages (idempotent on run + group id)."""
        rec = inp.record
        await asyncio.to_thread(self.store.set_advantages, inp.advantages)
        return await asyncio.to_thread(
            self.store.put_group, rec.run_id, rec.group_id, rec.task_id, rec.model_dump(mode="json")
        )

    @activity.defn(name="finish_run")
    async def finish_run(self, run_id: str) -> None:
        await asyncio.to_thread(self.store.finish_run, run_id)

    def all(self) -> list:
        """Every activity of this class, for ``Worker(activities=...)``."""
        return [
            self.load_run,
            self.task_ids_at,
            self.latest_policy_version,
            self.prepare_rollout,
            self.generate_turn,
            self.env_step,
            self.finalize_rollout,
            self.finalize_group,
            self.finish_run,
        ]


def _strip_stop(text: str) -> str:
    """The answer is what the model wrote before its end-of-turn marker."""
    return text.split("<|end|>", 1)[0]


def _no_turn(inp: GenerateInput, at: int, finish: str, reason: TruncationReason) -> TurnResult:
    """A turn that sampled nothing because a limit was reached first (the rollout ends truncated)."""
    return TurnResult(
        turn=inp.turn, start=at, end=at, finish_reason=finish, policy_version=None, truncated_reason=reason
    )
