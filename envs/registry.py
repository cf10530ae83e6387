"""The environment registry: environments are found by name through Python entry points.

Invariant: the core never names an environment. ``run.env`` is looked up here, among the entry points of
the group ``durable_rollouts.environments`` of every installed distribution (this project registers
``math`` and ``coding``; a user's own package registers its own in its ``pyproject.toml``)::

    [project.entry-points."durable_rollouts.environments"]
    swe = "swe_env:SweEnvironment"

An entry point names an `Environment` subclass; it is instantiated once per process (no arguments).
"""

from __future__ import annotations

import functools
from importlib.metadata import EntryPoint, entry_points

from envs.base import Environment
from errors import ConfigError

GROUP = "durable_rollouts.environments"


def installed() -> dict[str, EntryPoint]:
    """Every registered environment's entry point, by name."""
    return {ep.name: ep for ep in entry_points(group=GROUP)}


@functools.cache
def get(name: str) -> Environment:
    """The environment registered as ``name``.

    Raises:
        ConfigError: no such environment (the message lists the installed ones), or its entry point does
            not load or does not name an `Environment` subclass.
    """
    eps = installed()
    if name not in eps:
        names = ", ".join(sorted(eps)) or "none"
        raise ConfigError(f"run.env: unknown environment {name!r} (installed: {names})")
    try:
        cls = eps[name].load()
    except Exception as e:  # a broken plug-in: say which, in one line
        raise ConfigError(f"run.env: environment {name!r} ({eps[name].value}) does not load: {e}") from e
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ConfigError(f"run.env: {eps[name].value} is not an Environment subclass")
    if getattr(cls, "name", None) != name:
        raise ConfigError(
            f"run.env: {eps[name].value} is registered as {name!r} but names itself {cls.name!r}"
        )
    return cls()


def find(name: str) -> Environment | None:
    """The environment registered as ``name``, or None when it is not installed (or does not load)."""
    try:
        return get(name)
    except ConfigError:
        return None
