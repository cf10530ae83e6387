"""The CLI's run summary: outcome counts, failures by cause, and reward figures from the group records;
the exit code of ``rollouts run --wait`` for a run with environment failures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from durable_rollouts.cli.progress import (
    ENVIRONMENT_FAILURE_EXIT,
    environment_failure_exit,
    failure_causes,
    summary_table,
    wait_verdict,
)
from durable_rollouts.config.models import Config, RunConfig
from durable_rollouts.contracts.types import RunProgress
from durable_rollouts.store import RunStore

REASONS = {
    "environment: ZeroDivisionError: division by zero": 3,
    "environment: NotImplementedError: environment x has no actions": 1,
    "infra: EngineUnavailable: http://e:8000 refused": 2,
    "infra: EngineUnavailable: http://e:8001 refused": 1,
    "infra: SandboxGone: container died": 1,
}


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


def test_failures_are_grouped_by_cause_with_their_top_error_types() -> None:
    causes = failure_causes(REASONS, top=2)
    assert causes.counts == {"environment": 4, "infra": 4}
    assert causes.top["environment"] == [
        ("ZeroDivisionError", 3, "division by zero"),
        ("NotImplementedError", 1, "environment x has no actions"),
    ]
    assert causes.top["infra"][0][:2] == ("EngineUnavailable", 3) and len(causes.top["infra"]) == 2
    assert failure_causes({"weird": 1}).counts == {"other": 1}


def test_the_summary_shows_failures_by_cause_and_the_top_reasons() -> None:
    text = render(summary_table(progress(), None, failure_causes(REASONS)))
    lines = [line for line in text.splitlines() if "failed by" in line or "Error:" in line or ": " in line]
    assert any("failed by environment" in line and "4" in line for line in lines)
    assert any("failed by infra" in line and "4" in line for line in lines)
    assert any("ZeroDivisionError: division by zero" in line and "3" in line for line in lines)
    assert any("EngineUnavailable:" in line and "3" in line for line in lines)
    assert "failed by" not in render(summary_table(progress(), None))  # no records: counts only


@pytest.mark.parametrize(
    ("env_failures", "rollouts", "max_share", "code"),
    [
        (0, 8, 0.0, 0),
        (1, 8, 0.0, ENVIRONMENT_FAILURE_EXIT),  # the default: any environment failure
        (2, 8, 0.25, 0),  # at the share: allowed
        (3, 8, 0.25, ENVIRONMENT_FAILURE_EXIT),
        (8, 8, 1.0, 0),  # 1 = never
    ],
)
def test_the_wait_exit_code_rule(env_failures: int, rollouts: int, max_share: float, code: int) -> None:
    assert environment_failure_exit(env_failures, rollouts, max_share) == code


def test_the_default_share_fails_the_wait_on_any_environment_failure_and_its_code_is_not_bad_input() -> None:
    assert RunConfig().max_environment_failure_share == 0.0
    assert ENVIRONMENT_FAILURE_EXIT not in (0, 1, 2)


def _record(store: RunStore, run: str, i: int, outcome: str, reason: str | None) -> None:
    store.put_rollout({
        "rollout_id": f"{run}/g0/{i}", "run_id": run, "group_id": "g0", "task_id": "t", "sample_index": i,
        "env": "math", "outcome": outcome, "reason": reason, "reward": None, "scorable": 0,
        "advantage": None, "prompt_length": 1, "num_tokens": 2, "sampling_json": "{}", "extra_json": "{}",
    })  # fmt: skip


def test_the_verdict_reads_the_runs_records_and_its_stored_threshold(tmp_path: Path) -> None:
    store = RunStore(tmp_path)
    for run, share in (("strict", 0.0), ("lenient", 0.5)):
        cfg = Config(run=RunConfig(max_environment_failure_share=share))
        store.register_run(run, cfg.model_dump_json(), "h")
        _record(store, run, 0, "failed", "environment: ZeroDivisionError: division by zero")
        _record(store, run, 1, "failed", "infra: EngineUnavailable: refused")
        _record(store, run, 2, "completed", None)
        _record(store, run, 3, "completed", None)
    code, line = wait_verdict(store, "strict", max_share=1.0)  # the stored config's share applies
    assert code == ENVIRONMENT_FAILURE_EXIT
    assert line.startswith("run strict: 1 of 4 rollouts failed by the environment (ZeroDivisionError x1)")
    assert "\n" not in line and "max_environment_failure_share=0" in line
    assert wait_verdict(store, "lenient", max_share=0.0)[0] == 0  # 1 of 4 <= 0.5
    assert json.loads(store.get_run("lenient")["config_json"])["run"]["max_environment_failure_share"] == 0.5


def test_summary_names_the_groups_being_accounted_for_and_why() -> None:
    reason = "infra: WorkflowTerminated: group terminated (web UI or CLI)"
    p = progress().model_copy(
        update={"groups_done": 1, "groups_inflight": 1, "done": False, "accounting": {"g000001": reason}}
    )
    flat = " ".join(render(summary_table(p, None)).replace("│", " ").split())  # cells wrap: one line
    assert "groups in flight 1" in flat
    assert "accounting for g000001" in flat and "closed without reporting" in flat
    assert "WorkflowTerminated: group terminated (web UI or CLI)" in flat


def test_a_stopped_run_says_why() -> None:
    stopped = progress().model_copy(update={"done": False, "stopped": "4 consecutive environment failures"})
    assert "stopped" in render(summary_table(stopped, None))
    assert "4 consecutive environment failures" in render(summary_table(stopped, None))
    assert "stopped" not in render(summary_table(progress(), None))


def _times(env: str, n: int, generation_s: float, wall_s: float) -> list[tuple[str, dict[str, float]]]:
    time = {"generation_s": generation_s, "environment_s": 0.1 * wall_s, "reward_s": 0.1, "transfer_s": 0.05}
    return [(env, {**time, "wall_s": wall_s, "trainer_wait_s": 1.0})] * n


@pytest.mark.parametrize(
    "envs",
    [["math"], ["math", "coding"], ["math", "coding", "reasoning_gym"]],
    ids=["make demo", "two environments", "three environments"],
)
def test_the_run_summary_reads_at_80_columns(envs: list[str]) -> None:
    """``rollouts run --wait``'s two tables on a terminal of 80 columns: no header cut short ("rollo…",
    "gener…" in the time table's nine columns once), every header word there, no line wider."""
    from durable_rollouts.cli.progress import time_table
    from durable_rollouts.records.timing import totals_by_env

    run = "run-20261206-101010-ab12"
    items = [
        t for k, env in enumerate(envs) for t in _times(env, 160 // (k + 1), 3.2 * (k + 1), 4.3 * (k + 1))
    ]
    p = progress().model_copy(update={"run_id": run, "rollouts_total": 160, "total_groups": 40})
    console = Console(width=80, record=True)
    console.print(
        summary_table(
            p, [{"reward_mean": 0.5, "scorable": 4, "zero_variance": False}], failure_causes(REASONS)
        )
    )
    console.print(time_table(run, totals_by_env(items)))
    text = console.export_text()
    assert "…" not in text and "..." not in text, text
    assert max(len(line) for line in text.splitlines()) <= 80, text
    words = set(text.replace("│", " ").replace("┃", " ").split())  # a header may wrap, word by word
    headers = ["outcome", "rollouts", "summed over rollouts", *envs, *(["all"] if len(envs) > 1 else [])]
    rows = ["wall", "generation", "environment", "reward", "transfer", "other (orchestration)"]
    for label in [*headers, *rows, "trainer wait (mean)", "where the time went"]:
        assert set(label.split()) <= words, f"{label!r} missing:\n{text}"


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

    import durable_rollouts.cli.rollouts as cli

    for final, code in (
        (progress(), 0),
        (progress().model_copy(update={"stopped": "4 consecutive"}), ENVIRONMENT_FAILURE_EXIT),
    ):

        class _Client:
            def __init__(self, handle: _Handle) -> None:
                self.handle = handle

            def get_workflow_handle_for(self, *_: object) -> _Handle:
                return self.handle

        async def connect(*_: object, final: RunProgress = final) -> _Client:
            return _Client(_Handle(final))

        monkeypatch.setattr(cli, "temporal_client", connect)
        monkeypatch.setenv("ROLLOUTS_HOME", str(tmp_path))
        result = CliRunner().invoke(cli.app, ["run", "config/examples/math.toml", "--run-id", "r", "--wait"])
        assert result.exit_code == code, result.output
        assert ("stopped: 4 consecutive" in result.output) == (code == ENVIRONMENT_FAILURE_EXIT)
