"""Groups on the simulated fleet (`admission_fleet.py`): each group's books in the driver, and the group
statistics a run reports: completion time over a cohort, the sibling length correlation, step times.

Invariant (checked by `group_stats`): a group's started members are its ended ones plus its unfinished
ones, summed over groups they match the driver's tally, and with a length-aware scheduler the members
never started are exactly the ones it holds.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from admission_fleet import Tally

COHORT_FRACTION = 0.5
"""Group completion times are taken over the groups admitted in this first share of the simulated time,
so that most of them can complete before the budget ends."""


@dataclass
class GroupBook:
    """One group's members in the driver: started, ended (accepted, cancelled or failed), when."""

    admitted_at: float
    started: int = 0
    ended: int = 0
    last_end: float = 0.0
    accepted_tokens: list[int] = field(default_factory=list)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in (0, 1]); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def group_stats(
    books: Mapping[int, GroupBook],
    tally: Tally,
    size: int,
    steps: Sequence[float],
    sim_s: float,
    held: int | None,
) -> dict[str, Any]:
    """Group completion over the cohort admitted in the first `COHORT_FRACTION` of the run, the sibling
    length correlation, and the groups' books (checked: started = ended + unfinished, held = not started)."""
    started, ended = sum(b.started for b in books.values()), sum(b.ended for b in books.values())
    assert started == tally.admitted, f"{started} members started, {tally.admitted} admitted"
    assert ended == tally.accepted + tally.cancelled + tally.failed, "a member ended twice or never"
    assert started - ended == tally.unfinished, "unfinished members do not match the groups' books"
    not_started = sum(size - b.started for b in books.values())
    if held is not None:
        assert not_started == held, f"{not_started} members never started, the scheduler holds {held}"
    cohort = [b for b in books.values() if b.admitted_at < COHORT_FRACTION * sim_s]
    times = [(b.last_end if b.ended == size else sim_s) - b.admitted_at for b in cohort]
    xs, ys = [], []
    for b in books.values():
        if b.ended == size:
            logs = [math.log(max(1, t)) for t in b.accepted_tokens]
            for i, x in enumerate(logs):
                for j, y in enumerate(logs):
                    if i != j:
                        xs.append(x)
                        ys.append(y)
    corr = statistics.correlation(xs, ys) if len(xs) > 2 and len(set(xs)) > 1 else None
    return {
        "admitted": len(books),
        "complete": sum(b.ended == size for b in books.values()),
        "not_started_members": not_started,
        "cohort": len(cohort),
        "cohort_censored": sum(b.ended < size for b in cohort),
        "p50_s": percentile(times, 0.50),
        "p90_s": percentile(times, 0.90),
        "p99_s": percentile(times, 0.99),
        "mean_s": statistics.mean(times) if times else 0.0,
        "sibling_log_length_corr": corr,
        "steps": len(steps),
        "step_mean_s": statistics.mean(steps) if steps else None,
        "step_max_s": max(steps, default=None),
    }
