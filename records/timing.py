"""Time decomposition of a rollout: where its wall time went, per turn and summed.

Components, in seconds (the record's ``time`` object and every turn entry):

- generation: each turn's ``queue_s`` (task queue and engine queue) + ``model_s`` (the engine).
- environment: each env step (parsing, acting: every sandbox command, tokenizing the observation), its
  store calls excluded, plus the rollout's sandbox create, recovery and teardown (``sandbox_s``: the
  per-rollout entry, measured by the workflow around those activities).
- reward: computing the reward (for coding, the hidden tests in the sandbox).
- transfer: run-store reads and writes of the turn's activities (``transfer_s`` in the turn's meta), plus
  the record's own reads at finalize (``record_transfer_s``). The write that stores a time cannot time
  itself: each activity's last write is not counted.
- trainer wait: from the group's record to the trainer feed handing the group to a trainer; known only
  once consumed, and outside the rollout's wall time (it comes after its end).

Invariants: the components are disjoint (no second counted in two), so generation + environment + reward
+ transfer <= wall; the remainder (``other``: workflow tasks, timers, scheduling) is never negative for a
record whose wall time is known. Pure arithmetic on the stored segment meta and record extras: the export,
``rollouts status`` and ``rollouts report`` all go through it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

COMPONENTS = ("generation_s", "environment_s", "reward_s", "transfer_s")
"""The summed components of the ``time`` object, in display order."""

TURN_TIMES = ("queue_s", "model_s", "env_s", "reward_s", "transfer_s")
"""The timed keys of a turn entry (segment meta of the turn's model segment)."""


def turn_times(meta: Mapping[str, Any]) -> dict[str, float]:
    """A turn's times from its segment meta; absent keys are 0 (records stored before they existed).

    A truncated rollout scored after its last step keeps that scoring's times under ``score_*`` keys:
    they are already folded into ``env_s``/``reward_s``/``transfer_s`` by the step that wrote them.
    """
    return {k: float(meta.get(k) or 0.0) for k in TURN_TIMES}


def turn_total(t: Mapping[str, float]) -> float:
    """Seconds of one turn entry across every component."""
    return sum(t[k] for k in TURN_TIMES)


def rollout_time(
    turns: Iterable[Mapping[str, Any]], extra: Mapping[str, Any], trainer_wait_s: float | None = None
) -> dict[str, Any]:
    """The record's ``time`` object from its turns' meta and its stored extras.

    ``extra`` is the record's ``extra_json``: ``started_at``/``ended_at`` (workflow time, epoch seconds),
    ``sandbox_s`` and ``record_transfer_s``; records stored before them get null wall time and 0 for the
    per-rollout entries. ``trainer_wait_s`` appears only when given (the group was consumed).
    """
    gen = env = reward = transfer = 0.0
    for meta in turns:
        t = turn_times(meta)
        gen += t["queue_s"] + t["model_s"]
        env += t["env_s"]
        reward += t["reward_s"]
        transfer += t["transfer_s"]
    sandbox = float(extra.get("sandbox_s") or 0.0)
    started, ended = extra.get("started_at"), extra.get("ended_at")
    out: dict[str, Any] = {
        "generation_s": gen,
        "environment_s": env + sandbox,
        "reward_s": reward,
        "transfer_s": transfer + float(extra.get("record_transfer_s") or 0.0),
        "sandbox_s": sandbox,
        "wall_s": max(0.0, ended - started) if started is not None and ended is not None else None,
        "started_at": started,
        "ended_at": ended,
    }
    if trainer_wait_s is not None:
        out["trainer_wait_s"] = max(0.0, trainer_wait_s)
    return out


@dataclass
class Totals:
    """Summed time objects of a set of rollouts (one environment, or all of a run)."""

    rollouts: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COMPONENTS, 0.0))
    """Per component: the sum over the rollouts."""
    wall_s: float = 0.0
    """Summed wall time of the rollouts whose wall time is known."""
    timed: int = 0
    """Rollouts with a known wall time (records stored before wall time have none)."""
    trainer_wait_s: float = 0.0
    """Summed trainer wait of the rollouts whose group the feed handed to a trainer."""
    waited: int = 0
    """Rollouts with a known trainer wait."""

    def add(self, time: Mapping[str, Any]) -> None:
        self.rollouts += 1
        for k in COMPONENTS:
            self.seconds[k] += float(time.get(k) or 0.0)
        if time.get("wall_s") is not None:
            self.wall_s += float(time["wall_s"])
            self.timed += 1
        if time.get("trainer_wait_s") is not None:
            self.trainer_wait_s += float(time["trainer_wait_s"])
            self.waited += 1

    @property
    def other_s(self) -> float:
        """Wall time not in any component (orchestration); 0 when no wall time is known."""
        return max(0.0, self.wall_s - sum(self.seconds.values())) if self.timed else 0.0

    def shares(self) -> dict[str, float | None]:
        """Each component's (and ``other_s``'s) share of the summed wall time; None without wall time."""
        keys = (*COMPONENTS, "other_s")
        if not self.wall_s:
            return dict.fromkeys(keys, None)
        vals = {**self.seconds, "other_s": self.other_s}
        return {k: vals[k] / self.wall_s for k in keys}

    @property
    def mean_trainer_wait_s(self) -> float | None:
        return self.trainer_wait_s / self.waited if self.waited else None


def totals_by_env(items: Iterable[tuple[str, Mapping[str, Any]]]) -> dict[str, Totals]:
    """(env, time object) pairs summed per environment, plus ``"all"`` when there are several."""
    out: dict[str, Totals] = {}
    every = Totals()
    for env, t in items:
        out.setdefault(env, Totals()).add(t)
        every.add(t)
    if len(out) > 1:
        out["all"] = every
    return out
