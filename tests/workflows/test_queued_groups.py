"""``admission.max_queued_groups`` against a group that reports while the run's fleet poll is in flight
(patch ``queued-groups-reported-in-poll``), on the test server with fake activities.

The poll counts the complete groups the trainer has not taken before the group's record exists; the group
then reports, so the run no longer counts it in flight either. Counted in neither, it let one group more
than the limit start. Here the fake poll reads its count, then waits for the group in flight to report
before it answers (the race, every time), and a fake trainer takes every complete group at the start of
the next poll: at every poll's start the groups in flight plus the complete ones not yet taken are at
most the limit.
"""

from __future__ import annotations

import asyncio

from temporalio import activity
from temporalio.testing import WorkflowEnvironment

from durable_rollouts.config.models import AdmissionSection
from durable_rollouts.contracts.dispatch import FleetPoll, PollFleetInput

from .fakes import Fakes, admitted_run
from .test_breaker import run

LIMIT = 1


class RacingPolls(Fakes):
    """A poll that counts the untaken groups, then waits for a group in flight to report; a trainer
    that takes every complete group at a poll's start."""

    def __init__(self) -> None:
        super().__init__()
        self.taken: set[str] = set()
        self.seen: list[tuple[int, int]] = []
        """Per poll with a count: (groups in flight, complete groups not taken) at its start."""

    @activity.defn(name="poll_fleet")
    async def poll_fleet(self, inp: PollFleetInput) -> FleetPoll:
        if not inp.count_unconsumed:
            return await super().poll_fleet(inp)
        complete = set(self.groups)
        self.seen.append((len(inp.groups), len(complete - self.taken)))
        self.taken |= complete  # the trainer takes them
        unconsumed = len(complete - self.taken)  # 0: read before the group in flight reports
        for _ in range(200):  # the group in flight reports meanwhile
            if not inp.groups or any(g in self.groups for g in inp.groups):
                break
            await asyncio.sleep(0.05)
        poll = await super().poll_fleet(inp)
        return poll.model_copy(update={"unconsumed_groups": unconsumed})


async def test_a_group_that_reports_during_a_poll_counts_as_queued(
    ts_env: WorkflowEnvironment, uid: str
) -> None:
    fakes = RacingPolls()
    fakes.clock = ts_env.get_current_time  # readings on the server's (skipped) clock stay fresh
    fakes.done_on_turn = 1

    async def slow_turn(_: object) -> None:  # a group lives past the next poll's start
        await asyncio.sleep(1.0)

    fakes.generate_hook = slow_turn
    admission = AdmissionSection(
        enabled=True, initial_cap=8, max_inflight=8, admit_window_s=0.0, poll_interval_s=0.5,
        max_queued_groups=LIMIT,
    )  # fmt: skip
    inp = admitted_run(uid, admission, groups=4, size=1, inflight=8)
    result, _ = await run(ts_env.client, fakes, inp, uid)
    assert result.done and result.groups_done == 4
    raced = [s for s in fakes.seen if s[0] > 0]
    assert raced, fakes.seen  # some poll found a group in flight (and waited for its report)
    assert all(inflight + untaken <= LIMIT for inflight, untaken in fakes.seen), fakes.seen
