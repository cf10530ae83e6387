"""The code a benchmark measures: a commit extracted from this checkout (``git archive``) or the checkout
itself, and how to import and run it (its module names, ``PYTHONPATH``, its ``rollouts`` command) whatever
its layout: older commits import their folders as top-level packages, newer ones install under the
``durable_rollouts`` namespace.

Invariant: nothing here changes the checkout; an extracted commit lives where the caller puts it, and its
import link beside it.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent  # the checkout the benchmarks run from


@dataclass(frozen=True)
class Code:
    label: str
    commit: str
    root: Path
    sets: tuple[tuple[str, Any], ...] = ()
    """Run-config overrides of this sitting's runs (a ``--variant`` of the current code)."""

    @property
    def cli(self) -> str:
        """The module of its ``rollouts`` command."""
        return cli_module(self.root)


def namespaced(root: Path) -> bool:
    """Whether the code at ``root`` installs under the ``durable_rollouts`` namespace (its folders mapped
    onto the repository's top level); older commits import its folders as top-level packages."""
    pyproject = root / "pyproject.toml"
    return pyproject.is_file() and 'package-dir = {"durable_rollouts" = "."}' in pyproject.read_text()


def module(root: Path, name: str) -> str:
    """The importable name of the code at ``root``'s module ``name`` (``workers.worker``, ...)."""
    return f"durable_rollouts.{name}" if namespaced(root) else name


def import_path(root: Path) -> str:
    """What goes on ``PYTHONPATH`` to import the code at ``root``: the root itself for older commits; for the
    namespace layout, a folder beside it holding a link ``durable_rollouts`` to it."""
    if not namespaced(root):
        return str(root)
    base = root.parent / f"{root.name}.import"
    link = base / "durable_rollouts"
    if not link.exists():
        base.mkdir(exist_ok=True)
        link.symlink_to(root, target_is_directory=True)
    return str(base)


def cli_module(root: Path) -> str:
    """The module of the ``rollouts`` command in the code at ``root`` (``workers.cli`` in commits before
    the ``cli`` package)."""
    return module(root, "cli.rollouts") if (root / "cli" / "rollouts.py").is_file() else "workers.cli"


def git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()


def checkout(commit: str, dest: Path) -> Path:
    """The tree of ``commit`` extracted under ``dest`` (git archive)."""
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", commit], cwd=REPO_ROOT, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return dest
