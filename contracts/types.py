"""Plain data carriers shared by workflows, activities, the store and the CLI.

Invariant: nothing here imports anything heavier than pydantic and the config models, and nothing here
carries token arrays: these objects travel through Temporal history, where only keys, counts and small
scalars belong. Each workflow has one input model (its per-run settings) and one state model (what it
carries across continue-as-new), never one object that is both.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from durable_rollouts.config.models import Config
from durable_rollouts.contracts.dispatch import (
    AdmissionState,
    DispatchLog,
    DispatchState,
    EngineReading,
    FleetPoll,
    GroupCounts,
    GroupSlot,
    PollFleetInput,
    QueueBacklog,
    TokenBucket,
)
from durable_rollouts.contracts.ref import RolloutRef
from durable_rollouts.contracts.sandbox import (
    SandboxCreated,
    SandboxPlaceInput,
    SandboxPlacement,
    SandboxStepInput,
)
from durable_rollouts.sandboxes.base import SandboxSpec
from durable_rollouts.sandboxes.pool import PoolStatus, SandboxPoolConfig


class _Data(BaseModel):
    model_config = ConfigDict(extra="forbid")


__all__ = [  # re-exported: defined by concern in contracts/dispatch.py and contracts/sandbox.py
    "AdmissionState",
    "DispatchLog",
    "DispatchState",
    "EngineReading",
    "FleetPoll",
    "GroupCounts",
    "GroupSlot",
    "PollFleetInput",
    "PoolStatus",
    "QueueBacklog",
    "RolloutRef",
    "SandboxCreated",
    "SandboxPlaceInput",
    "SandboxPlacement",
    "SandboxStepInput",
    "TokenBucket",
]


class Outcome(StrEnum):
    """How a rollout ended."""

    COMPLETED = "completed"
    TRUNCATED = "truncated"
    FAILED = "failed"
    CANCELLED = "cancelled"


RAN_TO_END = frozenset({Outcome.COMPLETED, Outcome.TRUNCATED})
"""Outcomes of a rollout that ran to its end (or a named limit): scorable; admission learns their lengths."""


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
    failover: bool = True
    outage_budget_s: float = 300.0
    """How long an engine with no replica to fail over to may stay unavailable before rollouts fail."""
    stall_timeout_s: float | None = None
    """How long an engine may make no progress under an outstanding call (None: the worker's default)."""


class EnvTraits(_Data):
    """What the workflows need to know of a run's environment (from its class, at load_run): no names."""

    name: str
    """The registered name (``run.env``): recorded and indexed, never compared by workflow code."""
    uses_sandbox: bool = False
    """Rollouts may hold a sandbox (created before the first turn, destroyed at the end)."""
    inline_steps: bool = False
    """The env step runs inside the model call's activity (cheap, no sandbox)."""
    harness: bool = False
    """A harness program in the sandbox drives the rollout; its model calls come through the gateway."""


class RetrySettings(_Data):
    """Retry settings of model calls (transport errors and 5xx)."""

    max_attempts: int
    initial_s: float
    max_s: float


class RolloutInput(_Data):
    """Everything a RolloutWorkflow needs: its settings, and (after continue-as-new) its state."""

    run_id: str
    group_id: str
    rollout_id: str
    task_id: str
    sample_index: int
    env: EnvTraits
    sampling: SamplingParams
    engine: EngineTarget
    retry: RetrySettings
    max_turns: int
    max_total_tokens: int
    timeout_s: float
    score_truncated: bool
    sandbox: SandboxSpec | None = None
    """The run's default sandbox spec (the environment derives each task's from it); None without one."""
    pool: SandboxPoolConfig | None = None
    """The sandbox pool the rollout holds a slot of while its sandbox lives; None = no pool gating."""
    run_workflow_id: str | None = None
    step_token_budget: int | None = None
    partial_poll_s: float = 5.0
    preferred_engine: str | None = None
    """Replica the dispatcher chose for the rollout's group (bounded-load affinity); None = hash order."""
    state: RolloutState | None = None
    """The rollout's state when it continued as new; None at its start."""
    revision: int = 0
    """The command revision its parent asked for (``workflows.patches.REVISION``); 0 in inputs written
    before revisions existed. A behaviour change for workflows started after an upgrade rides on it
    instead of a patch marker, which would cost every rollout two history events and a visibility write."""
    local_model_calls: bool = False
    """Model calls run as local activities (``rollout.local_model_calls``; never with a sandbox)."""
    in_group: bool = False
    """The rollout runs inside its group's workflow (``group.inline_rollouts``): it upserts no search
    attributes, sets no live details and never continues as new (those belong to its group)."""
    batched: bool = False
    """The rollout runs with its group's others inside one activity (``group.batch_rollouts``,
    ``activities.batch``): no workflow of its own; its progress is durable in the store."""

    def ref(self) -> RolloutRef:
        """The member's reference, carried by every activity input of the rollout (built once per member:
        by its workflow at its start, by its group when the group records it)."""
        return RolloutRef(
            run_id=self.run_id,
            group_id=self.group_id,
            rollout_id=self.rollout_id,
            task_id=self.task_id,
            sample_index=self.sample_index,
            env=self.env.name,
            model=self.engine.model,
        )


class RolloutState(_Data):
    """Everything a rollout has counted so far: the one object carried across continue-as-new."""

    turn: int = 0
    """Model turns completed."""
    tokens: int = 0
    """Context length so far (prompt, turns, observations)."""
    started_at: float | None = None
    """Workflow time of the rollout's start (its wall-clock limit counts from here)."""
    version: str | None = None
    """Policy version of the last turn."""
    engine_failovers: int = 0
    reprefill_tokens: int = 0
    """Tokens the replicas failed over to had to prefill again."""
    sampled_tokens: int = 0
    step_sampled: int = 0
    """Tokens sampled since the last partial-rollout pause (or the start)."""
    partial_steps: int = 0
    """Pauses for a newer policy version so far."""
    sandbox: bool = False
    """A sandbox was created for this rollout (and must be destroyed at its end)."""
    sandbox_host: str | None = None
    """The Docker daemon running the rollout's sandbox (``SandboxCreated.host``)."""
    sandbox_queue: str | None = None
    """``placement = "hosts"``: the task queue of the sandbox host the rollout is placed on (its sandbox
    activities and sandboxed env steps run there); None: the run's own queue."""
    sandbox_avoid: list[str] = Field(default_factory=list)
    """Sandbox hosts this rollout could not reach; placement never picks them again."""
    sandbox_replays: int = 0
    """Sandboxes lost and replaced by replaying the recorded actions."""
    sandbox_slot_waits: int = 0
    """Durable waits for a sandbox pool slot (or a backend that was not ready)."""
    outage_since: float | None = None
    """Workflow time the current engine outage began (None: the engine answers)."""
    outage_waits: int = 0
    """Durable waits for an unavailable engine so far."""
    sandbox_s: float = 0.0
    """Workflow seconds in the sandbox's create, recover and destroy activities (environment time)."""
    task_deadline: float | None = None
    """Workflow time past which the task's own limit truncates the rollout (reason ``timeout``): its
    sandbox's creation plus ``SandboxCreated.timeout_s``; None: only ``rollout.timeout_s`` applies."""


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
    attempt: int = 1
    """Attempt of the model call that returned this turn (``activity.info().attempt``; 1 = first try)."""


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
    infra_retries: int = 0
    """``rollout.infra_retries``: times a slot whose member failed for infrastructure runs again (next
    attempt id); 0 for groups started before the setting existed."""
    on_infra_failure: Literal["exclude", "fail-group"] = "exclude"
    """``group.on_infra_failure``: what a member still failed for infrastructure after its retries does to
    its group (left out of the statistics, or the whole group unscorable)."""
    revision: int = 0
    """The command revision its parent asked for (``workflows.patches.REVISION``); 0 before revisions."""


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
    infra_failures: dict[str, int] = Field(default_factory=dict)
    """Members that failed for infrastructure, by error type (the run's circuit breaker counts them)."""
    successes: int = 0
    """Members with a reward (scorable)."""
    complete_tokens: int = 0
    """Summed ``num_tokens`` of the members that completed or were truncated."""
    superseded: int = 0
    """Attempts that failed for infrastructure and whose slot ran again (``rollout.infra_retries``); they
    count in ``failed`` and ``outcomes``, never in the statistics."""
    unscorable_reason: str | None = None
    """Set when the group is unscorable as a whole (``group.on_infra_failure = "fail-group"``): no member is
    scorable, no advantages, the trainer feed discards it."""
    environment_failures: int = 0
    """Members that failed in the environment's code (reasons ``environment: ...``)."""
    environment_failure: str | None = None
    """The first of those reasons (for the run's stop line)."""


class BreakerState(_Data):
    """What the run's circuit breaker remembers (carried across continue-as-new; rules in
    admission/breaker.py)."""

    streaks: dict[str, int] = Field(default_factory=dict)
    """Consecutive infra failures per error type since the last success."""
    open_since: float | None = None
    """When it opened (or the last probe failed); None = closed."""
    reason: str | None = None
    probe: str | None = None
    """The probe group in flight while open."""
    opened: int = 0
    """Times it opened in this run."""
    env_streak: int = 0
    """Consecutive environment failures since the last success."""
    stopped: str | None = None
    """Set once a streak of environment failures stopped the run (one line); never cleared."""


class RunInput(_Data):
    """A run: its config (typed) and, after continue-as-new, its state."""

    run_id: str
    config: Config
    config_hash: str = ""
    state: RunState | None = None
    """The run's state when it continued as new; None at its start."""


class RunState(_Data):
    """Everything a run carries across continue-as-new (the dispatcher's groups in flight included)."""

    num_tasks: int = 0
    env: EnvTraits | None = None
    """The environment's traits, from load_run."""
    next_group: int = 0
    groups_done: int = 0
    outcomes: dict[str, int] = Field(default_factory=dict)
    segment: int = 0
    slots: dict[str, GroupSlot] = Field(default_factory=dict)
    """Groups in flight, by group id (also what group_done signals remove)."""
    admission_cancelled: int = 0
    wasted_tokens: int = 0
    dispatch: DispatchState = Field(default_factory=lambda: DispatchState())
    breaker: BreakerState = Field(default_factory=lambda: BreakerState())
    """The circuit breaker (admission/breaker.py)."""
    """The adaptive dispatcher's carry (unused with a fixed cap)."""


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
    breaker: str | None = None
    """The circuit breaker, when open (one line); None when closed."""
    breaker_opened: int = 0
    """Times the circuit breaker opened in this run."""
    accounting: dict[str, str] = Field(default_factory=dict)
    """Groups that closed without reporting and that the run is accounting for now, with the reason their
    members without a record get (workflows/closed_groups.py)."""
    stopped: str | None = None
    """Why the run was stopped before its end (a streak of environment failures); None otherwise."""


def sampling_params(cfg: Config) -> SamplingParams:
    """The behaviour policy's sampling settings of a run (every rollout, and ``rollouts reproduce``)."""
    return SamplingParams(
        temperature=cfg.sampling.temperature,
        top_p=cfg.sampling.top_p,
        top_k=cfg.sampling.top_k,
        max_tokens=cfg.sampling.max_tokens,
        min_tokens=cfg.sampling.min_tokens,
        seed=cfg.sampling.seed,
        logprob_mode=cfg.engine.logprob_mode,
    )


def rollout_id(run_id: str, group_id: str, index: int) -> str:
    """Deterministic rollout id (also its workflow id): ``<run>/<group>/<i>``."""
    return f"{run_id}/{group_id}/{index}"


def group_id(index: int) -> str:
    """Deterministic group id of the run's index-th group."""
    return f"g{index:06d}"


RunInput.model_rebuild()
RunState.model_rebuild()
RolloutInput.model_rebuild()
TurnResult.model_rebuild()
