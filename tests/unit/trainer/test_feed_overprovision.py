"""Over-provisioning on the trainer feed: batches of the first complete groups, late groups kept.

With ``run.overprovision`` the generator keeps more groups in flight than a step needs, so the short ones
complete first. These tests drive a real RunStore through the pipeline's write methods and check that the
feed takes the first complete groups, keeps the late ones for the next batch (oldest first), discards a
group only by its versions (with a counted reason), never marks a group twice, and that the books balance
after every take; the length mix of what it consumed then equals what was generated.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from durable_rollouts.store.runstore import RunStore
from durable_rollouts.trainer.feed import Count, TrainerFeed
from tests.unit.trainer.test_feed import RUN, publish, put_group, put_member


def write_group(store: RunStore, gid: str, lengths: list[int], version: str, upto: int | None = None) -> None:
    """Members ``[0, upto)`` of a group whose every token ``version`` sampled; its record once all are in."""
    for k, n in enumerate(lengths[:upto]):
        put_member(store, gid, k, [[version] * n], "t")
    if upto is None or upto >= len(lengths):
        put_group(store, gid, len(lengths), "t", zero_variance=False)


def finish_group(store: RunStore, gid: str, lengths: list[int], version: str, written: int) -> None:
    for k in range(written, len(lengths)):
        put_member(store, gid, k, [[version] * lengths[k]], "t")
    put_group(store, gid, len(lengths), "t", zero_variance=False)


def test_a_late_group_stays_for_the_next_batch_and_is_taken_before_younger_ones(tmp_path: Path) -> None:
    store = RunStore(tmp_path)
    feed = TrainerFeed(store, RUN)
    publish(store, "v0")
    # a step needs 2 groups; over-provisioned by 2, four are in flight under v0; g0 has a long member
    lengths = {"g0": [5, 90], "g1": [4, 6], "g2": [7, 3], "g3": [6, 5]}
    write_group(store, "g0", lengths["g0"], "v0", upto=1)
    for gid in ("g1", "g2", "g3"):
        write_group(store, gid, lengths[gid], "v0")
    first = feed.take(2, "v0", max_lag=1)
    assert [g.group_id for g in first.groups] == ["g1", "g2"]  # the first complete ones; g0 not awaited
    assert first.discarded == []
    ledger = feed.ledger().check()
    assert ledger.waiting == Count(2 + 1, 6 + 5 + 5)  # g3 (complete) and g0's first member wait
    publish(store, "v1")
    finish_group(store, "g0", lengths["g0"], "v0", written=1)
    write_group(store, "g4", [2, 2], "v1")
    second = feed.take(2, "v1", max_lag=1)
    assert [(g.group_id, g.lag) for g in second.groups] == [("g0", 1), ("g3", 1)]  # late, not dropped
    assert second.discarded == []
    mix = feed.length_mix()
    assert mix["consumed"]["groups"] == 4 and mix["waiting"]["groups"] == 1  # g4, for the step after
    assert mix["consumed"]["p99"] == 90  # the long member reached an update
    assert feed.ledger().check().discarded == Count()


def test_a_group_late_past_max_lag_is_discarded_by_its_version_with_a_reason(tmp_path: Path) -> None:
    store = RunStore(tmp_path)
    feed = TrainerFeed(store, RUN)
    publish(store, "v0")
    write_group(store, "g0", [3, 80], "v0", upto=1)
    write_group(store, "g1", [3, 4], "v0")
    assert [g.group_id for g in feed.take(1, "v0", max_lag=0).groups] == ["g1"]
    publish(store, "v1")
    finish_group(store, "g0", [3, 80], "v0", written=1)
    batch = feed.take(1, "v1", max_lag=0)
    assert batch.groups == []
    assert [(d.group_id, d.reason, d.records, d.tokens) for d in batch.discarded] == [
        ("g0", "stale: lag 1 > max_lag 0", 2, 83)
    ]
    mix = feed.length_mix()
    assert mix["discarded"] == {"groups": 1, "rollouts": 2, "mean": 41.5, "p50": 3, "p90": 80, "p99": 80}
    assert feed.ledger().check().discarded == Count(2, 83)


def test_length_mix_reports_nearest_rank_percentiles_per_state(tmp_path: Path) -> None:
    store = RunStore(tmp_path)
    feed = TrainerFeed(store, RUN)
    publish(store, "v0")
    write_group(store, "g0", list(range(1, 11)), "v0")  # 1..10 tokens
    write_group(store, "g1", [100, 100], "v0", upto=1)
    empty = feed.length_mix()
    assert empty["consumed"] == {"groups": 0, "rollouts": 0, **dict.fromkeys(("mean", "p50", "p90", "p99"))}
    feed.take(1, "v0", max_lag=0)
    mix = feed.length_mix()
    assert mix["consumed"] == {"groups": 1, "rollouts": 10, "mean": 5.5, "p50": 5, "p90": 9, "p99": 10}
    assert mix["waiting"] == {"groups": 1, "rollouts": 1, "mean": 100.0, "p50": 100, "p90": 100, "p99": 100}
    assert mix["generated"]["rollouts"] == 11 and mix["generated"]["p90"] == 10


lengths_st = st.lists(st.integers(1, 40), min_size=2, max_size=2)


@settings(max_examples=30, deadline=None)
@given(
    batch=st.integers(1, 3),
    extra=st.integers(0, 3),
    steps=st.integers(1, 4),
    max_lag=st.integers(0, 2),
    draws=st.lists(lengths_st, min_size=40, max_size=40),
)
def test_over_provisioned_steps_balance_the_books_and_drop_nothing_for_being_late(
    batch: int, extra: int, steps: int, max_lag: int, draws: list[list[int]]
) -> None:
    """Each step keeps ``batch + extra`` groups outstanding, completes the shortest first (as a fleet
    does) until ``batch`` are complete, and takes ``batch``. Then the run ends: everything completes and the
    feed is drained."""
    root = Path(tempfile.mkdtemp(prefix="feed-over-"))
    try:
        store = RunStore(root)
        feed = TrainerFeed(store, RUN)
        born: dict[str, int] = {}  # group -> index of the version that sampled it
        lengths: dict[str, list[int]] = {}
        open_: dict[str, int] = {}  # incomplete group -> members written
        marked: dict[str, str] = {}  # group -> consumed | discarded
        published = 0
        publish(store, "v0")

        def take(n: int) -> None:
            current = published
            complete = sorted(g for g in lengths if g not in open_ and g not in marked)
            fresh = [g for g in complete if current - born[g] <= max_lag]
            b = feed.take(n, f"v{current}", max_lag)
            got = [g.group_id for g in b.groups]
            assert got == fresh[:n]  # the oldest of the first complete groups, up to n
            assert sorted(d.group_id for d in b.discarded) == [g for g in complete if g not in fresh]
            for d in b.discarded:
                assert d.reason == f"stale: lag {current - born[d.group_id]} > max_lag {max_lag}"
            for gid in got + [d.group_id for d in b.discarded]:
                assert gid not in marked  # each group leaves "waiting" once
                marked[gid] = "consumed" if gid in got else "discarded"
            feed.ledger().check()

        for _ in range(steps):
            outstanding = [g for g in lengths if g not in marked]
            for _ in range(batch + extra - len(outstanding)):
                gid = f"g{len(lengths):04d}"
                lengths[gid], born[gid] = draws[len(lengths) % len(draws)], published
                write_group(store, gid, lengths[gid], f"v{published}", upto=1)
                open_[gid] = 1
            while sum(1 for g in lengths if g not in open_ and g not in marked) < batch and open_:
                gid = min(open_, key=lambda g: (max(lengths[g]), g))  # the shortest finishes first
                finish_group(store, gid, lengths[gid], f"v{born[gid]}", open_.pop(gid))
            take(batch)
            published += 1
            publish(store, f"v{published}")
        for gid in sorted(open_):
            finish_group(store, gid, lengths[gid], f"v{born[gid]}", open_.pop(gid))
        take(len(lengths))
        assert set(marked) == set(lengths)  # every group ended once: consumed or discarded, none waiting
        ledger = feed.ledger().check()
        assert ledger.waiting == Count()
        stale = {g for g, m in marked.items() if m == "discarded"}
        assert all(published - born[g] > max_lag for g in stale)  # only ever by version, never by lateness
        mix = feed.length_mix()
        if not stale:  # all consumed: the batches' length mix is the generated one, not skewed short
            assert mix["consumed"] == mix["generated"]
    finally:
        shutil.rmtree(root, ignore_errors=True)
