"""The stale-queue workbench's result row and its two tables (bench/stale_queue.py runs the policies).

``Result`` is one policy's books (records / sampled tokens, the feed's own), its trainer metrics and its
length mix: mean and p90 sampled tokens per rollout of every admitted group (the workload's draw, finished
or not) against those of the consumed groups. Consumed shorter than admitted means the batches were skewed
toward short rollouts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from durable_rollouts.trainer.feed import Count


@dataclass
class Result:
    policy: str
    max_lag: int
    limit: str
    generated: dict[str, int]
    consumed: dict[str, int]
    discarded: dict[str, int]
    waiting: dict[str, int]
    balanced: bool
    tokens_reaching_update: float
    """Consumed sampled tokens / every sampled token (records plus those of aborted groups)."""
    in_flight_tokens: int
    in_flight_groups: int
    groups_complete: int
    """Group records written (every member in)."""
    groups_admitted: int
    trainer_steps: int
    sim_s: float
    trainer_idle_s: float
    trainer_idle_fraction: float
    mean_consumed_lag: float
    preemptions: int
    discard_reasons: dict[str, int] = field(default_factory=dict)
    overprovision: int = 0
    drop_late: bool = False
    aborted_groups: int = 0
    aborted_tokens: int = 0
    """Sampled tokens of groups aborted unfinished once a batch was full (``drop`` only; not records)."""
    admitted_mix: dict[str, Any] = field(default_factory=dict)
    consumed_mix: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0


def asdict_count(c: Count) -> dict[str, int]:
    return {"records": c.records, "tokens": c.tokens}


def table(results: list[Result]) -> str:
    """The books per policy."""
    head = (
        "| policy | max lag | queue limit (groups) | generated rec / tok | consumed rec / tok | "
        "discarded rec / tok | waiting rec / tok | tokens reaching update | trainer idle | balanced |"
    )
    rows = [head, "|" + "---|" * 10]
    for r in results:
        cells = [
            r.policy,
            str(r.max_lag),
            r.limit,
            *(
                f"{c['records']:,} / {c['tokens']:,}"
                for c in (r.generated, r.consumed, r.discarded, r.waiting)
            ),
            f"**{r.tokens_reaching_update:.1%}**",
            f"{r.trainer_idle_fraction:.0%}",
            "yes" if r.balanced else "NO",
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def mix_table(results: list[Result]) -> str:
    """The length mix per policy: admitted vs consumed sampled tokens per rollout."""
    head = (
        "| policy | max lag | admitted mean / p90 | consumed mean / p90 | consumed/admitted mean | "
        "discarded rec | aborted groups / tok | tokens reaching update | trainer idle | balanced |"
    )
    rows = [head, "|" + "---|" * 10]
    for r in results:
        a, c = r.admitted_mix, r.consumed_mix
        cells = [
            r.policy,
            str(r.max_lag),
            f"{a['mean']:.1f} / {a['p90']}",
            f"{c['mean']:.1f} / {c['p90']}" if c.get("mean") is not None else "-",
            f"**{_ratio(r):.3f}**",
            f"{r.discarded['records']:,}",
            f"{r.aborted_groups} / {r.aborted_tokens:,}",
            f"{r.tokens_reaching_update:.1%}",
            f"{r.trainer_idle_fraction:.0%}",
            "yes" if r.balanced else "NO",
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def summary(results: list[Result]) -> list[str]:
    """One line per max lag: adaptive vs baseline tokens, and each over-provisioning's length mix."""
    out = []
    for lag in sorted({r.max_lag for r in results}):
        by = {r.policy: r for r in results if r.max_lag == lag}
        ad, base = by["adaptive"].tokens_reaching_update, by["baseline"].tokens_reaching_update
        out.append(
            f"max lag {lag}: {ad:.1%} of generated tokens reach an update (adaptive) vs {base:.1%} (baseline)"
        )
        for r in by.values():
            if r.overprovision and "sync" in by:
                out.append(
                    f"max lag {lag}: {r.policy}: consumed/admitted mean tokens {_ratio(r):.3f} "
                    f"(sync {_ratio(by['sync']):.3f}), trainer idle {r.trainer_idle_fraction:.0%} "
                    f"(sync {by['sync'].trainer_idle_fraction:.0%})"
                )
    return out


def _ratio(r: Result) -> float:
    a, c = r.admitted_mix.get("mean"), r.consumed_mix.get("mean")
    return c / a if a and c else 0.0
