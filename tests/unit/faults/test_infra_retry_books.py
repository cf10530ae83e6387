"""The books of infra retries, on a real run store: a slot's failed (infra) attempt marked superseded by the
next is no duplicate to the ledger, an unmarked one is; an unscorable group's members are stored not
scorable and the trainer feed discards the group (reason unscorable) with its books balanced; a stopped run
is held to the rules of a cancelled one. The store writes are those ``finalize_group`` makes, driven by the
group's own close (``workflows.group.close_group`` and ``finalize_input``)."""

from __future__ import annotations

import json
from pathlib import Path

from durable_rollouts.contracts.types import Outcome, RolloutResult
from durable_rollouts.faults import check_store
from durable_rollouts.records.export import group_record, rollout_record
from durable_rollouts.store import RunStore
from durable_rollouts.trainer.feed import TrainerFeed
from durable_rollouts.workflows.group import close_group, finalize_input

RUN = "retried"
INFRA = "infra: EngineUnavailable: connection refused"


def _attempt(
    store: RunStore, gid: str, rid: str, i: int, outcome: Outcome, reward: float | None
) -> RolloutResult:
    reason = INFRA if outcome == Outcome.FAILED else None
    store.put_rollout({
        "rollout_id": f"{RUN}/{gid}/{rid}", "run_id": RUN, "group_id": gid, "task_id": "t",
        "sample_index": i, "env": "math", "outcome": outcome.value, "reason": reason, "reward": reward,
        "scorable": int(reward is not None), "advantage": None, "prompt_length": 1, "num_tokens": 2,
        "sampling_json": json.dumps({"logprob_mode": "processed_logprobs"}), "extra_json": "{}",
    })  # fmt: skip
    return RolloutResult(
        rollout_id=f"{RUN}/{gid}/{rid}", sample_index=i, outcome=outcome, reason=reason, reward=reward,
        scorable=reward is not None,
    )  # fmt: skip


def _group(store: RunStore, gid: str, on_infra_failure: str, mark: bool = True) -> None:
    """Group ``gid`` of 2: slot 0 completed; slot 1 failed (infra), then ran again and completed, or (for
    ``fail-group``) failed again."""
    attempts = [
        _attempt(store, gid, "0", 0, Outcome.COMPLETED, 1.0),
        _attempt(store, gid, "1", 1, Outcome.FAILED, None),
        _attempt(store, gid, "1r1", 1, *((Outcome.FAILED, None) if on_infra_failure == "fail-group"
                                         else (Outcome.COMPLETED, 0.0))),
    ]  # fmt: skip
    record, advantages = close_group(RUN, gid, "t", 2, attempts, 1e-6, on_infra_failure)
    closing = finalize_input(record, advantages, attempts)
    store.set_advantages(closing.advantages)
    if mark:
        store.mark_members(closing.superseded, closing.unscorable)
        store.mark_members(closing.superseded, closing.unscorable)  # a retried activity: same rows
    store.put_group(RUN, gid, "t", record.model_dump(mode="json"))


def _store(tmp_path: Path, groups: int = 2) -> RunStore:
    store = RunStore(tmp_path)
    store.register_run(RUN, json.dumps({"run": {"num_groups": groups, "group_size": 2}}), "h")
    return store


def test_a_superseded_attempt_is_no_duplicate_and_the_exports_say_so(tmp_path: Path) -> None:
    store = _store(tmp_path)
    _group(store, "g000000", "exclude")
    _group(store, "g000001", "fail-group")
    report = check_store(store, RUN)
    assert report.ok, report.lines()
    first = store.rollout(f"{RUN}/g000000/1")
    assert first is not None and json.loads(first["extra_json"]) == {"superseded_by": f"{RUN}/g000000/1r1"}
    assert rollout_record(store, first)["superseded_by"] == f"{RUN}/g000000/1r1"
    last = store.rollout(f"{RUN}/g000000/1r1")
    assert last is not None and "superseded_by" not in rollout_record(store, last)
    kept = group_record(store.group(RUN, "g000000") or {})
    assert (kept["scorable"], kept["failed"], kept["superseded"], kept["unscorable_reason"]) == (
        2,
        1,
        1,
        None,
    )


def test_an_unmarked_earlier_failure_is_a_duplicate(tmp_path: Path) -> None:
    store = _store(tmp_path, groups=1)
    _group(store, "g000000", "exclude", mark=False)
    lines = [v.line for v in check_store(store, RUN).violations]
    assert lines == [f"duplicate: {RUN}/g000000/1 is failed but slot 1 ran again"], lines


def test_an_unscorable_group_is_discarded_by_the_feed_and_the_books_balance(tmp_path: Path) -> None:
    store = _store(tmp_path)
    _group(store, "g000000", "exclude")
    _group(store, "g000001", "fail-group")
    lost = group_record(store.group(RUN, "g000001") or {})
    assert lost["unscorable_reason"] == f"{RUN}/g000001/1r1: {INFRA}" and lost["scorable"] == 0
    members = store.rollouts(RUN, "g000001")
    assert [r["scorable"] for r in members] == [0, 0, 0] and {r["advantage"] for r in members} == {None}
    assert check_store(store, RUN).ok  # the completed member keeps its reward, out of every comparison
    store.put_policy("v0", "h0", "/w", [])
    store.finish_policy("v0", [])
    feed = TrainerFeed(store, RUN)
    batch = feed.take(10, "v0", max_lag=0)
    assert [g.group_id for g in batch.groups] == ["g000000"]
    assert [(d.group_id, d.reason, d.records) for d in batch.discarded] == [
        ("g000001", f"unscorable: {RUN}/g000001/1r1: {INFRA}", 3)
    ]
    ledger = feed.ledger().check()
    assert ledger.generated.records == 6 and ledger.waiting.records == 0


def test_a_stopped_run_is_checked_like_a_cancelled_one(tmp_path: Path) -> None:
    store = _store(tmp_path, groups=3)
    _group(store, "g000000", "exclude")
    rules = sorted(v.rule for v in check_store(store, RUN).violations)
    assert rules == ["missing-group"] * 2 + ["missing-record"] * 4
    store.finish_run(RUN, "stopped")
    assert check_store(store, RUN).ok
