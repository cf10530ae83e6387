"""A container's cgroup freezer, read and set directly (not through Docker): the way the fault kit thaws a
sandbox whose ``docker unpause`` hangs or whose failed ``docker pause`` left it frozen.

cgroup v1 (``<root>/freezer/.../freezer.state``: THAWED, FREEZING, FROZEN) and cgroup v2
(``cgroup.freeze`` 0/1, ``cgroup.events``' ``frozen`` line), for the cgroupfs driver's ``docker/<id>``
and the systemd driver's ``system.slice/docker-<id>.scope``.

Invariant: a state is only reported once the kernel reads it back (``set`` waits for it); nothing here
touches a cgroup other than the container's own.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
THAWED, FREEZING, FROZEN = "THAWED", "FREEZING", "FROZEN"
POLL_S = 0.01


@dataclass(frozen=True)
class Freezer:
    """The freezer of one container's cgroup (``v2``: a unified-hierarchy cgroup directory)."""

    path: Path
    v2: bool = False

    def state(self) -> str:
        """THAWED, FREEZING or FROZEN as the kernel reads it now (OSError: the cgroup is gone)."""
        if not self.v2:
            return (self.path / "freezer.state").read_text().strip()
        wanted = (self.path / "cgroup.freeze").read_text().strip() == "1"
        events = (self.path / "cgroup.events").read_text().split("\n")
        frozen = any(line.strip() == "frozen 1" for line in events)
        return FROZEN if frozen else (FREEZING if wanted else THAWED)

    def set(self, want: str, wait_s: float = 5.0) -> bool:
        """Write ``want`` (THAWED or FROZEN) and wait up to ``wait_s`` until it reads back; the write is
        repeated while waiting (cgroup v1 may need it: a task that joined meanwhile). Returns whether it
        reads ``want``."""
        deadline = time.monotonic() + wait_s
        while True:
            if self.v2:
                (self.path / "cgroup.freeze").write_text("1" if want == FROZEN else "0")
            else:
                (self.path / "freezer.state").write_text(want)
            if self.state() == want:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S)


def find(container_id: str, root: Path = CGROUP_ROOT) -> Freezer | None:
    """The freezer of the container ``container_id`` (its full id) under ``root``; None when it has no
    cgroup there (not running, or removed)."""
    if (root / "freezer").is_dir():  # cgroup v1: the freezer controller's own hierarchy
        for rel in (f"docker/{container_id}", f"system.slice/docker-{container_id}.scope"):
            if (root / "freezer" / rel / "freezer.state").is_file():
                return Freezer(root / "freezer" / rel)
        return None
    for rel in (f"system.slice/docker-{container_id}.scope", f"docker/{container_id}"):
        if (root / rel / "cgroup.freeze").is_file():
            return Freezer(root / rel, v2=True)
    return None
