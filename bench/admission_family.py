"""A family of seeded workloads on the simulated fleet, each with an oracle: the best fixed cap in hindsight.

Every workload is `bench/admission_fleet.py`'s driver with some flags changed (`FAMILY`): heavier tails,
more turns with longer contexts, long tool waits, a smaller fleet with less KV, and turn lengths that drift
during the run as a training policy's would. For each, on a fresh fleet per policy and the same simulated
budget: adaptive (the ``probe`` preset), adaptive with the ``prime-rl`` preset, the fixed cap at KV capacity /
max length, synchronous batches of that size, and a sweep of fixed caps at ``--sweep`` multiples of it. The
oracle is the sweep's (and the KV cap's) best accepted rollouts per simulated second: a coarse grid, so the
true best fixed cap may lie between two points and be a little better.

Reported per workload: oracle (rate and cap), adaptive and its ratios to the oracle and to the KV cap,
prime-rl, KV cap, sync; adaptive's preemptions, storm polls (rule P1's definition, from the engines' own
counters) and wasted tokens, beside the oracle's. Targets (issue 12): adaptive >= 0.9 × oracle, >= 1.3 × KV
cap, no storm poll.

    python bench/admission_family.py --out bench/results/admission_family.json

``--workloads`` runs a subset (two processes can share the family); ``--merge A.json B.json --out C.json``
joins their results and prints the table, later files' runs replacing earlier ones of the same name (so
``--policies adaptive --no-sweep`` reruns only the controller against the same oracle).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

from admission_fleet import Workload, _parser, fixed_cap, run_policy  # bench/ is on sys.path as a script

FAMILY: dict[str, dict[str, Any]] = {
    "default": {},
    "heavy-tail": {"tail_fraction": 0.08},
    "long-context": {"min_turns": 8, "max_turns": 14, "median_tokens": 220},
    "tool-bound": {"tool_median_s": 8.0},
    "small-fleet": {"replicas": 2, "kv_blocks": 768},
    "drift": {"median_tokens": 400, "drift_from_tokens": 40, "drift_to_tokens": 700},
}
"""Workload name -> the `bench/admission_fleet.py` flags (argparse destinations) unlike its defaults."""


def workload_args(name: str, common: argparse.Namespace) -> argparse.Namespace:
    args = _parser().parse_args([])
    for key in ("budget_s", "max_wall_s", "time_scale", "seed"):
        setattr(args, key, getattr(common, key))
    for key, value in FAMILY[name].items():
        setattr(args, key, value)
    return args


async def run_workload(name: str, common: argparse.Namespace) -> dict[str, Any]:
    args = workload_args(name, common)
    workload = Workload(args)
    kv_cap = fixed_cap(args)
    caps = sorted({max(1, round(kv_cap * m)) for m in common.sweep} - {kv_cap})
    runs: dict[str, dict[str, Any]] = {}
    for policy in common.policies:
        runs[policy] = await run_policy(policy, args, workload)
        print(f"{name}: {policy} {runs[policy]['accepted_per_sim_s']:.3f}/s", flush=True)
    for cap in caps if common.sweep_caps else []:
        args.fixed_cap = cap
        runs[f"fixed@{cap}"] = await run_policy("fixed", args, workload)
        print(f"{name}: fixed@{cap} {runs[f'fixed@{cap}']['accepted_per_sim_s']:.3f}/s", flush=True)
    args.fixed_cap = None
    for key, r in runs.items():
        if key != "adaptive":
            r.pop("trace", None)
    return {"flags": FAMILY[name], "kv_cap": kv_cap, "sweep": [kv_cap, *caps], "runs": runs}


def summary(name: str, w: dict[str, Any]) -> dict[str, Any]:
    runs = w["runs"]
    rate = {k: r["accepted_per_sim_s"] for k, r in runs.items()}
    fixed = {w["kv_cap"]: rate["fixed"]} | {int(k.split("@")[1]): v for k, v in rate.items() if "@" in k}
    best = max(fixed, key=fixed.__getitem__)
    oracle = runs["fixed"] if best == w["kv_cap"] else runs[f"fixed@{best}"]
    a = runs["adaptive"]
    return {
        "workload": name,
        "kv_cap": w["kv_cap"],
        "oracle_cap": best,
        "oracle": fixed[best],
        "adaptive": rate["adaptive"],
        "adaptive/oracle": rate["adaptive"] / fixed[best] if fixed[best] else 0.0,
        "adaptive/kv_cap": rate["adaptive"] / rate["fixed"] if rate["fixed"] else 0.0,
        "prime-rl": rate["prime-rl"],
        "kv_cap_rate": rate["fixed"],
        "sync": rate["sync"],
        "adaptive_caps": a["caps"],
        "adaptive_mean_inflight": a["mean_inflight"],
        "adaptive_preemptions": a["preemptions"],
        "adaptive_storm_polls": a["storm_polls"],
        "adaptive_wasted_tokens": a["wasted_tokens"],
        "oracle_preemptions": oracle["preemptions"],
        "oracle_storm_polls": oracle["storm_polls"],
        "oracle_wasted_tokens": oracle["wasted_tokens"],
        "sim_s_min": min(r["sim_s"] for r in runs.values()),
    }


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| workload | oracle /s (cap) | adaptive /s | ×oracle | ×KV cap | prime-rl /s | KV cap /s (cap) "
        "| sync /s | adaptive caps first/last/max | preemptions adaptive / oracle | storm polls adaptive / "
        "oracle | wasted tokens adaptive / oracle |"
    )
    lines = [head, "|" + "---|" * 12]
    for s in rows:
        lines.append(
            f"| {s['workload']} | {s['oracle']:.3f} ({s['oracle_cap']}) | {s['adaptive']:.3f} "
            f"| {s['adaptive/oracle']:.2f} | {s['adaptive/kv_cap']:.2f} | {s['prime-rl']:.3f} "
            f"| {s['kv_cap_rate']:.3f} ({s['kv_cap']}) | {s['sync']:.3f} | {s['adaptive_caps']} "
            f"| {s['adaptive_preemptions']} / {s['oracle_preemptions']} "
            f"| {s['adaptive_storm_polls']} / {s['oracle_storm_polls']} "
            f"| {s['adaptive_wasted_tokens']} / {s['oracle_wasted_tokens']} |"
        )
    return "\n".join(lines)


async def run_all(args: argparse.Namespace) -> dict[str, Any]:
    workloads = {}
    for name in args.workloads:
        workloads[name] = await run_workload(name, args)
    return {
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "merge")},
        "workloads": workloads,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", nargs="+", choices=list(FAMILY), default=list(FAMILY))
    p.add_argument("--policies", nargs="+", default=["adaptive", "prime-rl", "fixed", "sync"])
    p.add_argument("--no-sweep", dest="sweep_caps", action="store_false", help="run no fixed-cap sweep")
    p.add_argument("--sweep", type=float, nargs="+", default=[4, 8, 14, 22], help="multiples of the KV cap")
    p.add_argument("--budget-s", type=float, default=480.0, help="simulated seconds per policy")
    p.add_argument("--max-wall-s", type=float, default=75.0, help="wall seconds per policy at most")
    p.add_argument("--time-scale", type=float, default=25.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--merge", type=Path, nargs="+", default=None, help="join these result files instead")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.merge:
        parts = [json.loads(f.read_text()) for f in args.merge]
        report = {"config": parts[0]["config"], "workloads": {}}
        for part in parts:
            for name, w in part["workloads"].items():
                if name in report["workloads"]:
                    report["workloads"][name]["runs"].update(w["runs"])
                else:
                    report["workloads"][name] = w
    else:
        report = asyncio.run(run_all(args))
    complete = {"adaptive", "prime-rl", "fixed", "sync"}
    report["summary"] = [summary(n, w) for n, w in report["workloads"].items() if complete <= set(w["runs"])]
    print(table(report["summary"]))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
