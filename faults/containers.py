"""Container faults on a run's sandboxes, and sandbox creation failures, through the Docker daemon.

- ``kill``: SIGKILL the container (``docker kill``);
- ``paused``: freeze it (``docker pause``, the cgroup freezer) and unpause it on leaving;
- ``oom``: OOM-kill it as a whole: the container's init is made the kernel's first OOM victim
  (``oom_score_adj`` 1000, from the host; needs root), then a memory hog started with ``docker exec``
  fills the container's memory limit, so the kernel's OOM killer, inside the container's own memory
  cgroup, kills the init and with it the container (Docker reports ``OOMKilled``);
- ``image_unavailable``: the sandbox image's tag is removed for a while (held under another tag, so no
  layer is lost), so every sandbox create of that image fails as the pipeline's real error path sees it
  (image missing: ``SandboxNotReady``) and succeeds again once the tag is back.

A run's containers are found by the labels the Docker backend puts on every sandbox
(``durable-rollouts.run``).

Invariants: only containers labelled with the run are touched; a paused container is always unpaused and a
removed tag always restored on leaving the context (and ``held_images`` lists tags an injector that died left
held); the image fault never removes an image, only a tag.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import docker.errors

from durable_rollouts.sandboxes.docker_backend import LABEL_PROJECT, LABEL_ROLLOUT, LABEL_RUN

HOLD_REPO = "durable-rollouts-chaos-hold"
"""Repository of the tags that keep an image while its own tag is removed."""
HOG = "exec tail /dev/zero"
"""Grows its line buffer until the memory limit: /dev/zero never yields a newline."""


class ContainerFaultError(RuntimeError):
    """A container fault could not be injected (one-line message)."""


def client() -> docker.DockerClient:
    try:
        return docker.from_env(timeout=60)
    except docker.errors.DockerException as e:
        raise ContainerFaultError(f"docker daemon unreachable: {e}") from None


def run_containers(run_id: str, dc: docker.DockerClient | None = None) -> list[Any]:
    """The running (not paused) sandbox containers of ``run_id``, oldest first."""
    dc = dc or client()
    found = dc.containers.list(filters={"label": [f"{LABEL_PROJECT}=1", f"{LABEL_RUN}={run_id}"]})
    running = [c for c in found if c.status == "running"]
    return sorted(running, key=lambda c: (c.attrs.get("Created", ""), c.name))


def rollout_of(container: Any) -> str:
    """The rollout id a sandbox container belongs to (its label)."""
    return str((container.labels or {}).get(LABEL_ROLLOUT, container.name))


def kill(container: Any) -> None:
    """SIGKILL the container (gone already is fine: the fault happened)."""
    with contextlib.suppress(docker.errors.NotFound):
        container.kill()


@contextlib.contextmanager
def paused(container: Any) -> Iterator[Any]:
    """Freeze the container on entry; unpause it on exit (always; removed meanwhile is fine)."""
    container.pause()
    try:
        yield container
    finally:
        with contextlib.suppress(docker.errors.NotFound, docker.errors.APIError):
            container.unpause()


def _set_oom_first(pid: int) -> None:
    try:
        Path(f"/proc/{pid}/oom_score_adj").write_text("1000")
    except OSError as e:
        why = f"cannot set oom_score_adj of pid {pid} ({e}); the OOM fault needs root"
        raise ContainerFaultError(why) from None


def oom(container: Any, timeout_s: float = 30.0) -> bool:
    """OOM-kill the container as a whole (see the module docstring); returns whether Docker reports it
    ``OOMKilled``.

    Raises:
        ContainerFaultError: the container is not running, or the OOM score cannot be set.
    """
    container.reload()
    state = container.attrs["State"]
    if not state.get("Running") or state.get("Paused"):
        raise ContainerFaultError(f"container {container.name} is not running")
    _set_oom_first(int(state["Pid"]))
    started = int(time.time()) - 1
    try:
        container.client.api.exec_start(
            container.client.api.exec_create(container.id, ["/bin/sh", "-c", HOG], user="65534:65534"),
            detach=True,
        )
    except docker.errors.APIError as e:
        raise ContainerFaultError(f"container {container.name}: cannot start the memory hog ({e})") from None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            container.reload()
        except docker.errors.NotFound:  # removed meanwhile (the pipeline replaced it): ask the daemon's log
            return _oom_event(container, started)
        if not container.attrs["State"].get("Running"):
            return bool(container.attrs["State"].get("OOMKilled")) or _oom_event(container, started)
        time.sleep(0.1)
    raise ContainerFaultError(f"container {container.name}: running {timeout_s:.0f} s after the memory hog")


def _hold_tag(image: str) -> str:
    return re.sub(r"[^a-z0-9_.-]+", "-", image.lower()).strip("-.")[:120] or "image"


@contextlib.contextmanager
def image_unavailable(image: str, dc: docker.DockerClient | None = None) -> Iterator[str]:
    """Remove ``image``'s tag for the body of the ``with`` (creates of it fail), then tag it again.

    Yields the hold tag (``durable-rollouts-chaos-hold:<image>``) that keeps the image meanwhile.

    Raises:
        ContainerFaultError: the image does not exist.
    """
    dc = dc or client()
    try:
        img = dc.images.get(image)
    except docker.errors.ImageNotFound:
        raise ContainerFaultError(f"image {image!r} not found; nothing to make unavailable") from None
    hold = f"{HOLD_REPO}:{_hold_tag(image)}"
    img.tag(HOLD_REPO, _hold_tag(image))
    try:
        dc.images.remove(image, noprune=True)  # the hold tag keeps the image: only the tag goes
        yield hold
    finally:
        repo, _, tag = image.rpartition(":") if ":" in image.rsplit("/", 1)[-1] else (image, "", "latest")
        dc.images.get(hold).tag(repo, tag or "latest")
        with contextlib.suppress(docker.errors.APIError):
            dc.images.remove(hold, noprune=True)


def held_images(dc: docker.DockerClient | None = None) -> list[str]:
    """Hold tags left by an injector that died mid-fault (restore the image's tag by hand with
    ``docker tag HOLD IMAGE``; the hold tag names the image with ':' and '/' replaced)."""
    dc = dc or client()
    return [t for img in dc.images.list(name=HOLD_REPO) for t in img.tags]


def _oom_event(container: Any, since: int) -> bool:
    """Whether the daemon logged an ``oom`` event for the container since ``since`` (epoch seconds): the
    kernel's OOM kill as Docker saw it, still known once the container is gone."""
    only = {"container": container.id, "event": "oom"}
    events = container.client.api.events(since=since, until=int(time.time()) + 1, filters=only, decode=True)
    return any(True for _ in events)
