"""Rule O of the admission controller (admission/backlog.py), on recorded traces 5 s apart.

A trace here is what a run records per poll: one engine's reading (KV usage low throughout, so the engine
rules alone keep growing the cap: the probe preset's ramp doubles a binding cap every poll), the rollouts in
flight (as many as the cap), how many ended since the previous poll, and the run's task queue backlog.
"""

from __future__ import annotations

from admission.backlog import CAUSE
from admission.controller import AdmissionController, Decision, QueueBacklog
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


def test_a_high_backlog_holds_the_cap_while_a_larger_cap_accepts_no_more_rollouts_per_second() -> None:
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
    assert [d.cap for d in later] == [20] * 14  # the engine rules would have doubled it every poll
    assert all(d.kv_cap == 40 for d in later)
    judged = [r for r in tr.reasons() if "/s at cap" in r]
    # judged once 20 turned over (10 polls): 0.40/s, no gain over 10's; the threshold is 5 % of the
    # 50 s lifetime (20 in flight / 0.4 per s)
    assert len(judged) == 5, tr.reasons()
    assert judged[0] == (
        f"{CAUSE}: hold cap 20 (engine rules: 40); accepted 0.40/s at cap 20 vs 0.40/s at cap 10;"
        " workflow tasks wait 5.0 s > 2.5 s (queue backlog 50, age 5.0 s)"
    )
    assert tr.ctl.state.backlog_ceiling == 20


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


def test_a_backlog_that_keeps_growing_without_a_rate_gain_trims_the_cap() -> None:
    tr = Trace()
    ages = iter(5.0 + k for k in range(100))  # the oldest workflow task waits longer every poll
    for _ in range(6):
        tr.poll(ended=2, age_s=next(ages))
    assert tr.ctl.state.cap == 20
    after = [tr.poll(ended=2, age_s=next(ages)) for _ in range(12)]
    trims = [r for r in tr.reasons() if "trim" in r]
    # measured at 20 after ten polls: no gain over 10, and the wait rose on three polls and more: trim
    # to max(0.8 x 20, 10), a ceiling; nothing cancelled
    assert [d.cap for d in after] == [20] * 9 + [16] * 3
    assert len(trims) == 1 and trims[0].startswith(f"{CAUSE}: trim cap 20 -> 16 (engine rules: 40)")
    assert all(d.cancel == [] for d in tr.log)
    assert tr.ctl.state.backlog_ceiling == 16


def test_a_backlog_below_the_rollouts_timescale_leaves_the_engine_rules_alone() -> None:
    # 0.9 s is under the 1 s floor: the same trace as the hold above grows as without a backlog
    tr = Trace()
    caps = [tr.poll(ended=2, age_s=0.9).cap for _ in range(4)]
    assert caps == [20, 40, 80, 160] and tr.reasons() == []


def test_the_rule_switched_off_never_holds() -> None:
    tr = Trace(orchestration_backlog=False)
    caps = [tr.poll(ended=2, age_s=30.0).cap for _ in range(4)]
    assert caps == [20, 40, 80, 160] and tr.reasons() == []
