"""A sampling profiler for a worker process, where py-spy is not installed: run a module under it.

    python bench/sampler.py --out prof.json [--hz 200] -m durable_rollouts.workers.worker --address ...

A daemon thread reads, ``--hz`` times a second, how long each OS thread of the process has run on a CPU
(``/proc/self/task/TID/schedstat``, in nanoseconds) and charges what it ran since the last sample to the
stack the thread is in now (``sys._current_frames``; innermost frame last, ``file:function`` per
frame): a CPU-weighted profile, so a thread that waits (a selector, a lock, SQLite's busy wait) costs
nothing. A thread without Python frames (the Temporal core's tokio threads) is counted by its kernel
name. When the module exits (a worker's SIGTERM, as the benchmarks stop it), the CPU seconds per thread
kind and per stack are written to ``--out`` as JSON.

Invariant: the module runs as ``python -m`` would run it (``sys.argv`` is its own, ``__name__`` is
``__main__``); the profile is written once, at exit, however the module ends (``os._exit`` included).
The sampler's own thread costs CPU (reported as its own thread), so absolute CPU figures of a profiled
run are not comparable with an unprofiled one; shares are.
"""

from __future__ import annotations

import argparse
import atexit
import collections
import cProfile
import json
import os
import runpy
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import NoReturn


def _stack(frame: FrameType | None, depth: int = 80) -> tuple[str, ...]:
    out: list[str] = []
    while frame is not None and len(out) < depth:
        code = frame.f_code
        out.append(f"{Path(code.co_filename).name}:{code.co_name}")
        frame = frame.f_back
    return tuple(reversed(out))


def _cpu_ns(tid: int) -> int | None:
    """Nanoseconds thread ``tid`` of this process has run on a CPU (None: it has ended)."""
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _comm(tid: int) -> str:
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:
        return str(tid)


def _kind(name: str) -> str:
    """A thread's name without its number (``asyncio_3`` -> ``asyncio``)."""
    return name.rstrip("0123456789_-") or name


class Sampler:
    """Every ``1/hz`` s: each thread's CPU since the last sample, charged to the stack it is in now."""

    def __init__(self, hz: float) -> None:
        self.period = 1.0 / hz
        self.stacks: collections.Counter[tuple[str, tuple[str, ...]]] = collections.Counter()
        self.threads: collections.Counter[str] = collections.Counter()
        self.samples = 0
        self._last: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self._sample()

    def _sample(self) -> None:
        self.samples += 1
        python = {t.native_id: t for t in threading.enumerate()}
        frames = sys._current_frames()
        try:
            tids = [int(t) for t in os.listdir("/proc/self/task")]
        except OSError:
            return
        for tid in tids:
            ns = _cpu_ns(tid)
            if ns is None:
                continue
            delta = ns - self._last.get(tid, ns if self.samples > 1 else 0)
            self._last[tid] = ns
            if delta <= 0:
                continue
            t = python.get(tid)
            name = _kind(t.name if t is not None else _comm(tid))
            self.threads[name] += delta
            frame = frames.get(t.ident) if t is not None and t.ident is not None else None
            if frame is not None and t is not threading.current_thread():
                self.stacks[(name, _stack(frame))] += delta

    def stopped(self) -> bool:
        return self._stop.is_set()

    def write(self, out: Path) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._sample()
        out.write_text(
            json.dumps(
                {
                    "samples": self.samples,
                    "period_s": self.period,
                    "thread_cpu_s": {k: v / 1e9 for k, v in self.threads.most_common()},
                    "stacks": [
                        {"thread": t, "stack": list(s), "cpu_s": n / 1e9}
                        for (t, s), n in self.stacks.most_common()
                    ],
                    "written_at": time.time(),
                }
            )
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="profile JSON written at exit")
    p.add_argument("--hz", type=float, default=200.0)
    p.add_argument(
        "--cprofile",
        action="store_true",
        help="also profile the main thread with cProfile (exact call counts and times; the sampler sees a "
        "thread only where it gives up the GIL, mostly its I/O), written beside --out as .prof",
    )
    p.add_argument("-m", dest="module", required=True, help="the module to run, then its arguments")
    args, rest = p.parse_known_args()
    sampler = Sampler(args.hz)
    exact = cProfile.Profile() if args.cprofile else None

    def write() -> None:
        if exact is not None and not sampler.stopped():
            exact.disable()
            exact.dump_stats(args.out.with_suffix(".prof"))
        sampler.write(args.out)

    atexit.register(write)
    hard_exit = os._exit

    def written_exit(status: int) -> NoReturn:  # workers leave through os._exit (stack.procs.exit_now)
        write()
        hard_exit(status)

    os._exit = written_exit
    sampler.start()
    sys.argv = [args.module, *rest]
    if exact is not None:
        exact.enable()
    runpy.run_module(args.module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
