"""Paths and types the Harbor plug-in's tests share (a module of its own: ``conftest`` is a name the SWE
plug-in's tests use too)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]
EXAMPLES = PACKAGE / "examples"
REPO = PACKAGE.parents[1]

MakeTask = Callable[..., Path]
