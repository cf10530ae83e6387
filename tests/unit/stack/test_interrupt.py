"""Ctrl-C in the ``rollouts`` command (stack/interrupt.py): exit 130 without a traceback wherever the
interrupt lands (the imports, a command that swallows it, click's own handling), and a command that cleans up
after Ctrl-C (``patient``) is not cut short."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from tests import REPO_ROOT

PRELUDE = (
    "import sys, time\nfrom durable_rollouts.stack import interrupt\ninterrupt.install()\n"
    "from durable_rollouts.stack.procs import run_main\n"
)


def _interrupted(body: str) -> subprocess.CompletedProcess[str]:
    """Run ``body`` after the prelude; once it prints ``ready``, SIGINT it; wait for it to end."""
    proc = subprocess.Popen([sys.executable, "-c", PRELUDE + body], cwd=REPO_ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.timeout(60)
def test_an_interrupt_during_the_imports_leaves_with_130() -> None:
    done = _interrupted(
        "print('ready', flush=True)\ntime.sleep(60)  # still importing: run_main not yet called"
    )
    assert done.returncode == 130 and "Traceback" not in done.stderr, done.stderr


@pytest.mark.timeout(60)
def test_a_command_that_swallows_the_interrupt_is_ended_by_the_watchdog() -> None:
    body = (
        "def main():\n"
        "    said = False\n"
        "    while True:\n"
        "        try:\n"
        "            if not said:\n"
        "                said = print('ready', flush=True) or True\n"
        "            time.sleep(60)\n"
        "        except KeyboardInterrupt:\n"
        "            pass\n"
        "run_main(main)"
    )
    done = _interrupted(body)
    assert done.returncode == 130 and "Traceback" not in done.stderr, done.stderr


@pytest.mark.timeout(60)
def test_a_typer_command_exits_130_not_clicks_1() -> None:
    body = (
        "import typer\n"
        "app = typer.Typer()\n"
        "@app.command()\n"
        "def wait() -> None:\n"
        "    print('ready', flush=True)\n"
        "    time.sleep(60)\n"
        "run_main(app)"
    )
    done = _interrupted(body)
    assert done.returncode == 130 and "Traceback" not in done.stderr, done.stderr


@pytest.mark.timeout(60)
def test_a_patient_command_cleans_up_past_the_grace() -> None:
    body = (
        "def main():\n"
        "    interrupt.patient()\n"
        "    try:\n"
        "        print('ready', flush=True)\n"
        "        time.sleep(60)\n"
        "    finally:\n"
        "        time.sleep(interrupt.GRACE_S + 1)\n"
        "        print('cleaned up', flush=True)\n"
        "run_main(main)"
    )
    done = _interrupted(body)
    assert done.returncode == 130 and done.stdout.strip() == "cleaned up", (done.stdout, done.stderr)
