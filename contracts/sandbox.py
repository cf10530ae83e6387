"""The data of a rollout's sandbox crossing Temporal: where it is placed, what creating it did, one operation.

Invariant: as in ``contracts.types``, only keys, counts and small scalars; nothing heavier than pydantic,
the config models and the sandbox spec is imported.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from durable_rollouts.contracts.ref import OfRollout, RolloutRef
from durable_rollouts.sandboxes.base import SandboxSpec
from durable_rollouts.sandboxes.pool import SandboxPoolConfig


class _Data(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SandboxPlaceInput(_Data):
    """Ask for a sandbox host for a rollout (``placement = "hosts"``)."""

    rollout_id: str
    pool: SandboxPoolConfig
    avoid: list[str] = Field(default_factory=list)
    """Hosts the rollout could not reach (their queue had no poller within ``host_timeout_s``)."""


class SandboxPlacement(_Data):
    """The host that runs a rollout's sandbox, and the task queue of its sandbox activities."""

    host: str
    task_queue: str


class SandboxCreated(_Data):
    """What ``sandbox_create`` did: whether the task got a sandbox, and where it runs."""

    created: bool
    """False when the environment gives this task no sandbox."""
    host: str | None = None
    """The Docker daemon running it (its name as ``docker info`` reports it); None if unknown."""
    timeout_s: float | None = None
    """The task's own wall-clock limit of the rollout from now on (``SandboxPlan.timeout_s``, e.g. a Harbor
    task's ``[agent].timeout_sec``); None: only the run's ``rollout.timeout_s``."""

    @model_validator(mode="before")
    @classmethod
    def _from_bool(cls, value: Any) -> Any:
        """Histories written before the host was reported carry a bare bool."""
        return {"created": value} if isinstance(value, bool) else value


class SandboxStepInput(OfRollout):
    """One sandbox operation of a rollout (create, recover): its sandbox is keyed by the rollout id."""

    ref: RolloutRef
    turn: int
    engine_url: str
    spec: SandboxSpec
    """The run's default spec; the environment derives the task's own from it."""
    pool: SandboxPoolConfig | None = None
    """The sandbox pool (create: hold one of its slots first; create and recover: its image registry); None =
    no pool gating and no registry."""
