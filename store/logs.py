"""The store's logs and marks: manual actions, the dispatcher's decisions, a trainer's off-policy evidence,
policy versions, the trainer feed's marks (methods of `store.RunStore`).

Invariants: the manual-actions log, the dispatch log, the off-policy evidence and the policy table are
append-only; a version id is never re-bound to other weights; a group is consumed or discarded at most
once, and the consumed marks one call writes share one batch id (numbered under the run's feed lock, so
two feeds never mint the same).
"""

from __future__ import annotations

import json
import time
from typing import Any

from durable_rollouts.store.db import Database


class LogStore:
    """Append-only logs and marks (``db`` is the store's)."""

    db: Database

    # -- manual actions (rollouts cancel / retry / terminate; append-only) -----------------------------
    def put_manual_action(
        self, run_id: str, target: str, action: str, reason: str | None, detail: dict[str, Any]
    ) -> int:
        """Log an operator's action on a rollout or group; returns its sequence number."""
        with self.db.tx() as db:
            cur = db.execute(
                "INSERT INTO manual_actions (run_id, target, action, reason, detail_json, at)"
                " VALUES (?,?,?,?,?,?) RETURNING seq",
                (run_id, target, action, reason, json.dumps(detail), time.time()),
            )
            return int(cur.fetchone()[0])

    def manual_actions(self, run_id: str) -> list[dict[str, Any]]:
        """The run's manual actions in the order they were taken."""
        rows = self.db.execute(
            "SELECT * FROM manual_actions WHERE run_id=? ORDER BY seq", (run_id,)
        ).fetchall()
        return [{**dict(r), "detail": json.loads(r["detail_json"])} for r in rows]

    # -- the dispatcher's decisions (one row per poll, idempotent on (run, seq)) -----------------------
    def put_dispatch_log(self, run_id: str, seq: int, at: float, record: dict[str, Any]) -> None:
        with self.db.tx() as db:
            db.execute(
                "INSERT INTO dispatch_log (run_id, seq, at, record_json) VALUES (?,?,?,?)"
                " ON CONFLICT DO NOTHING",
                (run_id, seq, at, json.dumps(record)),
            )

    def dispatch_log(self, run_id: str) -> list[dict[str, Any]]:
        rows = self.db.execute(
            "SELECT record_json FROM dispatch_log WHERE run_id=? ORDER BY seq", (run_id,)
        ).fetchall()
        return [json.loads(r[0]) for r in rows]

    # -- a trainer's off-policy evidence (one row per consumed batch, idempotent on (run, batch)) --------
    def put_offpolicy_evidence(self, run_id: str, batch_id: str, record: dict[str, Any]) -> bool:
        """Keep what a trainer measured on one consumed batch (the first write of a batch stands: a
        retried report of the same batch changes nothing). Returns whether this call wrote it."""
        with self.db.tx() as db:
            cur = db.execute(
                "INSERT INTO offpolicy_evidence (run_id, batch_id, at, record_json) VALUES (?,?,?,?)"
                " ON CONFLICT DO NOTHING",
                (run_id, batch_id, time.time(), json.dumps(record)),
            )
            return cur.rowcount == 1

    def offpolicy_evidence(self, run_id: str) -> list[dict[str, Any]]:
        """The run's off-policy evidence, one dict per batch in the order it was kept (``batch_id`` and
        ``at`` added to what the trainer reported)."""
        rows = self.db.execute(
            "SELECT batch_id, at, record_json FROM offpolicy_evidence WHERE run_id=? ORDER BY at, batch_id",
            (run_id,),
        ).fetchall()
        return [{**json.loads(r[2]), "batch_id": r[0], "at": r[1]} for r in rows]

    # -- policy versions (append-only; a version id is never re-bound to other weights) ---------------
    def put_policy(
        self, version: str, weights_hash: str, weights_dir: str, engines: list[str]
    ) -> dict[str, Any]:
        """Reserve ``version`` for these weights unless it exists; returns the stored row (the first wins)."""
        with self.db.tx() as db:
            db.execute(
                "INSERT INTO policies (version, weights_hash, weights_dir, engines_json, status, created_at)"
                " VALUES (?,?,?,?,?,?) ON CONFLICT DO NOTHING",
                (version, weights_hash, weights_dir, json.dumps(engines), "publishing", time.time()),
            )
        stored = self.get_policy(version)
        assert stored is not None
        return stored

    def finish_policy(self, version: str, engines: list[str]) -> None:
        """Mark ``version`` as live on ``engines`` (the first completion time is kept)."""
        with self.db.tx() as db:
            db.execute(
                "UPDATE policies SET status='published', engines_json=?,"
                " published_at=COALESCE(published_at, ?) WHERE version=?",
                (json.dumps(engines), time.time(), version),
            )

    def get_policy(self, version: str) -> dict[str, Any] | None:
        row = self.db.execute("SELECT * FROM policies WHERE version=?", (version,)).fetchone()
        return _policy(row) if row else None

    def policies(self) -> list[dict[str, Any]]:
        """Every version in publish order (``seq`` ascending)."""
        rows = self.db.execute("SELECT * FROM policies ORDER BY seq").fetchall()
        return [_policy(r) for r in rows]

    # -- trainer feed (a group is consumed or discarded at most once) ---------------------------------
    def feed_marks(self, run_id: str) -> dict[str, dict[str, Any]]:
        """The run's consumed and discarded groups, keyed by group id."""
        rows = self.db.execute("SELECT * FROM feed WHERE run_id=?", (run_id,)).fetchall()
        return {r["group_id"]: dict(r) for r in rows}

    def put_feed_marks(self, run_id: str, marks: list[dict[str, Any]]) -> tuple[str | None, list[str]]:
        """Mark groups consumed or discarded in one transaction; a group already marked keeps its mark.

        Each mark has ``group_id``, ``state``, ``reason``, ``records``, ``tokens``, ``lag``. Consumed marks
        written here share a new batch id. Returns (batch id or None, the group ids this call marked).
        """
        written: list[str] = []
        with self.db.tx() as db:
            db.lock(f"feed {run_id}")
            n = db.execute(
                "SELECT COUNT(DISTINCT batch_id) FROM feed WHERE run_id=? AND batch_id IS NOT NULL", (run_id,)
            ).fetchone()[0]
            batch_id = f"b{n + 1:06d}"
            now = time.time()
            for m in marks:
                cur = db.execute(
                    "INSERT INTO feed (run_id, group_id, state, reason, batch_id, records, tokens, lag, at)"
                    " VALUES (?,?,?,?,?,?,?,?,?) ON CONFLICT DO NOTHING",
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
        rows = self.db.execute(
            "SELECT r.rollout_id, COALESCE(SUM(CASE WHEN s.kind='model' THEN s.length END), 0)"
            " FROM rollouts r LEFT JOIN segments s ON s.rollout_id = r.rollout_id"
            " WHERE r.run_id=? GROUP BY r.rollout_id",
            (run_id,),
        ).fetchall()
        return {r[0]: r[1] for r in rows}


def _policy(row: Any) -> dict[str, Any]:
    out = dict(row)
    out["engines"] = json.loads(out.pop("engines_json"))
    return out
