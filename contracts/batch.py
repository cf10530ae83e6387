"""The input of the batch activity (``activities.batch``, ``group.batch_rollouts``).

Invariant: as in ``contracts.types``, only keys, settings and small scalars; token arrays stay in the store.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from durable_rollouts.contracts.activity_io import FinalizeGroupInput
from durable_rollouts.contracts.types import RolloutInput


class BatchInput(BaseModel):
    """Rollouts run together inside one activity: each member's full input (its ``state`` carries the
    time the member's attempt started, from which its ``timeout_s`` counts across batch retries)."""

    model_config = ConfigDict(extra="forbid")

    members: list[RolloutInput]
    batch_round: int = 0
    """How many batches its group ran before this one (a member in a later batch resumes from the store)."""


class ReportGroupInput(BaseModel):
    """A group's close: what finalize_group writes, and the run workflow its record goes to."""

    model_config = ConfigDict(extra="forbid")

    finalize: FinalizeGroupInput
    run_workflow_id: str | None = None
    """The run workflow told ``group_done`` (None: a group started on its own tells nobody)."""
    by_update: bool = False
    """Tell the run by its ``group_report`` update, which it refuses while it drains for continue-as-new
    (input revision 3; the call is retried until the next segment takes it), instead of the ``group_done``
    signal, which lands in whatever workflow task the run has in flight."""
