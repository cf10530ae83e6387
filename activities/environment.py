"""The env step activity: a thin wrapper of ``turns.step`` (the step's logic and invariants live there).

This module adds only what Temporal needs: the activity's options, its heartbeats (a dead worker's step
is noticed within the heartbeat timeout instead of waiting out its full timeout), the attempt number from
``activity.info()`` (a retry finds what an earlier attempt recorded), and the mapping of a
``RolloutError`` to the ``ApplicationError`` that names its boundary. An environment with inline steps is
stepped inside the model turn (``turns.model``), not through this activity.
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import activity
from temporalio.common import RetryPolicy

from durable_rollouts.activities.calls import Options, options
from durable_rollouts.activities.heartbeat import heartbeating
from durable_rollouts.activities.sandbox import SandboxActivities
from durable_rollouts.contracts.activity_io import EnvStepInput
from durable_rollouts.contracts.types import EnvStepResult
from durable_rollouts.errors import RolloutError, SandboxGone, SandboxPathError, names
from durable_rollouts.store import RunStore
from durable_rollouts.turns.engine import Engine
from durable_rollouts.turns.step import EnvSteps

ENV_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    maximum_interval=timedelta(seconds=10),
    maximum_attempts=5,
    non_retryable_error_types=names(SandboxGone, SandboxPathError),
)
"""A step retries transient trouble (engine, store, daemon); a lost sandbox is final for the attempt (the
workflow recovers a lost sandbox by replay), and so is an environment failure, by its own flag
(``non_retryable``), unless the environment declared it transient (``Environment.retryable_errors``)."""


class EnvironmentActivities:
    """The env step of every environment; holds the turn module's steps (store, engine, sandboxes)."""

    def __init__(self, store: RunStore, engine: Engine, sandboxes: SandboxActivities | None) -> None:
        self.steps = EnvSteps(store, engine, sandboxes.bound if sandboxes is not None else None,
                              sandboxes.siblings if sandboxes is not None else None)  # fmt: skip

    @options(
        Options(timedelta(minutes=15), ENV_RETRY, heartbeat=timedelta(seconds=30), wait_cancellation=True)
    )
    @activity.defn
    async def env_step(self, inp: EnvStepInput) -> EnvStepResult:
        """Step the environment with the turn's text, or (``score_only``) score the rollout as it stands."""
        try:
            return await heartbeating(self.steps.step(inp, activity.info().attempt))
        except RolloutError as e:
            raise e.to_application_error() from e

    def all(self) -> list:
        return [self.env_step]
