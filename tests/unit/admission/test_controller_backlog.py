"""Rule O of the admission controller (admission/backlog.py), on recorded traces 5 s apart.

A trace here is what a run records per poll: one engine's reading (KV usage low throughout, so the engine
rules alone keep growing the cap: the probe preset's ramp doubles a binding cap every poll), the rollouts in
flight (as many as the cap), how many ended since the previous poll, and the run's task queue backlog.
"""

from __future__ import annotations

from durable_rollouts.admission.backlog import CAUSE
from durable_rollouts.admission.controller import AdmissionController, Decision, QueueBacklog
from tests.unit.admission.test_controller_probe import cfg, flight, reading


class Trace:
    """One engine at 10 % KV usage, polls 5 s apart, the cap's worth of rollouts in flight."""

    def __init__(self, **overrides) -> None:
        self.ctl = AdmissionController(cfg(**overrides))
        self.t, self.tokens = 0.0, 0.0
        self.log: list[Decision] = []

    def poll(self, ended: int, age_s: float | None, reported: bool = True) -> Decision:
        """One poll: ``ended`` rollouts ended since the last, the backlog's age (None: not read)."""
        if self.t > 0:
            self.tokens += 500.0
        backlog = None
        if age_s is not None:
            backlog = QueueBacklog(
                task_queue="q", at=self.t, reported=reported, count=int(age_s * 10), age_s=age_s
            )
        cap = self.ctl.state.cap or 10
        d = self.ctl.step(
            self.t, [reading(self.t, self.tokens, usage=0.1)], flight(cap), ended, ended * 500.0, backlog
        )
        self.t += 5.0
        self.log.append(d)
        return d

    def reasons(self) -> list[str]:
        return [r for d in self.log for r in d.reasons if r.startswith(CAUSE)]


def test_without_a_backlog_the_engine_rules_grow_the_cap_every_poll() -> None:
    # the baseline the other traces depart from: at 10 % KV the ramp doubles a binding cap each poll
    tr = Trace()
    caps = [tr.poll(ended=2, age_s=0.0).cap for _ in range(4)]
    assert caps == [20, 40, 80, 160]
    assert all(d.kv_cap == d.cap for d in tr.log) and tr.reasons() == []


def test_a_high_backlog_reverts_a_larger_cap_that_accepts_no_more_rollouts_per_second() -> None:
    tr = Trace()
    # a steady 5 s backlog; 2 rollouts end per poll whatever the cap: more admitted only wait longer
    first = [tr.poll(ended=2, age_s=5.0) for _ in range(6)]
    # held at 10 until its rate is measured: 2 polls and one turnover (10 ended, at 0.4/s after 25 s);
    # then one step up, to learn what 20 gives
    assert [d.cap for d in first] == [10, 10, 10, 10, 10, 20]
    assert [d.kv_cap for d in first] == [20] * 6
    assert "hold cap 10 (engine rules: 20) until its accepted rate is measured" in first[0].reasons[-1]
    assert "wait 5.0 s > 1.0 s" in first[0].reasons[-1]  # no rate yet: the threshold is the 1 s floor
    later = [tr.poll(ended=2, age_s=5.0) for _ in range(14)]
    # 20 is held until it turned over (10 polls: 20 in flight, 2 end per poll), then judged: 0.40/s, no
    # gain over 10's, so back to 10, a ceiling the engine rules (who would double it every poll) stay under
    assert [d.cap for d in later] == [20] * 9 + [10] * 5
    assert all(d.kv_cap == 40 for d in later[:10]) and all(d.kv_cap == 20 for d in later[10:])
    judged = [r for r in tr.reasons() if "/s at cap" in r]
    # the threshold is 5 % of the 50 s lifetime (20 in flight / 0.4 per s)
    assert judged[0] == (
        f"{CAUSE}: revert cap 20 -> 10 (engine rules: 40); accepted 0.40/s at cap 20 vs 0.40/s at cap 10,"
        " needed +50%; workflow tasks wait 5.0 s > 2.5 s (queue backlog 50, age 5.0 s)"
    )
    assert all(d.cancel == [] for d in tr.log)  # nothing cancelled: the excess finishes
    assert tr.ctl.state.backlog_ceiling == 10


def test_a_larger_cap_must_raise_the_accepted_rate_in_proportion_to_its_growth() -> None:
    # 10 -> 20 (x2) must raise the accepted rate by more than 50 % (backlog_gain_share 0.5)
    def run(ended_at_larger: int) -> list[int]:
        tr = Trace()
        caps = []
        for _ in range(24):
            cap = tr.ctl.state.cap or 10
            caps.append(tr.poll(ended=4 if cap == 10 else ended_at_larger, age_s=5.0).cap)
        return caps

    # +25 % (1.0/s at 20 vs 0.8/s at 10): each rollout would live 1.6 x as long for it; back to 10, and
    # 20 is probed again once the ceiling lifts (reprobe_polls)
    assert run(5) == [10] * 3 + [20] * 4 + [10] * 12 + [20] * 4 + [10]
    # +75 %: the engine rules double it again; 40 gains nothing over 20 and goes back to 20
    assert run(7) == [10] * 3 + [20] * 3 + [40] * 6 + [20] * 12


def test_with_a_start_cap_a_run_that_reads_its_backlog_starts_small_and_the_ramp_grows_it() -> None:
    # no initial_cap: the engine's KV (409,600 tokens / 1000 per rollout) would start the run at 409
    tr = Trace(initial_cap=None, max_model_len=1000, backlog_start_cap=8)
    caps = [tr.poll(ended=2, age_s=0.0).cap for _ in range(5)]
    assert caps == [16, 32, 64, 128, 256]  # from the start cap, doubled by the ramp each poll
    assert tr.reasons()[0] == (
        f"{CAUSE}: start at cap 8 (engine rules: 409) until the orchestration's accepted rate is measured"
    )
    # unread (no stats from the server), an explicit initial_cap, or the start off (the default): the
    # engines' cap
    start = {"backlog_start_cap": 8}
    for kw, reported in (
        (start, False),
        (start | {"initial_cap": 50}, True),
        ({"backlog_start_cap": None}, True),
        ({}, True),
    ):
        other = Trace(**({"initial_cap": None, "max_model_len": 1000} | kw))
        first = other.poll(ended=0, age_s=0.0, reported=reported)  # 10 in flight: the cap does not bind
        assert first.cap == (kw.get("initial_cap") or 409) and "start at cap" not in str(first.reasons)


def test_a_high_backlog_lets_the_cap_grow_while_each_increase_raises_the_accepted_rate() -> None:
    tr = Trace()
    caps = []
    for _ in range(17):  # rollouts end in proportion to the cap: more in flight, more accepted
        cap = tr.ctl.state.cap or 10
        caps.append(tr.poll(ended=cap // 5, age_s=5.0).cap)
    # each cap is held until it turned over (5 polls here), then the step up is taken: 0.4, 0.8, 1.6 per s
    assert caps == [10] * 5 + [20] * 5 + [40] * 5 + [80] * 2
    assert not any("/s at cap" in r for r in tr.reasons())
    assert tr.ctl.state.backlog_ceiling is None


def test_without_stats_from_the_server_the_rule_is_inactive_and_says_so_once() -> None:
    tr = Trace()
    caps = [tr.poll(ended=2, age_s=0.0, reported=False).cap for _ in range(4)]
    assert caps == [20, 40, 80, 160]  # as without a backlog
    assert tr.reasons() == [f"{CAUSE}: task queue q reports no backlog; rule inactive"]


def test_a_backlog_below_the_rollouts_timescale_leaves_the_engine_rules_alone() -> None:
    # 0.9 s is under the 1 s floor: the same trace as the hold above grows as without a backlog
    tr = Trace()
    caps = [tr.poll(ended=2, age_s=0.9).cap for _ in range(4)]
    assert caps == [20, 40, 80, 160] and tr.reasons() == []


def test_the_rule_switched_off_never_holds() -> None:
    tr = Trace(orchestration_backlog=False)
    caps = [tr.poll(ended=2, age_s=30.0).cap for _ in range(4)]
    assert caps == [20, 40, 80, 160] and tr.reasons() == []
