"""The ledger's notion of a run cancelled as a whole (store status ``cancelled``): the groups it started
are held to every rule, the groups it never started are no violation, and it need not have a success."""

from __future__ import annotations

import json
from pathlib import Path

from durable_rollouts.faults import check_store
from durable_rollouts.store import RunStore

RUN = "cancelled-run"


def _record(store: RunStore, gid: str, i: int, outcome: str, reward: float | None = None) -> None:
    reason = "run-cancelled" if outcome == "cancelled" else None
    store.put_rollout({
        "rollout_id": f"{RUN}/{gid}/{i}", "run_id": RUN, "group_id": gid, "task_id": "t",
        "sample_index": i, "env": "math", "outcome": outcome, "reason": reason, "reward": reward,
        "scorable": int(reward is not None), "advantage": None, "prompt_length": 1, "num_tokens": 2,
        "sampling_json": "{}", "extra_json": "{}",
    })  # fmt: skip


def _group(store: RunStore, gid: str, scorable: int) -> None:
    rec = {"run_id": RUN, "group_id": gid, "task_id": "t", "size": 2, "scorable": scorable, "failed": 0}
    store.put_group(RUN, gid, "t", rec)


def _run(tmp_path: Path) -> RunStore:
    """Four groups of two; group 0 closed with both members cancelled, groups 1-3 never started."""
    store = RunStore(tmp_path)
    store.register_run(RUN, json.dumps({"run": {"num_groups": 4, "group_size": 2}}), "h")
    _record(store, "g000000", 0, "cancelled")
    _record(store, "g000000", 1, "cancelled")
    _group(store, "g000000", scorable=0)
    return store


def test_a_cancelled_run_is_checked_on_the_groups_it_started_and_needs_no_success(tmp_path: Path) -> None:
    store = _run(tmp_path)
    rules = sorted(v.rule for v in check_store(store, RUN).violations)
    assert rules == ["missing-group"] * 3 + ["missing-record"] * 6 + ["no-success"]  # not cancelled yet
    store.finish_run(RUN, "cancelled")
    report = check_store(store, RUN)
    assert report.ok, report.lines()
    assert (report.groups, report.rollouts, report.successes) == (1, 2, 0)


def test_a_started_group_of_a_cancelled_run_still_owes_every_record(tmp_path: Path) -> None:
    store = _run(tmp_path)
    _record(store, "g000001", 0, "completed", reward=1.0)  # started: a member recorded, no group record
    store.finish_run(RUN, "cancelled")
    lines = [v.line for v in check_store(store, RUN).violations]
    assert lines == [
        "missing-group: group g000001 has no record",
        f"missing-record: slot {RUN}/g000001/1 has no record",
    ], lines
