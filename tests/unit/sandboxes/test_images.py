"""Images from a registry (``sandbox_pool.registry``, sandboxes/images.py), without Docker: the claim's
decision as a pure function, the registry's row in the store on both backends (claim, wait, digest, stale
takeover, failure kept, push given up, digest forgotten), and `ensure_image` on fake hosts that share a
fake registry: one build and push, every other host pulls the recorded digest; a failed push or pull is a
one-line `SandboxNotReady` naming the image and the registry."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from pathlib import Path

import pytest

from durable_rollouts.errors import EnvironmentFailure, SandboxNotReady
from durable_rollouts.sandboxes import images
from durable_rollouts.sandboxes._docker_build import RegistryError
from durable_rollouts.sandboxes.base import AsyncSandboxBackend, ImageBuild
from durable_rollouts.sandboxes.images import (
    BUILD_STALE_S,
    FAILED_KEEP_S,
    ImageBuilds,
    decide,
    ensure_image,
    registry_key,
    remote_image,
)
from durable_rollouts.sandboxes.pool import SandboxPoolConfig
from durable_rollouts.store import RunStore

REGISTRY = "127.0.0.1:5000/durable-rollouts"
KEY = registry_key(REGISTRY)
TAG = "dr-harbor-env:0123abcd"
REPO = "127.0.0.1:5000/durable-rollouts/dr-harbor-env"
DIGEST = "sha256:" + "ab" * 32
BUILD = ImageBuild(tag=TAG, context={"Dockerfile": "RlJPTSBzY3JhdGNoCg=="}, what="task hello")


def row(state: str, **kw: object) -> dict[str, object]:
    base: dict[str, object] = {"state": state, "owner": None, "beat_at": None, "finished_at": None}
    return {"error": None, "pushed_to": None, "digest": None, **base, **kw}


# ------------------------------------------------------------------------------------------ the decision


def test_decide_on_a_registry_row_pulls_once_built_whenever_that_was() -> None:
    built = row("built", finished_at=10.0, pushed_to=REPO, digest=DIGEST)
    assert decide(built, "r1", looked_at=99.0, now=100.0, shared=True) == ("pull", f"{REPO}@{DIGEST}")
    # per host, the same row built before the caller looked means the image was removed since: build again
    assert decide(built, "r1", looked_at=99.0, now=100.0) == ("build", "")
    assert decide(built, "r1", looked_at=5.0, now=100.0) == ("built", "")
    # a registry row built without a digest (not written by this code) is built again, not pulled
    assert decide(row("built", finished_at=10.0), "r1", 0.0, 100.0, shared=True) == ("build", "")


@pytest.mark.parametrize("shared", [False, True])
def test_decide_waits_for_a_live_builder_takes_a_stale_one_over_and_keeps_a_failure(shared: bool) -> None:
    building = row("building", owner="r1", beat_at=100.0)
    assert decide(building, "r2", 0.0, 100.0 + BUILD_STALE_S - 1, shared) == ("wait", "")
    assert decide(building, "r2", 0.0, 100.0 + BUILD_STALE_S + 1, shared) == ("build", "")  # its host died
    assert decide(building, "r1", 0.0, 101.0, shared) == ("build", "")  # the builder's own retry
    failed = row("failed", finished_at=100.0, error="task hello: image build failed")
    assert decide(failed, "r2", 0.0, 100.0 + FAILED_KEEP_S - 1, shared) == (
        "failed",
        "task hello: image build failed",
    )
    assert decide(failed, "r2", 0.0, 100.0 + FAILED_KEEP_S + 1, shared) == ("build", "")
    assert decide(row("new", error="push failed"), "r2", 0.0, 100.0, shared) == ("build", "")


def test_remote_image_names_the_repository_and_tag_under_the_registry() -> None:
    assert remote_image(REGISTRY, TAG) == (REPO, "0123abcd")
    assert remote_image("127.0.0.1:5000", "plain") == ("127.0.0.1:5000/plain", "latest")
    assert remote_image("reg.example.com/x", "localhost:5001/team/img:v1") == (
        "reg.example.com/x/localhost-5001/team/img",
        "v1",
    )
    assert remote_image("reg.example.com", "localhost:5001/img") == (
        "reg.example.com/localhost-5001/img",
        "latest",
    )


def test_the_registry_setting_must_be_a_registry_docker_recognizes() -> None:
    assert SandboxPoolConfig().registry is None
    assert SandboxPoolConfig(registry=REGISTRY).registry == REGISTRY
    assert SandboxPoolConfig(registry="localhost/dr").registry == "localhost/dr"
    with pytest.raises(ValueError, match="Docker Hub"):
        SandboxPoolConfig(registry="team/images")
    for bad in ("http://127.0.0.1:5000", "127.0.0.1:5000/Upper", "127.0.0.1:5000/x:tag", "reg.io/a/"):
        with pytest.raises(ValueError, match="host\\[:port\\]\\[/namespace\\]"):
            SandboxPoolConfig(registry=bad)


# ----------------------------------------------------------------------------------------- the store row


def test_the_registry_row_claims_once_records_the_digest_and_answers_pull(any_store: RunStore) -> None:
    builds = ImageBuilds(any_store.db)
    assert builds.claim(KEY, TAG, "r1", "task hello", 0.0, now=100.0, shared=True) == ("build", "")
    assert builds.claim(KEY, TAG, "r2", "task hello", 0.0, now=101.0, shared=True) == ("wait", "")
    builds.finish(KEY, TAG, "r2", True, "not mine", None, "elsewhere", "sha256:" + "00" * 32)  # no-op
    builds.finish(KEY, TAG, "r1", True, "Step 1/1 : FROM scratch\n", None, REPO, DIGEST)
    got = builds.get(KEY, TAG)
    assert got is not None and (got["state"], got["pushed_to"], got["digest"]) == ("built", REPO, DIGEST)
    for owner in ("r2", "r3", "r1"):
        assert builds.claim(KEY, TAG, owner, "task hello", 0.0, shared=True) == ("pull", f"{REPO}@{DIGEST}")
    assert builds.builds(TAG) == 1


def test_a_builder_that_died_leaves_a_row_the_next_host_takes_over(any_store: RunStore) -> None:
    builds = ImageBuilds(any_store.db)
    assert builds.claim(KEY, TAG, "dead", "task hello", 0.0, now=100.0, shared=True)[0] == "build"
    assert builds.claim(KEY, TAG, "r2", "task hello", 0.0, now=110.0, shared=True)[0] == "wait"
    assert (
        builds.claim(KEY, TAG, "r2", "task hello", 0.0, now=100.0 + BUILD_STALE_S + 1, shared=True)[0]
        == "build"
    )
    builds.finish(KEY, TAG, "dead", True, "late", None, REPO, "sha256:" + "ff" * 32)  # lost its row: nothing
    got = builds.get(KEY, TAG)
    assert got is not None and (got["state"], got["owner"], got["digest"], got["builds"]) == (
        "building",
        "r2",
        None,
        2,
    )


def test_a_given_up_push_and_a_forgotten_digest_free_the_row_for_the_next_build(any_store: RunStore) -> None:
    builds = ImageBuilds(any_store.db)
    assert builds.claim(KEY, TAG, "r1", "task hello", 0.0, shared=True)[0] == "build"
    builds.release(KEY, TAG, "r1", "log", "task hello: push of image ... failed")
    got = builds.get(KEY, TAG)
    assert got is not None and got["state"] == "new" and "push" in got["error"]
    assert builds.claim(KEY, TAG, "r2", "task hello", 0.0, shared=True)[0] == "build"
    builds.finish(KEY, TAG, "r2", True, "log", None, REPO, DIGEST)
    builds.forget(KEY, TAG, "sha256:" + "00" * 32, "another digest")  # not the row's digest: kept
    assert builds.claim(KEY, TAG, "r3", "task hello", 0.0, shared=True)[0] == "pull"
    builds.forget(KEY, TAG, DIGEST, "manifest unknown")
    assert builds.claim(KEY, TAG, "r3", "task hello", 0.0, shared=True)[0] == "build"
    assert builds.builds(TAG) == 3


def test_the_per_host_rows_are_untouched_by_the_registry_row(any_store: RunStore) -> None:
    builds = ImageBuilds(any_store.db)
    assert builds.claim("h1", TAG, "r1", "task hello", 0.0, now=100.0)[0] == "build"
    assert builds.claim(KEY, TAG, "r2", "task hello", 0.0, now=100.0, shared=True)[0] == "build"
    builds.finish("h1", TAG, "r1", True, "log", None)
    got = builds.get("h1", TAG)
    assert got is not None and got["digest"] is None and got["state"] == "built"


# ----------------------------------------------------------------------------------- ensure_image, faked


class FakeRegistry:
    """Manifests by repository and digest; ``down``: refuses every push and pull."""

    def __init__(self) -> None:
        self.manifests: dict[str, str] = {}  # "repo@digest" -> image id
        self.down = False
        self._n = itertools.count(1)

    def push(self, image_id: str, repository: str) -> str:
        if self.down:
            raise RegistryError("Get http://127.0.0.1:5000/v2/: connection refused")
        digest = f"sha256:{next(self._n):064x}"
        self.manifests[f"{repository}@{digest}"] = image_id
        return digest

    def pull(self, reference: str) -> str:
        if self.down:
            raise RegistryError("Get http://127.0.0.1:5000/v2/: connection refused")
        if reference not in self.manifests:
            raise RegistryError(f"manifest for {reference} not found: manifest unknown", missing=True)
        return self.manifests[reference]


class FakeHost:
    """A Docker daemon as `ensure_image` uses it: images by tag, builds (slow, counted), push and pull."""

    def __init__(
        self, name: str, registry: FakeRegistry, build_s: float = 0.3, can_build: bool = True
    ) -> None:
        self.name, self.registry, self.build_s, self.can_build = name, registry, build_s, can_build
        self.images: dict[str, str] = {}
        self.built = self.pushed = self.pulled = 0
        self._lock = threading.Lock()

    def has_image(self, tag: str) -> bool:
        return tag in self.images

    def build_image(self, build: ImageBuild) -> tuple[bool, str]:
        with self._lock:
            self.built += 1
        time.sleep(self.build_s)
        if not self.can_build:
            return False, "Step 1/2 : FROM base\nerror: pull access denied for base\n"
        self.images[build.tag] = f"img-{self.name}"
        return True, "Step 1/2 : FROM base\nSuccessfully built\n"

    def push_image(self, local: str, repository: str, tag: str) -> str:
        self.pushed += 1
        return self.registry.push(self.images[local], repository)

    def pull_image(self, reference: str, local: str) -> None:
        self.pulled += 1
        self.images[local] = self.registry.pull(reference)


@pytest.fixture
def fast(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(images, "WAIT_POLL_S", 0.05)
    monkeypatch.setattr(images, "BUILD_BEAT_S", 0.05)


def ensure(
    builds: ImageBuilds, host: FakeHost, owner: str, registry: str | None = REGISTRY
) -> asyncio.Task[None]:
    backend = AsyncSandboxBackend(host)  # type: ignore[arg-type]
    return asyncio.ensure_future(ensure_image(builds, backend, host.name, BUILD, owner, registry=registry))


async def until_building(builds: ImageBuilds, key: str = KEY) -> None:
    for _ in range(200):
        got = await asyncio.to_thread(builds.get, key, TAG)
        if got is not None and got["state"] == "building":
            return
        await asyncio.sleep(0.01)
    raise AssertionError("no build started")


async def test_two_hosts_racing_one_builds_and_pushes_the_other_waits_and_pulls_the_digest(
    tmp_path: Path, fast: None
) -> None:
    builds, registry = ImageBuilds(RunStore(tmp_path).db), FakeRegistry()
    h1, h2 = FakeHost("h1", registry, build_s=1.0), FakeHost("h2", registry, can_build=False)
    first = ensure(builds, h1, "r1")
    await until_building(builds)
    second, third = ensure(builds, h2, "r2"), ensure(builds, h2, "r3")  # two rollouts on h2 meanwhile
    await asyncio.gather(first, second, third)
    got = builds.get(KEY, TAG)
    assert got is not None and got["state"] == "built" and got["pushed_to"] == REPO
    assert (h1.built, h1.pushed, h2.built) == (1, 1, 0)
    assert h2.pulled in (1, 2)  # the second rollout on h2 pulls too, unless the first has tagged it already
    assert h2.images[TAG] == registry.manifests[f"{REPO}@{got['digest']}"] == "img-h1"
    assert builds.builds(TAG) == 1 and builds.get("h2", TAG) is None
    # later rollouts on either host use the image they have
    await asyncio.gather(ensure(builds, h1, "r4"), ensure(builds, h2, "r5"))
    pulled = h2.pulled
    await asyncio.gather(ensure(builds, h1, "r6"), ensure(builds, h2, "r7"))
    assert (h1.built, h2.built, h2.pulled) == (1, 0, pulled)


async def test_a_host_that_died_mid_build_is_taken_over_by_the_next(tmp_path: Path, fast: None) -> None:
    builds, registry = ImageBuilds(RunStore(tmp_path).db), FakeRegistry()
    builds.claim(KEY, TAG, "dead", "task hello", 0.0, now=time.time() - BUILD_STALE_S - 1, shared=True)
    h2, h3 = FakeHost("h2", registry), FakeHost("h3", registry)
    await ensure(builds, h2, "r2")
    await ensure(builds, h3, "r3")
    assert (h2.built, h2.pushed, h3.built, h3.pulled, builds.builds(TAG)) == (1, 1, 0, 1, 2)


async def test_a_failed_build_ends_every_host_s_rollouts_without_a_build_each(
    tmp_path: Path, fast: None
) -> None:
    builds, registry = ImageBuilds(RunStore(tmp_path).db), FakeRegistry()
    h1, h2 = FakeHost("h1", registry, can_build=False), FakeHost("h2", registry)
    with pytest.raises(
        EnvironmentFailure, match=r"task hello: image build dr-harbor-env:0123abcd failed on h1"
    ):
        await ensure(builds, h1, "r1")
    with pytest.raises(EnvironmentFailure, match="pull access denied"):
        await ensure(builds, h2, "r2")
    assert (h2.built, h2.pulled, builds.builds(TAG)) == (0, 0, 1)


async def test_a_failed_push_is_an_infra_error_and_the_next_host_builds_and_pushes(
    tmp_path: Path, fast: None
) -> None:
    builds, registry = ImageBuilds(RunStore(tmp_path).db), FakeRegistry()
    h1, h2 = FakeHost("h1", registry), FakeHost("h2", registry)
    registry.down = True
    with pytest.raises(SandboxNotReady) as e:
        await ensure(builds, h1, "r1")
    message = str(e.value)
    assert "\n" not in message and message.startswith(
        f"task hello: push of image {TAG} to registry {REGISTRY} failed on h1: "
    )
    assert "connection refused" in message
    got = builds.get(KEY, TAG)
    assert got is not None and got["state"] == "new" and got["error"] == message
    await ensure(builds, h1, "r1")  # its retry: h1 has the image it built
    registry.down = False
    await ensure(builds, h2, "r2")  # the row is free: h2 builds and pushes
    await ensure(builds, FakeHost("h3", registry), "r3")
    assert (h1.built, h2.built, h2.pushed, builds.builds(TAG)) == (1, 1, 1, 2)


async def test_a_failed_pull_is_an_infra_error_naming_the_image_and_the_registry(
    tmp_path: Path, fast: None
) -> None:
    builds, registry = ImageBuilds(RunStore(tmp_path).db), FakeRegistry()
    h1, h2 = FakeHost("h1", registry), FakeHost("h2", registry)
    await ensure(builds, h1, "r1")
    got = builds.get(KEY, TAG)
    assert got is not None
    reference = f"{REPO}@{got['digest']}"
    registry.down = True  # unreachable: the row stays, the retry pulls again
    with pytest.raises(SandboxNotReady) as e:
        await ensure(builds, h2, "r2")
    assert str(e.value) == (
        f"task hello: pull of image {TAG} ({reference}) from registry {REGISTRY} failed on h2: "
        "Get http://127.0.0.1:5000/v2/: connection refused"
    )
    assert builds.get(KEY, TAG)["state"] == "built"  # type: ignore[index]
    registry.down = False
    registry.manifests.clear()  # the registry lost it: the row is forgotten, the retry builds and pushes
    with pytest.raises(SandboxNotReady, match="manifest unknown"):
        await ensure(builds, h2, "r2")
    assert builds.get(KEY, TAG)["state"] == "new"  # type: ignore[index]
    await ensure(builds, h2, "r2")
    assert (h2.built, h2.pushed, builds.builds(TAG)) == (1, 1, 2)


async def test_without_a_registry_each_host_builds_its_own(tmp_path: Path, fast: None) -> None:
    builds, registry = ImageBuilds(RunStore(tmp_path).db), FakeRegistry()
    h1, h2 = FakeHost("h1", registry), FakeHost("h2", registry)
    await asyncio.gather(ensure(builds, h1, "r1", None), ensure(builds, h2, "r2", None))
    assert (h1.built, h2.built, h1.pushed + h2.pushed, builds.builds(TAG)) == (1, 1, 0, 2)
    assert builds.get(KEY, TAG) is None
