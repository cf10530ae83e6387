"""The CLI's run summary: outcome counts, and reward figures from the group records."""

from __future__ import annotations

from pathlib import Path

import pytest
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


def test_a_stopped_run_says_why() -> None:
    stopped = progress().model_copy(update={"done": False, "stopped": "4 consecutive environment failures"})
    assert "stopped" in render(summary_table(stopped, None))
    assert "4 consecutive environment failures" in render(summary_table(stopped, None))
    assert "stopped" not in render(summary_table(progress(), None))


class _Handle:
    """A run's workflow handle that has already ended with ``final``."""

    def __init__(self, final: RunProgress) -> None:
        self.final = final

    async def describe(self) -> None:
        return None

    async def result(self) -> RunProgress:
        return self.final

    async def query(self, *_: object) -> RunProgress:
        return self.final


def test_run_wait_exits_non_zero_for_a_stopped_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    import workers.cli as cli

    for final, code in ((progress(), 0), (progress().model_copy(update={"stopped": "4 consecutive"}), 1)):

        class _Client:
            def __init__(self, handle: _Handle) -> None:
                self.handle = handle

            def get_workflow_handle_for(self, *_: object) -> _Handle:
                return self.handle

        async def connect(*_: object, final: RunProgress = final) -> _Client:
            return _Client(_Handle(final))

        monkeypatch.setattr(cli, "_client", connect)
        monkeypatch.setenv("ROLLOUTS_HOME", str(tmp_path))
        result = CliRunner().invoke(cli.app, ["run", "config/examples/math.toml", "--run-id", "r", "--wait"])
        assert result.exit_code == code, result.output
        assert ("stopped: 4 consecutive" in result.output) == (code == 1)
