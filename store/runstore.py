"""The run store: SQLite for metadata plus a blob directory for token arrays.

Invariants:
- Every write is idempotent on a key that survives retries (run id, rollout id, rollout id + segment name),
  so a retried activity never creates a duplicate and never overwrites data already produced.
- A rollout's token sequence is append-only: segments are written once, at the offset where the previous
  segment ended, and read back in order; nothing is ever re-tokenized.
- Schema changes after the base schema are numbered migrations (``MIGRATIONS``), applied in order when a
  store opens and recorded in SQLite's ``user_version``; each is idempotent, so two processes opening an
  old store at once both end at the newest version. The manual-actions log is append-only.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pydantic import BaseModel

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY, config_json TEXT NOT NULL, config_hash TEXT NOT NULL,
    created_at REAL NOT NULL, finished_at REAL, status TEXT NOT NULL DEFAULT 'running');
CREATE TABLE IF NOT EXISTS tasks (
    run_id TEXT NOT NULL, idx INTEGER NOT NULL, task_id TEXT NOT NULL, data_json TEXT NOT NULL,
    PRIMARY KEY (run_id, idx));
CREATE INDEX IF NOT EXISTS tasks_by_id ON tasks (run_id, task_id);
CREATE TABLE IF NOT EXISTS segments (
    rollout_id TEXT NOT NULL, name TEXT NOT NULL, kind TEXT NOT NULL, turn INTEGER,
    start INTEGER NOT NULL, length INTEGER NOT NULL, blob TEXT NOT NULL, meta_json TEXT NOT NULL,
    PRIMARY KEY (rollout_id, name));
CREATE TABLE IF NOT EXISTS rollouts (
    rollout_id TEXT PRIMARY KEY, run_id TEXT NOT NULL, group_id TEXT NOT NULL, task_id TEXT NOT NULL,
    sample_index INTEGER NOT NULL, env TEXT NOT NULL, outcome TEXT NOT NULL, reason TEXT,
    reward REAL, scorable INTEGER NOT NULL, advantage REAL, prompt_length INTEGER NOT NULL,
    num_tokens INTEGER NOT NULL, sampling_json TEXT NOT NULL, extra_json TEXT NOT NULL,
    finished_at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS rollouts_by_run ON rollouts (run_id, group_id, sample_index);
CREATE TABLE IF NOT EXISTS sandboxes (
    rollout_id TEXT PRIMARY KEY, handle_json TEXT NOT NULL, updated_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS groups (
    run_id TEXT NOT NULL, group_id TEXT NOT NULL, task_id TEXT NOT NULL, record_json TEXT NOT NULL,
    finished_at REAL NOT NULL, PRIMARY KEY (run_id, group_id));
CREATE TABLE IF NOT EXISTS policies (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, version TEXT NOT NULL UNIQUE, weights_hash TEXT NOT NULL,
    weights_dir TEXT NOT NULL, engines_json TEXT NOT NULL, status TEXT NOT NULL, created_at REAL NOT NULL,
    published_at REAL);
CREATE TABLE IF NOT EXISTS dispatch_log (
    run_id TEXT NOT NULL, seq INTEGER NOT NULL, at REAL NOT NULL, record_json TEXT NOT NULL,
    PRIMARY KEY (run_id, seq));
CREATE TABLE IF NOT EXISTS feed (
    run_id TEXT NOT NULL, group_id TEXT NOT NULL, state TEXT NOT NULL, reason TEXT, batch_id TEXT,
    records INTEGER NOT NULL, tokens INTEGER NOT NULL, lag INTEGER, at REAL NOT NULL,
    PRIMARY KEY (run_id, group_id));
"""


MIGRATIONS: list[tuple[int, str]] = [
    (
        1,
        """
CREATE TABLE IF NOT EXISTS manual_actions (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, run_id TEXT NOT NULL, target TEXT NOT NULL, action TEXT NOT NULL,
    reason TEXT, detail_json TEXT NOT NULL, at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS manual_actions_by_run ON manual_actions (run_id, seq);
""",
    ),
]
"""(version, DDL): what a store of an older ``user_version`` runs to catch up (1: the manual-actions log of
``rollouts cancel/retry/terminate``)."""

SCHEMA_VERSION = MIGRATIONS[-1][0]

CONTEXT_CACHE = 1024
"""Rollouts whose context a store object keeps in memory (see `RunStore.token_ids`)."""


class Segment(BaseModel):
    """A contiguous piece of a rollout's token sequence: the prompt, one model turn, or one observation."""

    name: str
    kind: str
    turn: int | None
    start: int
    token_ids: list[int]
    logprobs: list[float] | None = None
    policy_versions: list[str | None] | None = None
    meta: dict[str, Any] = {}

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


def model_segment(turn: int) -> str:
    """Name of the segment holding turn ``turn``'s sampled tokens."""
    return f"t{turn:05d}.model"


def obs_segment(turn: int) -> str:
    """Name of the segment holding the observation that follows turn ``turn``."""
    return f"t{turn:05d}.obs"


class RunStore:
    """SQLite + blob directory under one root; safe to share between threads and processes."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.blob_dir = self.root / "blobs"
        self.blob_dir.mkdir(parents=True, exist_ok=True)
        self.db_path = self.root / "store.sqlite"
        self._local = threading.local()
        self._contexts: OrderedDict[str, tuple[tuple[str, ...], list[int]]] = OrderedDict()
        self._cache_lock = threading.Lock()
        self._conn().executescript(_SCHEMA)
        self._migrate()

    # -- plumbing -------------------------------------------------------------------------------------
    def _conn(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(self.db_path, timeout=30, isolation_level=None)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.row_factory = sqlite3.Row
            self._local.conn = conn
        return conn

    def _migrate(self) -> None:
        conn = self._conn()
        for version, ddl in MIGRATIONS:
            if conn.execute("PRAGMA user_version").fetchone()[0] < version:
                conn.executescript(f"BEGIN IMMEDIATE;{ddl}PRAGMA user_version={version};COMMIT;")

    def schema_version(self) -> int:
        """The store's schema version (``PRAGMA user_version``; 0 = the base schema only)."""
        return int(self._conn().execute("PRAGMA user_version").fetchone()[0])

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        conn = self._conn()
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield conn
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    def _blob_path(self, rollout_id: str, name: str) -> Path:
        return self.blob_dir / rollout_id / f"{name}.json"

    # -- runs and tasks -------------------------------------------------------------------------------
    def register_run(self, run_id: str, config_json: str, config_hash: str) -> bool:
        """Record a run once; returns False if it already existed (the stored config is kept)."""
        with self._tx() as db:
            cur = db.execute(
                "INSERT OR IGNORE INTO runs (run_id, config_json, config_hash, created_at) VALUES (?,?,?,?)",
                (run_id, config_json, config_hash, time.time()),
            )
            return cur.rowcount == 1

    def finish_run(self, run_id: str, status: str = "finished") -> None:
        with self._tx() as db:
            db.execute(
                "UPDATE runs SET status=?, finished_at=COALESCE(finished_at, ?) WHERE run_id=?",
                (status, time.time(), run_id),
            )

    def get_run(self, run_id: str) -> dict[str, Any] | None:
        row = self._conn().execute("SELECT * FROM runs WHERE run_id=?", (run_id,)).fetchone()
        return dict(row) if row else None

    def put_tasks(self, run_id: str, tasks: list[dict[str, Any]]) -> int:
        """Store a run's tasks in order (idempotent); returns how many the run has."""
        with self._tx() as db:
            db.executemany(
                "INSERT OR IGNORE INTO tasks (run_id, idx, task_id, data_json) VALUES (?,?,?,?)",
                [(run_id, i, t["id"], json.dumps(t)) for i, t in enumerate(tasks)],
            )
            return db.execute("SELECT COUNT(*) FROM tasks WHERE run_id=?", (run_id,)).fetchone()[0]

    def get_task(self, run_id: str, task_id: str) -> dict[str, Any]:
        row = (
            self._conn()
            .execute("SELECT data_json FROM tasks WHERE run_id=? AND task_id=?", (run_id, task_id))
            .fetchone()
        )
        if row is None:
            raise KeyError(f"run {run_id}: no task {task_id!r}")
        return json.loads(row[0])

    def task_at(self, run_id: str, idx: int) -> dict[str, Any]:
        row = (
            self._conn()
            .execute("SELECT data_json FROM tasks WHERE run_id=? AND idx=?", (run_id, idx))
            .fetchone()
        )
        if row is None:
            raise KeyError(f"run {run_id}: no task at index {idx}")
        return json.loads(row[0])

    # -- token segments -------------------------------------------------------------------------------
    def put_segment(self, rollout_id: str, seg: Segment) -> Segment:
        """Write a segment once. If it already exists (a retried activity), return the stored one."""
        existing = self.get_segment(rollout_id, seg.name)
        if existing is not None:
            return existing
        path = self._blob_path(rollout_id, seg.name)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}.{threading.get_ident()}")
        payload = {
            "token_ids": seg.token_ids,
            "logprobs": seg.logprobs,
            "policy_versions": seg.policy_versions,
        }
        tmp.write_text(json.dumps(payload, separators=(",", ":")))
        os.replace(tmp, path)
        with self._tx() as db:
            db.execute(
                "INSERT OR IGNORE INTO segments"
                " (rollout_id, name, kind, turn, start, length, blob, meta_json) VALUES (?,?,?,?,?,?,?,?)",
                (
                    rollout_id,
                    seg.name,
                    seg.kind,
                    seg.turn,
                    seg.start,
                    len(seg.token_ids),
                    str(path.relative_to(self.root)),
                    json.dumps(seg.meta),
                ),
            )
        stored = self.get_segment(rollout_id, seg.name)
        assert stored is not None
        return stored

    def update_segment_meta(self, rollout_id: str, name: str, **meta: Any) -> None:
        with self._tx() as db:
            row = db.execute(
                "SELECT meta_json FROM segments WHERE rollout_id=? AND name=?", (rollout_id, name)
            ).fetchone()
            if row is None:
                raise KeyError(f"rollout {rollout_id}: no segment {name!r}")
            merged = {**json.loads(row[0]), **meta}
            db.execute(
                "UPDATE segments SET meta_json=? WHERE rollout_id=? AND name=?",
                (json.dumps(merged), rollout_id, name),
            )

    def _load(self, row: sqlite3.Row) -> Segment:
        payload = json.loads((self.root / row["blob"]).read_text())
        return Segment(
            name=row["name"],
            kind=row["kind"],
            turn=row["turn"],
            start=row["start"],
            meta=json.loads(row["meta_json"]),
            **payload,
        )

    def get_segment(self, rollout_id: str, name: str) -> Segment | None:
        row = (
            self._conn()
            .execute("SELECT * FROM segments WHERE rollout_id=? AND name=?", (rollout_id, name))
            .fetchone()
        )
        return self._load(row) if row else None

    def segments(self, rollout_id: str) -> list[Segment]:
        """The rollout's segments in token order."""
        rows = (
            self._conn()
            .execute("SELECT * FROM segments WHERE rollout_id=? ORDER BY start, name", (rollout_id,))
            .fetchall()
        )
        return [self._load(r) for r in rows]

    def token_ids(self, rollout_id: str) -> list[int]:
        """The rollout's whole context so far: prompt followed by every turn and observation.

        Segments are immutable once written, so the context read last time is cached (per store object,
        the most recent ``CONTEXT_CACHE`` rollouts) and only segments written since are read from their
        blobs: a turn costs one blob read, not one per earlier segment.
        """
        rows = (
            self._conn()
            .execute(
                "SELECT name, start, length, blob FROM segments WHERE rollout_id=? ORDER BY start, name",
                (rollout_id,),
            )
            .fetchall()
        )
        with self._cache_lock:
            names, out = self._contexts.pop(rollout_id, ((), []))
        if tuple(r["name"] for r in rows[: len(names)]) != names:
            names, out = (), []
        out = list(out)
        for r in rows[len(names) :]:
            if r["start"] != len(out):
                raise ValueError(
                    f"rollout {rollout_id}: segment {r['name']} starts at {r['start']}, not {len(out)}"
                )
            out.extend(json.loads((self.root / r["blob"]).read_text())["token_ids"])
        with self._cache_lock:
            self._contexts[rollout_id] = (tuple(r["name"] for r in rows), out)
            while len(self._contexts) > CONTEXT_CACHE:
                self._contexts.popitem(last=False)
        return list(out)

    # -- sandboxes ------------------------------------------------------------------------------------
    def put_sandbox(self, rollout_id: str, handle: BaseModel) -> None:
        """Remember the rollout's current sandbox (replaced when a dead one is recovered)."""
        with self._tx() as db:
            db.execute(
                "INSERT OR REPLACE INTO sandboxes (rollout_id, handle_json, updated_at) VALUES (?,?,?)",
                (rollout_id, handle.model_dump_json(), time.time()),
            )

    def get_sandbox(self, rollout_id: str) -> Any:
        """The rollout's current sandbox handle, or None."""
        from sandboxes import SandboxHandle

        row = (
            self._conn()
            .execute("SELECT handle_json FROM sandboxes WHERE rollout_id=?", (rollout_id,))
            .fetchone()
        )
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
        with self._tx() as db:
            cur = db.execute(
                f"INSERT OR IGNORE INTO rollouts ({','.join(cols)}) VALUES ({','.join('?' * len(cols))})",
                [row[c] for c in cols],
            )
            return cur.rowcount == 1

    def set_advantages(self, advantages: dict[str, float | None]) -> None:
        with self._tx() as db:
            db.executemany(
                "UPDATE rollouts SET advantage=? WHERE rollout_id=?",
                [(a, rid) for rid, a in advantages.items()],
            )

    def put_group(self, run_id: str, group_id: str, task_id: str, record: dict[str, Any]) -> bool:
        with self._tx() as db:
            cur = db.execute(
                "INSERT OR IGNORE INTO groups (run_id, group_id, task_id, record_json, finished_at)"
                " VALUES (?,?,?,?,?)",
                (run_id, group_id, task_id, json.dumps(record), time.time()),
            )
            return cur.rowcount == 1

    def rollouts(self, run_id: str, group_id: str | None = None) -> list[dict[str, Any]]:
        q = "SELECT * FROM rollouts WHERE run_id=?"
        args: list[Any] = [run_id]
        if group_id is not None:
            q += " AND group_id=?"
            args.append(group_id)
        rows = self._conn().execute(q + " ORDER BY group_id, sample_index", args).fetchall()
        return [dict(r) for r in rows]

    def rollout(self, rollout_id: str) -> dict[str, Any] | None:
        row = self._conn().execute("SELECT * FROM rollouts WHERE rollout_id=?", (rollout_id,)).fetchone()
        return dict(row) if row else None

    def group(self, run_id: str, group_id: str) -> dict[str, Any] | None:
        """One group's record, or None before it is written."""
        row = (
            self._conn()
            .execute("SELECT record_json FROM groups WHERE run_id=? AND group_id=?", (run_id, group_id))
            .fetchone()
        )
        return json.loads(row[0]) if row else None

    def groups(self, run_id: str) -> list[dict[str, Any]]:
        rows = (
            self._conn()
            .execute("SELECT record_json FROM groups WHERE run_id=? ORDER BY group_id", (run_id,))
            .fetchall()
        )
        return [json.loads(r[0]) for r in rows]

    def count_rollouts(self, run_id: str) -> dict[str, int]:
        rows = (
            self._conn()
            .execute("SELECT outcome, COUNT(*) FROM rollouts WHERE run_id=? GROUP BY outcome", (run_id,))
            .fetchall()
        )
        return {r[0]: r[1] for r in rows}

    def group_counts(self, run_id: str, group_ids: list[str]) -> dict[str, tuple[int, int]]:
        """Per group: (records written, records cancelled for admission)."""
        if not group_ids:
            return {}
        marks = ",".join("?" * len(group_ids))
        rows = (
            self._conn()
            .execute(
                "SELECT group_id, COUNT(*), SUM(outcome='cancelled' AND reason='admission') FROM rollouts"
                f" WHERE run_id=? AND group_id IN ({marks}) GROUP BY group_id",
                [run_id, *group_ids],
            )
            .fetchall()
        )
        return {r[0]: (r[1], r[2] or 0) for r in rows}

    def unconsumed_groups(self, run_id: str) -> int:
        """Complete groups of the run that the trainer feed has neither consumed nor discarded."""
        row = (
            self._conn()
            .execute(
                "SELECT COUNT(*) FROM groups g WHERE g.run_id=? AND NOT EXISTS"
                " (SELECT 1 FROM feed f WHERE f.run_id=g.run_id AND f.group_id=g.group_id)",
                (run_id,),
            )
            .fetchone()
        )
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
        return {r[0]: max(0.0, r[1]) for r in self._conn().execute(q, args).fetchall()}

    def turn_meta(self, run_id: str) -> list[tuple[str, dict[str, Any]]]:
        """(rollout id, meta) of every model turn of the run's finalized rollouts, in token order; reads
        no blobs (the time decomposition of a whole run without its tokens)."""
        rows = (
            self._conn()
            .execute(
                "SELECT s.rollout_id, s.meta_json FROM rollouts r JOIN segments s"
                " ON s.rollout_id = r.rollout_id WHERE r.run_id=? AND s.kind='model'"
                " ORDER BY s.rollout_id, s.start, s.name",
                (run_id,),
            )
            .fetchall()
        )
        return [(r[0], json.loads(r[1])) for r in rows]

    # -- manual actions (rollouts cancel / retry / terminate; append-only) -----------------------------
    def put_manual_action(
        self, run_id: str, target: str, action: str, reason: str | None, detail: dict[str, Any]
    ) -> int:
        """Log an operator's action on a rollout or group; returns its sequence number."""
        with self._tx() as db:
            cur = db.execute(
                "INSERT INTO manual_actions (run_id, target, action, reason, detail_json, at)"
                " VALUES (?,?,?,?,?,?)",
                (run_id, target, action, reason, json.dumps(detail), time.time()),
            )
            return int(cur.lastrowid or 0)

    def manual_actions(self, run_id: str) -> list[dict[str, Any]]:
        """The run's manual actions in the order they were taken."""
        rows = (
            self._conn()
            .execute("SELECT * FROM manual_actions WHERE run_id=? ORDER BY seq", (run_id,))
            .fetchall()
        )
        return [{**dict(r), "detail": json.loads(r["detail_json"])} for r in rows]

    # -- the dispatcher's decisions (one row per poll, idempotent on (run, seq)) -----------------------
    def put_dispatch_log(self, run_id: str, seq: int, at: float, record: dict[str, Any]) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT OR IGNORE INTO dispatch_log (run_id, seq, at, record_json) VALUES (?,?,?,?)",
                (run_id, seq, at, json.dumps(record)),
            )

    def dispatch_log(self, run_id: str) -> list[dict[str, Any]]:
        rows = (
            self._conn()
            .execute("SELECT record_json FROM dispatch_log WHERE run_id=? ORDER BY seq", (run_id,))
            .fetchall()
        )
        return [json.loads(r[0]) for r in rows]

    # -- policy versions (append-only; a version id is never re-bound to other weights) ---------------
    def put_policy(
        self, version: str, weights_hash: str, weights_dir: str, engines: list[str]
    ) -> dict[str, Any]:
        """Reserve ``version`` for these weights unless it exists; returns the stored row (the first wins)."""
        with self._tx() as db:
            db.execute(
                "INSERT OR IGNORE INTO policies (version, weights_hash, weights_dir, engines_json, status,"
                " created_at) VALUES (?,?,?,?,?,?)",
                (version, weights_hash, weights_dir, json.dumps(engines), "publishing", time.time()),
            )
        stored = self.get_policy(version)
        assert stored is not None
        return stored

    def finish_policy(self, version: str, engines: list[str]) -> None:
        """Mark ``version`` as live on ``engines`` (the first completion time is kept)."""
        with self._tx() as db:
            db.execute(
                "UPDATE policies SET status='published', engines_json=?,"
                " published_at=COALESCE(published_at, ?) WHERE version=?",
                (json.dumps(engines), time.time(), version),
            )

    def get_policy(self, version: str) -> dict[str, Any] | None:
        row = self._conn().execute("SELECT * FROM policies WHERE version=?", (version,)).fetchone()
        return _policy(row) if row else None

    def policies(self) -> list[dict[str, Any]]:
        """Every version in publish order (``seq`` ascending)."""
        rows = self._conn().execute("SELECT * FROM policies ORDER BY seq").fetchall()
        return [_policy(r) for r in rows]

    # -- trainer feed (a group is consumed or discarded at most once) ---------------------------------
    def feed_marks(self, run_id: str) -> dict[str, dict[str, Any]]:
        """The run's consumed and discarded groups, keyed by group id."""
        rows = self._conn().execute("SELECT * FROM feed WHERE run_id=?", (run_id,)).fetchall()
        return {r["group_id"]: dict(r) for r in rows}

    def put_feed_marks(self, run_id: str, marks: list[dict[str, Any]]) -> tuple[str | None, list[str]]:
        """Mark groups consumed or discarded in one transaction; a group already marked keeps its mark.

        Each mark has ``group_id``, ``state``, ``reason``, ``records``, ``tokens``, ``lag``. Consumed marks
        written here share a new batch id. Returns (batch id or None, the group ids this call marked).
        """
        written: list[str] = []
        with self._tx() as db:
            n = db.execute(
                "SELECT COUNT(DISTINCT batch_id) FROM feed WHERE run_id=? AND batch_id IS NOT NULL", (run_id,)
            ).fetchone()[0]
            batch_id = f"b{n + 1:06d}"
            now = time.time()
            for m in marks:
                cur = db.execute(
                    "INSERT OR IGNORE INTO feed"
                    " (run_id, group_id, state, reason, batch_id, records, tokens, lag, at)"
                    " VALUES (?,?,?,?,?,?,?,?,?)",
                    (
                        run_id, m["group_id"], m["state"], m.get("reason"),
                        batch_id if m["state"] == "consumed" else None,
                        m["records"], m["tokens"], m.get("lag"), now,
                    ),
                )  # fmt: skip
                if cur.rowcount == 1:
                    written.append(m["group_id"])
            q = "SELECT 1 FROM feed WHERE run_id=? AND batch_id=?"
            used = db.execute(q, (run_id, batch_id)).fetchone()
        return (batch_id if used else None), written

    def sampled_tokens(self, run_id: str) -> dict[str, int]:
        """Sampled tokens (model segments, loss_mask 1) of each finalized rollout of the run."""
        rows = (
            self._conn()
            .execute(
                "SELECT r.rollout_id, COALESCE(SUM(CASE WHEN s.kind='model' THEN s.length END), 0)"
                " FROM rollouts r LEFT JOIN segments s ON s.rollout_id = r.rollout_id"
                " WHERE r.run_id=? GROUP BY r.rollout_id",
                (run_id,),
            )
            .fetchall()
        )
        return {r[0]: r[1] for r in rows}


def _policy(row: sqlite3.Row) -> dict[str, Any]:
    out = dict(row)
    out["engines"] = json.loads(out.pop("engines_json"))
    return out
