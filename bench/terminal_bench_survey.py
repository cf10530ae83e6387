"""Terminal-Bench 2 survey: the published task directories against the Harbor plug-in, before and after.

    python bench/terminal_bench_survey.py --tasks DIR --out bench/results/terminal_bench_survey.json

``DIR`` holds the task directories (Terminal-Bench 2.0: 89). For each task:

1. accepted at submit by the plug-in's loader (`terminal_bench_accept`), and if refused its one-line
   reason, tallied by reason: read alone and in a dataset with ``network_policy = "no-network"``, by
   today's plug-in ("after") and by the plug-in at ``--before`` (a git revision, run from a temporary
   worktree);
2. its image built here on a local stand-in for its base image (`terminal_bench_images`), or why not;
3. its own solve.sh and then test.sh through the durable pipeline (`terminal_bench_reference`), for the
   tasks whose image was built: the rollout's outcome and reward;
4. (stage ``offline``, a diagnostic kept apart from the counts) the same with ``tests/test.sh`` rewritten to
   download nothing and run the image's own pytest (`terminal_bench_reference.offline_test_sh`): which
   reference solutions pass their own tests once the verifier's downloads are out of the way.

The result file has the counts (``summary``) and every task's row (``tasks``). Images and the stand-in
base this script tagged are removed at the end (``--keep-images`` keeps them). Nothing is downloaded:
builds run with ``--network none`` and the sandboxes have no network.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import terminal_bench_accept as accept
import terminal_bench_images as images

REPO = Path(__file__).resolve().parent.parent
BEFORE = "515be5b^"
"""The plug-in before the work on Terminal-Bench-style tasks (users, network, the rest of the format): the
parent of the first commit that changed it for that work."""


def _rev(rev: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", rev], capture_output=True, text=True
    )
    if done.returncode != 0:
        raise SystemExit(f"--before {rev}: not a revision of {REPO}")
    return done.stdout.strip()


def _changes() -> list[str]:
    """Uncommitted changes under the plug-in and the sandboxes (the pipeline stages run the installed,
    working-tree code; the submit stage runs committed revisions)."""
    done = subprocess.run(
        ["git", "-C", str(REPO), "status", "--porcelain", "--", "environments/harbor", "sandboxes"],
        capture_output=True, text=True,
    )  # fmt: skip
    return done.stdout.splitlines()


def survey_accept(dirs: list[Path], revs: dict[str, str]) -> dict[str, Any]:
    """Each side's loader (``revs``: side -> git revision) run from its own temporary worktree."""
    out: dict[str, Any] = {}
    for side, rev in revs.items():
        where = Path(tempfile.mkdtemp(prefix=f"tb2-{side}-"))
        where.rmdir()
        try:
            out[side] = accept.run_loader(dirs, accept.worktree(REPO, rev, where))["tasks"]
        finally:
            accept.remove_worktree(REPO, where)
    return out


def survey_builds(dirs: list[Path], facts: dict[str, dict[str, Any]], timeout_s: float, made: list[str],
                  limit: int | None) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:  # fmt: skip
    unavailable = images.make_standins(made)
    out: dict[str, dict[str, Any]] = {}
    tried = 0
    for d in dirs:
        f = facts[d.name]
        if f["from"] in unavailable:
            out[d.name] = {"built": False, "cause": f"stand-in unavailable: {unavailable[f['from']]}"}
            continue
        if f["from"] in images.STANDINS and limit is not None and tried >= limit:
            out[d.name] = {"built": False, "cause": "not tried (--max-builds)"}
            continue
        tried += f["from"] in images.STANDINS
        t0 = time.monotonic()
        out[d.name] = images.build_task(d, f, timeout_s, made)
        out[d.name]["seconds"] = round(time.monotonic() - t0, 1)
        print(f"build {d.name}: {out[d.name]['built']} {out[d.name].get('cause') or ''}", flush=True)
    return out, unavailable


def summarise(rows: dict[str, dict[str, Any]], acc: dict[str, Any] | None, refs: dict[str, Any] | None,
              builds: dict[str, Any] | None, offline: dict[str, Any] | None) -> dict[str, Any]:  # fmt: skip
    summary: dict[str, Any] = {"tasks": len(rows)}
    if acc is not None:
        for side in ("before", "after"):
            summary[f"accepted_{side}"] = {
                key: accept.tally(acc[side], key) for key in ("alone", "no_network_policy")
            }
    if builds is not None:
        causes: dict[str, int] = {}
        for b in builds.values():
            if not b["built"]:
                causes[b["cause"]] = causes.get(b["cause"], 0) + 1
        summary["built"] = sum(b["built"] for b in builds.values())
        summary["not_built"] = dict(sorted(causes.items(), key=lambda kv: -kv[1]))
    for key, runs in (("reference", refs), ("offline_verifier_diagnostic", offline)):
        if runs is not None:
            summary[key] = {
                "run": len(runs),
                "reward_1": sum(r["reward"] == 1.0 for r in runs.values()),
                "outcomes": _count(f"{r['outcome']}, reward {r['reward']}" for r in runs.values()),
            }
    facts = [r["static"] for r in rows.values()]
    summary["static"] = {
        "base_images": _count(f["from"] for f in facts),
        "dockerfile_downloads": sum(bool(f["dockerfile_fetches"]) for f in facts),
        "dockerfile_sets_user": sum(f["dockerfile_user"] for f in facts),
        "test_sh_downloads": sum(bool(f["test_fetches"]) for f in facts),
        "test_sh_uvx_pytest": sum(f["test_uvx_pytest"] for f in facts),
        "solve_sh_downloads": sum(bool(f["solve_fetches"]) for f in facts),
        "deprecated_sizes": sum(f["deprecated_sizes"] for f in facts),
    }
    return summary


def _count(values: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[str(v)] = out.get(str(v), 0) + 1
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", required=True, type=Path, help="folder of Terminal-Bench 2 task directories")
    p.add_argument("--out", required=True, type=Path, help="result file (JSON)")
    p.add_argument(
        "--before", default=BEFORE, help=f"git revision of the 'before' plug-in (default {BEFORE})"
    )
    p.add_argument(
        "--stages",
        default="accept,build,reference,offline",
        help="comma list: accept, build, reference, offline",
    )
    p.add_argument("--after", default="HEAD", help="git revision of the 'after' plug-in (default HEAD)")
    p.add_argument("--build-timeout", type=float, default=300.0, help="seconds per image build")
    p.add_argument("--max-builds", type=int, default=None, help="try at most this many builds")
    p.add_argument("--command-timeout", type=int, default=600, help="seconds per sandbox command (solve.sh)")
    p.add_argument("--keep-images", action="store_true", help="keep the images this run tagged")
    args = p.parse_args(argv)
    stages = set(args.stages.split(","))
    if not stages <= {"accept", "build", "reference", "offline"}:
        raise SystemExit(f"--stages {args.stages}: only accept, build, reference, offline")
    if stages & {"reference", "offline"} and "build" not in stages:
        raise SystemExit(
            "--stages: reference and offline need build (they run the tasks whose image was built)"
        )
    dirs = accept.task_dirs(args.tasks)
    rows: dict[str, dict[str, Any]] = {d.name: {"static": accept.static_facts(d)} for d in dirs}
    t0 = time.monotonic()
    acc = builds = refs = offline = None
    unavailable: dict[str, str] = {}
    if "accept" in stages:
        acc = survey_accept(dirs, {"before": args.before, "after": args.after})
        for side in ("before", "after"):
            for name, verdict in acc[side].items():
                rows[name][f"submit_{side}"] = verdict
    made: list[str] = []
    try:
        if "build" in stages:
            builds, unavailable = survey_builds(
                dirs, {n: r["static"] for n, r in rows.items()}, args.build_timeout, made, args.max_builds
            )
            for name, b in builds.items():
                rows[name]["build"] = b
        built = [d for d in dirs if builds is not None and builds[d.name]["built"]]
        if "reference" in stages and built:
            from terminal_bench_reference import run_reference

            with tempfile.TemporaryDirectory(prefix="tb2-ref-") as work:
                refs = asyncio.run(run_reference(built, Path(work), args.command_timeout))
            for name, r in refs.items():
                rows[name]["reference"] = r
        if "offline" in stages and built:
            from terminal_bench_reference import offline_copies, run_reference

            with tempfile.TemporaryDirectory(prefix="tb2-offline-") as work:
                (Path(work) / "tasks").mkdir()
                copies, skipped = offline_copies(built, Path(work) / "tasks")
                offline = (
                    asyncio.run(run_reference(copies, Path(work), args.command_timeout)) if copies else {}
                )
            for name, r in offline.items():
                rows[name]["offline_verifier_diagnostic"] = r
            for name, why in skipped.items():
                rows[name]["offline_verifier_diagnostic"] = {"skipped": why}
    finally:
        if not args.keep_images:
            images.remove_images(made)
    result = {
        "command": "python bench/terminal_bench_survey.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "before": _rev(args.before),
        "after": _rev(args.after),
        "installed_plugin_changes": _changes(),
        "stand_ins": {name: df.splitlines()[-1] for name, df in images.STANDINS.items()},
        "stand_ins_unavailable": unavailable,
        "host": {"machine": platform.machine(), "python": platform.python_version()},
        "seconds": round(time.monotonic() - t0, 1),
        "summary": summarise(rows, acc, refs, builds, offline),
        "tasks": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, sort_keys=False) + "\n", encoding="utf-8")
    print(json.dumps(result["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
