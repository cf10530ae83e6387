"""Where the project keeps its state, and how a path named in a config or on a command line is found.

Invariant: nothing here assumes a checkout. A path is absolute, relative to the working directory, or a
resource of an installed package written ``PACKAGE:RELATIVE`` (``math_env:data/addition.jsonl``, the bundled
tiny policy ``engines:tiny-policy``), read through `importlib.resources`; so an installed
wheel finds its bundled model, tasks and example configs wherever it is installed.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import os
import shutil
import sys
from pathlib import Path

from durable_rollouts.errors import ConfigError

TINY_POLICY = "durable_rollouts.engines:tiny-policy"
"""The bundled tiny policy (a Hugging Face model directory shipped as package data)."""


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


def is_resource(path: str | Path) -> bool:
    """Whether ``path`` is written as a package resource, ``PACKAGE:RELATIVE``."""
    text = str(path)
    package, sep, _ = text.partition(":")
    return bool(sep) and bool(package) and all(part.isidentifier() for part in package.split("."))


def resource_path(spec: str, what: str = "path") -> Path:
    """The file or folder ``PACKAGE:RELATIVE`` names, inside the installed package.

    Raises:
        ConfigError: the package is not installed or holds no such file (one line naming ``what``).
    """
    package, _, relative = spec.partition(":")
    try:
        found = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        found = None
    if found is None:
        raise ConfigError(f"{what}: {spec!r} names package {package!r}, which is not installed")
    target = importlib.resources.files(package).joinpath(*Path(relative).parts)
    if not target.is_file() and not target.is_dir():
        raise ConfigError(f"{what}: {spec!r}: package {package!r} has no {relative!r}")
    return Path(str(target)).resolve()


def resolve_path(path: str | Path, what: str = "path") -> Path:
    """A path as given (absolute, or relative to the working directory), or a package resource
    (``PACKAGE:RELATIVE``, `resource_path`). A relative path that does not exist is returned resolved, so
    that the caller's error names where it looked."""
    if is_resource(path):
        return resource_path(str(path), what)
    return Path(path).resolve()
