"""faults/pgrestart.py on a real PostgreSQL server (store/local_postgres.py): found by its data directory's
pid file, stopped by that pid, started again with the same command line on the same data; a store's
statement while the server is down waits for it (``reconnect_s``) and lands once, or fails as a retryable
`StoreError` after that window; one on a connection left idle across the restart runs once on a new
connection; a pid file that names another process is never acted on."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
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
def test_the_server_restarts_on_its_data_and_the_store_rides_it_out(server_url: str) -> None:
    db = PostgresDatabase(server_url, reconnect_s=0.5)  # gives up at once: the down window seen as errors
    db.execute("CREATE TABLE kept (k INTEGER PRIMARY KEY)")
    db.execute("INSERT INTO kept VALUES (1)")
    idle, idle_tx, waiting = (PostgresDatabase(server_url) for _ in range(3))
    for d in (idle, idle_tx, waiting):
        assert d.execute("SELECT count(*) FROM kept").fetchone()[0] == 1  # each opens its connection
    server = pgrestart.find_for(db)
    assert server.argv[0].endswith("/postgres") and server.netns is None
    assert server.uid == os.stat(server.data_dir).st_uid  # as the user that owns the data, not root

    with ThreadPoolExecutor(1) as pool, pgrestart.stopped(server):
        assert not (server.data_dir / "postmaster.pid").exists()
        with pytest.raises(StoreError, match=r"^store postgresql://\S+: cannot connect: ") as e:
            db.execute("SELECT 1")  # its connection ended, and no server to reconnect to within 0.5 s
        assert e.value.retryable and "\n" not in str(e.value)
        # a write issued while the server is down waits for it (reconnect_s, 30 s) and lands once
        written = pool.submit(waiting.execute, "INSERT INTO kept VALUES (4) RETURNING k")
        time.sleep(1.0)
        assert not written.done()

    assert written.result(timeout=30).fetchall() == [(4,)]
    again = pgrestart.find(server.data_dir)
    assert again.pid != server.pid and again.argv == server.argv
    assert db.execute("SELECT k FROM kept").fetchall()[0] == (1,)  # the same data, reconnected
    # a connection left idle across the restart: the server ended it, so the statement (or the
    # transaction's BEGIN) runs once on a new connection, with no error
    assert idle.execute("INSERT INTO kept VALUES (2) RETURNING k").fetchall() == [(2,)]
    with idle_tx.tx() as tx:
        tx.execute("INSERT INTO kept VALUES (3)")
    assert db.execute("SELECT k FROM kept ORDER BY k").fetchall() == [(1,), (2,), (3,), (4,)]
    for d in (db, idle, idle_tx, waiting):
        d.close()


def test_a_pid_file_naming_another_process_is_refused(tmp_path: Path) -> None:
    (tmp_path / "postmaster.pid").write_text(f"{os.getpid()}\n{tmp_path}\n")
    with pytest.raises(PgRestartError, match="is not that server"):
        pgrestart.find(tmp_path)
    with pytest.raises(PgRestartError, match="no running PostgreSQL"):
        pgrestart.find(tmp_path / "nowhere")
