"""Which store a process uses: one URL, given or from ``$ROLLOUTS_STORE``, else the home directory.

- ``postgresql://user[:password]@host[:port]/db`` (or ``postgres://``): a PostgreSQL server; every host
  of a run can share it.
- ``sqlite:///abs/path/home``, or a plain path: the embedded store, ``store.sqlite`` in that directory.
- unset: ``$ROLLOUTS_HOME`` (default ``.rollouts/``), as before there was a choice.
"""

from __future__ import annotations

import os
from pathlib import Path

from durable_rollouts.config.paths import rollouts_home
from durable_rollouts.errors import ConfigError
from durable_rollouts.store.db import PostgresDatabase
from durable_rollouts.store.runstore import RunStore

STORE_ENV = "ROLLOUTS_STORE"


def store_url(url: str | Path | None = None, home: Path | None = None) -> str:
    """The store URL in effect: ``url`` if given, else ``$ROLLOUTS_STORE``, else the home directory
    (``home``, or ``$ROLLOUTS_HOME``)."""
    if url is not None and str(url) != "":
        return str(url)
    return os.environ.get(STORE_ENV) or str(home or rollouts_home())


def is_postgres(url: str) -> bool:
    return url.startswith(("postgresql://", "postgres://"))


def sqlite_home(url: str) -> Path | None:
    """The home directory an embedded-store URL names (None for a server URL)."""
    if is_postgres(url):
        return None
    if url.startswith("sqlite://"):
        path = url.removeprefix("sqlite://")
        if not path.startswith("/"):
            raise ConfigError(f"store {url}: a sqlite URL names an absolute directory (sqlite:///abs/path)")
        return Path(path)
    if "://" in url:
        raise ConfigError(f"store {url}: unknown scheme (use postgresql://..., sqlite:///dir or a directory)")
    return Path(url).expanduser().resolve()


def store_exists(url: str | Path | None = None, home: Path | None = None) -> bool:
    """Whether the store holds anything yet (a server is assumed to; an embedded store needs its file)."""
    home = sqlite_home(store_url(url, home))
    return home is None or (home / "store.sqlite").exists()


def open_store(url: str | Path | None = None, home: Path | None = None) -> RunStore:
    """The run store ``url`` names, else the configured one (see `store_url` and the module docstring);
    its schema is migrated on open.

    Raises:
        ConfigError: An unknown scheme, or a server that does not answer (one line naming the URL).
    """
    resolved = store_url(url, home)
    directory = sqlite_home(resolved)
    if directory is None:
        return RunStore(PostgresDatabase(resolved))
    return RunStore(directory)
