"""Store fixtures for both backends: ``store_url`` (params sqlite and postgres) and ``any_store``.

PostgreSQL: ``ROLLOUTS_TEST_POSTGRES`` (the URL of a server the tests may create databases on) if set,
else one cluster per session in a temporary directory (store/local_postgres.py), started and stopped by
pid. Each test gets a database of its own, dropped when it ends. A missing PostgreSQL skips, which under
``CI=true`` is a failure (tests/conftest.py).
"""

from __future__ import annotations

import hashlib
import itertools
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from durable_rollouts.stack.procs import free_port
from durable_rollouts.store import RunStore, open_store
from durable_rollouts.store.local_postgres import database_url, local_postgres, postgres_bin

BACKENDS = ["sqlite", "postgres"]
_seq = itertools.count()


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[str]:
    """The URL of a PostgreSQL server's maintenance database (``postgres``)."""
    url = os.environ.get("ROLLOUTS_TEST_POSTGRES")
    if url:
        yield url
        return
    if postgres_bin() is None:
        pytest.skip("PostgreSQL is not installed (apt-get install postgresql; .ci/with-services.sh does)")
    with local_postgres(free_port(), {"fsync": "off"}) as url:
        yield url


def new_database(server: str, label: str) -> str:
    """Create a fresh database on ``server``; returns its URL."""
    import psycopg

    digest = hashlib.sha256(f"{label}-{os.getpid()}-{next(_seq)}".encode()).hexdigest()[:16]
    name = f"t_{digest}"
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return database_url(server, name)


def drop_database(server: str, url: str) -> None:
    import psycopg

    name = url.rsplit("/", 1)[1]
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(params=BACKENDS)
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A store URL of an empty store: a directory (sqlite) or a database of its own (postgres)."""
    if request.param == "sqlite":
        yield str(tmp_path / "store")
        return
    server = request.getfixturevalue("postgres_server")
    url = new_database(server, request.node.nodeid)
    yield url
    drop_database(server, url)


@pytest.fixture
def any_store(store_url: str) -> Iterator[RunStore]:
    """An empty store on each backend."""
    store = open_store(store_url)
    yield store
    store.close()
