"""The model calls a harness made through its rollout's gateway (table ``gateway_calls``, migration 6), and
the files its harness leaves that are kept with the rollout (table ``harness_files``, migration 7).

Invariants:
- A call is numbered once: the harness's request is recorded under (rollout id, index), the next index
  after the rollout's last call; the same request again (a client's retry, the same conversation and
  tools) is the same call, whether or not it was answered yet.
- A harness makes one call at a time: a different request while one is unanswered is refused.
- An answer is written once (the first write wins): a retried model-call activity finds it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from durable_rollouts.store.db import Database


class CallInFlight(Exception):
    """A different request arrived while the rollout's previous call is still unanswered."""


@dataclass(frozen=True)
class GatewayCall:
    """One recorded call: its request, and its answer (HTTP status and body) once written."""

    rollout_id: str
    index: int
    request_key: str
    request: dict[str, Any]
    status: int | None
    response: dict[str, Any] | None
    detail: dict[str, Any] | None
    """What the next call needs: the conversation as rendered, the model's raw text, the sequence."""

    @property
    def answered(self) -> bool:
        return self.status is not None


class GatewayCallStore:
    """The gateway-call methods of `store.RunStore`."""

    db: Database

    def open_call(self, rollout_id: str, key: str, request: dict[str, Any]) -> GatewayCall:
        """The call this request is: the rollout's last one when ``key`` matches it, else a new one.

        Raises:
            CallInFlight: the last call is unanswered and this is another request.
        """
        with self.db.tx() as db:
            db.lock(f"gateway:{rollout_id}")
            row = db.execute(
                "SELECT * FROM gateway_calls WHERE rollout_id=? ORDER BY idx DESC LIMIT 1", (rollout_id,)
            ).fetchone()
            if row is not None and row["request_key"] == key:
                return _call(row)
            if row is not None and row["status"] is None:
                raise CallInFlight(f"rollout {rollout_id}: call {row['idx']} is still unanswered")
            idx = 0 if row is None else row["idx"] + 1
            db.execute(
                "INSERT INTO gateway_calls (rollout_id, idx, request_key, request_json, created_at)"
                " VALUES (?,?,?,?,?)",
                (rollout_id, idx, key, json.dumps(request), time.time()),
            )
        return GatewayCall(rollout_id, idx, key, request, None, None, None)

    def get_call(self, rollout_id: str, index: int) -> GatewayCall | None:
        row = self.db.execute(
            "SELECT * FROM gateway_calls WHERE rollout_id=? AND idx=?", (rollout_id, index)
        ).fetchone()
        return _call(row) if row else None

    def call_status(self, rollout_id: str, index: int) -> int | None:
        """The answer's HTTP status (None: not answered yet); a cheap poll for the gateway."""
        row = self.db.execute(
            "SELECT status FROM gateway_calls WHERE rollout_id=? AND idx=?", (rollout_id, index)
        ).fetchone()
        return None if row is None else row["status"]

    def answer_call(
        self, rollout_id: str, index: int, status: int, response: dict[str, Any], detail: dict[str, Any]
    ) -> GatewayCall:
        """Write the call's answer once; returns the call as stored (an earlier answer stands)."""
        with self.db.tx() as db:
            db.execute(
                "UPDATE gateway_calls SET status=?, response_json=?, detail_json=?, answered_at=?"
                " WHERE rollout_id=? AND idx=? AND status IS NULL",
                (status, json.dumps(response), json.dumps(detail), time.time(), rollout_id, index),
            )
        stored = self.get_call(rollout_id, index)
        if stored is None:
            raise KeyError(f"rollout {rollout_id}: no gateway call {index}")
        return stored

    def gateway_calls(self, rollout_id: str, below: int | None = None) -> list[GatewayCall]:
        """The rollout's calls in order (those before index ``below`` only, if given)."""
        rows = self.db.execute(
            "SELECT * FROM gateway_calls WHERE rollout_id=? AND idx < ? ORDER BY idx",
            (rollout_id, below if below is not None else 1 << 62),
        ).fetchall()
        return [_call(r) for r in rows]

    def keep_harness_file(self, rollout_id: str, path: str, data: bytes | None, error: str | None) -> None:
        """Keep a file the rollout's harness left in its sandbox (or why it could not be read); the first
        write stands (a retried harness activity reads the same file of the same process)."""
        with self.db.tx() as db:
            db.execute(
                "INSERT INTO harness_files (rollout_id, path, data, error, kept_at) VALUES (?,?,?,?,?)"
                " ON CONFLICT DO NOTHING",
                (rollout_id, path, data, error, time.time()),
            )

    def harness_files(self, rollout_id: str) -> dict[str, bytes | str]:
        """The files kept from the rollout's harness: path -> its bytes, or the reason it is missing (str)."""
        rows = self.db.execute(
            "SELECT path, data, error FROM harness_files WHERE rollout_id=? ORDER BY path", (rollout_id,)
        ).fetchall()
        return {r["path"]: bytes(r["data"]) if r["data"] is not None else str(r["error"]) for r in rows}


def _call(row: Any) -> GatewayCall:
    return GatewayCall(
        rollout_id=row["rollout_id"],
        index=row["idx"],
        request_key=row["request_key"],
        request=json.loads(row["request_json"]),
        status=row["status"],
        response=None if row["response_json"] is None else json.loads(row["response_json"]),
        detail=None if row["detail_json"] is None else json.loads(row["detail_json"]),
    )
