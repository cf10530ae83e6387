"""Images built where the sandbox runs: one build per image tag per sandbox host, coordinated in the store.

An environment whose sandbox plan carries an `ImageBuild` (e.g. a Harbor task's ``environment/Dockerfile``)
gets its image built by the Docker daemon of the host that runs the rollout's sandbox, inside the
``sandbox_create`` activity, before the container is created. The tag names the build context's content
hash, so one tag is one image, wherever it is built.

Invariants:
- One build of a tag per host at a time, across every worker of the store: a rollout claims the build in
  the store's ``image_builds`` row (host, tag) under a row lock (``BEGIN IMMEDIATE`` on SQLite, ``SELECT ...
  FOR UPDATE`` on PostgreSQL); every other rollout that needs the tag on that host waits for the row to
  leave ``building`` (polling, heartbeating its activity). Sixteen rollouts of one task starting at once
  cause one build (``builds`` counts them).
- A builder refreshes ``beat_at`` while it builds; a ``building`` row whose beat is older than
  `BUILD_STALE_S` was left by a dead worker and is taken over (a retried activity of the same rollout
  takes its own row over at once).
- A failed build ends every rollout that needs it with `EnvironmentFailure` naming what needed it, the tag
  and the log's last lines; the failure stands for `FAILED_KEEP_S` (the rollouts starting with it get the
  same outcome, not a build each), after which the next rollout builds again.
- The log of the latest build stays in the row (its last `LOG_KEEP_CHARS` characters).
- An image the daemon already has is used as it is (no row needed). A rollout that found no image and
  then finds the row ``built`` by a build that ended after it looked, looks again instead of building;
  a row ``built`` before it looked (the image was removed since) is built again.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from durable_rollouts.errors import EnvironmentFailure
from durable_rollouts.sandboxes.base import AsyncSandboxBackend, ImageBuild

BUILD_BEAT_S = 2.0
"""How often a builder refreshes its row."""
BUILD_STALE_S = 30.0
"""A ``building`` row not refreshed for this long belongs to a dead builder: the next rollout takes over."""
FAILED_KEEP_S = 600.0
"""How long a failed build is the answer for its tag on its host before the next rollout tries again."""
WAIT_POLL_S = 1.0
"""How often a waiting rollout looks at the row (and heartbeats)."""
LOG_KEEP_CHARS = 256 * 1024
"""Most characters of a build log kept in the store."""
TAIL_LINES = 8
"""Lines of a failed build's log quoted in the rollout's outcome."""


class _Tx(Protocol):
    def execute(self, sql: str, args: Sequence[Any] = ()) -> Any: ...


class _Database(Protocol):
    for_update: str

    def tx(self) -> contextlib.AbstractContextManager[_Tx]: ...

    def execute(self, sql: str, args: Sequence[Any] = ()) -> Any: ...


class ImageBuilds:
    """The store's ``image_builds`` table (schema 5): who builds which tag on which host, and how it went."""

    def __init__(self, db: _Database) -> None:
        self.db = db

    @contextlib.contextmanager
    def _row(self, host: str, tag: str, now: float) -> Iterator[tuple[_Tx, dict[str, Any]]]:
        with self.db.tx() as tx:
            tx.execute(
                "INSERT INTO image_builds (host, tag, state, builds) VALUES (?,?,'new',0)"
                " ON CONFLICT DO NOTHING",
                (host, tag),
            )
            row = tx.execute(
                "SELECT * FROM image_builds WHERE host=? AND tag=?" + self.db.for_update, (host, tag)
            ).fetchone()
            yield tx, dict(row)

    def claim(
        self, host: str, tag: str, owner: str, what: str, looked_at: float, now: float | None = None
    ) -> tuple[str, str]:
        """``("build", "")`` when ``owner`` is now the builder; ``("wait", "")`` when another builds;
        ``("built", "")`` when a build finished after ``looked_at`` (when the caller found no image: look
        again); ``("failed", error)`` when the latest build failed less than `FAILED_KEEP_S` ago."""
        now = time.time() if now is None else now
        with self._row(host, tag, now) as (tx, row):
            state = row["state"]
            if state == "built" and (row["finished_at"] or 0) >= looked_at:
                return "built", ""
            if state == "building" and row["owner"] != owner and now - (row["beat_at"] or 0) < BUILD_STALE_S:
                return "wait", ""
            if state == "failed" and now - (row["finished_at"] or 0) < FAILED_KEEP_S:
                return "failed", str(row["error"] or "")
            tx.execute(
                "UPDATE image_builds SET state='building', owner=?, what=?, builds=builds+1, started_at=?,"
                " beat_at=?, finished_at=NULL, log=NULL, error=NULL WHERE host=? AND tag=?",
                (owner, what, now, now, host, tag),
            )
            return "build", ""

    def beat(self, host: str, tag: str, owner: str) -> None:
        """The builder is alive."""
        self.db.execute(
            "UPDATE image_builds SET beat_at=? WHERE host=? AND tag=? AND owner=? AND state='building'",
            (time.time(), host, tag, owner),
        )

    def finish(self, host: str, tag: str, owner: str, ok: bool, log: str, error: str | None) -> None:
        """Record the build's end (only its owner's: a builder that lost the row to a takeover records
        nothing)."""
        with self.db.tx() as tx:
            tx.execute(
                "UPDATE image_builds SET state=?, finished_at=?, log=?, error=?"
                " WHERE host=? AND tag=? AND owner=?",
                ("built" if ok else "failed", time.time(), log[-LOG_KEEP_CHARS:], error, host, tag, owner),
            )

    def get(self, host: str, tag: str) -> dict[str, Any] | None:
        row = self.db.execute("SELECT * FROM image_builds WHERE host=? AND tag=?", (host, tag)).fetchone()
        return None if row is None else dict(row)

    def builds(self, tag: str | None = None) -> int:
        """How many builds were started (of ``tag``, or of every tag), on every host."""
        sql, args = "SELECT COALESCE(SUM(builds), 0) FROM image_builds", ()  # type: tuple[str, tuple[str, ...]]
        if tag is not None:
            sql, args = sql + " WHERE tag=?", (tag,)
        return int(self.db.execute(sql, args).fetchone()[0])


async def ensure_image(
    builds: ImageBuilds,
    backend: AsyncSandboxBackend,
    host: str,
    build: ImageBuild,
    owner: str,
    heartbeat: Callable[[], None] = lambda: None,
) -> None:
    """Make sure the daemon of ``backend`` (called ``host``) has ``build.tag``: use it, build it, or wait
    for the rollout that builds it (see the module docstring).

    Raises:
        EnvironmentFailure: the build failed (now, or less than `FAILED_KEEP_S` ago).
    """
    while True:
        looked_at = time.time()
        if await backend.has_image(build.tag):
            return
        verdict, error = await asyncio.to_thread(builds.claim, host, build.tag, owner, build.what, looked_at)
        if verdict == "failed":
            raise EnvironmentFailure(error)
        if verdict == "built":
            continue
        if verdict == "wait":
            heartbeat()
            await asyncio.sleep(WAIT_POLL_S)
            continue
        job = asyncio.ensure_future(backend.build_image(build))
        while not job.done():
            await asyncio.wait({job}, timeout=BUILD_BEAT_S)
            heartbeat()
            await asyncio.to_thread(builds.beat, host, build.tag, owner)
        ok, log = job.result()
        failure = None if ok else failure_message(build, host, log)
        await asyncio.to_thread(builds.finish, host, build.tag, owner, ok, log, failure)
        if failure is not None:
            raise EnvironmentFailure(failure)
        return


def failure_message(build: ImageBuild, host: str, log: str) -> str:
    """One line naming what needed the image, the tag, the host and the log's last lines."""
    tail = " | ".join(line.strip() for line in log.strip().splitlines()[-TAIL_LINES:] if line.strip())
    return f"{build.what}: image build {build.tag} failed on {host}: {tail or 'no log'}"
