"""faults/pgrestart.py on a real PostgreSQL server (store/local_postgres.py): found by its data directory's
pid file, stopped by that pid, started again with the same command line on the same data; the store's
connection that the restart broke fails once as a retryable `StoreError` and the next statement reconnects;
a pid file that names another process is never acted on."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from durable_rollouts.errors import StoreError
from durable_rollouts.faults import pgrestart
from durable_rollouts.faults.pgrestart import PgRestartError
from durable_rollouts.stack.procs import free_port
from durable_rollouts.store.db import PostgresDatabase
from durable_rollouts.store.local_postgres import local_postgres, postgres_bin


@pytest.fixture
def server_url() -> Iterator[str]:
    if postgres_bin() is None:
        pytest.skip("PostgreSQL is not installed (apt-get install postgresql; .ci/with-services.sh does)")
    with local_postgres(free_port(), {"fsync": "off"}) as url:
        db = PostgresDatabase(url)
        data = Path(str(db.execute("SHOW data_directory").fetchone()[0]))
        db.close()
        try:
            yield url
        finally:  # a server this test started again is not local_postgres's process: stop it by its pid
            if (data / "postmaster.pid").exists():
                pgrestart.stop(pgrestart.find(data), timeout_s=15)


@pytest.mark.timeout(120)
def test_the_server_restarts_on_its_data_and_the_store_reconnects(server_url: str) -> None:
    db = PostgresDatabase(server_url)
    db.execute("CREATE TABLE kept (k INTEGER PRIMARY KEY)")
    db.execute("INSERT INTO kept VALUES (1)")
    server = pgrestart.find_for(db)
    assert server.argv[0].endswith("/postgres") and server.netns is None
    assert server.uid == os.stat(server.data_dir).st_uid  # as the user that owns the data, not root

    with pgrestart.stopped(server):
        assert not (server.data_dir / "postmaster.pid").exists()
        with pytest.raises(StoreError, match="store postgresql://"):
            db.execute("SELECT 1")  # the connection the shutdown closed: retryable, one line
        with pytest.raises(StoreError, match="cannot connect"):
            db.execute("SELECT 1")  # and a new one finds no server

    again = pgrestart.find(server.data_dir)
    assert again.pid != server.pid and again.argv == server.argv
    assert db.execute("SELECT k FROM kept").fetchall() == [(1,)]  # the same data, reconnected
    db.close()


def test_a_pid_file_naming_another_process_is_refused(tmp_path: Path) -> None:
    (tmp_path / "postmaster.pid").write_text(f"{os.getpid()}\n{tmp_path}\n")
    with pytest.raises(PgRestartError, match="is not that server"):
        pgrestart.find(tmp_path)
    with pytest.raises(PgRestartError, match="no running PostgreSQL"):
        pgrestart.find(tmp_path / "nowhere")
