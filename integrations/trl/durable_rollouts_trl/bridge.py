"""The trainer process's handle on the durable-rollouts core: a sidecar child speaking JSON lines.

Invariants:
- Importing this module (or anything in ``durable_rollouts_trl``) imports no core module: the core's
  generic top-level names (``config``, ``store``, ``metrics``, ``trainer``, ...) would collide with a
  trainer's own modules. The child (``durable_rollouts_trl.sidecar``) runs with ``python -P`` and a
  ``PYTHONPATH`` of ``DURABLE_ROLLOUTS_PYTHONPATH`` only, so neither the trainer's working directory
  nor its ``PYTHONPATH`` reaches the core's imports.
- One request at a time (a lock), one reply per request; a dead child is an error naming its exit code.
- The child is stopped by its pid (:meth:`Bridge.close`); a child outliving its parent ends when its stdin
  closes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any


class BridgeError(RuntimeError):
    """The core refused a request, or the sidecar died (one line)."""


class Bridge:
    """A sidecar process over the run store in ``home`` (or ``store_url``)."""

    def __init__(self, home: str | Path, store_url: str | None = None, python: str | None = None) -> None:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        if os.environ.get("DURABLE_ROLLOUTS_PYTHONPATH"):
            env["PYTHONPATH"] = os.environ["DURABLE_ROLLOUTS_PYTHONPATH"]
        env["PYTHONSAFEPATH"] = "1"
        argv = [
            python or sys.executable,
            "-P",
            "-m",
            "durable_rollouts_trl.sidecar",
            str(home),
            store_url or "",
        ]
        self._lock = threading.Lock()
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True, bufsize=1
        )
        self._read("start")

    def _read(self, op: str) -> Any:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            raise BridgeError(f"durable-rollouts sidecar exited ({code}) during {op}; see its stderr above")
        reply = json.loads(line)
        if not reply["ok"]:
            raise BridgeError(reply["error"])
        return reply["result"]

    def call(self, op: str, **args: Any) -> Any:
        """Run one operation of :class:`durable_rollouts_trl.sidecar.Sidecar` (``op_<op>``)."""
        with self._lock:
            if self.proc.poll() is not None:
                raise BridgeError(f"durable-rollouts sidecar exited ({self.proc.returncode})")
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
            self.proc.stdin.flush()
            return self._read(op)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        """Stop the sidecar (by its pid): close its stdin, then terminate if it lingers."""
        if self.proc.poll() is None:
            try:
                if self.proc.stdin:
                    self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except (subprocess.TimeoutExpired, OSError):
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()
