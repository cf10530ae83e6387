"""A family of seeded workloads on the simulated fleet, each with an oracle: the best fixed cap in hindsight.

Every workload is `bench/admission_fleet.py`'s driver with some flags changed (`FAMILY`): heavier tails, more
turns with longer contexts, long tool waits, a smaller fleet with less KV, turn lengths that drift during the
run as a training policy's would; and three that differ on several axes at once: drift with long tails that
follow the task (every rollout of a task is long, not a random request), many small replicas (8 of 640 KV
blocks each, room for 1.25 sequences of the full context), and large groups (32 rollouts) with short tool
waits (0.3 s). For each, on a fresh fleet per policy and the same simulated budget: adaptive (the ``probe``
preset), adaptive with the ``prime-rl`` preset, the fixed cap at KV capacity / max length, synchronous batches
of that size, and a sweep of fixed caps at ``--sweep`` multiples of it. The oracle is the sweep's (and the KV
cap's) best accepted rollouts per simulated second: a coarse grid, so the true best fixed cap may lie between
two points and be a little better.

Reported per workload: oracle (rate and cap), adaptive and its ratios to the oracle and to the KV cap,
prime-rl, KV cap, sync; adaptive's preemptions, storm polls (rule P1's definition, from the engines' own
counters) and wasted tokens, beside the oracle's. Targets (issue 12): adaptive >= 0.9 × oracle, >= 1.3 × KV
cap, no storm poll.

    python bench/admission_family.py --out bench/results/admission_family.json

``--length-aware`` instead compares, per workload, adaptive with and without length-aware groups
(`bench/length_aware.py`, Seer-style waves; the same controller, seed and budget), with task-correlated
lengths on (``--task-sigma``, a per-task log-normal length scale), in two modes: continuous admission (the
family's usual driver) and synchronous steps of ``--step-groups`` groups (Seer's setting). Variants
(``--la-variants``): ``la`` (one probe per group, siblings released when a member finished, predicted by
the max finished length) and ``la-progress`` (released already after a first-wave member's first turn).
Reported: accepted rollouts per simulated second, p50/p99 group completion (admission to last member's
end), mean step time, and their ratios with / without:

    python bench/admission_family.py --length-aware --workloads default --out /tmp/la_default.json

(bench/results/length_aware.json joins one such run per workload, by ``--merge``, with supplements: its
``commands`` list every command behind it.)

``--workloads`` runs a subset (two processes can share the family); ``--merge A.json B.json --out C.json``
joins their results and prints the table, later files' runs replacing earlier ones of the same name (so
``--policies adaptive --no-sweep`` reruns only the controller against the same oracle). Every result file
lists in ``commands`` the command lines behind it: a run its own, a merge its parts' (in order, each once),
then its ``--note`` lines and its own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from admission_fleet import _parser, fixed_cap, run_policy  # bench/ is on sys.path as a script
from fleet_workload import Workload

FAMILY: dict[str, dict[str, Any]] = {
    "default": {},
    "heavy-tail": {"tail_fraction": 0.08},
    "long-context": {"min_turns": 8, "max_turns": 14, "median_tokens": 220},
    "tool-bound": {"tool_median_s": 8.0},
    "small-fleet": {"replicas": 2, "kv_blocks": 768},
    "drift": {"median_tokens": 400, "drift_from_tokens": 40, "drift_to_tokens": 700},
    "drift-task-tails": {
        "median_tokens": 400,
        "drift_from_tokens": 40,
        "drift_to_tokens": 700,
        "tail_fraction": 0.08,
        "tail_key": "task",
        "task_sigma": 0.5,
    },
    "small-replicas": {"replicas": 8, "kv_blocks": 640},
    "large-groups": {"group_size": 32, "tool_median_s": 0.3},
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


LA_VARIANTS: dict[str, dict[str, Any]] = {
    "la": {"length_aware": True},
    "la-progress": {"length_aware": True, "la_release": "progress"},
}
"""Length-aware variant -> its `bench/admission_fleet.py` flags (argparse destinations)."""


async def run_length_aware(name: str, common: argparse.Namespace) -> dict[str, Any]:
    """Adaptive without and with each length-aware variant, continuous and in steps, one workload."""
    args = workload_args(name, common)
    args.task_sigma = common.task_sigma
    workload = Workload(args)
    runs: dict[str, dict[str, Any]] = {}
    for mode in common.modes:
        args.step_groups = common.step_groups if mode == "stepped" else None
        for variant in ["off", *common.la_variants]:
            variant_args = argparse.Namespace(**{**vars(args), **LA_VARIANTS.get(variant, {})})
            r = await run_policy("adaptive", variant_args, workload)
            r.pop("trace", None)
            runs[f"{mode}/{variant}"] = r
            g = r["groups"]
            print(
                f"{name}: {mode}/{variant} {r['accepted_per_sim_s']:.3f}/s, groups p50 {g['p50_s']:.0f} s "
                f"p99 {g['p99_s']:.0f} s, steps {g['steps']} ({r['sim_s']:.0f} sim s, {r['wall_s']:.0f} s)",
                flush=True,
            )
    flags = FAMILY[name] | {"task_sigma": common.task_sigma}
    return {"flags": flags, "step_groups": common.step_groups, "runs": runs}


def la_summary(name: str, w: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (mode, variant) with its off run: rates, group completion, step time, ratios."""
    rows = []
    for key, r in w["runs"].items():
        mode, variant = key.split("/")
        off = w["runs"].get(f"{mode}/off")
        if variant == "off" or off is None:
            continue
        g, g0 = r["groups"], off["groups"]

        def ratio(a: float | None, b: float | None) -> float | None:
            return a / b if a is not None and b else None

        rows.append(
            {
                "workload": name,
                "mode": mode,
                "variant": variant,
                "sibling_log_length_corr": g0["sibling_log_length_corr"],
                "rate_off": off["accepted_per_sim_s"],
                "rate_on": r["accepted_per_sim_s"],
                "rate_ratio": ratio(r["accepted_per_sim_s"], off["accepted_per_sim_s"]),
                "p50_off": g0["p50_s"],
                "p50_on": g["p50_s"],
                "p50_ratio": ratio(g["p50_s"], g0["p50_s"]),
                "p99_off": g0["p99_s"],
                "p99_on": g["p99_s"],
                "p99_ratio": ratio(g["p99_s"], g0["p99_s"]),
                "step_off": g0["step_mean_s"],
                "step_on": g["step_mean_s"],
                "step_ratio": ratio(g["step_mean_s"], g0["step_mean_s"]),
                "steps_off_on": f"{g0['steps']}/{g['steps']}",
                "cohort_off_on": f"{g0['cohort']}/{g['cohort']}",
                "censored_off_on": f"{g0['cohort_censored']}/{g['cohort_censored']}",
                "preemptions_off_on": f"{off['preemptions']}/{r['preemptions']}",
                "not_started_off_on": f"{g0['not_started_members']}/{g['not_started_members']}",
                "books_balance": all(_balanced(x["tally"]) for x in (off, r)),
                "sim_s_min": min(off["sim_s"], r["sim_s"]),
            }
        )
    return rows


def _balanced(t: dict[str, Any]) -> bool:
    """The driver's invariant: every admitted rollout ended exactly once (or was unfinished at the end)."""
    return bool(t["admitted"] == t["accepted"] + t["cancelled"] + t["failed"] + t["unfinished"])


def la_table(rows: list[dict[str, Any]]) -> str:
    def f(v: float | None, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    head = (
        "| workload | mode | variant | sibling corr | rollouts/s off → on (×) | group p50 s off → on (×) "
        "| group p99 s off → on (×) | step s off → on (×) |"
    )
    lines = [head, "|" + "---|" * 8]
    for s in rows:
        lines.append(
            f"| {s['workload']} | {s['mode']} | {s['variant']} | {f(s['sibling_log_length_corr'], '.2f')} "
            f"| {s['rate_off']:.3f} → {s['rate_on']:.3f} ({f(s['rate_ratio'], '.2f')}) "
            f"| {s['p50_off']:.0f} → {s['p50_on']:.0f} ({f(s['p50_ratio'], '.2f')}) "
            f"| {s['p99_off']:.0f} → {s['p99_on']:.0f} ({f(s['p99_ratio'], '.2f')}) "
            f"| {f(s['step_off'], '.0f')} → {f(s['step_on'], '.0f')} ({f(s['step_ratio'], '.2f')}) |"
        )
    return "\n".join(lines)


def fixed_runs(w: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """The workload's fixed-cap runs by cap: the KV cap's and the sweep's."""
    runs = w["runs"]
    return {w["kv_cap"]: runs["fixed"]} | {int(k.split("@")[1]): r for k, r in runs.items() if "@" in k}


def summary(name: str, w: dict[str, Any]) -> dict[str, Any]:
    """A workload's row. The oracle is the fixed cap with the most accepted rollouts per simulated second,
    flagged when it is the largest cap run (the sweep did not reach the peak). Beside it, the latency-matched
    oracle: the best fixed cap whose group completion p50 is no longer than adaptive's (more accepted
    rollouts bought with longer-waiting groups, more policy lag for an async trainer, excluded)."""
    runs = w["runs"]
    rate = {k: r["accepted_per_sim_s"] for k, r in runs.items()}
    fixed = fixed_runs(w)
    best = max(fixed, key=lambda c: fixed[c]["accepted_per_sim_s"])
    top = fixed[best]["accepted_per_sim_s"]
    oracle = fixed[best]
    a = runs["adaptive"]
    # runs written before groups were reported lack their p50: no latency-matched oracle for those
    p50 = a.get("group_p50_s")
    matched = [c for c, r in fixed.items() if p50 is not None and r.get("group_p50_s", p50 + 1) <= p50]
    by_latency: dict[str, Any] = {
        "adaptive_group_p50_s": p50,
        "oracle_group_p50_s": oracle.get("group_p50_s"),
    }
    if matched:
        m = max(matched, key=lambda c: fixed[c]["accepted_per_sim_s"])
        by_latency |= {
            "matched_cap": m,
            "matched": fixed[m]["accepted_per_sim_s"],
            "adaptive/matched": rate["adaptive"] / fixed[m]["accepted_per_sim_s"],
            "matched_group_p50_s": fixed[m]["group_p50_s"],
        }
    return {
        "workload": name,
        "kv_cap": w["kv_cap"],
        "oracle_cap": best,
        "oracle_at_largest_cap": best == max(fixed),
        "oracle": top,
        "adaptive": rate["adaptive"],
        "adaptive/oracle": rate["adaptive"] / top if top else 0.0,
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
        **by_latency,
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
    lines += [
        "",
        "| workload | oracle cap (the sweep's largest?) | group p50 s: adaptive / oracle "
        "| latency-matched oracle /s (cap, group p50 s) | adaptive × matched |",
        "|" + "---|" * 5,
    ]
    for s in rows:
        if s["adaptive_group_p50_s"] is None or s["oracle_group_p50_s"] is None:
            continue
        matched = (
            f"{s['matched']:.3f} ({s['matched_cap']}, {s['matched_group_p50_s']:.0f}) "
            f"| {s['adaptive/matched']:.2f}"
            if "matched" in s
            else "- | -"
        )
        lines.append(
            f"| {s['workload']} | {s['oracle_cap']} ({'yes' if s['oracle_at_largest_cap'] else 'no'}) "
            f"| {s['adaptive_group_p50_s']:.0f} / {s['oracle_group_p50_s']:.0f} | {matched} |"
        )
    return "\n".join(lines)


async def run_all(args: argparse.Namespace) -> dict[str, Any]:
    workloads = {}
    for name in args.workloads:
        run = run_length_aware if args.length_aware else run_workload
        workloads[name] = await run(name, args)
    return {
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "merge")},
        "workloads": workloads,
    }


def merged_commands(files: list[Path], parts: list[dict[str, Any]]) -> list[str]:
    """The commands behind the merged files, in order, each once (a file written before runs recorded their
    command says so)."""
    commands: list[str] = []
    for f, part in zip(files, parts, strict=True):
        for c in part.get("commands") or [f"({f}: written before result files recorded their commands)"]:
            if c not in commands:
                commands.append(c)
    return commands


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
    p.add_argument("--length-aware", action="store_true", help="compare adaptive with / without length-aware")
    p.add_argument(
        "--task-sigma", type=float, default=0.5, help="per-task length scale (with --length-aware)"
    )
    p.add_argument("--modes", nargs="+", choices=["continuous", "stepped"], default=["continuous", "stepped"])
    p.add_argument("--step-groups", type=int, default=24, help="groups per synchronous step (stepped mode)")
    p.add_argument("--la-variants", nargs="+", choices=list(LA_VARIANTS), default=list(LA_VARIANTS))
    p.add_argument("--merge", type=Path, nargs="+", default=None, help="join these result files instead")
    p.add_argument(
        "--note",
        nargs="+",
        default=[],
        help="with --merge: lines added to the result's commands, after its parts'",
    )
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    command = shlex.join(["python", "bench/admission_family.py", *(sys.argv[1:] if argv is None else argv)])
    if args.merge:
        parts = [json.loads(f.read_text()) for f in args.merge]
        report = {
            "config": parts[0]["config"],
            "commands": merged_commands(args.merge, parts),
            "workloads": {},
        }
        report["commands"] += [*args.note, command]
        for part in parts:
            for name, w in part["workloads"].items():
                if name in report["workloads"]:
                    report["workloads"][name]["runs"].update(w["runs"])
                else:
                    report["workloads"][name] = w
    else:
        report = asyncio.run(run_all(args))
        report["commands"] = [command]
    if report["config"].get("length_aware"):
        report["summary"] = [row for n, w in report["workloads"].items() for row in la_summary(n, w)]
        print(la_table(report["summary"]))
    else:
        complete = {"adaptive", "prime-rl", "fixed", "sync"}
        report["summary"] = [
            summary(n, w) for n, w in report["workloads"].items() if complete <= set(w["runs"])
        ]
        print(table(report["summary"]))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
