"""Trainer feed: the books balance under any interleaving; stale groups go at take time, each group once.

The property test drives a real RunStore (temp dir) through its public write methods with random
interleavings of: generating a group (random size, lengths, versions, some members late), a member arriving
late, publishing a version, taking a batch (random n, max_lag, current version, zero-variance filter) and
restarting the feed on a fresh store handle. A plain model of the same events predicts every take.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from durable_rollouts.store.runstore import RunStore, Segment
from durable_rollouts.trainer.feed import Count, FeedError, TrainerFeed

RUN = "run"


# -- factories ------------------------------------------------------------------------------------------
def put_member(store: RunStore, gid: str, k: int, turns: list[list[str | None]], task: str) -> int:
    """Write one finalized rollout: a 3-token prompt, then per turn sampled tokens (one version each) and a
    2-token observation. Returns its sampled tokens."""
    rid = f"{RUN}/{gid}/{k}"
    store.put_segment(rid, Segment(name="prompt", kind="prompt", turn=None, start=0, token_ids=[1, 2, 3]))
    pos = 3
    for t, versions in enumerate(turns):
        ids = list(range(len(versions)))
        lps = [-0.5] * len(ids)
        store.put_segment(rid, Segment(name=f"t{t:05d}.model", kind="model", turn=t, start=pos, token_ids=ids,
                                       logprobs=lps, policy_versions=versions))  # fmt: skip
        pos += len(ids)
        store.put_segment(
            rid, Segment(name=f"t{t:05d}.obs", kind="observation", turn=t, start=pos, token_ids=[7, 8])
        )
        pos += 2
    store.put_rollout(
        {
            "rollout_id": rid, "run_id": RUN, "group_id": gid, "task_id": task, "sample_index": k,
            "env": "math", "outcome": "completed", "reason": None, "reward": float(k % 2), "scorable": 1,
            "advantage": None, "prompt_length": 3, "num_tokens": pos, "sampling_json": "{}",
            "extra_json": json.dumps({}),
        }
    )  # fmt: skip
    return sum(len(v) for v in turns)


def put_group(store: RunStore, gid: str, size: int, task: str, zero_variance: bool) -> None:
    record = {
        "run_id": RUN, "group_id": gid, "task_id": task, "size": size, "scorable": size, "failed": 0,
        "reward_mean": 0.5, "reward_std": 0.0 if zero_variance else 0.5, "zero_variance": zero_variance,
        "outcomes": {"completed": size},
    }  # fmt: skip
    store.put_group(RUN, gid, task, record)


def publish(store: RunStore, version: str) -> None:
    store.put_policy(version, f"hash-{version}", f"/weights/{version}", ["http://e"])
    store.finish_policy(version, ["http://e"])


# -- the model --------------------------------------------------------------------------------------------
@dataclass
class GroupModel:
    gid: str
    size: int
    task: str
    zero_variance: bool
    members: list[list[list[str | None]]]  # member -> turn -> per-token versions
    written: int = 0
    state: str = "waiting"  # waiting, consumed, discarded
    reason: str | None = None

    @property
    def complete(self) -> bool:
        return self.written == self.size

    def tokens(self, upto: int | None = None) -> int:
        return sum(len(v) for m in self.members[: self.written if upto is None else upto] for v in m)

    def versions(self) -> set[str | None]:
        return {v for m in self.members for turn in m for v in turn}


@dataclass
class Model:
    published: list[str] = field(default_factory=list)
    groups: dict[str, GroupModel] = field(default_factory=dict)

    def verdict(self, g: GroupModel, current: str, max_lag: int, drop_zv: bool) -> tuple[str, str | None]:
        """('wait' | 'discard' | 'fresh', reason) exactly as the feed's contract states it."""
        vs = g.versions()
        if None in vs:
            return "discard", "stale: unversioned tokens"
        if any(v not in self.published for v in vs):
            return "discard", "stale: unknown version"
        lags = [self.published.index(current) - self.published.index(v) for v in vs]
        if lags and min(lags) < 0:
            return "wait", None
        lag = max(lags, default=0)
        if lag > max_lag:
            return "discard", f"stale: lag {lag} > max_lag {max_lag}"
        if drop_zv and g.zero_variance:
            return "discard", "zero_variance"
        return "fresh", None

    def count(self, state: str | None = None) -> Count:
        out = Count()
        for g in self.groups.values():
            if state is None or g.state == state:
                out += Count(g.written, g.tokens())
        return out


class FeedMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="feed-"))
        self.store = RunStore(self.root)
        self.feed = TrainerFeed(self.store, RUN)
        self.model = Model()
        self.consumed_ever: list[str] = []
        self._publish()

    def teardown(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def _publish(self) -> None:
        version = f"v{len(self.model.published)}"
        publish(self.store, version)
        self.model.published.append(version)

    def _turn(self, n: int, how: str, rnd: st.DataObject) -> list[str | None]:
        pub = self.model.published
        if how == "none":
            return [None] * n
        if how == "unknown":
            return ["ghost"] * n
        latest = pub[-1]
        if how == "latest":
            return [latest] * n
        older = pub[rnd.draw(st.integers(0, len(pub) - 1))]
        if how == "older":
            return [older] * n
        cut = rnd.draw(st.integers(0, n))  # a publish in the middle of the turn: two spans
        return [older] * cut + [latest] * (n - cut)

    @rule(
        data=st.data(),
        size=st.integers(1, 4),
        late=st.integers(0, 4),
        record_first=st.booleans(),
        zero_variance=st.booleans(),
        task=st.sampled_from(["add-small", "add-big", "code"]),
    )
    def generate_group(
        self, data: st.DataObject, size: int, late: int, record_first: bool, zero_variance: bool, task: str
    ) -> None:
        gid = f"g{len(self.model.groups):06d}"
        flavor = data.draw(
            st.sampled_from(["latest"] * 4 + ["older"] * 2 + ["split"] * 2 + ["unknown", "none"])
        )
        how = st.sampled_from(["latest", flavor])
        members = []
        for _ in range(size):
            turns = data.draw(st.lists(st.tuples(st.integers(0, 9), how), min_size=0, max_size=3))
            members.append([self._turn(n, how, data) for n, how in turns])
        g = GroupModel(gid, size, task, zero_variance, members)
        self.model.groups[gid] = g
        if record_first:  # a group record ahead of its last members must not make the group complete
            put_group(self.store, g.gid, g.size, g.task, g.zero_variance)
        self._write_members(g, size - min(late, size))

    def _write_members(self, g: GroupModel, upto: int) -> None:
        for k in range(g.written, upto):
            put_member(self.store, g.gid, k, g.members[k], g.task)
        g.written = max(g.written, upto)
        if g.complete:
            put_group(self.store, g.gid, g.size, g.task, g.zero_variance)

    @precondition(lambda self: any(not g.complete for g in self.model.groups.values()))
    @rule(data=st.data())
    def late_member_arrives(self, data: st.DataObject) -> None:
        late = sorted(gid for gid, g in self.model.groups.items() if not g.complete)
        g = self.model.groups[data.draw(st.sampled_from(late))]
        self._write_members(g, data.draw(st.integers(g.written + 1, g.size)))

    @rule()
    def publish_version(self) -> None:
        self._publish()

    @rule()
    def restart_feed(self) -> None:
        self.store = RunStore(self.root)
        self.feed = TrainerFeed(self.store, RUN)

    @rule(data=st.data(), n=st.integers(0, 4), max_lag=st.integers(0, 3), drop_zv=st.booleans())
    def take(self, data: st.DataObject, n: int, max_lag: int, drop_zv: bool) -> None:
        pub = self.model.published
        current = data.draw(st.sampled_from([pub[-1], pub[-1], pub[max(0, len(pub) - 2)], pub[0]]))
        expected_fresh, expected_discard = [], {}
        for gid in sorted(self.model.groups):
            g = self.model.groups[gid]
            if g.state != "waiting" or not g.complete:
                continue
            verdict, reason = self.model.verdict(g, current, max_lag, drop_zv)
            if verdict == "discard":
                expected_discard[gid] = reason
            elif verdict == "fresh" and len(expected_fresh) < n:
                expected_fresh.append(gid)
        batch = self.feed.take(n, current, max_lag, drop_zero_variance=drop_zv)
        for what, hit in (
            ("consumed", bool(expected_fresh)),
            ("discarded stale", any(r.startswith("stale") for r in expected_discard.values())),
            ("discarded zero_variance", "zero_variance" in expected_discard.values()),
        ):
            event(f"take {what}: {hit}")
        got_fresh = [g.group_id for g in batch.groups]
        assert got_fresh == expected_fresh
        assert {d.group_id: d.reason.split(" ghost")[0] for d in batch.discarded} == expected_discard
        assert not set(got_fresh) & set(self.consumed_ever), "a group was consumed twice"
        self.consumed_ever += got_fresh
        for fg in batch.groups:
            g = self.model.groups[fg.group_id]
            assert len(fg.rollouts) == g.size and fg.lag <= max_lag
            assert all(len(r["token_ids"]) == len(r["policy_versions"]) for r in fg.rollouts)
            g.state = "consumed"
        for d in batch.discarded:
            self.model.groups[d.group_id].state, self.model.groups[d.group_id].reason = "discarded", d.reason
        assert batch.count == Count(sum(len(g.rollouts) for g in batch.groups), sum(
            self.model.groups[g].tokens() for g in got_fresh))  # fmt: skip

    @invariant()
    def books_balance_and_match_the_model(self) -> None:
        led = self.feed.ledger().check()
        assert led.generated == self.model.count()
        assert led.consumed == self.model.count("consumed")
        assert led.discarded == self.model.count("discarded")
        assert led.waiting == self.model.count("waiting")

    @invariant()
    def only_complete_groups_leave_waiting(self) -> None:
        marks = self.store.feed_marks(RUN)
        for gid, g in self.model.groups.items():
            assert (gid in marks) == (g.state != "waiting")
            if not g.complete:
                assert g.state == "waiting", "an incomplete group was dropped or consumed"


FeedMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_feed_state_machine = FeedMachine.TestCase


# -- plain examples -------------------------------------------------------------------------------------
def test_a_late_long_group_waits_for_the_next_batch_instead_of_being_dropped(tmp_path: Path) -> None:
    store = RunStore(tmp_path)
    publish(store, "v0")
    feed = TrainerFeed(store, RUN)
    put_member(store, "g000000", 0, [["v0"] * 50], "long")  # one member of a long group still running
    for i in (1, 2):
        put_member(store, f"g00000{i}", 0, [["v0"] * 3], "short")
        put_group(store, f"g00000{i}", 1, "short", zero_variance=False)
    first = feed.take(1, "v0", max_lag=1)
    assert [g.group_id for g in first.groups] == ["g000001"]  # g000002 is fresh but over-provisioned
    put_member(store, "g000000", 1, [["v0"] * 60], "long")
    put_group(store, "g000000", 2, "long", zero_variance=False)
    second = feed.take(5, "v0", max_lag=1)
    assert [g.group_id for g in second.groups] == ["g000000", "g000002"]  # oldest group first
    assert feed.ledger().check().consumed == Count(4, 116)


def test_stale_groups_are_discarded_at_take_time_with_a_reason_and_reported(tmp_path: Path) -> None:
    store = RunStore(tmp_path)
    feed = TrainerFeed(store, RUN)
    for v in ("v0", "v1", "v2"):
        publish(store, v)
    put_member(store, "g000000", 0, [["v0"] * 40], "add-big")
    put_group(store, "g000000", 1, "add-big", zero_variance=False)
    put_member(store, "g000001", 0, [["v1"] * 2 + ["v2"] * 3], "add-small")  # spans an update
    put_group(store, "g000001", 1, "add-small", zero_variance=False)
    assert feed.ledger().waiting == Count(2, 45)  # nothing is judged at admission
    batch = feed.take(4, "v2", max_lag=1)
    assert [g.group_id for g in batch.groups] == ["g000001"] and batch.groups[0].lag == 1
    assert batch.groups[0].versions == ["v1", "v2"]
    assert [(d.group_id, d.reason) for d in batch.discarded] == [("g000000", "stale: lag 2 > max_lag 1")]
    report = feed.discard_report()
    assert report["by_reason"] == {"stale: lag 2 > max_lag 1": 1}
    assert report["by_task"]["add-big"] == {"discarded": 1, "generated": 1}
    assert report["by_length"]["<=64"] == {"discarded": 1, "generated": 1}
    assert report["mean_length"]["discarded"] == 40


def test_a_restarted_feed_does_not_consume_again_and_can_reread_its_batch(tmp_path: Path) -> None:
    store = RunStore(tmp_path)
    publish(store, "v0")
    put_member(store, "g000000", 0, [["v0"] * 4], "t")
    put_group(store, "g000000", 1, "t", zero_variance=False)
    batch = TrainerFeed(store, RUN).take(3, "v0", max_lag=0)
    again = TrainerFeed(RunStore(tmp_path), RUN)
    assert again.take(3, "v0", max_lag=0).groups == []
    lines = again.batch(batch.batch_id or "")
    assert [ln["kind"] for ln in lines] == ["rollout", "group"] and lines == batch.lines()


def test_an_unpublished_current_version_is_refused(tmp_path: Path) -> None:
    store = RunStore(tmp_path)
    publish(store, "v0")
    with pytest.raises(FeedError, match="never published"):
        TrainerFeed(store, RUN).take(1, "v9", max_lag=0)


def test_books_that_do_not_balance_are_reported(tmp_path: Path) -> None:
    store = RunStore(tmp_path)
    publish(store, "v0")
    feed = TrainerFeed(store, RUN)
    put_member(store, "g000000", 0, [["v0"] * 4], "t")
    put_group(store, "g000000", 1, "t", zero_variance=False)
    feed.take(1, "v0", max_lag=0)
    put_member(store, "g000000", 1, [["v0"] * 4], "t")  # a record appearing after its group was consumed
    with pytest.raises(FeedError, match="do not balance"):
        feed.ledger().check()


def test_cli_takes_a_batch_and_shows_the_books(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from durable_rollouts.cli.rollouts import app

    monkeypatch.setenv("ROLLOUTS_HOME", str(tmp_path))
    store = RunStore(tmp_path)
    store.register_run(RUN, "{}", "h")
    publish(store, "v0")
    publish(store, "v1")
    for i, version in enumerate(["v0", "v1"]):
        put_member(store, f"g00000{i}", 0, [[version] * 5], "t")
        put_group(store, f"g00000{i}", 1, "t", zero_variance=False)
    runner = CliRunner()
    out = tmp_path / "batch.jsonl"
    res = runner.invoke(
        app, ["feed", "take", RUN, "--n", "4", "--version", "v1", "--max-lag", "0", "-o", str(out)]
    )
    assert res.exit_code == 0, res.output
    assert "batch b000001: consumed 1 groups (1 records, 5 sampled tokens)" in res.output
    assert "discarded g000000: stale: lag 1 > max_lag 0" in res.output
    assert [json.loads(ln)["kind"] for ln in out.read_text().splitlines()] == ["rollout", "group"]
    res = runner.invoke(app, ["feed", "status", RUN])
    assert res.exit_code == 0 and "books balance" in res.output, res.output
    res = runner.invoke(app, ["feed", "take", RUN, "--n", "1", "--version", "v7", "--max-lag", "0"])
    assert res.exit_code == 2 and "error: current version 'v7' was never published" in res.output
    res = runner.invoke(app, ["feed", "batch", RUN, "b000001", "-o", str(tmp_path / "again.jsonl")])
    assert res.exit_code == 0 and (tmp_path / "again.jsonl").read_text() == out.read_text()
