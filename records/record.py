"""The export records as typed models: the contract trainers read, one JSON object per line.

The committed JSON Schemas ``records/schema/rollout.json`` and ``records/schema/group.json`` are generated
from these models (``python -m durable_rollouts.records.schema``; a unit test fails when they differ). Every
line carries ``schema_version`` (:data:`SCHEMA_VERSION`); the format before it had none and is version 1.

Invariants: unknown keys are rejected (nothing a workflow happens to store leaks into the contract); the
optional fields of a rollout are written only where the rollout has them (the exporter dumps with
``exclude_unset``), so an absent optional field means its default; existing fields keep their names and
meaning, and any change to these models bumps :data:`SCHEMA_VERSION` and regenerates the schemas.
"""

from __future__ import annotations

import importlib.resources
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

SCHEMA_VERSION = 6
"""Version of the export format written today (1 = the implicit format before ``schema_version``; 3 added
the time decomposition: ``time`` and the turns' ``transfer_s``; 5 the infra retries: a rollout's
``superseded_by``, a group's ``superseded`` and ``unscorable_reason``; 6 a harness rollout's
``sequences``)."""

ROLLOUT_OPTIONAL = (
    "sandbox_replays",
    "sandbox_slot_waits",
    "partial_steps",
    "engine_failovers",
    "reprefill_tokens",
    "score_truncated",
    "wasted_tokens",
    "superseded_by",
    "sequences",
)
"""Optional rollout fields, as the rollout workflow stores them (``extra_json``) when they apply."""


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class Lineage(_Record):
    """What produced a rollout (see README, "Lineage and reproduction")."""

    policy_versions: list[str]
    """Policy versions that sampled the rollout's tokens, in order of first use (engine-reported)."""
    config_hash: str | None
    """Hash of the run's resolved config (the store's ``runs`` table keeps the config); null if unknown."""
    env: str
    """Environment of the rollout (e.g. math, coding)."""
    env_version: str | None
    """The environment's ENV_VERSION when the rollout was recorded; null if never recorded."""
    verifier_version: str | None
    """The environment's VERIFIER_VERSION when the rollout was recorded; null if never recorded."""
    sandbox_image: str | None
    """Coding only: the stored config's sandbox.image tag (not the digest); null otherwise."""


class TurnRecord(_Record):
    """Timing and provenance of one model turn of a rollout."""

    turn: int = Field(ge=0)
    """Index of the turn in the rollout, from 0."""
    engine: str | None
    """Base URL of the engine replica that sampled the turn."""
    finish_reason: str | None
    """The engine's finish reason of the turn (e.g. stop, length)."""
    range: list[int] = Field(min_length=2, max_length=2)
    """[start, end): the token range of ``token_ids`` this turn sampled."""
    queue_s: float
    """Seconds the turn waited before the engine started it (task queue and engine queue)."""
    model_s: float
    """Seconds the engine spent on the turn."""
    env_s: float
    """Seconds the environment step after the turn took (0 if none)."""
    reward_s: float
    """Seconds the reward computation took (0 if the turn was not scored)."""
    attempt: int | None
    """Activity attempt that produced the turn (1 = first try)."""
    transfer_s: float = Field(0.0, ge=0)
    """Seconds the turn's activities spent in run-store reads and writes (present from schema 3; from
    then on ``env_s`` excludes them, so the turn's times are disjoint)."""
    logprob_mode: str | None = None
    """The logprobs mode the engine reported serving when it sampled the turn (vLLM's dev-mode
    ``/server_info``; from schema 4); null when the engine could not tell. A turn is never sampled by an
    engine whose reported mode differs from ``sampling.logprob_mode``."""
    metrics: dict[str, float] | None = None
    """The verifier's metrics when this turn was scored and the environment reports more than the reward
    (e.g. every key of a Harbor task's ``reward.json``); absent otherwise."""


class RolloutTime(_Record):
    """Where the rollout's wall time went, summed over its turns (see ``records/timing.py``).

    Invariant: the components are disjoint, so generation_s + environment_s + reward_s + transfer_s <=
    wall_s where the wall time is known; trainer_wait_s comes after the rollout's end, outside wall_s.
    """

    generation_s: float = Field(ge=0)
    """Every turn's queue_s + model_s (task queue, engine queue, engine)."""
    environment_s: float = Field(ge=0)
    """Every turn's env_s (env steps, every sandbox command) plus sandbox_s."""
    reward_s: float = Field(ge=0)
    """Every turn's reward_s (for coding, the hidden tests)."""
    transfer_s: float = Field(ge=0)
    """Every turn's transfer_s plus the record's own store reads when it was written."""
    sandbox_s: float = Field(ge=0)
    """Of environment_s: the sandbox's create, recovery and teardown (0 without a sandbox)."""
    wall_s: float | None = Field(ge=0)
    """From the rollout workflow's start to its record; null for records stored before it was kept."""
    started_at: float | None
    """Workflow time (epoch seconds) of the rollout's start; null if not kept."""
    ended_at: float | None
    """Workflow time (epoch seconds) when the rollout's record was written; null if not kept."""
    trainer_wait_s: float | None = Field(None, ge=0)
    """Present once the trainer feed consumed the group: seconds from the group's record to the feed
    handing it to a trainer."""


class SamplingRecord(_Record):
    """The behaviour policy's sampling settings (identical for every member of a group).

    Always written in full by a run; a field absent from a record means its default here.
    """

    temperature: float = 1.0
    """Sampling temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass; 1 = disabled."""
    top_k: int = -1
    """Top-k cut-off; -1 = disabled."""
    max_tokens: int | None = None
    """Most tokens one model call could sample."""
    seed: int | None = None
    """Base seed of the run (each rollout derives its own from it); null = random."""
    logprob_mode: Literal["processed_logprobs", "raw_logprobs"] = "processed_logprobs"
    """Meaning of ``logprobs``: after temperature and top-k/top-p (processed) or raw."""
    min_tokens: int = 0
    """The end-of-turn token was suppressed until a turn had this many tokens (absent in old records)."""


class SequenceStart(_Record):
    """Where a harness's rewritten history (truncated, summarised) started a new token sequence, and why."""

    start: int = Field(ge=0)
    """Offset in ``token_ids`` of the sequence's first token (its context, loss mask 0)."""
    call: int = Field(ge=0)
    """The harness's model call (0-based) whose messages did not extend the previous call's."""
    at_message: int | None = None
    """The first message that differs from the previous call's conversation (null: the template's render
    of the new messages did not extend the old one)."""
    why: str
    """What did not extend, in words."""


class RolloutRecord(_Record):
    """One rollout: its outcome, reward and the full token sequence with per-token sampling data.

    Invariant: ``token_ids``, ``logprobs``, ``loss_mask`` and ``policy_versions`` have the same length, and
    ``logprobs``/``policy_versions`` are null exactly where ``loss_mask`` is 0.
    """

    schema_version: int = Field(json_schema_extra={"const": SCHEMA_VERSION})
    """Version of the export format (records.models.SCHEMA_VERSION)."""
    sandbox_replays: int = Field(0, ge=0)
    """Sandboxed envs only (e.g. coding): times a lost sandbox was recreated and its commands replayed."""
    sandbox_slot_waits: int = Field(0, ge=0)
    """Sandboxed envs only, present when non-zero: times the rollout waited for a free sandbox slot."""
    partial_steps: int = Field(0, ge=0)
    """Present when non-zero: times the rollout paused at rollout.step_token_budget for a new policy."""
    engine_failovers: int = Field(0, ge=0)
    """Present when non-zero: times the rollout moved to another engine replica."""
    reprefill_tokens: int = Field(0, ge=0)
    """Present with engine_failovers: context tokens the new replicas had to prefill again."""
    score_truncated: bool | None = None
    """Truncated rollouts only: whether the run scores truncated rollouts."""
    wasted_tokens: int = Field(0, ge=0)
    """Cancelled rollouts only: tokens sampled before the cancel."""
    superseded_by: str | None = None
    """Present on a rollout that failed for infrastructure and whose slot ran again
    (``rollout.infra_retries``): the id of the attempt that replaced it; the slot's last attempt counts."""
    sequences: list[SequenceStart] | None = None
    """Harness rollouts whose harness rewrote its history only: where each token sequence after the first
    starts (a trainer scores each sequence on its own: its model tokens were sampled on it alone)."""
    kind: Literal["rollout"]
    """Line type."""
    run_id: str
    """The run."""
    group_id: str
    """The rollout's group (same task, same sampling)."""
    rollout_id: str
    """Unique id of the rollout."""
    task_id: str
    """The task (prompt) the rollout answered."""
    sample_index: int = Field(ge=0)
    """Position of the rollout in its group."""
    env: str
    """Environment (e.g. math, coding)."""
    outcome: Literal["completed", "truncated", "failed", "cancelled"]
    """How the rollout ended."""
    reason: str | None
    """Why it ended that way (e.g. max_turns, token_budget, admission); null for a plain completion."""
    reward: float | None
    """The environment's reward; null where the rollout is not scorable."""
    scorable: bool
    """Whether the rollout has a reward and takes part in its group's statistics."""
    advantage: float | None
    """(reward - group mean) / (group std + eps); 0 in a zero-variance group; null if not scorable."""
    prompt_length: int = Field(ge=0)
    """Tokens of the prompt at the start of token_ids."""
    token_ids: list[int]
    """The prompt followed by everything after it (sampled turns and observations)."""
    logprobs: list[float | None]
    """Per token: the sampled token's logprob (see sampling.logprob_mode); null where not sampled."""
    loss_mask: list[Literal[0, 1]]
    """Per token: 1 where the policy sampled the token, 0 elsewhere (prompt, observations)."""
    policy_versions: list[str | None]
    """Per token: the engine-reported policy version that sampled it; null where not sampled."""
    sampling: SamplingRecord
    """The sampling settings of the rollout."""
    turns: list[TurnRecord]
    """One entry per model turn, in order."""
    time: RolloutTime
    """The time decomposition: per-turn times summed, wall time, trainer wait."""
    lineage: Lineage
    """What produced the rollout."""


class GroupRecord(_Record):
    """One closed group: counts and reward statistics over its scorable members.

    Statistics and advantages use scorable members only; members that failed for infrastructure reasons
    count toward ``size``.
    """

    schema_version: int = Field(json_schema_extra={"const": SCHEMA_VERSION})
    """Version of the export format (records.models.SCHEMA_VERSION)."""
    kind: Literal["group"]
    """Line type."""
    run_id: str
    """The run."""
    group_id: str
    """The group."""
    task_id: str
    """The task every member answered."""
    size: int = Field(ge=0)
    """Members of the group (every outcome)."""
    scorable: int = Field(ge=0)
    """Members with a reward."""
    failed: int = Field(ge=0)
    """Members that failed."""
    reward_mean: float | None
    """Mean reward of the scorable members; null if none."""
    reward_std: float | None
    """Standard deviation of the scorable members' rewards; null if none."""
    zero_variance: bool
    """Fewer than two scorable members or equal rewards (advantages 0)."""
    outcomes: dict[str, int] = Field(default_factory=dict)
    """Members per outcome."""
    admission_cancelled: int = Field(0, ge=0)
    """Members cancelled by the dispatcher (reason admission); with redispatch, their slots ran again."""
    wasted_tokens: int = Field(0, ge=0)
    """Tokens those cancelled members had sampled."""
    trainer_wait_s: float | None = Field(None, ge=0)
    """Present once the trainer feed consumed the group: seconds from its record to the feed handing it
    to a trainer."""
    superseded: int = Field(0, ge=0)
    """Attempts that failed for infrastructure and whose slot ran again (counted in ``failed`` and
    ``outcomes``, never in the statistics; their records carry ``superseded_by``)."""
    unscorable_reason: str | None = None
    """Set when the whole group is unscorable (``group.on_infra_failure = "fail-group"`` and a member still
    failed for infrastructure after its retries: that member and its reason): no member is scorable, no
    advantages, and the trainer feed discards the group."""


RECORDS: dict[str, type[_Record]] = {"rollout": RolloutRecord, "group": GroupRecord}
"""The model of each line kind; the JSON Schema of kind K is ``records/schema/K.json``."""


def json_schema(kind: str) -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of one line kind, as generated from its model."""
    schema = RECORDS[kind].model_json_schema()
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema}


def schema_text(kind: str) -> str:
    """The committed form of :func:`json_schema`: 2-space indented JSON and a final newline."""
    return json.dumps(json_schema(kind), indent=2) + "\n"


SCHEMA_DIR = Path(str(importlib.resources.files("durable_rollouts.records.schema")))
"""Where the committed schemas live (package data: ``records/schema/{rollout,group}.json``)."""


def committed_schema(kind: str) -> dict[str, Any]:
    """The committed JSON Schema of one line kind (what trainers validate against)."""
    return json.loads((SCHEMA_DIR / f"{kind}.json").read_text())
