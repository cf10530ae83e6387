"""Seeded fault schedules: which fault, when, for how long; the same seed gives the same schedule.

Invariant: a schedule is a pure function of its seed and parameters (no clock, no I/O), so a chaos run is
reproduced by its command line; the injector logs each fault with the time it actually fired.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Planned:
    """One planned fault."""

    at_s: float
    """Seconds after the schedule's start."""
    kind: str
    duration_s: float
    """How long it lasts before it is cleared (0 for instant faults such as a SIGKILL)."""


def schedule(
    seed: int,
    kinds: list[str],
    total_s: float,
    every_s: tuple[float, float] = (15.0, 30.0),
    duration_s: tuple[float, float] = (2.0, 10.0),
    instant: frozenset[str] = frozenset(),
) -> list[Planned]:
    """Faults one every ``every_s`` (uniform) seconds over ``total_s``, kinds drawn uniformly.

    Raises:
        ValueError: no kinds, or a bad interval.
    """
    if not kinds:
        raise ValueError("schedule: no fault kinds")
    if not 0 < every_s[0] <= every_s[1] or not 0 <= duration_s[0] <= duration_s[1]:
        raise ValueError(f"schedule: bad intervals every={every_s} duration={duration_s}")
    rng = random.Random(seed)
    out: list[Planned] = []
    t = rng.uniform(*every_s)
    while t < total_s:
        kind = rng.choice(kinds)
        dur = 0.0 if kind in instant else rng.uniform(*duration_s)
        out.append(Planned(round(t, 3), kind, round(dur, 3)))
        t += rng.uniform(*every_s)
    return out
