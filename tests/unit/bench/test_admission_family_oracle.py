"""bench/admission_family.py's oracles: the best fixed cap by accepted rollouts per simulated second and by
useful tokens per simulated second, each flagged when it is the largest cap run (the sweep did not reach
the peak); files written before useful tokens were recorded still summarise, without the work oracle."""

from __future__ import annotations

from typing import Any

from tests.unit.bench.test_admission_family_merge import _family


def run(rate: float, work: float | None, p50: float = 10.0) -> dict[str, Any]:
    r: dict[str, Any] = {
        "accepted_per_sim_s": rate, "caps": "9/9/9", "mean_inflight": 9.0, "preemptions": 0, "storm_polls": 0,
        "wasted_tokens": 0, "sim_s": 480.0, "group_p50_s": p50,
    }  # fmt: skip
    if work is not None:
        r["useful_tokens_per_sim_s"] = work
    return r


def workload(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {"kv_cap": 9, "runs": runs}


def test_a_cap_that_finishes_more_rollouts_only_by_leaving_more_unfinished_is_not_the_work_oracle() -> None:
    family = _family()
    w = workload({
        "adaptive": run(1.5, 2000.0, p50=120), "prime-rl": run(0.4, 500.0), "sync": run(0.2, 300.0),
        "fixed": run(0.25, 400.0), "fixed@198": run(1.6, 2100.0, p50=126),
        "fixed@720": run(1.76, 2050.0, p50=359),
    })  # fmt: skip
    s = family.summary("drift", w)
    assert (s["oracle_cap"], s["oracle_at_largest_cap"]) == (720, True)
    assert (s["work_oracle_cap"], s["work_oracle_at_largest_cap"]) == (198, False)
    assert round(s["adaptive/oracle"], 3) == round(1.5 / 1.76, 3)
    assert round(s["adaptive/work_oracle"], 3) == round(2000 / 2100, 3)
    p50 = (s["adaptive_group_p50_s"], s["oracle_group_p50_s"], s["work_oracle_group_p50_s"])
    assert p50 == (120, 359, 126)
    table = family.table([s])
    assert "| drift | 720 (yes) | 198 (no) | 2100 | 2000 | 0.95 | 120 / 359 / 126 |" in table


def test_the_kv_cap_itself_can_be_the_oracle_and_older_files_summarise_without_the_work_oracle() -> None:
    family = _family()
    runs = {"adaptive": run(1.0, 900.0), "prime-rl": run(0.4, 500.0), "sync": run(0.2, 300.0)}
    s = family.summary("small", workload(runs | {"fixed": run(1.2, 1000.0), "fixed@36": run(1.1, 950.0)}))
    assert (s["oracle_cap"], s["oracle_at_largest_cap"], s["work_oracle_cap"]) == (9, False, 9)
    old = {k: {x: v for x, v in r.items() if x != "useful_tokens_per_sim_s"} for k, r in runs.items()}
    s = family.summary("old", workload(old | {"fixed": run(1.2, None), "fixed@36": run(1.1, None)}))
    assert "work_oracle" not in s and s["oracle_cap"] == 9
    assert "useful tok/s" not in family.table([s])
