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
- An image the daemon already has is used as it is; a ``building`` row of its tag on that host is marked
  ``built`` then (`ImageBuilds.settle`: its builder's activity died after the daemon had finished the build,
  e.g. a worker SIGKILLed or cut off from the daemon mid-build, so nothing else would end the row). A
  rollout that found no image and then finds the row ``built`` by a build that ended after it looked,
  looks again instead of building; a row ``built`` before it looked (the image was removed since) is built
  again.

With a registry (``sandbox_pool.registry``) the claim is one per tag and registry instead of per host (the
row whose ``host`` is `registry_key`): the first sandbox host that needs the image builds it, pushes it
(`remote_image` names where) and records the repository and the digest the registry stored in the row;
every other host, and every later rollout on a host without the image, pulls it by that digest and tags
it locally, never building it. The same rules hold for that row: a host that dies mid-build leaves a
stale ``building`` row the next host takes over; a failed build is the answer on every host for
`FAILED_KEEP_S`. A push that fails puts the row back (the next host that needs the image builds and
pushes it) and a pull that fails ends the attempt: both are `SandboxNotReady` (an infra error, retried)
in one line naming the image and the registry; a registry that answers it has no such digest has the row
forgotten, so the retry builds and pushes again.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from durable_rollouts.errors import EnvironmentFailure, SandboxNotReady
from durable_rollouts.sandboxes.base import AsyncSandboxBackend, ImageBuild
from durable_rollouts.sandboxes.pool import check_registry

T = TypeVar("T")

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
        self,
        host: str,
        tag: str,
        owner: str,
        what: str,
        looked_at: float,
        now: float | None = None,
        shared: bool = False,
    ) -> tuple[str, str]:
        """`decide` on the row (host, tag) under its lock; on ``build``, ``owner`` is now its builder
        (``builds`` counts it). ``shared``: the row is a registry's (`registry_key`), whose build every
        host pulls."""
        now = time.time() if now is None else now
        with self._row(host, tag, now) as (tx, row):
            verdict, detail = decide(row, owner, looked_at, now, shared)
            if verdict == "build":
                tx.execute(
                    "UPDATE image_builds SET state='building', owner=?, what=?, builds=builds+1,"
                    " started_at=?, beat_at=?, finished_at=NULL, log=NULL, error=NULL, pushed_to=NULL,"
                    " digest=NULL"
                    " WHERE host=? AND tag=?",
                    (owner, what, now, now, host, tag),
                )
            return verdict, detail

    def beat(self, host: str, tag: str, owner: str) -> None:
        """The builder is alive."""
        self.db.execute(
            "UPDATE image_builds SET beat_at=? WHERE host=? AND tag=? AND owner=? AND state='building'",
            (time.time(), host, tag, owner),
        )

    def finish(
        self,
        host: str,
        tag: str,
        owner: str,
        ok: bool,
        log: str,
        error: str | None,
        pushed_to: str | None = None,
        digest: str | None = None,
    ) -> None:
        """Record the build's end (only its owner's: a builder that lost the row to a takeover records
        nothing); a registry's row also records where the image was pushed and its digest there."""
        with self.db.tx() as tx:
            tx.execute(
                "UPDATE image_builds SET state=?, finished_at=?, log=?, error=?, pushed_to=?, digest=?"
                " WHERE host=? AND tag=? AND owner=?",
                ("built" if ok else "failed", time.time(), log[-LOG_KEEP_CHARS:], error, pushed_to, digest,
                 host, tag, owner),
            )  # fmt: skip

    def settle(self, host: str, tag: str) -> None:
        """The daemon of ``host`` has ``tag``: a ``building`` row of it is ``built`` (module docstring)."""
        self.db.execute(
            "UPDATE image_builds SET state='built', finished_at=?"
            " WHERE host=? AND tag=? AND state='building'",
            (time.time(), host, tag),
        )

    def release(self, host: str, tag: str, owner: str, log: str, error: str) -> None:
        """The owner gives its build up without a verdict on the image (its push failed): the row is free
        for the next rollout that needs it, which builds again; ``error`` stays in the row."""
        self.db.execute(
            "UPDATE image_builds SET state='new', finished_at=?, log=?, error=?"
            " WHERE host=? AND tag=? AND owner=? AND state='building'",
            (time.time(), log[-LOG_KEEP_CHARS:], error, host, tag, owner),
        )

    def forget(self, host: str, tag: str, digest: str, error: str) -> None:
        """The registry has no image of ``digest`` (any more): the row, if it still names it, is free for
        the next rollout, which builds and pushes again; ``error`` stays in the row."""
        self.db.execute(
            "UPDATE image_builds SET state='new', error=?"
            " WHERE host=? AND tag=? AND state='built' AND digest=?",
            (error, host, tag, digest),
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


def decide(
    row: Mapping[str, Any], owner: str, looked_at: float, now: float, shared: bool = False
) -> tuple[str, str]:
    """What a rollout that needs the image does, given the row (host, tag) as it is now.

    ``("build", "")``: build it (the row is new, free, stale, its failure old, or the rollout's own);
    ``("wait", "")``: another builds it (its beat is fresher than `BUILD_STALE_S`); ``("failed", error)``:
    its latest build failed less than `FAILED_KEEP_S` ago. Per host: ``("built", "")`` when a build ended
    at or after ``looked_at`` (the caller found no image before it ended: look again; one that ended
    before was removed since, and is built again). ``shared`` (a registry's row): ``("pull",
    "repository@digest")`` once it is built, whenever that was."""
    state = row["state"]
    if shared and state == "built" and row.get("digest") and row.get("pushed_to"):
        return "pull", f"{row['pushed_to']}@{row['digest']}"
    if not shared and state == "built" and (row["finished_at"] or 0) >= looked_at:
        return "built", ""
    if state == "building" and row["owner"] != owner and now - (row["beat_at"] or 0) < BUILD_STALE_S:
        return "wait", ""
    if state == "failed" and now - (row["finished_at"] or 0) < FAILED_KEEP_S:
        return "failed", str(row["error"] or "")
    return "build", ""


def registry_key(registry: str) -> str:
    """The ``host`` of the row that holds a tag's build for every host using ``registry``."""
    return f"registry:{registry}"


def remote_image(registry: str, tag: str) -> tuple[str, str]:
    """Where the image of local tag ``tag`` lives in ``registry``: (repository, tag). ``dr-harbor-env:ab12``
    in ``127.0.0.1:5000/durable-rollouts`` is ``127.0.0.1:5000/durable-rollouts/dr-harbor-env``, ``ab12``;
    an untagged name is ``latest``. A local name's own registry host, if any, becomes part of the path."""
    name, sep, version = tag.rpartition(":")
    if not sep or "/" in version:
        name, version = tag, "latest"
    return f"{check_registry(registry)}/{name.replace(':', '-')}", version


async def ensure_image(
    builds: ImageBuilds,
    backend: AsyncSandboxBackend,
    host: str,
    build: ImageBuild,
    owner: str,
    heartbeat: Callable[[], None] = lambda: None,
    registry: str | None = None,
) -> None:
    """Make sure the daemon of ``backend`` (called ``host``) has ``build.tag``: use it, build it, wait for
    the rollout that builds it, or (with ``registry``) pull it by digest (see the module docstring).

    Raises:
        EnvironmentFailure: the build failed (now, or less than `FAILED_KEEP_S` ago).
        SandboxNotReady: with ``registry``: the push or the pull failed (one line naming the image and the
            registry).
    """
    if registry is not None:
        await _from_registry(builds, backend, host, build, owner, heartbeat, registry)
        return
    while True:
        looked_at = time.time()
        if await backend.has_image(build.tag):
            await asyncio.to_thread(builds.settle, host, build.tag)
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
        ok, log = await _built(builds, backend, host, build, owner, heartbeat)
        failure = None if ok else failure_message(build, host, log)
        await asyncio.to_thread(builds.finish, host, build.tag, owner, ok, log, failure)
        if failure is not None:
            raise EnvironmentFailure(failure)
        return


async def _from_registry(
    builds: ImageBuilds,
    backend: AsyncSandboxBackend,
    host: str,
    build: ImageBuild,
    owner: str,
    heartbeat: Callable[[], None],
    registry: str,
) -> None:
    """`ensure_image` with a registry: one build per tag and registry, pulled by digest everywhere else."""
    from durable_rollouts.sandboxes._docker_build import RegistryError

    key = registry_key(registry)
    repository, version = remote_image(registry, build.tag)
    while True:
        if await backend.has_image(build.tag):
            return
        claim = functools.partial(builds.claim, key, build.tag, owner, build.what, 0.0, shared=True)
        verdict, detail = await asyncio.to_thread(claim)
        if verdict == "failed":
            raise EnvironmentFailure(detail)
        if verdict == "wait":
            heartbeat()
            await asyncio.sleep(WAIT_POLL_S)
            continue
        if verdict == "pull":
            try:
                await _beating(_pull(backend, detail, build.tag), _tick(heartbeat))
            except RegistryError as e:
                message = (
                    f"{build.what}: pull of image {build.tag} ({detail}) from registry {registry} failed on "
                    f"{host}: {e}"
                )
                if e.missing:  # the registry lost it: the next rollout that needs it builds and pushes it
                    await asyncio.to_thread(builds.forget, key, build.tag, detail.rpartition("@")[2], message)
                raise SandboxNotReady(message) from None
            return
        ok, log = await _built(builds, backend, key, build, owner, heartbeat)
        if not ok:
            failure = failure_message(build, host, log)
            await asyncio.to_thread(builds.finish, key, build.tag, owner, False, log, failure)
            raise EnvironmentFailure(failure)
        try:
            pushing = _push(backend, build.tag, repository, version)
            digest = await _beating(pushing, _beat(builds, key, build.tag, owner, heartbeat))
        except RegistryError as e:
            message = f"{build.what}: push of image {build.tag} to registry {registry} failed on {host}: {e}"
            await asyncio.to_thread(builds.release, key, build.tag, owner, log, message)
            raise SandboxNotReady(message) from None
        await asyncio.to_thread(builds.finish, key, build.tag, owner, True, log, None, repository, digest)
        return


async def _built(
    builds: ImageBuilds,
    backend: AsyncSandboxBackend,
    row_host: str,
    build: ImageBuild,
    owner: str,
    heartbeat: Callable[[], None],
) -> tuple[bool, str]:
    """Build on ``backend``, beating the row (``row_host``, tag) while it runs: (succeeded, log)."""
    return await _beating(backend.build_image(build), _beat(builds, row_host, build.tag, owner, heartbeat))


def _beat(
    builds: ImageBuilds, row_host: str, tag: str, owner: str, heartbeat: Callable[[], None]
) -> Callable[[], Awaitable[None]]:
    async def tick() -> None:
        heartbeat()
        await asyncio.to_thread(builds.beat, row_host, tag, owner)

    return tick


def _tick(heartbeat: Callable[[], None]) -> Callable[[], Awaitable[None]]:
    async def tick() -> None:
        heartbeat()

    return tick


async def _beating(job: Awaitable[T], tick: Callable[[], Awaitable[None]]) -> T:
    """``job``'s result, calling ``tick`` every `BUILD_BEAT_S` while it runs."""
    task = asyncio.ensure_future(job)
    while not task.done():
        await asyncio.wait({task}, timeout=BUILD_BEAT_S)
        await tick()
    return task.result()


def _docker_api(backend: AsyncSandboxBackend) -> Any:
    api = getattr(backend.backend, "api", None)
    if api is None:
        kind = type(backend.backend).__name__
        raise SandboxNotReady(f"this sandbox backend cannot push or pull images ({kind})")
    return api


async def _push(backend: AsyncSandboxBackend, local: str, repository: str, tag: str) -> str:
    """Push ``local`` as ``repository:tag``: the backend's ``push_image(local, repository, tag)`` if it has
    one, else the Docker daemon behind its ``api``; returns the registry's digest (raises `RegistryError`)."""
    fn = getattr(backend.backend, "push_image", None)
    if fn is not None:
        return str(await asyncio.to_thread(fn, local, repository, tag))
    from durable_rollouts.sandboxes._docker_build import push_image

    return await asyncio.to_thread(push_image, _docker_api(backend), local, repository, tag)


async def _pull(backend: AsyncSandboxBackend, reference: str, local: str) -> None:
    """Pull ``reference`` (``repository@digest``) and tag it ``local``: the backend's ``pull_image(reference,
    local)`` if it has one, else the Docker daemon behind its ``api`` (raises `RegistryError`)."""
    fn = getattr(backend.backend, "pull_image", None)
    if fn is not None:
        await asyncio.to_thread(fn, reference, local)
        return
    from durable_rollouts.sandboxes._docker_build import pull_image

    await asyncio.to_thread(pull_image, _docker_api(backend), reference, local)


def failure_message(build: ImageBuild, host: str, log: str) -> str:
    """One line naming what needed the image, the tag, the host and the log's last lines."""
    tail = " | ".join(line.strip() for line in log.strip().splitlines()[-TAIL_LINES:] if line.strip())
    return f"{build.what}: image build {build.tag} failed on {host}: {tail or 'no log'}"
