"""The run store: runs, tasks, token segments, records, dispatch log, policies, feed marks, sandbox pool,
harnesses' gateway calls.

One implementation of the store's logic over two databases (store/db.py): the embedded default, SQLite
in a home directory (``RunStore(root)``: ``root/store.sqlite``), or a PostgreSQL server
(``RunStore(PostgresDatabase(url))``); `store.open_store` picks one from a URL.

Invariants:
- Every write is idempotent on a key that survives retries (run id, rollout id, rollout id + segment name),
  so a retried activity never creates a duplicate and never overwrites data already produced.
- A rollout's token sequence is append-only (store/segments.py).
- Schema changes after the base schema are numbered migrations (store/schema.py), applied in order when a
  store opens and recorded in the database; two processes opening an old store at once both end at the
  newest version, each migration applied once. The manual-actions log is append-only.
- A run's tasks never change once stored (``put_tasks`` inserts or keeps), so a store object keeps the
  most recent ``TASK_CACHE`` it read (`cached_task`): a turn of a task already seen reads nothing.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from durable_rollouts.store.db import Database, SqliteDatabase
from durable_rollouts.store.gateway_calls import GatewayCallStore
from durable_rollouts.store.logs import LogStore
from durable_rollouts.store.schema import BASE, MIGRATIONS, SCHEMA_VERSION
from durable_rollouts.store.segments import CONTEXT_CACHE, Segment, SegmentStore, model_segment, obs_segment

TASK_CACHE = 4096
"""Tasks (as their stored JSON text) a store object keeps after reading them."""

__all__ = [
    "CONTEXT_CACHE",
    "MIGRATIONS",
    "SCHEMA_VERSION",
    "RunStore",
    "Segment",
    "model_segment",
    "obs_segment",
]


class RunStore(SegmentStore, LogStore, GatewayCallStore):
    """The run store on one database; safe to share between threads and processes (and, on PostgreSQL,
    hosts)."""

    def __init__(self, root: Path | str | Database) -> None:
        if isinstance(root, Database):
            self.db = root
            self.root = root.path.parent if isinstance(root, SqliteDatabase) else None
        else:
            self.root = Path(root)
            self.root.mkdir(parents=True, exist_ok=True)
            self.db = SqliteDatabase(self.root / "store.sqlite")
        self.location = self.db.location
        """Where the store is, for messages: its home directory or its URL (without a password)."""
        self._contexts: OrderedDict[str, tuple[tuple[str, ...], list[int]]] = OrderedDict()
        self._cache_lock = threading.Lock()
        self._tasks: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._requests = OrderedDict()
        self._requests_lock = threading.Lock()
        self._answered = OrderedDict()
        self.db.migrate(BASE, MIGRATIONS)

    # -- plumbing -------------------------------------------------------------------------------------
    def schema_version(self) -> int:
        """The store's schema version (0 = the base schema only)."""
        return self.db.schema_version()

    def _tx(self) -> Any:
        """A write transaction (see `store.db.Database.tx`)."""
        return self.db.tx()

    def close(self) -> None:
        """Close the store's connections (a later call reconnects)."""
        self.db.close()

    # -- runs and tasks -------------------------------------------------------------------------------
    def register_run(self, run_id: str, config_json: str, config_hash: str) -> bool:
        """Record a run once; returns False if it already existed (the stored config is kept)."""
        with self.db.tx() as db:
            cur = db.execute(
                "INSERT INTO runs (run_id, config_json, config_hash, created_at) VALUES (?,?,?,?)"
                " ON CONFLICT DO NOTHING",
                (run_id, config_json, config_hash, time.time()),
            )
            return cur.rowcount == 1

    def finish_run(self, run_id: str, status: str = "finished") -> None:
        with self.db.tx() as db:
            db.execute(
                "UPDATE runs SET status=?, finished_at=COALESCE(finished_at, ?) WHERE run_id=?",
                (status, time.time(), run_id),
            )

    def get_run(self, run_id: str) -> dict[str, Any] | None:
        row = self.db.execute("SELECT * FROM runs WHERE run_id=?", (run_id,)).fetchone()
        return dict(row) if row else None

    def runs(self) -> list[dict[str, Any]]:
        """Every run of the store, newest first: its ``runs`` row (``status``: ``running`` until the run
        workflow marks it ``finished``, ``cancelled`` or ``stopped``) and ``groups_done``, its group
        records."""
        rows = self.db.execute(
            "SELECT r.*, (SELECT COUNT(*) FROM groups g WHERE g.run_id=r.run_id) AS groups_done"
            " FROM runs r ORDER BY r.created_at DESC, r.run_id DESC"
        ).fetchall()
        return [dict(r) for r in rows]

    def put_tasks(self, run_id: str, tasks: list[dict[str, Any]]) -> int:
        """Store a run's tasks in order (idempotent); returns how many the run has."""
        with self.db.tx() as db:
            db.executemany(
                "INSERT INTO tasks (run_id, idx, task_id, data_json) VALUES (?,?,?,?) ON CONFLICT DO NOTHING",
                [(run_id, i, t["id"], json.dumps(t)) for i, t in enumerate(tasks)],
            )
            return db.execute("SELECT COUNT(*) FROM tasks WHERE run_id=?", (run_id,)).fetchone()[0]

    def task_count(self, run_id: str) -> int:
        """How many tasks the run has in the store (0 before they are stored)."""
        return int(self.db.execute("SELECT COUNT(*) FROM tasks WHERE run_id=?", (run_id,)).fetchone()[0])

    def get_task(self, run_id: str, task_id: str) -> dict[str, Any]:
        """The stored task (a fresh dict on every call); read once per store object (see `cached_task`)."""
        cached = self.cached_task(run_id, task_id)
        if cached is not None:
            return cached
        row = self.db.execute(
            "SELECT data_json FROM tasks WHERE run_id=? AND task_id=?", (run_id, task_id)
        ).fetchone()
        if row is None:
            raise KeyError(f"run {run_id}: no task {task_id!r}")
        with self._cache_lock:
            self._tasks[(run_id, task_id)] = row[0]
            while len(self._tasks) > TASK_CACHE:
                self._tasks.popitem(last=False)
        return json.loads(row[0])

    def cached_task(self, run_id: str, task_id: str) -> dict[str, Any] | None:
        """The task if this store object read it before (no database call, so no thread hop is needed);
        None otherwise. Safe because stored tasks never change."""
        with self._cache_lock:
            text = self._tasks.get((run_id, task_id))
            if text is not None:
                self._tasks.move_to_end((run_id, task_id))
        return None if text is None else json.loads(text)

    def task_at(self, run_id: str, idx: int) -> dict[str, Any]:
        row = self.db.execute(
            "SELECT data_json FROM tasks WHERE run_id=? AND idx=?", (run_id, idx)
        ).fetchone()
        if row is None:
            raise KeyError(f"run {run_id}: no task at index {idx}")
        return json.loads(row[0])

    # -- sandboxes ------------------------------------------------------------------------------------
    def put_sandbox(self, rollout_id: str, handle: BaseModel) -> None:
        """Remember the rollout's current sandbox (replaced when a dead one is recovered)."""
        with self.db.tx() as db:
            db.execute(
                "INSERT INTO sandboxes (rollout_id, handle_json, updated_at) VALUES (?,?,?) ON CONFLICT"
                " (rollout_id) DO UPDATE SET handle_json=excluded.handle_json,"
                " updated_at=excluded.updated_at",
                (rollout_id, handle.model_dump_json(), time.time()),
            )

    def get_sandbox(self, rollout_id: str) -> Any:
        """The rollout's current sandbox handle, or None."""
        from durable_rollouts.sandboxes import SandboxHandle

        row = self.db.execute(
            "SELECT handle_json FROM sandboxes WHERE rollout_id=?", (rollout_id,)
        ).fetchone()
        return SandboxHandle.model_validate_json(row[0]) if row else None

    # -- records --------------------------------------------------------------------------------------
    def put_rollout(self, rec: dict[str, Any]) -> bool:
        """Write a rollout's final record once; returns False if it already existed."""
        cols = [
            "rollout_id",
            "run_id",
            "group_id",
            "task_id",
            "sample_index",
            "env",
            "outcome",
            "reason",
            "reward",
            "scorable",
            "advantage",
            "prompt_length",
            "num_tokens",
            "sampling_json",
            "extra_json",
            "finished_at",
        ]
        row = {**rec, "finished_at": time.time()}
        with self.db.tx() as db:
            cur = db.execute(
                f"INSERT INTO rollouts ({','.join(cols)}) VALUES ({','.join('?' * len(cols))})"
                " ON CONFLICT DO NOTHING",
                [row[c] for c in cols],
            )
            return cur.rowcount == 1

    def set_advantages(self, advantages: dict[str, float | None]) -> None:
        with self.db.tx() as db:
            db.executemany(
                "UPDATE rollouts SET advantage=? WHERE rollout_id=?",
                [(a, rid) for rid, a in advantages.items()],
            )

    def mark_members(self, superseded: dict[str, str], unscorable: list[str]) -> None:
        """What a group's close says of its members' records (idempotent): each failed attempt in
        ``superseded`` names the attempt that replaced it (``extra_json["superseded_by"]``), and the members
        of an unscorable group are stored as not scorable."""
        if not superseded and not unscorable:
            return
        with self.db.tx() as db:
            for rid, by in sorted(superseded.items()):
                row = db.execute(
                    "SELECT extra_json FROM rollouts WHERE rollout_id=?" + self.db.for_update, (rid,)
                ).fetchone()
                if row is None:
                    continue
                extra = json.loads(row[0] or "{}")
                if extra.get("superseded_by") != by:
                    extra["superseded_by"] = by
                    db.execute(
                        "UPDATE rollouts SET extra_json=? WHERE rollout_id=?", (json.dumps(extra), rid)
                    )
            db.executemany(
                "UPDATE rollouts SET scorable=0 WHERE rollout_id=?", [(rid,) for rid in unscorable]
            )

    def put_group(self, run_id: str, group_id: str, task_id: str, record: dict[str, Any]) -> bool:
        with self.db.tx() as db:
            cur = db.execute(
                "INSERT INTO groups (run_id, group_id, task_id, record_json, finished_at)"
                " VALUES (?,?,?,?,?) ON CONFLICT DO NOTHING",
                (run_id, group_id, task_id, json.dumps(record), time.time()),
            )
            return cur.rowcount == 1

    def rollouts(self, run_id: str, group_id: str | None = None) -> list[dict[str, Any]]:
        q = "SELECT * FROM rollouts WHERE run_id=?"
        args: list[Any] = [run_id]
        if group_id is not None:
            q += " AND group_id=?"
            args.append(group_id)
        rows = self.db.execute(q + " ORDER BY group_id, sample_index", args).fetchall()
        return [dict(r) for r in rows]

    def rollout(self, rollout_id: str) -> dict[str, Any] | None:
        row = self.db.execute("SELECT * FROM rollouts WHERE rollout_id=?", (rollout_id,)).fetchone()
        return dict(row) if row else None

    def group(self, run_id: str, group_id: str) -> dict[str, Any] | None:
        """One group's record, or None before it is written."""
        row = self.db.execute(
            "SELECT record_json FROM groups WHERE run_id=? AND group_id=?", (run_id, group_id)
        ).fetchone()
        return json.loads(row[0]) if row else None

    def groups(self, run_id: str) -> list[dict[str, Any]]:
        rows = self.db.execute(
            "SELECT record_json FROM groups WHERE run_id=? ORDER BY group_id", (run_id,)
        ).fetchall()
        return [json.loads(r[0]) for r in rows]

    def count_rollouts(self, run_id: str) -> dict[str, int]:
        rows = self.db.execute(
            "SELECT outcome, COUNT(*) FROM rollouts WHERE run_id=? GROUP BY outcome", (run_id,)
        ).fetchall()
        return {r[0]: r[1] for r in rows}

    def failure_reasons(self, run_id: str) -> dict[str, int]:
        """The run's failed rollouts by reason (``<kind>: <Type>: <message>``)."""
        rows = self.db.execute(
            "SELECT reason, COUNT(*) FROM rollouts WHERE run_id=? AND outcome='failed' GROUP BY reason",
            (run_id,),
        ).fetchall()
        return {r[0] or "": r[1] for r in rows}

    def group_counts(self, run_id: str, group_ids: list[str]) -> dict[str, tuple[int, int, int, int]]:
        """Per group: (records written, records cancelled for admission, records completed or truncated,
        their summed ``num_tokens``)."""
        if not group_ids:
            return {}
        marks = ",".join("?" * len(group_ids))
        ended = "outcome IN ('completed','truncated')"  # contracts.types.RAN_TO_END
        rows = self.db.execute(
            "SELECT group_id, COUNT(*),"
            " SUM(CASE WHEN outcome='cancelled' AND reason='admission' THEN 1 ELSE 0 END),"
            f" SUM(CASE WHEN {ended} THEN 1 ELSE 0 END), SUM(CASE WHEN {ended} THEN num_tokens ELSE 0 END)"
            f" FROM rollouts WHERE run_id=? AND group_id IN ({marks}) GROUP BY group_id",
            [run_id, *group_ids],
        ).fetchall()
        return {r[0]: (r[1], r[2] or 0, r[3] or 0, r[4] or 0) for r in rows}

    def unconsumed_groups(self, run_id: str) -> int:
        """Complete groups of the run that the trainer feed has neither consumed nor discarded."""
        row = self.db.execute(
            "SELECT COUNT(*) FROM groups g WHERE g.run_id=? AND NOT EXISTS"
            " (SELECT 1 FROM feed f WHERE f.run_id=g.run_id AND f.group_id=g.group_id)",
            (run_id,),
        ).fetchone()
        return int(row[0])

    def trainer_waits(self, run_id: str, group_id: str | None = None) -> dict[str, float]:
        """Per consumed group: seconds from its record to the trainer feed's mark (its wait in the queue)."""
        q = (
            "SELECT g.group_id, f.at - g.finished_at FROM groups g JOIN feed f"
            " ON f.run_id=g.run_id AND f.group_id=g.group_id WHERE g.run_id=? AND f.state='consumed'"
        )
        args: list[Any] = [run_id]
        if group_id is not None:
            q += " AND g.group_id=?"
            args.append(group_id)
        return {r[0]: max(0.0, r[1]) for r in self.db.execute(q, args).fetchall()}

    def turn_meta(self, run_id: str) -> list[tuple[str, dict[str, Any]]]:
        """(rollout id, meta) of every model turn of the run's finalized rollouts, in token order; reads
        no blobs (the time decomposition of a whole run without its tokens)."""
        rows = self.db.execute(
            "SELECT s.rollout_id, s.meta_json FROM rollouts r JOIN segments s"
            " ON s.rollout_id = r.rollout_id WHERE r.run_id=? AND s.kind='model'"
            " ORDER BY s.rollout_id, s.start, s.name",
            (run_id,),
        ).fetchall()
        return [(r[0], json.loads(r[1])) for r in rows]
