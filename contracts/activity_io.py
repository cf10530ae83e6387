"""The inputs and results of the activities (load a run, prepare, generate, step, finalize, account for
terminated groups), beside the workflow inputs and states of ``contracts.types``.

Invariant: as in ``contracts.types``, only keys, counts and small scalars; nothing heavier than pydantic and
the other contracts is imported.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from durable_rollouts.contracts.ref import OfRollout, RolloutRef
from durable_rollouts.contracts.types import (
    EnvTraits,
    GroupResult,
    Outcome,
    RolloutResult,
    RolloutState,
    SamplingParams,
)


class _Data(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LoadRunInput(_Data):
    run_id: str
    config_json: str
    config_hash: str
    task_file: str
    env: str


class LoadRunResult(_Data):
    """The run is stored with its tasks (read from the store's upload, or the task file)."""

    num_tasks: int
    env: EnvTraits


class PrepareInput(OfRollout):
    """Render and store the rollout's first prompt (once)."""

    ref: RolloutRef
    engine_url: str
    stall_timeout_s: float | None = None
    """``engine.stall_timeout_s`` (None: the worker's default; see ``engines.watchdog``)."""


class GenerateInput(OfRollout):
    """One model turn (``turns.model``): sample on the stored context, store the segment, step inline."""

    _nested: ClassVar[tuple[str, ...]] = ("prepare", "env_after")
    ref: RolloutRef
    turn: int
    engine_url: str
    sampling: SamplingParams
    max_tokens: int
    """The turn's budget as the workflow computed it (``turns.budget.turn_budget`` on its token count)."""
    env_after: EnvStepInput | None = None
    """Run this env step in the same activity once the turn is stored, unless the turn was truncated
    (environments with ``inline_steps``); saves a workflow task per turn."""
    max_total_tokens: int = 0
    """The rollout's token limit (prompt + every turn): the call samples at most what is left, and a turn
    that reaches it is truncated (token_budget), not stepped. 0 = no limit beyond max_tokens."""
    prepare: PrepareInput | None = None
    """Render and store the prompt first if it is not stored yet (a math rollout's first call)."""
    stall_timeout_s: float | None = None
    """``engine.stall_timeout_s`` (None: the worker's default; see ``engines.watchdog``)."""


class EnvStepInput(OfRollout):
    """The environment's step on a stored turn (``turns.step``), or the scoring of a truncated rollout."""

    ref: RolloutRef
    turn: int
    last_turn: bool
    engine_url: str
    score_only: bool = False
    """Score the rollout as it stands (a truncated rollout) instead of stepping the environment."""
    transfer_s: float = 0.0
    """Store seconds of the model call before this step that its turn's meta does not hold yet (the
    turn's own write, timed after it); the step records them with its times."""


class FinalizeRolloutInput(OfRollout):
    """Write a rollout's record (built by ``workflows.rollout.finalize_input`` only)."""

    ref: RolloutRef
    outcome: Outcome
    reason: str | None
    reward: float | None
    scorable: bool
    sampling: SamplingParams
    turns: int
    state: RolloutState = Field(default_factory=lambda: RolloutState())
    """The rollout's counters (failovers, sandbox replays, ...), stored as the record's optional fields."""
    uses_sandbox: bool = False
    score_truncated: bool | None = None
    """Set on truncated rollouts: whether the run scores them."""
    wasted_tokens: int | None = None
    """Set on rollouts cancelled for admission: the tokens they had sampled."""
    ended_at: float | None = None
    """Workflow time of scheduling the record; the stored end adds the record's reads (``_times``)."""
    failure: dict[str, Any] | None = None
    """Set on rollouts failed by an exception of the environment's code: its type, the hook that raised
    it and the traceback's last frames (``errors.failure_details``); stored as ``extra_json["failure"]``."""


class StoredOutcome(_Data):
    """A rollout's record as the store holds it (the first write wins; a retry returns the stored one)."""

    outcome: Outcome
    reason: str | None = None
    reward: float | None = None
    scorable: bool = False
    wasted_tokens: int = 0
    inserted: bool = True
    """Whether this call wrote the record (False: it existed already)."""


class TerminatedGroupInput(_Data):
    """A group terminated by hand (``rollouts terminate GROUP``): the members to account for."""

    run_id: str
    group_id: str
    members: list[str] = Field(default_factory=list)
    """Rollout ids of its members that were running (their workflows died with the group)."""
    reason: str = "manual"
    task_index: int = 0
    """Index of the group's task in the run's task file (the run fills it in)."""
    size: int = 0
    """The group's size (the run fills it in): its member attempts are also looked up in Temporal."""


class TerminatedGroup(_Data):
    """The store's view of a terminated group, after its unrecorded members were recorded as failed."""

    task_id: str
    members: list[RolloutResult]
    """Every member attempt with a record, the ones just written included."""
    record: GroupResult | None = None
    """The group's record if the group wrote it before it was terminated."""
    unended: list[str] = Field(default_factory=list)
    """Its member attempts that Temporal holds and that did not complete (asked when ``size`` is given),
    and those that stored tokens without a record (members that ran inside the group's workflow)."""


class ClosedGroupsInput(_Data):
    """Groups of a run to ask Temporal about (``DispatchActivities.closed_groups``)."""

    run_id: str
    groups: list[str]


class FinalizeGroupInput(_Data):
    record: GroupResult
    advantages: dict[str, float | None]
    superseded: dict[str, str] = Field(default_factory=dict)
    """Failed (infra) attempts whose slot ran again: rollout id -> the id of the attempt after it."""
    unscorable: list[str] = Field(default_factory=list)
    """Members of an unscorable group (``record.unscorable_reason``): stored as not scorable."""


GenerateInput.model_rebuild()
