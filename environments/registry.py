"""The environment registry: environments are found by name through Python entry points.

Invariant: the core never names an environment. ``run.env`` is looked up here, among the entry points of
the group ``environments`` of every installed distribution (the core registers none; the
plug-ins under ``environments/`` register ``math``, ``coding``, ``swe``, ...; a user's own package registers
its own the same way, in its ``pyproject.toml``)::

    [project.entry-points."durable_rollouts.environments"]
    swe = "swe_env:SweEnvironment"

An entry point names an `Environment` subclass; it is instantiated once per process (no arguments).

Entry points are read once per process, so a worker knows the environments installed when it started. A worker
advertises each environment it loaded by polling that environment's task queue (`env_queue`: the run's queue
plus the name and ``env_version``), and `rollouts run` starts a run on the queue of its environment at the
version the submitter sees: so a run's workflows and activities only ever go to workers that can load its
environment at its version, and submission refuses a run no live worker can take (environments/fleet.py).
"""

from __future__ import annotations

import functools
from importlib.metadata import EntryPoint, entry_points

from durable_rollouts.environments.base import Environment
from durable_rollouts.errors import ConfigError

GROUP = "durable_rollouts.environments"
ENV_QUEUE_MARK = "@env-"
"""What separates a task queue from the environment part of its name (`env_queue`)."""


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


def loadable() -> dict[str, str]:
    """The environments this process can load, name -> ``env_version`` (a broken one is left out)."""
    found = {}
    for name in sorted(installed()):
        env = find(name)
        if env is not None:
            found[name] = env.env_version
    return found


def env_queue(task_queue: str, name: str, env_version: str) -> str:
    """The task queue of runs of environment ``name`` at ``env_version`` on ``task_queue``: polled only by
    workers that loaded that environment at that version."""
    return f"{task_queue}{ENV_QUEUE_MARK}{name}:{env_version}"


def run_queue(task_queue: str, name: str) -> str:
    """The queue a run of ``name`` is started on: its environment's, at the version this process loads.

    Raises:
        ConfigError: no such environment here, or it does not load.
    """
    return env_queue(task_queue, name, get(name).env_version)


def env_part(queue: str) -> str:
    """The environment part of a queue name (``@env-NAME:VERSION``; empty for a queue of no environment):
    what a sandbox host's queue carries for runs of that environment (``host queue + env_part``)."""
    at = queue.rfind(ENV_QUEUE_MARK)
    return queue[at:] if at >= 0 else ""
