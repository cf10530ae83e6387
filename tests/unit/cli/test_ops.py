"""Operating a run, pure pieces: durations, visibility filters and their web UI URLs, the stuck line, the
``top`` table, the bounded progress-upsert rate, reason keys, slot ids, group closing, the store's
versioned manual-actions log."""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest
from rich.console import Console

from durable_rollouts.cli import ops, top
from durable_rollouts.contracts.types import Outcome, RolloutResult, RunProgress, SandboxCreated
from durable_rollouts.store.runstore import SCHEMA_VERSION, RunStore
from durable_rollouts.workflows import search_attributes as sa
from durable_rollouts.workflows.group import close_group, slot_of


@pytest.mark.parametrize(
    ("text", "seconds"), [("60", 60), ("60s", 60), ("2m", 120), ("1m30s", 90), ("1h", 3600), ("0.5s", 0.5)]
)
def test_durations(text: str, seconds: float) -> None:
    assert ops.parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "s", "1d", "-5", "1m2h", "abc"])
def test_bad_durations_are_one_line(text: str) -> None:
    with pytest.raises(ops.OpsError, match="--for"):
        ops.parse_duration(text)


def test_filters_name_only_the_runs_rollouts() -> None:
    at = datetime(2026, 12, 1, 10, 0, 0, tzinfo=UTC)
    assert ops.stuck_filter("exp1", at) == (
        'WorkflowType = "RolloutWorkflow" AND RolloutRun = "exp1" AND ExecutionStatus = "Running"'
        ' AND RolloutProgressAt < "2026-12-01T10:00:00Z"'
    )
    assert ops.stuck_filter("exp1", at.timestamp()) == ops.stuck_filter("exp1", at)
    assert ops.retrying_filter("exp1").endswith('"Running" AND RolloutAttempt > 1')
    assert ops.replica_filter("exp1", "http://e:8000").endswith('RolloutEngine = "http://e:8000"')
    assert ops.phase_filter("exp1", "env").endswith('RolloutPhase = "env"')
    assert ops.failed_filter("exp1", "infra: EngineUnavailable").endswith(
        'RolloutOutcome = "failed" AND RolloutReason = "infra: EngineUnavailable"'
    )
    assert ops.rollouts_of('we"ird') == 'WorkflowType = "RolloutWorkflow" AND RolloutRun = "we\\"ird"'


def test_ui_urls_are_encoded_and_round_trip() -> None:
    q = ops.phase_filter("exp1", "generate")
    url = ops.ui_url(q)
    assert url.startswith("http://127.0.0.1:8233/namespaces/default/workflows?query=WorkflowType%20%3D%20%22")
    assert " " not in url and '"' not in url
    assert parse_qs(urlparse(url).query)["query"] == [q]
    assert ops.ui_url(q, "http://h:1/").startswith("http://h:1/namespaces/default/workflows?query=")


def test_a_stuck_line_says_phase_turn_elapsed_progress_engine_sandbox_and_the_pending_call() -> None:
    row = ops.StuckRollout(
        rollout_id="exp1/g000001/0", phase="generate", turn=3, started=1000.0, progress_at=1060.0,
        engine="http://e:8000", sandbox_host=None,
        pending=[ops.PendingCall("generate_turn", 2, 5, last_failure="boom", last_heartbeat=1170.0)],
    )  # fmt: skip
    line = ops.format_stuck(row, now=1180.0)
    assert line.startswith("exp1/g000001/0  phase=generate  turn=3  elapsed=3m00s  last-progress=2m00s ago")
    assert "(1970-01-01T00:17:40Z)" in line and "engine=http://e:8000  sandbox=-" in line
    assert "pending=generate_turn attempt=2/5 heartbeat=10s ago last-failure='boom'" in line
    assert "\n" not in line
    row.pending, row.waiting_on = [], "waiting on env step (turn 3 on box1)"
    assert ops.format_stuck(row, now=5000.0).endswith("(waiting on env step (turn 3 on box1))")


def test_top_counts_by_replica_and_phase() -> None:
    rows = [("generate", "a"), ("generate", "a"), ("env", "a"), ("queued", "b"), ("weird", "b")]
    assert top.tally(rows) == {"a": Counter(generate=2, env=1), "b": Counter(queued=1, weird=1)}
    progress = RunProgress(
        run_id="exp1", total_groups=2, groups_done=0, groups_inflight=2, rollouts_total=8,
        outcomes={"completed": 3}, segment=0, done=False,
    )  # fmt: skip
    console = Console(record=True, width=120)
    console.print(top.render_top("exp1", rows, progress, stuck=1, stuck_s=60))
    text = console.export_text()
    title = " ".join(text.split("┏")[0].split())  # the title wraps to the table's width
    assert title == "run exp1: 5 in flight, 3/8 done, 1 without progress for 1m00s"
    header = next(line for line in text.splitlines() if "replica" in line)
    assert header.index("queued") < header.index("generate") < header.index("env") < header.index("weird")
    assert any(line.split("│")[1].strip() == "all" for line in text.splitlines() if "│" in line)


def test_progress_upserts_are_rate_bounded() -> None:
    # Progress every second for a minute: indexed at most once per interval (first at once).
    upserts, last = [], None
    for t in range(61):
        if sa.progress_due(last, float(t)):
            upserts.append(t)
            last = float(t)
    assert upserts == list(range(0, 61, int(sa.PROGRESS_INDEX_INTERVAL_S)))
    assert sa.progress_due(None, 0.0) and not sa.progress_due(10.0, 14.9) and sa.progress_due(10.0, 15.0)


def test_search_attribute_definitions_fit_the_dev_server() -> None:
    assert sa.DEFINITIONS["RolloutProgressAt"] == "Datetime"
    assert sa.DEFINITIONS["RolloutAttempt"] == sa.DEFINITIONS["RolloutTurn"] == "Int"
    assert sa.DEFINITIONS["RolloutEngine"] == sa.DEFINITIONS["RolloutSandboxHost"] == "Keyword"
    kinds = Counter(sa.DEFINITIONS.values())
    assert kinds["Keyword"] <= 10 and kinds["Int"] <= 3 and kinds["Datetime"] <= 3  # SQLite visibility


@pytest.mark.parametrize(
    ("reason", "key"),
    [
        ("infra: EngineUnavailable: http://e:8000 refused after 5 attempts", "infra: EngineUnavailable"),
        ("environment: EnvironmentFailure: setup 'pip' failed", "environment: EnvironmentFailure"),
        ("infra: child workflow TerminatedError: Terminated", "infra: child workflow TerminatedError"),
        ("max_turns", "max_turns"),
        ("manual-retry", "manual-retry"),
    ],
)
def test_reason_keys_drop_the_message(reason: str, key: str) -> None:
    assert sa.reason_key(reason) == key


def test_slot_ids() -> None:
    assert slot_of("exp1/g000001/3") == (3, 0)
    assert slot_of("exp1/g000001/3r2") == (3, 2)


def test_a_group_closes_over_every_attempt_with_its_full_size() -> None:
    done, cancelled = Outcome.COMPLETED, Outcome.CANCELLED
    attempts = [
        RolloutResult(rollout_id="r/g/1", sample_index=1, outcome=cancelled, reason="manual-retry"),
        RolloutResult(rollout_id="r/g/0", sample_index=0, outcome=done, reward=1.0, scorable=True),
        RolloutResult(rollout_id="r/g/1r1", sample_index=1, outcome=done, reward=0.0, scorable=True),
        RolloutResult(
            rollout_id="r/g/2", sample_index=2, outcome=cancelled, reason="admission", wasted_tokens=7
        ),
    ]
    record, adv = close_group("r", "g", "t", 3, attempts, 1e-6)
    assert record.size == 3 and record.scorable == 2 and record.outcomes == {"cancelled": 2, "completed": 2}
    assert (record.admission_cancelled, record.wasted_tokens) == (1, 7)
    assert adv["r/g/1"] is None and adv["r/g/0"] is not None and adv["r/g/0"] > 0 > (adv["r/g/1r1"] or 0)


def test_sandbox_create_results_of_older_histories_still_decode() -> None:
    assert SandboxCreated.model_validate(True) == SandboxCreated(created=True, host=None)
    assert SandboxCreated.model_validate({"created": True, "host": "box1"}).host == "box1"


def test_the_manual_actions_log_is_a_versioned_schema_change(tmp_path: Path) -> None:
    import sqlite3

    old = sqlite3.connect(tmp_path / "store.sqlite")  # a store from before the log: user_version 0
    old.execute("CREATE TABLE runs (run_id TEXT PRIMARY KEY)")
    old.close()
    store = RunStore(tmp_path)
    assert store.schema_version() == SCHEMA_VERSION >= 1
    assert store.put_manual_action("exp1", "exp1/g000000/0", "cancel", "manual", {"group": "g000000"}) == 1
    store.put_manual_action("exp1", "exp1/g000001", "terminate", "manual", {"members": ["a"]})
    store.put_manual_action("other", "other/g000000/0", "retry", "manual-retry", {})
    again = RunStore(tmp_path)  # reopening migrates nothing twice
    assert again.schema_version() == SCHEMA_VERSION
    log = again.manual_actions("exp1")
    assert [(a["seq"], a["action"], a["target"]) for a in log] == [
        (1, "cancel", "exp1/g000000/0"),
        (2, "terminate", "exp1/g000001"),
    ]
    assert log[1]["detail"] == {"members": ["a"]} and log[0]["reason"] == "manual" and log[0]["at"] > 0
