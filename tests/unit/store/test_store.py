"""Run store, on both backends (SQLite, PostgreSQL; the ``store_url``/``any_store`` fixtures of
tests/postgres.py): idempotent writes keyed by ids that survive retries; append-only token sequences
stored packed; versioned migrations; stores of the previous schema still read."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

import durable_rollouts.store.runstore as runstore
import durable_rollouts.store.segments as segments
from durable_rollouts.store import RunStore, open_store
from durable_rollouts.store.runstore import SCHEMA_VERSION, Segment


def seg(name: str, start: int, ids: list[int], kind: str = "model") -> Segment:
    lp = [-0.5] * len(ids) if kind == "model" else None
    return Segment(name=name, kind=kind, turn=0, start=start, token_ids=ids, logprobs=lp)


def test_segment_write_is_idempotent_and_keeps_the_first(any_store: RunStore) -> None:
    first = any_store.put_segment("run/g/0", seg("t00000.model", 0, [1, 2, 3]))
    again = any_store.put_segment("run/g/0", seg("t00000.model", 0, [9, 9]))
    assert first.token_ids == again.token_ids == [1, 2, 3]
    assert len(any_store.segments("run/g/0")) == 1


def test_token_arrays_round_trip_packed(any_store: RunStore) -> None:
    ids = [0, 1, 2**31 - 1, 151_643, 7]
    lps = [-0.0, -1e-8, -0.6931471805599453, float("-inf"), -27.5]
    versions = ["v0", "v0", "v1", None, None]
    written = Segment(name="t00000.model", kind="model", turn=0, start=0, token_ids=ids, logprobs=lps)
    written.policy_versions = versions
    returned = any_store.put_segment("r", written)
    stored = any_store.get_segment("r", "t00000.model")
    assert stored is not None and stored == returned
    assert stored.token_ids == ids and stored.policy_versions == versions
    assert stored.logprobs is not None
    assert stored.logprobs[:2] == [-0.0, pytest.approx(-1e-8, rel=1e-6)]
    assert stored.logprobs[3] == float("-inf")
    assert stored.logprobs[2] == pytest.approx(lps[2], rel=1e-7) and stored.logprobs[2] != lps[2]  # float32
    q = "SELECT tokens, logprobs, versions FROM segments WHERE rollout_id='r'"
    row = any_store.db.execute(q).fetchone()
    assert len(row[0]) == 4 * len(ids) and len(row[1]) == 4 * len(lps)  # int32 / float32, not JSON text
    assert json.loads(row[2]) == [["v0", 2], ["v1", 1], [None, 2]]


def test_token_sequence_is_the_concatenation_in_order(any_store: RunStore) -> None:
    any_store.put_segment("r", seg("prompt", 0, [5, 6], kind="prompt"))
    any_store.put_segment("r", seg("t00000.model", 2, [7]))
    any_store.put_segment("r", seg("t00000.obs", 3, [8, 9], kind="observation"))
    assert any_store.token_ids("r") == [5, 6, 7, 8, 9]


def test_a_growing_context_reads_only_the_new_segments_and_another_store_sees_them(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, other = open_store(store_url), open_store(store_url)
    store.put_segment("r", seg("prompt", 0, [5, 6], kind="prompt"))
    assert store.token_ids("r") == [5, 6]
    reads: list[int] = []
    real = segments.unpack_ids
    monkeypatch.setattr(segments, "unpack_ids", lambda data: reads.append(len(data)) or real(data))
    other.put_segment("r", seg("t00000.model", 2, [7]))  # written by another worker's store
    other.put_segment("r", seg("t00000.obs", 3, [8], kind="observation"))
    context = store.token_ids("r")
    assert context == [5, 6, 7, 8] and reads == [4, 4]  # the prompt's array is not read again
    context.append(99)  # the caller's list is its own
    assert store.token_ids("r") == [5, 6, 7, 8]


def test_a_gap_in_the_sequence_is_an_error(any_store: RunStore) -> None:
    any_store.put_segment("r", seg("prompt", 0, [5, 6], kind="prompt"))
    any_store.put_segment("r", seg("t00000.model", 3, [7]))
    with pytest.raises(ValueError, match="starts at 3, not 2"):
        any_store.token_ids("r")


def test_segment_meta_updates_from_many_threads_lose_none(store_url: str) -> None:
    store = open_store(store_url)
    store.put_segment("r", seg("t00000.model", 0, [1]))

    def mark(i: int) -> None:
        for j in range(5):
            store.update_segment_meta("r", "t00000.model", **{f"k{i}_{j}": j})

    threads = [threading.Thread(target=mark, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got = store.get_segment("r", "t00000.model")
    assert got is not None and len(got.meta) == 30
    store.close()


def _record(rid: str, reward: float) -> dict:
    return {
        "rollout_id": rid,
        "run_id": "run",
        "group_id": "g",
        "task_id": "t",
        "sample_index": 0,
        "env": "math",
        "outcome": "completed",
        "reason": None,
        "reward": reward,
        "scorable": 1,
        "advantage": None,
        "prompt_length": 2,
        "num_tokens": 3,
        "sampling_json": "{}",
        "extra_json": "{}",
    }


def test_rollout_record_is_written_once(any_store: RunStore) -> None:
    assert any_store.put_rollout(_record("run/g/0", 1.0))
    assert not any_store.put_rollout(_record("run/g/0", 0.0))
    rows = any_store.rollouts("run")
    assert len(rows) == 1 and rows[0]["reward"] == 1.0
    assert any_store.group_counts("run", ["g"]) == {"g": (1, 0, 1, 3)}  # completed, 3 tokens


def test_a_task_is_read_once_per_store_object_and_every_caller_gets_its_own_copy(
    any_store: RunStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    any_store.put_tasks("run", [{"id": "t1", "prompt": "1+1"}, {"id": "t2", "prompt": "2+2"}])
    assert any_store.cached_task("run", "t1") is None  # never read by this object: no answer without I/O
    first = any_store.get_task("run", "t1")
    first["prompt"] = "changed by a caller"
    assert any_store.cached_task("run", "t1") == {"id": "t1", "prompt": "1+1"}
    monkeypatch.setattr(runstore, "TASK_CACHE", 1)
    any_store.get_task("run", "t2")  # the cache keeps the most recent TASK_CACHE tasks
    assert any_store.cached_task("run", "t1") is None
    assert any_store.get_task("run", "t1") == {"id": "t1", "prompt": "1+1"}  # read again from the database
    with pytest.raises(KeyError, match="no task 't3'"):
        any_store.get_task("run", "t3")


def test_attempts_that_stored_tokens_without_a_record_are_found_by_their_group(any_store: RunStore) -> None:
    for rid in ("run/g1/0", "run/g1/1", "run/g1/1r1", "run/g10/0", "run/g0/2", "run2/g1/0"):
        any_store.put_segment(rid, seg("prompt", 0, [1, 2], kind="prompt"))
    any_store.put_rollout(_record("run/g1/1", 0.0))
    # g10 and g0 sort next to g1 and are other groups; run2 is another run; run/g1/1 has its record
    assert any_store.unrecorded_with_segments("run/g1/") == ["run/g1/0", "run/g1/1r1"]
    assert any_store.unrecorded_with_segments("run/g2/") == []


def test_store_is_shared_between_instances(store_url: str) -> None:
    assert open_store(store_url).register_run("run", "{}", "h")
    assert not open_store(store_url).register_run("run", '{"x": 1}', "h2")
    assert open_store(store_url).get_run("run")["config_hash"] == "h"


def test_logs_and_marks_on_each_backend(any_store: RunStore) -> None:
    assert any_store.put_manual_action("run", "run/g/0", "cancel", "manual", {"a": 1}) == 1
    assert any_store.put_manual_action("run", "run/g/1", "retry", None, {}) == 2
    any_store.put_dispatch_log("run", 0, 1.5, {"admit": 2})
    any_store.put_dispatch_log("run", 0, 9.9, {"admit": 99})  # a retried poll keeps the first
    assert any_store.dispatch_log("run") == [{"admit": 2}]
    assert any_store.put_policy("v1", "h" * 64, "/w", ["e"])["seq"] == 1
    assert any_store.put_policy("v1", "x" * 64, "/x", [])["weights_hash"] == "h" * 64
    batch, written = any_store.put_feed_marks(
        "run", [{"group_id": "g", "state": "consumed", "records": 2, "tokens": 10, "lag": 0}]
    )
    assert (batch, written) == ("b000001", ["g"])
    again = any_store.put_feed_marks(
        "run", [{"group_id": "g", "state": "discarded", "records": 2, "tokens": 10, "reason": "stale"}]
    )
    assert again == (None, [])


def test_text_sorts_bytewise_on_both_backends(any_store: RunStore) -> None:
    ids = ["run/g-1", "run/g.1", "run/G1", "run/g_1", "run/g1", "run/g 1"]
    for i, gid in enumerate(ids):
        any_store.put_group("run", gid, "t", {"i": i})
    assert [g["i"] for g in any_store.groups("run")] == [ids.index(g) for g in sorted(ids)]


def test_migrations_are_versioned_and_applied_once(store_url: str) -> None:
    store = open_store(store_url)
    assert store.schema_version() == SCHEMA_VERSION >= 3
    barrier = threading.Barrier(4)
    errors: list[BaseException] = []

    def reopen() -> None:
        barrier.wait()
        try:
            assert open_store(store_url).schema_version() == SCHEMA_VERSION
        except BaseException as e:  # reported by the assert below
            errors.append(e)

    threads = [threading.Thread(target=reopen) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_a_store_of_the_previous_schema_is_migrated_and_its_json_segments_still_read(tmp_path: Path) -> None:
    from durable_rollouts.store.schema import BASE, MIGRATIONS

    old = sqlite3.connect(tmp_path / "store.sqlite")  # as release 0.2.0 wrote it: schema 1, JSON blob files
    old.executescript(BASE + MIGRATIONS[0][1] + "PRAGMA user_version=1;")
    blob = tmp_path / "blobs" / "r" / "prompt.json"
    blob.parent.mkdir(parents=True)
    blob.write_text(json.dumps({"token_ids": [5, 6], "logprobs": None, "policy_versions": None}))
    old.execute(
        "INSERT INTO segments (rollout_id, name, kind, turn, start, length, blob, meta_json)"
        " VALUES ('r', 'prompt', 'prompt', NULL, 0, 2, 'blobs/r/prompt.json', '{}')"
    )
    old.commit()
    old.close()
    store = RunStore(tmp_path)
    assert store.schema_version() == SCHEMA_VERSION
    store.put_segment("r", seg("t00000.model", 2, [7, 8]))  # a new segment is packed
    assert store.token_ids("r") == [5, 6, 7, 8]
    assert [s.token_ids for s in RunStore(tmp_path).segments("r")] == [[5, 6], [7, 8]]


def test_a_store_whose_version_a_previous_release_wrote_back_migrates_again_and_keeps_its_rows(
    tmp_path: Path,
) -> None:
    store = RunStore(tmp_path)
    store.put_segment("r", seg("prompt", 0, [5, 6]))
    # A 0.2.0 worker that read version 0 before this release migrated wrote its own version afterwards.
    conn = sqlite3.connect(tmp_path / "store.sqlite")
    conn.execute("PRAGMA user_version=1")
    conn.close()
    again = RunStore(tmp_path)  # the migrations run again: columns already added are not added twice
    assert again.schema_version() == SCHEMA_VERSION
    assert again.token_ids("r") == [5, 6]


def test_the_store_url_picks_the_backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from durable_rollouts.errors import ConfigError
    from durable_rollouts.store.db import PostgresDatabase, SqliteDatabase, redact

    monkeypatch.setenv("ROLLOUTS_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("ROLLOUTS_STORE", raising=False)
    assert open_store().root == tmp_path / "home"
    assert isinstance(open_store(f"sqlite://{tmp_path}/a").db, SqliteDatabase)
    monkeypatch.setenv("ROLLOUTS_STORE", str(tmp_path / "b"))
    assert open_store().root == tmp_path / "b"
    with pytest.raises(ConfigError, match="unknown scheme"):
        open_store("mysql://x/y")
    with pytest.raises(ConfigError, match="absolute directory"):
        open_store("sqlite://relative/dir")
    with pytest.raises(ConfigError, match=r"store postgresql://u:\*\*\*@127.0.0.1:1/db: cannot connect"):
        open_store("postgresql://u:secret@127.0.0.1:1/db")
    assert redact("postgresql://u:secret@h:5/db") == "postgresql://u:***@h:5/db"
    assert PostgresDatabase("postgresql://h/db").location == "postgresql://h/db"


def test_tasks_uploaded_at_submit_are_what_a_worker_on_another_host_loads(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from typer.testing import CliRunner

    import durable_rollouts.cli.rollouts as cli
    from durable_rollouts.activities.rollout import RolloutActivities
    from durable_rollouts.contracts.activity_io import LoadRunInput

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(
        '{"id": "a", "prompt": "1+1=", "answer": "2"}\n{"id": "b", "prompt": "2+2=", "answer": "4"}\n'
    )
    submitted: list[str] = []

    async def submit(
        cfg: object, cfg_hash: str, rid: str, wait: bool, upload: Callable[[], object], conn: object = None
    ) -> None:
        submitted.append(rid)
        upload()  # what the real one does once a live worker can take the run (environments/fleet.py)

    monkeypatch.setattr(cli, "_submit", submit)
    monkeypatch.setenv("ROLLOUTS_HOME", str(tmp_path / "elsewhere"))
    argv = [
        "run",
        "--task-file",
        str(tasks),
        "--run-id",
        "up1",
        "--set",
        f"store.url={json.dumps(store_url)}",
    ]
    result = CliRunner().invoke(cli.app, argv)
    assert result.exit_code == 0, result.output
    assert submitted == ["up1"]
    tasks.unlink()  # the worker's host has no such file
    store = open_store(store_url)
    acts = RolloutActivities(store, engine=None)  # type: ignore[arg-type]  # load_run never calls it
    inp = LoadRunInput(run_id="up1", config_json="{}", config_hash="h", task_file=str(tasks), env="math")
    loaded = asyncio.run(acts.load_run(inp))
    assert loaded.num_tasks == 2 and store.task_at("up1", 1)["id"] == "b"
    assert store.get_run("up1") is not None


def test_the_store_url_of_a_config_stays_out_of_the_run_it_submits() -> None:
    from durable_rollouts.config.load import config_hash, load_config

    cfg = load_config(None, ['store.url="postgresql://u:secret@db/rollouts"'])
    assert cfg.store.url == "postgresql://u:secret@db/rollouts"
    assert "store" not in cfg.model_dump() and "secret" not in cfg.model_dump_json()
    assert config_hash(cfg) == config_hash(load_config(None, []))


def test_a_postgres_connection_the_server_ended_is_reconnected_and_the_statement_runs_once(
    postgres_server: str,
) -> None:
    """The server ended the idle connection (terminated, or shut down and restarted): the statement never
    ran on it, so it runs once on a new connection. A server that is down is a retryable StoreError
    (tests/unit/faults/test_pgrestart.py)."""
    import psycopg

    from tests.postgres import drop_database, new_database

    url = new_database(postgres_server, "lost-connection")
    try:
        store = open_store(url)
        store.register_run("run", "{}", "h")
        with psycopg.connect(postgres_server, autocommit=True) as admin:
            ended = admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s",
                (url.rsplit("/", 1)[1],),
            ).fetchall()
        assert ended and all(row[0] for row in ended)
        assert store.get_run("run")["config_hash"] == "h"  # reconnected, no error
        store.close()
    finally:
        drop_database(postgres_server, url)
