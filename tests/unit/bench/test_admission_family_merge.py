"""bench/admission_family.py --merge: later files' runs replace earlier ones, and the result lists the
commands behind it (its parts', in order and each once, then its notes and its own command line)."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[3] / "bench"


def _family():
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))  # the bench imports its siblings as a script does
    import admission_family

    return admission_family


def _part(path: Path, runs: dict[str, float], commands: list[str] | None) -> Path:
    report = {
        "config": {"budget_s": 480.0},
        "workloads": {
            "default": {
                "flags": {},
                "kv_cap": 9,
                "sweep": [9],
                "runs": {k: {"r": v} for k, v in runs.items()},
            }
        },
    }
    if commands is not None:
        report["commands"] = commands
    path.write_text(json.dumps(report))
    return path


def test_merge_replaces_runs_and_records_every_command(tmp_path):
    family = _family()
    old = _part(tmp_path / "old.json", {"adaptive": 1.0, "fixed": 2.0}, None)
    new = _part(
        tmp_path / "new.json", {"adaptive": 3.0}, ["python bench/admission_family.py --workloads default"]
    )
    again = _part(tmp_path / "again.json", {}, ["python bench/admission_family.py --workloads default"])
    out = tmp_path / "merged.json"
    argv = ["--merge", str(old), str(new), str(again), "--note", "a note", "--out", str(out)]
    assert family.main(argv) == 0
    merged = json.loads(out.read_text())
    assert merged["workloads"]["default"]["runs"] == {"adaptive": {"r": 3.0}, "fixed": {"r": 2.0}}
    assert merged["commands"] == [
        f"({old}: written before result files recorded their commands)",
        "python bench/admission_family.py --workloads default",
        "a note",
        shlex.join(["python", "bench/admission_family.py", *argv]),  # "a note" quoted
    ]
