"""Every committed workflow history replays against the current workflow code (Temporal's Replayer).

Histories recorded by earlier releases live under ``tests/histories/<release>/`` (``record.py`` there
writes them). A workflow change that would break an in-flight workflow of an earlier release fails here,
in CI, instead of in a days-long run after a worker upgrade; such a change must go behind
``workflow.patched`` (README, "Upgrades").
"""

from __future__ import annotations

from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

from durable_rollouts.workers.worker import WORKFLOWS

HISTORIES = sorted((Path(__file__).parents[2] / "histories").glob("*/*.json"))


def test_histories_of_every_kind_are_committed() -> None:
    kinds = {p.name.split(".")[0] for p in HISTORIES}
    assert {
        "math-run",
        "coding-rollout",
        "long-rollout",
        "adaptive-run",
        "harbor-timeout-rollout",
        "harness-rollout",
    } <= kinds, kinds
    assert any(p.name.startswith("long-rollout.1") for p in HISTORIES), "no continued-as-new rollout"
    assert any(p.name.startswith("adaptive-run.1") for p in HISTORIES), "no continued-as-new run"


@pytest.mark.parametrize("path", HISTORIES, ids=lambda p: f"{p.parent.name}/{p.stem}")
async def test_history_replays(path: Path) -> None:
    history = WorkflowHistory.from_json(path.stem, path.read_text())
    replayer = Replayer(workflows=WORKFLOWS, data_converter=pydantic_data_converter)
    await replayer.replay_workflow(history)
