"""The CLI's run summary: outcome counts, and reward figures from the group records."""

from __future__ import annotations

from rich.console import Console

from contracts.types import RunProgress
from workers.progress import summary_table


def render(table) -> str:
    console = Console(width=100, record=True)
    console.print(table)
    return console.export_text()


def progress() -> RunProgress:
    return RunProgress(
        run_id="r",
        total_groups=2,
        groups_done=2,
        groups_inflight=0,
        rollouts_total=8,
        outcomes={"completed": 7, "failed": 1},
        segment=0,
        done=True,
    )


def test_summary_weights_group_means_by_scorable_members() -> None:
    groups = [
        {"reward_mean": 0.5, "scorable": 4, "zero_variance": False},
        {"reward_mean": 1.0, "scorable": 3, "zero_variance": True},
    ]
    text = render(summary_table(progress(), groups))
    assert "8/8" in text and "2/2" in text
    assert f"{(0.5 * 4 + 1.0 * 3) / 7:.3f}" in text
    assert "1/2" in text  # one zero-variance group of two


def test_summary_without_group_records_shows_counts_only() -> None:
    text = render(summary_table(progress(), None))
    assert "completed" in text and "failed" in text and "mean reward" not in text


def test_summary_names_the_groups_being_accounted_for_and_why() -> None:
    reason = "infra: WorkflowTerminated: group terminated (web UI or CLI)"
    p = progress().model_copy(
        update={"groups_done": 1, "groups_inflight": 1, "done": False, "accounting": {"g000001": reason}}
    )
    flat = " ".join(render(summary_table(p, None)).replace("│", " ").split())  # cells wrap: one line
    assert "groups in flight 1" in flat
    assert "accounting for g000001" in flat and "closed without reporting" in flat
    assert "WorkflowTerminated: group terminated (web UI or CLI)" in flat
