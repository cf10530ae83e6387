"""faults/chaos.py: a worker the kit SIGKILLs and starts again, which exits while starting (its store cut off
at that moment: a process's first store connection is not retried), is started again until it polls its
queue, as a supervisor with a restart policy would; the fault is cleared only then, with the number of
starts it took. Without it, the soak ran on without any worker (every later worker fault skipped: "no live
worker")."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest

from durable_rollouts.faults import process
from durable_rollouts.faults.chaos import Chaos
from durable_rollouts.faults.schedule import Planned
from durable_rollouts.stack import procs
from durable_rollouts.store import RunStore

WORKER = """
import os, sys, time
flag, ready = sys.argv[1], sys.argv[2]
if os.path.exists(flag):  # the store is unreachable this time: exit at once, as the worker does
    os.remove(flag)
    sys.exit(3)
open(ready, "w").write(str(os.getpid()))
time.sleep(600)
"""
"""A stand-in worker: exits at its first start while ``flag`` exists, else writes its pid to ``ready``
(it "polls") and runs."""


class _Client:
    """What `_worker_polls` asks: the pollers of a queue (here: the pid the stand-in wrote, once ready)."""

    def __init__(self, ready: Path) -> None:
        self.ready = ready


@pytest.fixture
def polls(monkeypatch: pytest.MonkeyPatch) -> None:
    from durable_rollouts.environments import fleet

    async def live_pollers(client: _Client, queue: str) -> list[str]:
        assert queue == "soak"
        text = client.ready.read_text() if client.ready.exists() else ""
        return [f"{text}@host"] if text and procs.pid_alive(int(text)) else []

    monkeypatch.setattr(fleet, "live_pollers", live_pollers)


async def test_a_worker_that_exits_while_starting_is_started_again_until_it_polls(
    tmp_path: Path, polls: None
) -> None:
    flag, ready = tmp_path / "store-down", tmp_path / "ready"
    argv = [sys.executable, "-c", WORKER, str(flag), str(ready), "--task-queue", "soak"]
    first = procs.spawn("worker", argv, tmp_path)
    chaos = Chaos(tmp_path, [], tmp_path / "chaos.jsonl", store=RunStore(tmp_path), client=_Client(ready),
                  echo=lambda line: None)  # fmt: skip
    new = None
    try:
        deadline = time.monotonic() + 30
        while not (ready.exists() and ready.read_text() == str(first)):  # it runs (the flag is not set yet)
            assert time.monotonic() < deadline, "the stand-in worker did not start"
            await asyncio.sleep(0.05)
        ready.unlink()
        flag.write_text("")  # the next start finds its store unreachable
        counts = await chaos.run([Planned(0.0, "worker_kill", 0.0)])
        assert dict(counts) == {"worker_kill": 1}
        cleared = [e for e in chaos.events if e["event"] == "cleared"]
        assert len(cleared) == 1 and cleared[0].get("starts") == 2, chaos.events  # one exit, one more start
        new = process.find(tmp_path, "worker")
        assert new is not None and new.pid == cleared[0]["new_pid"] != first
        assert ready.read_text() == str(new.pid) and not flag.exists()
    finally:
        procs.stop_pid(first)
        if new is not None:
            procs.stop_pid(new.pid)
