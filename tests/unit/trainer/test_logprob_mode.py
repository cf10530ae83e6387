"""Mislabelling is a fault too: the trainer feed refuses, at consumption, groups whose records declare a
logprobs mode the trainer did not ask for, and counts the reason in its books."""

from __future__ import annotations

import json
from pathlib import Path

from durable_rollouts.store.runstore import RunStore
from durable_rollouts.trainer.feed import TrainerFeed
from tests.unit.trainer.test_feed import RUN, publish, put_group, put_member


def _declare(store: RunStore, gid: str, mode: str) -> None:
    with store._tx() as db:
        db.execute(
            "UPDATE rollouts SET sampling_json=? WHERE group_id=?", (json.dumps({"logprob_mode": mode}), gid)
        )


def test_groups_declaring_another_logprobs_mode_are_discarded_with_the_reason(tmp_path: Path) -> None:
    store = RunStore(tmp_path)
    publish(store, "v0")
    for gid, mode in (("g000000", "processed_logprobs"), ("g000001", "raw_logprobs")):
        for k in range(2):
            put_member(store, gid, k, [["v0", "v0"]], "t")
        put_group(store, gid, 2, "t", zero_variance=False)
        _declare(store, gid, mode)
    feed = TrainerFeed(store, RUN)
    batch = feed.take(10, "v0", max_lag=0, logprob_mode="processed_logprobs")
    assert [g.group["group_id"] for g in batch.groups] == ["g000000"]
    [d] = batch.discarded
    assert d.group_id == "g000001"
    assert d.reason == "logprob_mode: raw_logprobs, the trainer asked for processed_logprobs"
    ledger = feed.ledger()
    assert ledger.balanced and ledger.discarded.records == 2 and ledger.consumed.records == 2
    assert feed.discard_report()["by_reason"] == {d.reason: 2}


def test_without_a_mode_asked_the_feed_does_not_judge_it(tmp_path: Path) -> None:
    store = RunStore(tmp_path)
    publish(store, "v0")
    put_member(store, "g000000", 0, [["v0"]], "t")
    put_group(store, "g000000", 1, "t", zero_variance=False)
    _declare(store, "g000000", "raw_logprobs")
    assert len(TrainerFeed(store, RUN).take(10, "v0", max_lag=0).groups) == 1
