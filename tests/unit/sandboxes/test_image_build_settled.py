"""sandboxes/images.py: a build whose builder's activity died after the daemon had finished it (a worker
SIGKILLed, or cut off from its sandbox host, mid-build) leaves its row ``building``; the next rollout that
finds the image on the daemon marks the row ``built``, so the run's ledger finds no build left
(``leaked-build``, seen in the chaos soak's cluster layout)."""

from __future__ import annotations

from pathlib import Path

from durable_rollouts.sandboxes.base import AsyncSandboxBackend, ImageBuild
from durable_rollouts.sandboxes.images import ImageBuilds, ensure_image
from durable_rollouts.store import RunStore

TAG = "dr-harness-env:0123abcd"
BUILD = ImageBuild(tag=TAG, context={"Dockerfile": "RlJPTSBzY3JhdGNoCg=="}, what="task hello")


class Daemon:
    """A daemon that has the image (its build ran to the end after the builder's activity died)."""

    def has_image(self, tag: str) -> bool:
        return tag == TAG

    def build_image(self, build: ImageBuild) -> tuple[bool, str]:
        raise AssertionError("an image the daemon has is not built again")


async def test_a_build_left_building_by_a_dead_builder_is_settled_once_the_image_is_there(
    tmp_path: Path,
) -> None:
    store = RunStore(tmp_path)
    builds = ImageBuilds(store.db)
    verdict, _ = builds.claim("h1", TAG, "run-a/g000001/0", BUILD.what, looked_at=0.0)
    assert verdict == "build"  # then its worker died mid-build; the daemon finished the build
    backend = AsyncSandboxBackend(Daemon())  # type: ignore[arg-type]
    await ensure_image(builds, backend, "h1", BUILD, "run-a/g000001/0r1")
    row = builds.get("h1", TAG)
    assert row is not None and row["state"] == "built" and row["owner"] == "run-a/g000001/0"
    assert builds.builds(TAG) == 1
    left = store.db.execute("SELECT count(*) FROM image_builds WHERE state = 'building'").fetchone()[0]
    assert left == 0  # what the ledger's leaked-build rule looks for
