"""``stack.procs.exit_now``: a process leaves without interpreter finalization (where the Temporal
runtime's threads can abort it) yet with its exit status and all its buffered output."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests import REPO_ROOT


def _run(body: str) -> subprocess.CompletedProcess[str]:
    code = f"import sys\nfrom durable_rollouts.stack.procs import run_main\n{body}\n"
    argv = [sys.executable, "-c", code]
    return subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(("raised", "rc"), [("None", 0), ("0", 0), ("3", 3), ("'bad config'", 1)])
def test_the_exit_status_is_systemexits(raised: str, rc: int) -> None:
    done = _run(f"run_main(lambda: sys.exit({raised}))")
    assert done.returncode == rc, done.stderr
    assert ("bad config" in done.stderr) == (raised == "'bad config'")


def test_buffered_output_and_logs_are_written_before_leaving() -> None:
    # a pipe is block-buffered: without the flush, os._exit would drop both
    body = (
        "import logging\n"
        "logging.basicConfig(stream=sys.stderr, format='%(message)s')\n"
        "def work():\n    print('partial', end='')\n    logging.warning('logged')\n"
        "run_main(work)"
    )
    done = _run(body)
    assert done.returncode == 0 and done.stdout == "partial" and "logged" in done.stderr


def test_atexit_handlers_do_not_run() -> None:
    # the point: nothing of interpreter shutdown runs (its thread teardown is what aborts)
    done = _run("import atexit\natexit.register(lambda: print('finalized'))\nrun_main(lambda: None)")
    assert done.returncode == 0 and "finalized" not in done.stdout


def test_an_uncaught_error_exits_1_with_its_traceback() -> None:
    done = _run("def work():\n    raise ValueError('boom')\nrun_main(work)")
    assert done.returncode == 1 and "ValueError: boom" in done.stderr and "Traceback" in done.stderr
