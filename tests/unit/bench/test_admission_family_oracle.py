"""bench/admission_family.py's oracles: the best fixed cap by accepted rollouts per simulated second, flagged
when it is the largest cap run (the sweep did not reach the peak), and the latency-matched oracle: the best
fixed cap whose group completion p50 is no longer than adaptive's. Files written before group p50s were
reported still summarise, without the matched oracle."""

from __future__ import annotations

from typing import Any

from tests.unit.bench.test_admission_family_merge import _family


def run(rate: float, p50: float | None = 10.0) -> dict[str, Any]:
    r: dict[str, Any] = {
        "accepted_per_sim_s": rate, "caps": "9/9/9", "mean_inflight": 9.0, "preemptions": 0, "storm_polls": 0,
        "wasted_tokens": 0, "sim_s": 480.0,
    }  # fmt: skip
    if p50 is not None:
        r["group_p50_s"] = p50
    return r


def workload(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {"kv_cap": 9, "runs": {"prime-rl": run(0.4), "sync": run(0.2)} | runs}


def test_an_oracle_at_the_sweeps_top_is_flagged_and_the_matched_one_waits_no_longer_than_adaptive() -> None:
    family = _family()
    w = workload({
        "adaptive": run(1.4, p50=125), "fixed": run(0.25, p50=62), "fixed@126": run(1.5, p50=85),
        "fixed@198": run(1.6, p50=126), "fixed@720": run(1.76, p50=365),
    })  # fmt: skip
    s = family.summary("drift", w)
    assert (s["oracle_cap"], s["oracle_at_largest_cap"], s["matched_cap"]) == (720, True, 126)
    assert round(s["adaptive/oracle"], 3) == round(1.4 / 1.76, 3)
    assert round(s["adaptive/matched"], 3) == round(1.4 / 1.5, 3)
    assert "| drift | 720 (yes) | 125 / 365 | 1.500 (126, 85) | 0.93 |" in family.table([s])


def test_an_interior_oracle_and_older_files_without_group_latencies() -> None:
    family = _family()
    runs = {"adaptive": run(1.0, p50=50), "fixed": run(1.2, p50=40), "fixed@36": run(1.1, p50=90)}
    s = family.summary("small", workload(runs))
    assert (s["oracle_cap"], s["oracle_at_largest_cap"], s["matched_cap"], s["matched"]) == (9, False, 9, 1.2)
    old = {k: run(r["accepted_per_sim_s"], p50=None) for k, r in runs.items()}
    s = family.summary("old", workload(old))
    assert "matched" not in s and s["oracle_cap"] == 9 and s["adaptive_group_p50_s"] is None
    assert "| old |" in family.table([s]) and "| old | 9 (no)" not in family.table([s])
