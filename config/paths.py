"""Where the project keeps its state: the state directory and the repository's bundled assets."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
"""The checkout this code runs from (bundled model, tasks and example configs live under it)."""


def rollouts_home() -> Path:
    """The state directory: ``$ROLLOUTS_HOME`` if set, else ``.rollouts/`` in the working directory."""
    return Path(os.environ.get("ROLLOUTS_HOME") or ".rollouts").resolve()


def venv_bin(name: str) -> Path:
    """A console script installed beside the running interpreter (temporal, temporal-test-server); where
    none is (a ``pip install --target`` image), the one on ``PATH``; else the path beside the interpreter,
    so that the caller's error names where it looked."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return beside
    found = shutil.which(name)
    return Path(found) if found else beside


def resolve_repo_path(path: str | Path) -> Path:
    """A path as given if absolute or existing from the working directory, else under the repository."""
    p = Path(path)
    if p.is_absolute() or p.exists():
        return p.resolve()
    return (REPO_ROOT / p).resolve()
