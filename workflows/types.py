"""Plain data carriers shared by workflows, activities, the store and the CLI.

Invariant: nothing here imports anything heavier than pydantic, and nothing here carries token arrays:
these objects travel through Temporal history, where only keys, counts and small scalars belong.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from workflows.admission import AdmissionState, EngineReading


class _Data(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Outcome(StrEnum):
    """How a rollout ended."""

    COMPLETED = "completed"
    TRUNCATED = "truncated"
    FAILED = "failed"
    CANCELLED = "cancelled"


class TruncationReason(StrEnum):
    """Why a rollout was cut short; each limit has its own name."""

    MAX_TURNS = "max_turns"
    TOKEN_BUDGET = "token_budget"
    CONTEXT_LENGTH = "context_length"
    TIMEOUT = "timeout"
    COMMAND_TIMEOUT = "command_timeout"


class FailureKind(StrEnum):
    """Whose fault a failed rollout is: infrastructure (engine, sandbox, worker) or the environment."""

    INFRA = "infra"
    ENVIRONMENT = "environment"


class Phase(StrEnum):
    """Where a live rollout is; shown as the RolloutPhase search attribute."""

    PREPARE = "prepare"
    GENERATE = "generate"
    ENV = "env"
    PAUSED = "paused"
    REWARD = "reward"
    FINALIZE = "finalize"
    DONE = "done"


class SamplingParams(_Data):
    """The behaviour policy's sampling settings; identical for every member of a group."""

    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    seed: int | None
    logprob_mode: str
    min_tokens: int = 0


class EngineTarget(_Data):
    """How to reach the engine fleet from an activity."""

    urls: list[str]
    model: str
    request_timeout_s: float
    default_policy_version: str
    failover: bool = True


class RetrySettings(_Data):
    """Retry settings of model calls (transport errors and 5xx)."""

    max_attempts: int
    initial_s: float
    max_s: float


class RolloutInput(_Data):
    """Everything a RolloutWorkflow needs; also its continue-as-new carry."""

    run_id: str
    group_id: str
    rollout_id: str
    task_id: str
    sample_index: int
    env: str
    sampling: SamplingParams
    engine: EngineTarget
    retry: RetrySettings
    max_turns: int
    max_total_tokens: int
    timeout_s: float
    score_truncated: bool
    sandbox_spec_json: str = ""
    """The coding environment's sandbox spec (JSON); empty for environments without a sandbox."""
    run_workflow_id: str | None = None
    # Carry across continue-as-new (keys and counters only).
    turns_done: int = 0
    num_tokens: int = 0
    started_at: float | None = None
    sandbox_replays: int = 0
    engine_failovers: int = 0
    reprefill_tokens: int = 0
    sampled_tokens: int = 0
    step_sampled: int = 0
    """Tokens sampled since the last partial-rollout pause (or the start)."""
    partial_steps: int = 0
    """Pauses for a newer policy version so far."""
    step_token_budget: int | None = None
    partial_poll_s: float = 5.0
    preferred_engine: str | None = None
    """Replica the dispatcher chose for the rollout's group (bounded-load affinity); None = hash order."""
    pool_json: str = ""
    """The sandbox pool's config (JSON) for environments with a sandbox."""


class PrepareResult(_Data):
    """The rollout's prompt was rendered and stored."""

    prompt_tokens: int
    engine: str


class TurnResult(_Data):
    """One model call: the sampled tokens live in the store under (rollout_id, turn)."""

    turn: int
    start: int
    end: int
    finish_reason: str
    policy_version: str | None
    truncated_reason: TruncationReason | None = None
    env: EnvStepResult | None = None
    """The env step's result when it ran inside the activity (``GenerateInput.env_after``)."""


class EnvStepResult(_Data):
    """The environment's answer to one turn: done or an observation (stored) to append."""

    done: bool
    reward: float | None = None
    observation_tokens: int = 0
    env_s: float = 0.0
    reward_s: float = 0.0
    truncated_reason: TruncationReason | None = None


class RolloutResult(_Data):
    """One finished rollout, as its group sees it (the full record lives in the store)."""

    rollout_id: str
    sample_index: int
    outcome: Outcome
    reason: str | None = None
    reward: float | None = None
    scorable: bool = False
    num_tokens: int = 0
    turns: int = 0
    wasted_tokens: int = 0
    """Tokens sampled by a rollout cancelled for admission (work thrown away)."""


class GroupInput(_Data):
    """A group: N rollouts of one task under a group id separate from the task id."""

    run_id: str
    group_id: str
    task_id: str
    size: int
    advantage_eps: float
    template: RolloutInput = Field(description="Rollout input with the per-member fields to be filled in.")
    run_workflow_id: str | None = None
    engine: str | None = None
    """Replica the dispatcher assigned to the group (its members share the prompt prefix there)."""
    redispatch_cancelled: bool = False
    """Restart a slot whose rollout was cancelled for admission (new rollout id ``<i>r<n>``)."""


class GroupResult(_Data):
    """A closed group: counts and reward statistics over its scorable members."""

    run_id: str
    group_id: str
    task_id: str
    size: int
    scorable: int
    failed: int
    reward_mean: float | None
    reward_std: float | None
    zero_variance: bool
    outcomes: dict[str, int] = Field(default_factory=dict)
    admission_cancelled: int = 0
    """Members cancelled by the dispatcher (reason admission); with redispatch, their slots ran again."""
    wasted_tokens: int = 0
    """Tokens those cancelled members had sampled."""


class RunInput(_Data):
    """A run: dispatch groups under a fixed in-flight cap; also the continue-as-new carry."""

    run_id: str
    config: dict
    config_hash: str = ""
    num_tasks: int = 0
    next_group: int = 0
    groups_done: int = 0
    outcomes: dict[str, int] = Field(default_factory=dict)
    segment: int = 0
    # The dispatcher's carry (adaptive admission): see workflows/run.py.
    slots: dict[str, GroupSlot] = Field(default_factory=dict)
    admission: AdmissionState | None = None
    readings: dict[str, EngineReading] = Field(default_factory=dict)
    bucket: TokenBucket | None = None
    polls: int = 0
    admission_cancelled: int = 0
    wasted_tokens: int = 0
    last_log: DispatchLog | None = None


class GroupSlot(_Data):
    """The dispatcher's view of one group in flight."""

    admitted_at: float
    engine: str
    size: int
    told: int = 0
    """Members the dispatcher told to cancel for admission so far."""


class TokenBucket(_Data):
    """Token-bucket state: ``tokens`` available at time ``at``."""

    tokens: float
    at: float


class GroupCounts(_Data):
    """Members of an in-flight group with a record, from the run store."""

    finished: int = 0
    admission_cancelled: int = 0


class PoolStatus(_Data):
    """The sandbox pool: slots ready, slots starting (scale-up in progress), slots in use, the limit."""

    ready: int
    starting: int
    in_use: int
    max_size: int
    waiting: int = 0
    """Rollouts backing off for a slot."""


class DispatchLog(_Data):
    """One dispatcher decision, written to the run store (``rollouts status`` and tests read it)."""

    run_id: str
    seq: int
    at: float
    cap: int
    inflight: int
    admitted: int
    cancelled: int
    kv_usage: float | None
    healthy: list[str]
    pool: PoolStatus | None = None
    reasons: list[str] = Field(default_factory=list)


class PollFleetInput(_Data):
    run_id: str
    engine_urls: list[str]
    groups: list[str]
    pool_json: str = ""
    """Sandbox pool config (JSON); empty for runs without sandboxes."""
    log: DispatchLog | None = None
    """The previous decision, to be written to the store (idempotent on its seq)."""
    count_unconsumed: bool = False
    """Also count the run's complete groups the trainer feed has not taken (admission.max_queued_groups)."""


class FleetPoll(_Data):
    """What one poll saw: fresh engine readings, per-group record counts, the sandbox pool."""

    at: float
    readings: list[EngineReading]
    errors: list[str] = Field(default_factory=list)
    counts: dict[str, GroupCounts] = Field(default_factory=dict)
    pool: PoolStatus | None = None
    unconsumed_groups: int = 0


class RunProgress(_Data):
    """A run's live progress (query result)."""

    run_id: str
    total_groups: int
    groups_done: int
    groups_inflight: int
    rollouts_total: int
    outcomes: dict[str, int]
    segment: int
    done: bool
    cap: int | None = None
    """The dispatcher's current in-flight cap in rollouts (adaptive admission), else None."""
    admission_cancelled: int = 0
    wasted_tokens: int = 0


def rollout_id(run_id: str, group_id: str, index: int) -> str:
    """Deterministic rollout id (also its workflow id): ``<run>/<group>/<i>``."""
    return f"{run_id}/{group_id}/{index}"


def group_id(index: int) -> str:
    """Deterministic group id of the run's index-th group."""
    return f"g{index:06d}"


# -- activity inputs --------------------------------------------------------------------------------


class LoadRunInput(_Data):
    run_id: str
    config_json: str
    config_hash: str
    task_file: str
    env: str


class PrepareInput(_Data):
    run_id: str
    rollout_id: str
    task_id: str
    engine_url: str
    model: str
    env: str = "math"


class GenerateInput(_Data):
    rollout_id: str
    turn: int
    engine_url: str
    model: str
    sampling: SamplingParams
    max_tokens: int
    env_after: EnvStepInput | None = None
    """Run this (cheap, pure) env step in the same activity once the turn is stored, unless the turn
    was truncated; saves a workflow task per turn (math)."""
    max_total_tokens: int = 0
    """The rollout's token limit (prompt + every turn): the call samples at most what is left, and a turn
    that reaches it is truncated (token_budget), not stepped. 0 = no limit beyond max_tokens."""
    prepare: PrepareInput | None = None
    """Render and store the prompt first if it is not stored yet (a math rollout's first call)."""


class EnvStepInput(_Data):
    run_id: str
    rollout_id: str
    task_id: str
    env: str
    turn: int
    last_turn: bool
    engine_url: str
    score_only: bool = False
    """Score the rollout as it stands (a truncated rollout) instead of stepping the environment."""
    model: str


class FinalizeRolloutInput(_Data):
    run_id: str
    group_id: str
    rollout_id: str
    task_id: str
    sample_index: int
    env: str
    outcome: Outcome
    reason: str | None
    reward: float | None
    scorable: bool
    sampling: SamplingParams
    turns: int
    extra: dict[str, Any] = Field(default_factory=dict)
    """Additional record fields (e.g. sandbox_replays), exported beside the contract's fields."""


class StoredOutcome(_Data):
    """A rollout's record as the store holds it (the first write wins; a retry returns the stored one)."""

    outcome: Outcome
    reason: str | None = None
    reward: float | None = None
    scorable: bool = False
    wasted_tokens: int = 0
    inserted: bool = True
    """Whether this call wrote the record (False: it existed already)."""


class FinalizeGroupInput(_Data):
    record: GroupResult
    advantages: dict[str, float | None]


class SandboxStepInput(_Data):
    """One sandbox operation of a coding rollout; the action itself is read from the store."""

    run_id: str
    rollout_id: str
    task_id: str
    turn: int
    engine_url: str
    model: str
    spec_json: str = ""
    pool_json: str = ""
    """The sandbox pool's settings (JSON) on create; empty = no pool gating."""


class ActionResult(_Data):
    """What one tool call did: the observation (stored) length, or the reward after submit()."""

    tool: str | None
    observation_tokens: int = 0
    truncated_reason: TruncationReason | None = None
    done: bool = False
    reward: float | None = None
    reward_s: float = 0.0


RunInput.model_rebuild()
GenerateInput.model_rebuild()
TurnResult.model_rebuild()
