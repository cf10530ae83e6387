"""bench/sampler.py runs a module as ``python -m`` would and, when it leaves (through ``os._exit`` too, as
a worker does), writes the CPU of each thread and of the stacks it ran in; ``--cprofile`` adds an exact
profile of the main thread beside it."""

from __future__ import annotations

import json
import pstats
import subprocess
import sys
from pathlib import Path

import pytest

SAMPLER = Path(__file__).resolve().parents[3] / "bench" / "sampler.py"

BURN = """
import os, sys, threading, time

def spin(seconds):
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass

def idle():
    time.sleep(0.6)

if __name__ == "__main__":
    assert sys.argv[1:] == ["--flag", "x"], sys.argv
    waiter = threading.Thread(target=idle, name="waiter")
    waiter.start()
    spin(0.5)
    waiter.join()
    sys.stdout.flush()
    os._exit(3)
"""


@pytest.mark.timeout(60)
def test_a_module_is_run_and_its_cpu_charged_to_its_threads_and_stacks(tmp_path: Path) -> None:
    (tmp_path / "burn.py").write_text(BURN)
    out = tmp_path / "prof.json"
    argv = [sys.executable, str(SAMPLER), "--out", str(out), "--cprofile", "-m", "burn", "--flag", "x"]
    done = subprocess.run(argv, cwd=tmp_path, env={"PYTHONPATH": str(tmp_path)}, timeout=50)
    assert done.returncode == 3  # the module's own exit status, through os._exit
    prof = json.loads(out.read_text())
    threads = prof["thread_cpu_s"]
    assert threads["MainThread"] >= 0.3 and threads.get("waiter", 0.0) < 0.1
    spun = sum(s["cpu_s"] for s in prof["stacks"] if s["stack"][-1] == "burn.py:spin")
    assert spun >= 0.2, prof["stacks"][:3]
    exact = pstats.Stats(str(out.with_suffix(".prof")))
    assert any(fn == "spin" for (_, _, fn) in exact.stats)  # type: ignore[attr-defined]
