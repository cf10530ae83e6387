"""The record of one rollout: its one builder lives in ``activities.members`` (the batch activity builds
records too, and activities may not import workflows); re-exported here for the workflows."""

from __future__ import annotations

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from durable_rollouts.activities.members import finalize_rollout_input

__all__ = ["finalize_rollout_input"]
