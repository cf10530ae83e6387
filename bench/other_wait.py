"""The orchestration's wait per rollout ("other" in the records) and the accepted rate of the main job, for
this checkout and an older commit in one sitting, on the embedded stack's real vLLM engine.

`make demo` (config/examples/math.toml: 8 groups x 4 one-turn math rollouts, admission on) and the same
config at 40 x 4 with ``run.max_inflight_groups=40``, run by each code version in turn, ``--reps`` times,
alternating (old, new, old, new, ...). Each sitting of a version starts its own Temporal dev server on a
fresh SQLite file with the SQLite pragmas that version's stack used (the old code: SQLite's defaults, unless
``--old-pragmas``; this checkout: ``StackConfig().temporal_sqlite_pragmas``) and its own worker from its own
code (``python -P -m workers.worker``, ``PYTHONPATH`` = the code's root; the older commit extracted with
``git archive``, as bench/orchestration_cost.py does). The engine is the one ``rollouts stack up`` started
(port 8000), shared by both, left running; the stack's own worker and Temporal server must be stopped
first (``--takeover`` stops them by their pid files).

``--variant NAME=KEY=VALUE,...`` adds, for this checkout in each repetition, the 40 x 4 config with those
settings (shape ``40x4+NAME``), e.g. an opt-in admission setting against the default in the same sitting.

``--sweep G ...`` then runs the 40 x 4 config with this checkout at each ``run.max_inflight_groups`` G
(shape ``40x4@G``): the wait against the rollouts in flight.

Per run: the records' mean wall time, generation and "other" (wall minus generation, environment, reward
and transfer: records/timing.py), the accepted rate (rollouts closed per second between the 10th and 90th
percentile of their close times, from the records), and CPU seconds per rollout of the worker (its process
tree), the Temporal server and the engine, from /proc before and after the run.

    rollouts stack up --detach
    python bench/other_wait.py --old 2f986a9 --takeover --out bench/results/other_wait.json

Invariant: it stops every process it started by pid however it ends, and removes the extracted checkout.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness import cpu_s  # noqa: E402  (bench/ is on sys.path as a script)
from orchestration_cost import checkout, cli_module, import_path, module  # noqa: E402

from durable_rollouts.config.models import StackConfig  # noqa: E402
from durable_rollouts.stack import procs  # noqa: E402

SHAPES = {"demo": [], "40x4": ["--groups", "40", "--set", "run.max_inflight_groups=40"]}


def tree(pid: int) -> list[int]:
    kids = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [pid] + [p for k in kids for p in tree(int(k))]


def engine_pids() -> list[int]:
    found = subprocess.run(["pgrep", "-f", "vllm|VLLM"], capture_output=True, text=True).stdout.split()
    return [int(p) for p in found]


def record_stats(path: Path) -> dict[str, Any]:
    """Mean wall, generation and other per rollout, and the accepted rate, from exported records."""
    rows = [r for r in map(json.loads, path.open()) if r.get("kind") == "rollout"]
    t = [r["time"] for r in rows]
    other = [
        x["wall_s"] - x["generation_s"] - x["environment_s"] - x["reward_s"] - x["transfer_s"] for x in t
    ]
    ends = sorted(x["ended_at"] for x in t)
    lo, hi = int(0.1 * len(ends)), int(0.9 * len(ends)) - 1
    return {
        "rollouts": len(rows),
        "other_s": statistics.mean(other),
        "rollout_wall_s": statistics.mean(x["wall_s"] for x in t),
        "generation_s": statistics.mean(x["generation_s"] for x in t),
        "accepted_per_s": (hi - lo) / (ends[hi] - ends[lo]) if ends[hi] > ends[lo] else None,
    }


def sitting(
    label: str, code: Path, pragmas: list[str], rep: int, tmp: Path, home: Path, shapes: dict[str, list[str]]
) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": import_path(code), "ROLLOUTS_HOME": str(home)}
    cli = cli_module(code)
    argv = procs.temporal_argv(tmp, 7233, 8233, pragmas)
    argv[argv.index("--db-filename") + 1] = str(tmp / f"{label}-{rep}.sqlite")
    server = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    worker = None
    runs = []
    try:
        procs.wait_until(lambda: procs.temporal_healthy("127.0.0.1:7233"), 60, "temporal", server.pid)
        worker = subprocess.Popen(
            [sys.executable, "-P", "-m", module(code, "workers.worker"), "--address", "127.0.0.1:7233",
             "--task-queue", "rollouts"],
            cwd=code, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            start_new_session=True,
        )  # fmt: skip
        assert worker.stdout is not None
        worker.stdout.readline()  # "worker polling ..."
        time.sleep(2)
        for shape, extra in shapes.items():
            run_id = f"wait-{label}-{rep}-{shape.replace('@', '-g').replace('+', '-')}-{int(time.time())}"
            parts = {"worker": worker.pid, "server": server.pid}
            before = {k: sum(cpu_s(p) for p in tree(pid)) for k, pid in parts.items()}
            before["engine"] = sum(cpu_s(p) for p in engine_pids())
            started = time.monotonic()
            cmd = [
                sys.executable,
                "-P",
                "-m",
                cli,
                "run",
                "config/examples/math.toml",
                "--run-id",
                run_id,
            ]
            res = subprocess.run([*cmd, *extra, "--wait"], cwd=code, env=env, capture_output=True, text=True)
            took = time.monotonic() - started
            after = {k: sum(cpu_s(p) for p in tree(pid)) for k, pid in parts.items()}
            after["engine"] = sum(cpu_s(p) for p in engine_pids())
            if res.returncode != 0:
                raise SystemExit(f"{label} {shape}: run failed: {res.stderr.strip().splitlines()[-1:]}")
            out = tmp / f"{run_id}.jsonl"
            subprocess.run(
                [sys.executable, "-P", "-m", cli, "export", run_id, "-o", str(out)],
                cwd=code, env=env, check=True, capture_output=True,
            )  # fmt: skip
            stats = record_stats(out)
            n = stats["rollouts"]
            runs.append({
                "code": label, "rep": rep, "shape": shape, "run_id": run_id, "run_wall_s": took,
                "load_avg_1m": os.getloadavg()[0], **stats,
                "cpu_ms_per_rollout": {k: 1000 * (after[k] - before[k]) / n for k in after},
            })  # fmt: skip
            print(
                json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in runs[-1].items()}),
                flush=True,
            )
    finally:
        if worker is not None:
            procs.stop_pid(worker.pid)
        procs.stop_pid(server.pid)
    return runs


def summary(runs: list[dict]) -> dict[str, dict[str, dict[str, float]]]:
    """Per shape and code: the mean over reps of other, rate and orchestration CPU per rollout."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for shape in dict.fromkeys(r["shape"] for r in runs):
        for code in ("old", "new"):
            mine = [r for r in runs if r["shape"] == shape and r["code"] == code]
            if mine:
                out.setdefault(shape, {})[code] = {
                    "other_s": statistics.mean(r["other_s"] for r in mine),
                    "accepted_per_s": statistics.mean(r["accepted_per_s"] for r in mine),
                    "worker_cpu_ms": statistics.mean(r["cpu_ms_per_rollout"]["worker"] for r in mine),
                    "server_cpu_ms": statistics.mean(r["cpu_ms_per_rollout"]["server"] for r in mine),
                }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--old", required=True, help="the older commit (its code and SQLite's default pragmas)")
    p.add_argument("--old-pragmas", nargs="*", default=[], help="SQLite pragmas of the old code's server")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument(
        "--takeover", action="store_true", help="stop the stack's worker and Temporal server first"
    )
    p.add_argument(
        "--sweep", type=int, nargs="*", default=[],
        help="then, this checkout only: the 40 x 4 run at each of these run.max_inflight_groups",
    )  # fmt: skip
    p.add_argument(
        "--variant", action="append", default=[], metavar="NAME=KEY=VALUE[,KEY=VALUE...]",
        help="this checkout only, in each repetition after its own runs: the 40 x 4 run with these settings"
        " (shape 40x4+NAME)",
    )  # fmt: skip
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    variants = {}
    for v in args.variant:
        name, _, settings = v.partition("=")
        if not name or not settings:
            raise SystemExit(f"--variant {v!r}: expected NAME=KEY=VALUE[,KEY=VALUE...]")
        extra = [a for kv in settings.split(",") for a in ("--set", kv)]
        variants[f"40x4+{name}"] = SHAPES["40x4"] + extra
    home = Path(os.environ.get("ROLLOUTS_HOME", ROOT / ".rollouts"))
    if args.takeover:
        for name in ("worker", "temporal"):
            if (pid := procs.read_pid(home, name)) is not None:
                procs.stop_pid(pid)
    tmp = Path(tempfile.mkdtemp(prefix="other-wait-"))
    try:
        old = checkout(args.old, tmp / "old")
        codes = {"old": (old, args.old_pragmas), "new": (ROOT, StackConfig().temporal_sqlite_pragmas)}
        runs = []
        for rep in range(args.reps):
            for label, (code, pragmas) in codes.items():
                shapes = SHAPES | variants if label == "new" else SHAPES
                runs += sitting(label, code, pragmas, rep, tmp, home, shapes)
        if args.sweep:
            groups = ["--groups", "40", "--set", "run.max_inflight_groups={}"]
            sweep = {f"40x4@{g}": [a.format(g) for a in groups] for g in args.sweep}
            runs += sitting("new", ROOT, codes["new"][1], args.reps, tmp, home, sweep)
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        )
        result = {
            "benchmark": "other_wait",
            "command": shlex.join(["python", "bench/other_wait.py", *sys.argv[1:]]),
            "commits": {"old": args.old, "new": head.stdout.strip()},
            "pragmas": {k: v[1] for k, v in codes.items()},
            "runs": runs,
            "summary": summary(runs),
        }
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps(result["summary"], indent=1))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
