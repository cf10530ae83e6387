"""The dispatcher's data crossing Temporal: engine readings, the admission controller's state, the
dispatch state and log, the fleet poll.

Invariant: as in ``contracts.types``, only keys, counts and small scalars; nothing heavier than pydantic,
the config models and the sandbox pool's models is imported.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from durable_rollouts.sandboxes.pool import PoolStatus, SandboxPoolConfig


class _Data(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EngineReading(BaseModel):
    """One engine's load at one poll, from its /metrics."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    engine_id: str = Field(min_length=1)
    at: float
    """When the reading was taken (seconds, same clock as `AdmissionController.step`'s ``now``)."""
    kv_usage: float = Field(ge=0.0, le=1.0)
    """Fraction of the KV cache in use."""
    running: int = Field(ge=0)
    """Requests in the running batch."""
    waiting_capacity: int = Field(ge=0)
    """Requests waiting for KV capacity."""
    preemptions_total: float = Field(ge=0.0)
    """Cumulative preemptions (a counter; it only resets when the engine restarts)."""
    kv_capacity_tokens: int = Field(ge=1)
    """KV cache size in tokens."""
    generation_tokens_total: float = Field(0.0, ge=0.0)
    """Cumulative output tokens (``vllm:generation_tokens_total``; 0 when the engine does not export it)."""


class QueueBacklog(BaseModel):
    """The orchestration's own backlog at one poll, from Temporal: the run's task queue as the server
    describes it (the workflow tasks of its normal queue: new workflows' first tasks, and any whose worker
    let them go), and how long the run's own latest workflow tasks waited for a worker slot (its history;
    sticky queues included, where a worker's cached workflows' tasks wait and no description shows them)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    task_queue: str = Field(min_length=1)
    at: float
    """When it was read (same clock as `EngineReading.at`); the server refreshes its stats every few s."""
    reported: bool = True
    """Whether the server reported stats (False: the counts below are 0)."""
    count: int = Field(0, ge=0)
    """Workflow tasks waiting for a worker slot (``approximate_backlog_count``)."""
    age_s: float = Field(0.0, ge=0.0)
    """How long the oldest of them has waited (``approximate_backlog_age``): schedule-to-start latency."""
    add_rate: float = Field(0.0, ge=0.0)
    """Workflow tasks added per second."""
    dispatch_rate: float = Field(0.0, ge=0.0)
    """Workflow tasks handed to workers per second."""
    latency_s: float | None = Field(None, ge=0.0)
    """Longest schedule-to-start wait of the run's own workflow tasks among its latest history events (the
    task running the poll included); None when the history could not be read."""

    @property
    def wait_s(self) -> float:
        """How long a workflow task waits for a slot: the longer of the backlog's age and ``latency_s``."""
        return max(self.age_s, self.latency_s or 0.0)

    @property
    def seen(self) -> bool:
        """Whether it says anything: stats reported or the run's own latency read."""
        return self.reported or self.latency_s is not None


class AdmissionState(BaseModel):
    """Everything the controller remembers; small, so a workflow carries it across continue-as-new."""

    model_config = ConfigDict(extra="forbid")

    cap: int | None = None
    polls: int = 0
    last_step_at: float | None = None
    ties_at_last_step: int = 0
    """Rollouts seen at the last step with admitted_at == last_step_at (already counted as admitted)."""
    preemptions: dict[str, float] = Field(default_factory=dict)
    queue_streak: int = 0
    draining: bool = False
    drained_at_poll: int | None = None
    admitted_since_change: int = 0
    window_start: float | None = None
    window_admitted: int = 0
    # the probe preset's memory (admission/controller.py, rules P0-P5)
    tokens_total: dict[str, float] = Field(default_factory=dict)
    """Each engine's generation-token counter at the previous poll."""
    epoch_start_at: float | None = None
    """When the current probe epoch began (None: none runs)."""
    epoch_tokens: float = 0.0
    epoch_polls: int = 0
    prev_rate: float | None = None
    """Generated tokens/s of the previous epoch, at ``prev_cap``."""
    prev_cap: int | None = None
    ceiling: int | None = None
    """Cap the probe does not grow past, set at ``ceiling_at_poll``."""
    ceiling_at_poll: int | None = None
    storm: bool = False
    """Whether the last poll saw a preemption storm."""
    storm_polls: int = 0
    """Polls that saw a preemption storm."""
    footprint: float | None = None
    """Predicted final KV footprint of a rollout in tokens (rule P5), from the rollouts that ended so far."""
    footprint_rollouts: int = 0
    """Ended rollouts the footprint estimate has seen."""
    engaged_share: float | None = None
    """Mean share of the rollouts in flight that are in an engine (rule P5), over ``engaged_polls`` polls."""
    engaged_polls: int = 0
    # rule O, the orchestration backlog (admission/controller.py): accepted rollouts/s per cap
    accepted_cap: int | None = None
    """The cap whose accepted rate the running segment measures (set when the cap last changed)."""
    accepted_since: float | None = None
    accepted_ended: int = 0
    """Rollouts that ended (completed or truncated) since ``accepted_since``."""
    accepted_polls: int = 0
    accepted_inflight: float = 0.0
    """Summed rollouts in flight over the segment's polls (its mean gives Little's law lifetime)."""
    accepted_prev_rate: float | None = None
    """Accepted rollouts/s of the last measured segment at another cap, ``accepted_prev_cap``."""
    accepted_prev_cap: int | None = None
    backlog_ceiling: int | None = None
    """Cap rule O does not let the other rules grow past, set at ``backlog_ceiling_at_poll``."""
    backlog_ceiling_at_poll: int | None = None
    backlog_unread_said: bool = False
    """Whether the dispatch log was told that the task queue reports no stats (said once)."""


class DispatchState(_Data):
    """The adaptive dispatcher's memory: controller state, last readings, token bucket, decision log."""

    admission: AdmissionState | None = None
    readings: dict[str, EngineReading] = Field(default_factory=dict)
    bucket: TokenBucket | None = None
    polls: int = 0
    last_log: DispatchLog | None = None
    unseen_complete: int = 0
    """Completed or truncated members of groups that closed before a poll showed them, and their tokens
    (from the group's record): the next step passes them to the controller."""
    unseen_complete_tokens: int = 0


class GroupSlot(_Data):
    """The dispatcher's view of one group in flight."""

    admitted_at: float
    engine: str
    size: int
    told: int = 0
    """Members the dispatcher told to cancel for admission so far."""
    seen_complete: int = 0
    """Completed or truncated members the controller was shown (`GroupCounts.complete`), and their tokens."""
    seen_complete_tokens: int = 0


class TokenBucket(_Data):
    """Token-bucket state: ``tokens`` available at time ``at``."""

    tokens: float
    at: float


class GroupCounts(_Data):
    """Members of an in-flight group with a record, from the run store."""

    finished: int = 0
    admission_cancelled: int = 0
    complete: int = 0
    """Members that completed or were truncated (the rollouts whose length admission learns, rule P5)."""
    complete_tokens: int = 0
    """Their summed ``num_tokens`` (final contexts)."""


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
    footprint: float | None = None
    """The controller's predicted final footprint of a rollout after this decision (rule P5), in tokens;
    None before a rollout ended, or outside the probe preset."""
    kv_cap: int | None = None
    """The cap the engine rules alone set at this decision (differs from ``cap`` when rule O held or trimmed
    it); None in logs written before rule O."""
    backlog: QueueBacklog | None = None
    """The run's task queue backlog this decision saw (rule O); None when none was read."""


class PollFleetInput(_Data):
    run_id: str
    engine_urls: list[str]
    groups: list[str]
    pool: SandboxPoolConfig | None = None
    """The run's sandbox pool; None for runs without sandboxes."""
    log: DispatchLog | None = None
    """The previous decision, to be written to the store (idempotent on its seq)."""
    count_unconsumed: bool = False
    """Also count the run's complete groups the trainer feed has not taken (admission.max_queued_groups)."""
    task_queue: str | None = None
    """The run's task queue, whose workflow-task backlog the poll reads (rule O); None reads none."""


class FleetPoll(_Data):
    """What one poll saw: fresh engine readings, per-group record counts, the sandbox pool."""

    at: float
    readings: list[EngineReading]
    errors: list[str] = Field(default_factory=list)
    counts: dict[str, GroupCounts] = Field(default_factory=dict)
    pool: PoolStatus | None = None
    unconsumed_groups: int = 0
    backlog: QueueBacklog | None = None
    """The run's task queue backlog; None when not asked (``PollFleetInput.task_queue``)."""


# forward references (a state names classes defined after it)
EngineReading.model_rebuild()
QueueBacklog.model_rebuild()
AdmissionState.model_rebuild()
DispatchState.model_rebuild()
GroupSlot.model_rebuild()
TokenBucket.model_rebuild()
GroupCounts.model_rebuild()
DispatchLog.model_rebuild()
PollFleetInput.model_rebuild()
FleetPoll.model_rebuild()
