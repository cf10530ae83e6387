"""Fixtures of the Harbor plug-in's tests: the bundled example dataset, and a factory of task directories.

No ``__init__.py`` here: these modules are imported by their own names (``test_harbor_*``), so they never
collide with the core's ``tests`` package.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from harbor_paths import MakeTask


@pytest.fixture
def make_task(tmp_path: Path) -> MakeTask:
    """Write a minimal valid task directory (``toml`` replaces its task.toml; ``drop`` removes files)."""

    def make(name: str = "t1", toml: str | None = None, drop: tuple[str, ...] = (), **files: str) -> Path:
        d = tmp_path / name
        contents = {
            "task.toml": '[agent]\ntimeout_sec = 60.0\n\n[environment]\nnetwork_mode = "no-network"\n',
            "instruction.md": "Do the thing.\n",
            "environment/Dockerfile": "FROM harbor-examples/base:bookworm\nWORKDIR /app\n",
            "tests/test.sh": "#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n",
            "solution/solve.sh": "#!/bin/bash\ntrue\n",
        }
        if toml is not None:
            contents["task.toml"] = toml
        contents.update({k.replace("__", "/"): v for k, v in files.items()})
        for rel, text in contents.items():
            if rel in drop:
                continue
            p = d / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text)
        return d

    return make
