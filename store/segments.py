"""Token segments: a rollout's token sequence, stored packed (int32 ids, float32 logprobs) in the store.

Invariants:
- A rollout's token sequence is append-only: segments are written once (``ON CONFLICT DO NOTHING`` on
  rollout id + segment name), at the offset where the previous segment ended, and read back in order;
  nothing is ever re-tokenized.
- Packing is exact for token ids (int32) and for logprobs an engine computed in float32 (vLLM's); a
  float64 logprob is rounded to float32 once, at write, and every later read returns the same value.
- Rows of a store written before schema 2 name a JSON file under the store root (``blob``) instead of
  packed columns; they are read from it as before.
"""

from __future__ import annotations

import json
import sys
import threading
from array import array
from collections import OrderedDict
from itertools import groupby
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from durable_rollouts.store.db import Database

CONTEXT_CACHE = 1024
"""Rollouts whose context a store object keeps in memory (see `SegmentStore.token_ids`)."""


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


def _packed(kind: str, values: list[Any]) -> bytes:
    arr = array(kind, values)
    if sys.byteorder == "big":
        arr.byteswap()
    return arr.tobytes()


def _unpacked(kind: str, data: bytes) -> list[Any]:
    arr = array(kind)
    arr.frombytes(bytes(data))
    if sys.byteorder == "big":
        arr.byteswap()
    return arr.tolist()


def pack_ids(ids: list[int]) -> bytes:
    """Token ids as little-endian int32."""
    return _packed("i", ids)


def unpack_ids(data: bytes) -> list[int]:
    return _unpacked("i", data)


def pack_logprobs(logprobs: list[float]) -> bytes:
    """Logprobs as little-endian float32."""
    return _packed("f", logprobs)


def unpack_logprobs(data: bytes) -> list[float]:
    return _unpacked("f", data)


def pack_versions(versions: list[str | None]) -> str:
    """Per-token policy versions run-length encoded: ``[[version, count], ...]`` (a turn is one run)."""
    return json.dumps([[v, len(list(g))] for v, g in groupby(versions)], separators=(",", ":"))


def unpack_versions(text: str) -> list[str | None]:
    return [v for v, n in json.loads(text) for _ in range(n)]


class SegmentStore:
    """The segment methods of `store.RunStore` (``db`` and ``root`` are the store's)."""

    db: Database
    root: Path | None
    _contexts: OrderedDict[str, tuple[tuple[str, ...], list[int]]]
    _cache_lock: threading.Lock

    def put_segment(self, rollout_id: str, seg: Segment) -> Segment:
        """Write a segment once. If it already exists (a retried activity), return the stored one."""
        tokens = pack_ids(seg.token_ids)
        logprobs = None if seg.logprobs is None else pack_logprobs(seg.logprobs)
        versions = None if seg.policy_versions is None else pack_versions(seg.policy_versions)
        with self.db.tx() as db:
            cur = db.execute(
                "INSERT INTO segments (rollout_id, name, kind, turn, start, length, blob, meta_json, tokens,"
                " logprobs, versions) VALUES (?,?,?,?,?,?,?,?,?,?,?) ON CONFLICT DO NOTHING",
                (
                    rollout_id, seg.name, seg.kind, seg.turn, seg.start, len(seg.token_ids), "",
                    json.dumps(seg.meta), tokens, logprobs, versions,
                ),
            )  # fmt: skip
            inserted = cur.rowcount == 1
        if not inserted:
            stored = self.get_segment(rollout_id, seg.name)
            assert stored is not None
            return stored
        lp = None if logprobs is None else unpack_logprobs(logprobs)
        return seg.model_copy(deep=True, update={"logprobs": lp, "meta": json.loads(json.dumps(seg.meta))})

    def update_segment_meta(self, rollout_id: str, name: str, **meta: Any) -> None:
        with self.db.tx() as db:
            row = db.execute(
                "SELECT meta_json FROM segments WHERE rollout_id=? AND name=?" + self.db.for_update,
                (rollout_id, name),
            ).fetchone()
            if row is None:
                raise KeyError(f"rollout {rollout_id}: no segment {name!r}")
            merged = {**json.loads(row[0]), **meta}
            db.execute(
                "UPDATE segments SET meta_json=? WHERE rollout_id=? AND name=?",
                (json.dumps(merged), rollout_id, name),
            )

    def _legacy(self, row: Any) -> dict[str, Any]:
        """The JSON file a segment written before schema 2 names (relative to the store root)."""
        if self.root is None:
            raise ValueError(
                f"segment {row['name']}: no packed tokens and no store root to read {row['blob']}"
            )
        return json.loads((self.root / row["blob"]).read_text())

    def _load(self, row: Any) -> Segment:
        if row["tokens"] is None:
            payload = self._legacy(row)
        else:
            payload = {
                "token_ids": unpack_ids(row["tokens"]),
                "logprobs": None if row["logprobs"] is None else unpack_logprobs(row["logprobs"]),
                "policy_versions": None if row["versions"] is None else unpack_versions(row["versions"]),
            }
        return Segment(
            name=row["name"],
            kind=row["kind"],
            turn=row["turn"],
            start=row["start"],
            meta=json.loads(row["meta_json"]),
            **payload,
        )

    def get_segment(self, rollout_id: str, name: str) -> Segment | None:
        row = self.db.execute(
            "SELECT * FROM segments WHERE rollout_id=? AND name=?", (rollout_id, name)
        ).fetchone()
        return self._load(row) if row else None

    def segments(self, rollout_id: str) -> list[Segment]:
        """The rollout's segments in token order."""
        rows = self.db.execute(
            "SELECT * FROM segments WHERE rollout_id=? ORDER BY start, name", (rollout_id,)
        ).fetchall()
        return [self._load(r) for r in rows]

    def unrecorded_with_segments(self, prefix: str) -> list[str]:
        """Rollout ids starting with ``prefix`` (e.g. ``<run>/<group>/``) that stored segments but have no
        record: attempts that began and never recorded their end (a group terminated around members that
        ran inside its workflow, with no workflow of their own for Temporal to list). A key range, so the
        segments' primary key serves it on both backends (text compares bytewise on both)."""
        if not prefix:
            raise ValueError("a prefix is required")
        end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
        rows = self.db.execute(
            "SELECT DISTINCT s.rollout_id FROM segments s LEFT JOIN rollouts r ON r.rollout_id = s.rollout_id"
            " WHERE s.rollout_id >= ? AND s.rollout_id < ? AND r.rollout_id IS NULL ORDER BY s.rollout_id",
            (prefix, end),
        ).fetchall()
        return [r[0] for r in rows]

    def token_ids(self, rollout_id: str) -> list[int]:
        """The rollout's whole context so far: prompt followed by every turn and observation.

        Segments are immutable once written, so the context read last time is cached (per store object,
        the most recent ``CONTEXT_CACHE`` rollouts) and only the token arrays of segments written since
        are read (one query; rows the cache covers come back without their arrays).
        """
        with self._cache_lock:
            names, out = self._contexts.pop(rollout_id, ((), []))
        rows = self._context_rows(rollout_id, len(out))
        if tuple(r["name"] for r in rows[: len(names)]) != names:
            names, out = (), []
            rows = self._context_rows(rollout_id, 0)
        out = list(out)
        for r in rows[len(names) :]:
            if r["start"] != len(out):
                raise ValueError(
                    f"rollout {rollout_id}: segment {r['name']} starts at {r['start']}, not {len(out)}"
                )
            out.extend(unpack_ids(r["tokens"]) if r["tokens"] is not None else self._legacy(r)["token_ids"])
        with self._cache_lock:
            self._contexts[rollout_id] = (tuple(r["name"] for r in rows), out)
            while len(self._contexts) > CONTEXT_CACHE:
                self._contexts.popitem(last=False)
        return list(out)

    def _context_rows(self, rollout_id: str, cached: int) -> list[Any]:
        """Segment rows in token order; token arrays only of those starting at or after ``cached``."""
        return self.db.execute(
            "SELECT name, start, blob, CASE WHEN start >= ? THEN tokens END AS tokens FROM segments"
            " WHERE rollout_id=? ORDER BY start, name",
            (cached, rollout_id),
        ).fetchall()
