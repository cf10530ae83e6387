"""The model calls a harness made through its rollout's gateway (table ``gateway_calls``, migration 6), and
the files its harness leaves that are kept with the rollout (table ``harness_files``, migration 7).

Invariants:
- A call is numbered once: the harness's request is recorded under (rollout id, index), the next index
  after the rollout's last call; the same request again (a client's retry, the same conversation and
  tools) is the same call, whether or not it was answered yet.
- A harness makes one call at a time: a different request while one is unanswered is refused.
- An answer is written once (the first write wins): a retried model-call activity finds it.
- A request is stored as a delta against the rollout's previous call (`request_delta`: the messages after
  the ones it shares with that call, the other fields that changed, and the previous call's index and
  key), so a conversation of n calls stores O(n) messages, not O(n^2); every read returns the request
  whole, rebuilt exactly (`apply_delta`). The first call, and rows written before deltas (whole
  requests), are read as they are. A row's request is never rewritten once inserted, nor its answer once
  written, so a store object keeps the last request it read or wrote of ``REQUEST_CACHE`` rollouts, whole,
  to rebuild the next one from, and the last answered call it read or wrote, to read it again unasked.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from durable_rollouts.store.db import Database

REQUEST_CACHE = 256
"""Rollouts whose last read or written request (whole) a store object keeps, to write and read the next
call's request as a delta without reading the rollout's earlier calls."""
DELTA = "delta"
"""The key of a stored request that marks it as a delta (no whole request has it: see `request_delta`)."""


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
    _requests: OrderedDict[str, tuple[int, str, dict[str, Any]]]
    """Rollout id -> (index, key, whole request) of the last call read or written (`REQUEST_CACHE`)."""
    _requests_lock: threading.Lock
    _answered: OrderedDict[str, GatewayCall]
    """Rollout id -> its last answered call this store object read or wrote (`REQUEST_CACHE`)."""

    def open_call(self, rollout_id: str, key: str, request: dict[str, Any]) -> GatewayCall:
        """The call this request is: the rollout's last one when ``key`` matches it, else a new one (its
        request stored as a delta against the last one's).

        Raises:
            CallInFlight: the last call is unanswered and this is another request.
        """
        with self.db.tx() as db:
            db.lock(f"gateway:{rollout_id}")
            row = db.execute(
                "SELECT * FROM gateway_calls WHERE rollout_id=? ORDER BY idx DESC LIMIT 1", (rollout_id,)
            ).fetchone()
            if row is not None and row["request_key"] == key:
                return self._row_call(db, row)
            if row is not None and row["status"] is None:
                raise CallInFlight(f"rollout {rollout_id}: call {row['idx']} is still unanswered")
            idx, stored = 0, request
            if row is not None:
                idx = row["idx"] + 1
                base = self._request(db, rollout_id, row["idx"], row["request_key"], row["request_json"])
                stored = request_delta(row["idx"], row["request_key"], base, request)
            db.execute(
                "INSERT INTO gateway_calls (rollout_id, idx, request_key, request_json, created_at)"
                " VALUES (?,?,?,?,?)",
                (rollout_id, idx, key, json.dumps(stored), time.time()),
            )
        kept = {**request, "messages": list(request.get("messages") or [])}  # the caller's list may grow
        self._keep_request(rollout_id, idx, key, kept)
        return GatewayCall(rollout_id, idx, key, kept, None, None, None)

    def get_call(self, rollout_id: str, index: int) -> GatewayCall | None:
        with self._requests_lock:
            done = self._answered.get(rollout_id)
        if done is not None and done.index == index:
            return done  # answered: it never changes
        row = self.db.execute(
            "SELECT * FROM gateway_calls WHERE rollout_id=? AND idx=?", (rollout_id, index)
        ).fetchone()
        if row is None:
            return None
        call = self._row_call(self.db, row)
        if call.answered:
            self._keep_answered(call)
        return call

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
        response_json, detail_json = json.dumps(response), json.dumps(detail)
        with self.db.tx() as db:
            written = db.execute(
                "UPDATE gateway_calls SET status=?, response_json=?, detail_json=?, answered_at=?"
                " WHERE rollout_id=? AND idx=? AND status IS NULL",
                (status, response_json, detail_json, time.time(), rollout_id, index),
            ).rowcount
        with self._requests_lock:
            kept = self._requests.get(rollout_id)
        if written == 1 and kept is not None and kept[0] == index:  # this answer stands: as it reads back
            call = GatewayCall(
                rollout_id,
                index,
                kept[1],
                kept[2],
                status,
                json.loads(response_json),
                json.loads(detail_json),
            )
            self._keep_answered(call)
            return call
        stored = self.get_call(rollout_id, index)
        if stored is None:
            raise KeyError(f"rollout {rollout_id}: no gateway call {index}")
        return stored

    def gateway_calls(self, rollout_id: str, below: int | None = None) -> list[GatewayCall]:
        """The rollout's calls in order (those before index ``below`` only, if given), requests whole."""
        rows = self.db.execute(
            "SELECT * FROM gateway_calls WHERE rollout_id=? AND idx < ? ORDER BY idx",
            (rollout_id, below if below is not None else 1 << 62),
        ).fetchall()
        out: list[GatewayCall] = []
        for r in rows:
            stored = json.loads(r["request_json"])
            if DELTA in stored:
                if not out:  # the rows before were not read: rebuild from the store
                    request = self._request(
                        self.db, rollout_id, r["idx"], r["request_key"], r["request_json"]
                    )
                else:
                    prev = out[-1]
                    request = apply_delta(stored, prev.index, prev.request_key, prev.request, rollout_id)
            else:
                request = stored
            out.append(_call(r, request))
        if out:
            self._keep_request(rollout_id, out[-1].index, out[-1].request_key, out[-1].request)
        return out

    def _row_call(self, db: Any, row: Any) -> GatewayCall:
        """A row as its call, its request whole."""
        request = self._request(db, row["rollout_id"], row["idx"], row["request_key"], row["request_json"])
        return _call(row, request)

    def _request(self, db: Any, rollout_id: str, index: int, key: str, text: str) -> dict[str, Any]:
        """Call ``index``'s request whole: as stored, or rebuilt from the previous call's (kept by this
        store object, else read back to the rollout's last whole request)."""
        stored = json.loads(text)
        if DELTA not in stored:
            self._keep_request(rollout_id, index, key, stored)
            return stored
        base_index, base_key = stored[DELTA]["of"], stored[DELTA]["key"]
        with self._requests_lock:
            kept = self._requests.get(rollout_id)
        if kept is not None and kept[0] == base_index and kept[1] == base_key:
            base = kept[2]
        else:
            rows = db.execute(
                "SELECT idx, request_key, request_json FROM gateway_calls WHERE rollout_id=? AND idx < ?"
                " ORDER BY idx",
                (rollout_id, index),
            ).fetchall()
            base, at, at_key = {}, -1, ""
            for r in rows:
                s = json.loads(r["request_json"])
                base = apply_delta(s, at, at_key, base, rollout_id) if DELTA in s else s
                at, at_key = r["idx"], r["request_key"]
        request = apply_delta(stored, base_index, base_key, base, rollout_id)
        self._keep_request(rollout_id, index, key, request)
        return request

    def _keep_answered(self, call: GatewayCall) -> None:
        with self._requests_lock:
            kept = self._answered.get(call.rollout_id)
            if kept is not None and kept.index > call.index:
                return
            self._answered[call.rollout_id] = call
            self._answered.move_to_end(call.rollout_id)
            while len(self._answered) > REQUEST_CACHE:
                self._answered.popitem(last=False)

    def _keep_request(self, rollout_id: str, index: int, key: str, request: dict[str, Any]) -> None:
        with self._requests_lock:
            kept = self._requests.get(rollout_id)
            if kept is not None and kept[0] > index:
                return  # a later call is kept already
            self._requests[rollout_id] = (index, key, request)
            self._requests.move_to_end(rollout_id)
            while len(self._requests) > REQUEST_CACHE:
                self._requests.popitem(last=False)

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


def request_delta(
    base_index: int, base_key: str, base: dict[str, Any], request: dict[str, Any]
) -> dict[str, Any]:
    """``request`` as stored after call ``base_index`` (key ``base_key``, request ``base``): the messages
    after those the two share, the other fields that differ, and under `DELTA` what rebuilds the rest."""
    old, new = base.get("messages") or [], request.get("messages") or []
    if new[: len(old)] == old:  # the usual call: the conversation so far, then what is new
        kept = len(old)
    else:  # the harness rewrote its history: what the two still share
        kept = next(
            (i for i, (a, b) in enumerate(zip(old, new, strict=False)) if a != b), min(len(old), len(new))
        )
    same = sorted(k for k, v in request.items() if k != "messages" and k in base and base[k] == v)
    out: dict[str, Any] = {k: v for k, v in request.items() if k != "messages" and k not in same}
    out["messages"] = new[kept:]
    out[DELTA] = {"of": base_index, "key": base_key, "kept": kept, "same": same}
    return out


def apply_delta(
    stored: dict[str, Any], base_index: int, base_key: str, base: dict[str, Any], rollout_id: str
) -> dict[str, Any]:
    """The whole request a stored delta (`request_delta`) stands for, given its base call's request.

    Raises:
        ValueError: the delta was written against another call than ``base_index``/``base_key``.
    """
    d = stored[DELTA]
    if d["of"] != base_index or d["key"] != base_key:
        raise ValueError(
            f"rollout {rollout_id}: a gateway call's request is stored against call {d['of']}"
            f" ({d['key'][:12]}), not call {base_index} ({base_key[:12]})"
        )
    out = {k: base[k] for k in d["same"]}
    out.update((k, v) for k, v in stored.items() if k not in (DELTA, "messages"))
    out["messages"] = [*base.get("messages", [])[: d["kept"]], *stored["messages"]]
    return out


def _call(row: Any, request: dict[str, Any]) -> GatewayCall:
    return GatewayCall(
        rollout_id=row["rollout_id"],
        index=row["idx"],
        request_key=row["request_key"],
        request=request,
        status=row["status"],
        response=None if row["response_json"] is None else json.loads(row["response_json"]),
        detail=None if row["detail_json"] is None else json.loads(row["detail_json"]),
    )
