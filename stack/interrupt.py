"""Ctrl-C for the ``rollouts`` command: it returns promptly, at any moment of its life, with exit 130 and no
traceback.

:func:`install` runs first in ``cli.rollouts`` (before its heavy imports) when that is the program (the
``rollouts`` script, ``python -m durable_rollouts.cli.rollouts``; not a process that imports it, such as a
test run) and replaces Python's SIGINT handling for the whole process:

- A SIGINT before the command runs (imports, mounting the sub-commands: before ``stack.procs.run_main``
  calls :func:`begin`) leaves at once with 130: there is nothing to clean up yet, and a ``KeyboardInterrupt``
  there would escape ``run_main`` with a traceback.
- The first SIGINT while it runs raises ``KeyboardInterrupt`` in the main thread, as Python's default
  handler does, so ``finally`` blocks and context managers run (rich's live views restore the terminal,
  ``chaos`` thaws a frozen process), and arms a watchdog that leaves through ``exit_now(130)`` if the
  process is still running :data:`GRACE_S` later.
- A second SIGINT leaves at once (130), unless the command is :func:`patient`.
- ``stack.procs.run_main`` exits 130 once a command ends after a SIGINT, whatever it returned or raised
  (click turns ``KeyboardInterrupt`` into "Aborted!" and exit 1; ``top`` used to swallow it and exit 0).

Why a watchdog, and why it is woken by the signal itself (``signal.set_wakeup_fd``) rather than by the
Python-level handler: that handler runs only when the main thread next executes Python code. A main thread
blocked in C never does: joining the threads of ``asyncio.run``'s default executor at shutdown, waiting on a
lock held by a thread in the Temporal SDK's runtime, a long C-level read. Such a command ignored Ctrl-C (a
loaded machine widens the windows where it lands there). The C-level handler writes the signal number to
the wakeup fd from whichever thread the kernel delivered it to, so the watchdog thread wakes regardless.
``asyncio.run`` installs its own SIGINT handler (cancel the main task, wait for it) only over Python's
default one, so under :func:`install` the interrupt is raised in place instead, and the watchdog bounds
whatever clean-up then waits.

Commands that stop what they started on Ctrl-C and may take longer (``stack up`` in the foreground, a
worker draining its tasks) call :func:`patient`: no watchdog, the clean-up runs to its end.

Standard library only; it must be cheap to import.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time

GRACE_S = 2.0
"""Seconds a command has after Ctrl-C to unwind before the watchdog ends it."""

_state = {"interrupted": False, "patient": False, "running": False}


def interrupted() -> bool:
    """Whether a SIGINT has arrived since :func:`install`."""
    return bool(_state["interrupted"])


def begin() -> None:
    """The command starts running (``run_main``): from now on Ctrl-C unwinds it (``KeyboardInterrupt``)."""
    _state["running"] = True


def patient() -> None:
    """Let this command's own clean-up after Ctrl-C run to its end: no watchdog (the status stays 130)."""
    _state["patient"] = True


def _flush_and_exit(code: int) -> None:
    """What ``stack.procs.exit_now`` does (without importing it: this may run mid-import)."""
    logging = sys.modules.get("logging")
    if logging is not None:
        with contextlib.suppress(Exception):
            logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _leave(code: int) -> None:
    """Flush the output and logs and end the process, or just end it if that cannot finish within 1 s (a
    stream or logging lock held by a thread that no longer runs)."""
    t = threading.Thread(target=_flush_and_exit, args=(code,), daemon=True)
    t.start()
    t.join(1.0)
    os._exit(code)


def _on_sigint(signum: int, frame: object) -> None:
    if not _state["running"] or (_state["interrupted"] and not _state["patient"]):
        _leave(130)
    _state["interrupted"] = True
    raise KeyboardInterrupt  # a patient command's clean-up is interrupted again, as it expects


def _watch(fd: int, grace_s: float) -> None:
    """Woken by every signal with a Python handler (the byte is its number); on SIGINT, end the process
    ``grace_s`` later unless a command made itself :func:`patient`."""
    while True:
        try:
            data = os.read(fd, 64)
        except OSError:
            return
        if not data:
            return
        if signal.SIGINT in data:
            break
    if not _state["running"]:
        _leave(130)
    _state["interrupted"] = True
    time.sleep(grace_s)
    if not _state["patient"]:
        _leave(130)


def install(grace_s: float = GRACE_S) -> None:
    """Take over SIGINT as the module docstring says (main thread only; elsewhere nothing happens)."""
    if threading.current_thread() is not threading.main_thread():
        return
    r, w = os.pipe()
    os.set_blocking(w, False)
    with contextlib.suppress(ValueError, OSError):
        signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    signal.signal(signal.SIGINT, _on_sigint)
    threading.Thread(target=_watch, args=(r, grace_s), name="sigint-watchdog", daemon=True).start()
