"""What a policy's run on the simulated fleet reports (`admission_fleet.py`): the engines' counts, one
policy's row (rates, preemptions, storm polls, wasted tokens, caps, groups), the side-by-side table and
adaptive's ratios to the other policies.

Reported per policy: accepted (finished) rollouts per simulated second; useful tokens per simulated second
(tokens sampled in the turns of rollouts that were accepted or are unfinished at the end: the work a run
that went on would deliver, which a count of finished rollouts misses when many are in flight at the end,
since within a fixed budget the short ones finish first); engine busy fraction (simulated time
with at least one running sequence / elapsed, mean over engines), preemptions, storm polls (polls in which
some engine preempted a storm's worth, `admission.controller` rule P1's definition, read from the engines'
own counters every poll interval for every policy), wasted tokens (KV recomputed after preemptions + tokens
of cancelled rollouts), and adaptive's throughput ratios. Engines, tool waits and
polls share one `PacedClock`: simulated time advances ``--time-scale`` times faster than the wall clock but
stops while the process is starved of CPU, so the numbers barely depend on machine load (the wall time to
reach them does, up to ``--max-wall-s`` per policy).

Also per policy, groups: each group's admission time (its first member's start) and completion time (its
last member's end); p50/p90/p99 of completion - admission over the groups admitted in the first half of
the budget (a group of that cohort still unfinished at the end counts at its elapsed time, a lower bound,
and is reported as censored); and the measured sibling length correlation (Pearson, log tokens of every
ordered pair of accepted siblings of a complete group).

Invariant (checked by `summarize`): every admitted rollout ended once (accepted, cancelled, failed) or is
counted unfinished.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from durable_rollouts.simengine import SimEngine

if TYPE_CHECKING:
    from admission_fleet import Tally


def fleet_stats(engines: list[SimEngine], sim_s: float) -> dict[str, Any]:
    loops = [e.steps for e in engines if e.steps is not None]
    stats = [s.scheduler.stats for s in loops]
    steps = sum(s.steps for s in stats)
    pools = [s.scheduler.pool for s in loops]
    return {
        "busy_fraction": statistics.mean(s.busy_s for s in stats) / sim_s,
        "preemptions": sum(s.preemptions for s in stats),
        "recomputed_tokens": sum(s.recomputed_tokens for s in stats),
        "aborted_tokens": sum(s.aborted_tokens for s in stats),
        # the timing model counts sampled tokens in its step stats (the engine's own counter stays 0)
        "generated_tokens": sum(s.sampled_tokens for s in stats)
        + sum(e.counters.generation_tokens for e in engines if e.steps is None),
        "mean_batch": sum(s.seq_steps for s in stats) / steps if steps else 0.0,
        "prefix_hit_rate": sum(p.hits_total for p in pools) / max(1, sum(p.queries_total for p in pools)),
        "behind_s": max(s.max_behind_s for s in loops),
    }


def summarize(name: str, tally: Tally, fleet: dict[str, Any]) -> dict[str, Any]:
    """One policy's row of the report; ``fleet`` holds the engines' counts, the trace and the clock."""
    sim_s, wall_s, trace, inflight = fleet["sim_s"], fleet["wall_s"], fleet["trace"], fleet["inflight"]
    ended = tally.accepted + tally.cancelled + tally.failed + tally.unfinished
    assert ended == tally.admitted, f"{name}: {tally.admitted} admitted but {ended} ended"
    caps = [t[1] for t in trace]
    return {
        "policy": name,
        "accepted": tally.accepted,
        "accepted_per_sim_s": tally.accepted / sim_s,
        "accepted_per_wall_s": tally.accepted / wall_s,
        "busy_fraction": fleet["busy_fraction"],
        "preemptions": fleet["preemptions"],
        "storm_polls": fleet["storm_polls"],
        "wasted_tokens": fleet["recomputed_tokens"] + tally.cancelled_tokens + fleet["aborted_tokens"],
        "wasted_recomputed": fleet["recomputed_tokens"],
        "wasted_cancelled": tally.cancelled_tokens + fleet["aborted_tokens"],
        "generated_tokens_per_sim_s": fleet["generated_tokens"] / sim_s,
        "useful_tokens_per_sim_s": (tally.accepted_tokens + tally.unfinished_tokens) / sim_s,
        "caps": f"{caps[0]}/{caps[-1]}/{max(caps)}" if caps else "-",
        "mean_inflight": statistics.mean(inflight) if inflight else 0.0,
        "mean_batch": fleet["mean_batch"],
        "prefix_hit_rate": fleet["prefix_hit_rate"],
        "engine_max_behind_s": fleet["behind_s"],
        "clock_paused_s": fleet["clock_paused_s"],
        "sim_s": sim_s,
        "wall_s": wall_s,
        "times": f"{sim_s:.0f}/{wall_s:.0f}",
        "group_p50_s": fleet["groups"]["p50_s"],
        "group_p99_s": fleet["groups"]["p99_s"],
        "groups": fleet["groups"],
        "tally": asdict(tally),
        "trace": [t for t in trace if t[4]],
    }


ROWS = (
    ("accepted rollouts", "accepted", "{:d}"),
    ("accepted / sim s", "accepted_per_sim_s", "{:.3f}"),
    ("engine busy fraction", "busy_fraction", "{:.2f}"),
    ("preemptions", "preemptions", "{:d}"),
    ("storm polls", "storm_polls", "{:d}"),
    ("wasted tokens", "wasted_tokens", "{:d}"),
    ("  recomputed (preempt)", "wasted_recomputed", "{:d}"),
    ("  cancelled rollouts", "wasted_cancelled", "{:d}"),
    ("generated tokens / sim s", "generated_tokens_per_sim_s", "{:.0f}"),
    ("useful tokens / sim s", "useful_tokens_per_sim_s", "{:.0f}"),
    ("cap initial/final/max", "caps", "{}"),
    ("mean in flight", "mean_inflight", "{:.1f}"),
    ("mean batch per step", "mean_batch", "{:.1f}"),
    ("prefix-cache hit rate", "prefix_hit_rate", "{:.2f}"),
    ("group completion p50 (s)", "group_p50_s", "{:.1f}"),
    ("group completion p99 (s)", "group_p99_s", "{:.1f}"),
    ("simulated s / wall s", "times", "{}"),
    ("clock paused (wall s)", "clock_paused_s", "{:.1f}"),
)


def table(results: dict[str, dict[str, Any]]) -> str:
    names = list(results)
    lines = [f"{'':26}" + "".join(f"{n:>16}" for n in names)]
    for label, key, fmt in ROWS:
        cells = []
        for n in names:
            r = results[n]
            cells.append(f"{fmt.format(r[key]):>16}")
        lines.append(f"{label:26}" + "".join(cells))
    return "\n".join(lines)


def ratios(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Adaptive's accepted rollouts per simulated second over each other policy's."""
    rate = {n: r["accepted_per_sim_s"] for n, r in results.items()}
    return {
        f"adaptive/{n}": rate["adaptive"] / v
        for n, v in rate.items()
        if n != "adaptive" and v and "adaptive" in rate
    }
