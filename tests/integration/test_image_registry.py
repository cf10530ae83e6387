"""Images from a registry (``sandbox_pool.registry``): a local registry (Debian's ``docker-registry`` on
127.0.0.1, started and stopped by its pid) and two Docker daemons (the main one and a second on its own
socket, data root and exec root, started and stopped by its pid, without even the sandbox base image).

- The first host builds the task image and pushes it; the second, asking while the build runs, waits for
  the digest and pulls it: its daemon builds nothing (no build call, no container event), the store
  records one build, both daemons hold the image under the recorded digest, and a sandbox on the second
  daemon runs the first one's build.
- A pull by a digest the registry does not have, or from a registry that is down, is one ``SandboxNotReady``
  line naming the image and the registry (the unknown digest is forgotten: the retry builds again).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import docker
import pytest

from durable_rollouts.errors import SandboxNotReady
from durable_rollouts.sandboxes import DockerBackend
from durable_rollouts.sandboxes.base import DEFAULT_IMAGE, AsyncSandboxBackend, ImageBuild, SandboxSpec
from durable_rollouts.sandboxes.images import ImageBuilds, ensure_image, registry_key, remote_image
from durable_rollouts.stack.procs import free_port
from durable_rollouts.store import RunStore
from tests.integration.docker_daemons import SecondDockerd, need_second_daemon

pytestmark = pytest.mark.timeout(300)


def _stop(proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    """Stop a process this test started (it leads its own session): SIGTERM, then SIGKILL."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@dataclass
class Registry:
    url: str
    """``127.0.0.1:PORT``: what ``sandbox_pool.registry`` names (plus a namespace)."""
    proc: subprocess.Popen[bytes]


@pytest.fixture(scope="module")
def registry() -> Iterator[Registry]:
    binary = shutil.which("docker-registry")
    if binary is None:
        pytest.skip("no image registry: apt-get install docker-registry (.ci/with-services.sh installs it)")
    root = Path(tempfile.mkdtemp(prefix="dr-registry-"))
    port = free_port()
    (root / "config.yml").write_text(
        "version: 0.1\nlog:\n  level: warn\n"
        f"storage:\n  filesystem:\n    rootdirectory: {root / 'data'}\n"
        f"http:\n  addr: 127.0.0.1:{port}\n  secret: durable-rollouts-test\n"
    )
    log = (root / "registry.log").open("ab")
    proc = subprocess.Popen(
        [binary, "serve", str(root / "config.yml")], stdout=log, stderr=log, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, (root / "registry.log").read_text()[
                -800:
            ]
            time.sleep(0.2)
        yield Registry(f"127.0.0.1:{port}", proc)
    finally:
        _stop(proc)
        log.close()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def second_daemon() -> Iterator[SecondDockerd]:
    """A second dockerd (the host that pulls), on a bridge of its own."""
    need_second_daemon()
    daemon = SecondDockerd("dr-d3")
    try:
        daemon.start()
        yield daemon
    finally:
        daemon.close()


class Counted(DockerBackend):
    """A Docker backend that counts the builds it was asked for; ``slow_s``: each takes that much longer."""

    def __init__(self, client: docker.DockerClient | None = None, slow_s: float = 0.0) -> None:
        super().__init__(client)
        self.builds, self.slow_s = 0, slow_s

    def build_image(self, build: ImageBuild) -> tuple[bool, str]:
        self.builds += 1
        time.sleep(self.slow_s)
        return super().build_image(build)


def task_image(nonce: str) -> ImageBuild:
    """A task image on the sandbox image with a file of its own (COPY: a build that runs no container)."""
    import base64

    def b64(text: str) -> str:
        return base64.b64encode(text.encode()).decode()

    dockerfile = f"FROM {DEFAULT_IMAGE}\nCOPY built-marker /built-marker\n"
    return ImageBuild(
        tag=f"dr-registry-test:{nonce}",
        context={"Dockerfile": b64(dockerfile), "built-marker": b64(f"built-{nonce}\n")},
        what=f"task registry-{nonce}",
    )


def _remove_images(backend: DockerBackend, *names: str) -> None:
    for name in names:
        with contextlib.suppress(docker.errors.NotFound):
            backend.api.remove_image(name)


async def test_the_first_host_builds_and_pushes_the_second_pulls_the_recorded_digest_and_never_builds(
    docker: DockerBackend, registry: Registry, second_daemon: SecondDockerd, tmp_path: Path
) -> None:
    nonce = uuid.uuid4().hex[:12]
    build, where = task_image(nonce), f"{registry.url}/durable-rollouts"
    repository, version = remote_image(where, build.tag)
    h1, h2 = Counted(slow_s=3.0), Counted(docker_client(second_daemon))  # h2 asks while h1 builds
    assert not h2.has_image(DEFAULT_IMAGE)  # the second host could not build this image if it tried
    builds = ImageBuilds(RunStore(tmp_path).db)
    since, row = int(time.time()) - 1, None
    try:
        first = asyncio.ensure_future(
            ensure_image(builds, AsyncSandboxBackend(h1), "h1", build, "rollout-1", registry=where)
        )
        for _ in range(300):  # the second host asks while the first builds
            row = builds.get(registry_key(where), build.tag)
            if row is not None and row["state"] == "building":
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError(f"the first host never started building: {first}")
        second = ensure_image(builds, AsyncSandboxBackend(h2), "h2", build, "rollout-2", registry=where)
        await asyncio.gather(first, second)

        row = builds.get(registry_key(where), build.tag)
        assert row is not None and row["state"] == "built" and row["pushed_to"] == repository, row
        digest = row["digest"]
        assert digest.startswith("sha256:") and "COPY built-marker" in row["log"]
        assert builds.builds(build.tag) == 1 and builds.get("h2", build.tag) is None
        assert (h1.builds, h2.builds) == (1, 0)
        for host in (h1, h2):
            assert f"{repository}@{digest}" in host.api.inspect_image(build.tag)["RepoDigests"]
        events = list(h2.api.events(since=since, until=int(time.time()) + 1, decode=True))
        assert [e for e in events if e["Type"] == "image" and e["Action"] == "pull"], events
        assert not [e for e in events if e["Type"] == "container"], events  # no build step ran there
        assert not [e for e in events if e["Type"] == "image" and e["Action"] == "push"], events

        # the image the second daemon pulled is the first one's build: a sandbox there runs it
        key = f"registry-{nonce}"
        handle = h2.create(key, "registry-test", SandboxSpec(image=build.tag))
        try:
            assert h2.exec(handle, "cat /built-marker").output.strip() == f"built-{nonce}"
        finally:
            h2.destroy(key)
        # a later rollout on either host uses the image it has
        for host, name in ((h1, "h1"), (h2, "h2")):
            await ensure_image(builds, AsyncSandboxBackend(host), name, build, "rollout-3", registry=where)
        assert (h1.builds, h2.builds, builds.builds(build.tag)) == (1, 0, 1)
    finally:
        _remove_images(docker, build.tag, f"{repository}:{version}")
        _remove_images(h2, build.tag)  # the second daemon goes with its data root


def docker_client(daemon: SecondDockerd) -> docker.DockerClient:
    return docker.DockerClient(base_url=daemon.url)


async def test_a_pull_that_fails_is_one_infra_line_naming_the_image_and_the_registry(
    docker: DockerBackend, registry: Registry, second_daemon: SecondDockerd, tmp_path: Path
) -> None:
    nonce = uuid.uuid4().hex[:12]
    build = task_image(nonce)
    h2 = Counted(docker_client(second_daemon))
    builds = ImageBuilds(RunStore(tmp_path).db)
    unknown = "sha256:" + "0" * 64
    dead = f"127.0.0.1:{free_port()}/durable-rollouts"  # nothing listens there
    for where in (f"{registry.url}/durable-rollouts", dead):
        repository, _ = remote_image(where, build.tag)
        key = registry_key(where)
        assert builds.claim(key, build.tag, "rollout-1", build.what, 0.0, shared=True)[0] == "build"
        builds.finish(key, build.tag, "rollout-1", True, "pushed elsewhere", None, repository, unknown)
        with pytest.raises(SandboxNotReady) as e:
            await ensure_image(builds, AsyncSandboxBackend(h2), "h2", build, "rollout-2", registry=where)
        message = str(e.value)
        assert "\n" not in message and message.startswith(
            f"task registry-{nonce}: pull of image {build.tag} ({repository}@{unknown}) from registry {where}"
            " failed on h2: "
        ), message
        row = builds.get(key, build.tag)
        assert row is not None
        if where == dead:
            assert "connection refused" in message and row["state"] == "built"  # the retry pulls again
        else:
            assert "manifest unknown" in message and row["state"] == "new"  # forgotten: the retry builds
    assert h2.builds == 0 and not h2.has_image(build.tag)
