"""One benchmark script, run by an older commit's code and by this checkout's, in one sitting.

    python bench/before_after.py --old cb3230d --out bench/results/pipeline_vs_bare_before_after.json \\
        -- bench/pipeline_vs_bare.py --rounds 2

The older commit is extracted with ``git archive`` into a temporary directory (as bench/orchestration_cost.py
does). Each version runs its own copy of the script (the path is relative to the code's root) in its own
process, from the same virtual environment, with ``PYTHONPATH`` set to that code's root and ``--out`` added,
the old code first. The result file holds both results as the script wrote them, the commits, the load
average before each, and ``ratios``: new / old for every number the two results share at the top level or
one level down (``bare.rollouts_per_s``), so a before/after table comes from one run of each.

The environment packages (``environments/*``) are installed into the virtual environment from this checkout,
so both versions use this checkout's environments; everything else (workflows, activities, workers, the
store, the benchmark itself) is the version's own.

Invariant: the extracted checkout is removed however the run ends; each script stops what it started.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def run_version(root: Path, script: str, args: list[str], out: Path, timeout_s: float) -> dict[str, Any]:
    """Run ``script`` (relative to ``root``) with that code on ``PYTHONPATH``; its result and wall time."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    argv = [sys.executable, str(root / script), *args, "--out", str(out)]
    load = os.getloadavg()[0]
    t0 = time.monotonic()
    proc = subprocess.run(argv, cwd=root, env=env, capture_output=True, text=True, timeout=timeout_s)
    wall = time.monotonic() - t0
    if proc.returncode != 0 or not out.exists():
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
        raise SystemExit(f"{root}/{script} exited {proc.returncode}:\n" + "\n".join(tail))
    return {"result": json.loads(out.read_text()), "wall_s": round(wall, 1), "load_before": round(load, 2)}


def ratios(old: dict[str, Any], new: dict[str, Any], prefix: str = "", depth: int = 0) -> dict[str, float]:
    """new / old for each number both hold (keys joined by '.'), one level of nesting deep."""
    out: dict[str, float] = {}
    for key, value in new.items():
        before = old.get(key)
        if isinstance(value, bool) or isinstance(before, bool):
            continue
        if isinstance(value, int | float) and isinstance(before, int | float) and before:
            out[prefix + key] = round(value / before, 3)
        elif isinstance(value, dict) and isinstance(before, dict) and depth == 0:
            out.update(ratios(before, value, f"{prefix}{key}.", depth + 1))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", required=True, help="the older commit")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--timeout-s", type=float, default=1800.0, help="per version")
    p.add_argument("script", help="the benchmark, relative to the code root")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments (after --)")
    args = p.parse_args(argv)
    script_args = [a for a in args.args if a != "--"]
    command = shlex.join(["python", "bench/before_after.py", *(sys.argv[1:] if argv is None else argv)])
    if not (ROOT / args.script).is_file():
        raise SystemExit(f"{args.script}: no such benchmark in this checkout")
    sys.path.insert(0, str(ROOT / "bench"))
    from orchestration_cost import checkout  # bench/ on sys.path, as when run as a script

    old = git("rev-parse", args.old)
    tmp = Path(tempfile.mkdtemp(prefix="before-after-"))
    try:
        old_root = checkout(old, tmp / f"code-{old[:8]}")
        if not (old_root / args.script).is_file():
            raise SystemExit(f"{args.script}: not in {args.old}")
        old_run = run_version(old_root, args.script, script_args, tmp / "old.json", args.timeout_s)
        new_run = run_version(ROOT, args.script, script_args, tmp / "new.json", args.timeout_s)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    result = {
        "command": command,
        "script": args.script,
        "args": script_args,
        "old": {"commit": old, **old_run},
        "new": {"commit": git("rev-parse", "HEAD"), "dirty": dirty, **new_run},
        "ratios": ratios(old_run["result"], new_run["result"]),
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["ratios"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
