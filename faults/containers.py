"""Container faults on a run's sandboxes, and sandbox creation failures, through the Docker daemon.

- ``kill``: SIGKILL the container (``docker kill``);
- ``paused``: freeze it (``docker pause``, the cgroup freezer) and thaw it on leaving, whatever Docker does
  (`unpause`: ``docker unpause`` waited for a bounded time, then the container's freezer cgroup thawed
  directly, ``faults.freezer``); a pause that fails leaves it thawed too (`pause`);
- ``oom``: OOM-kill it as a whole: the container's init is made the kernel's first OOM victim
  (``oom_score_adj`` 1000, from the host; needs root), then a memory hog started with ``docker exec``
  fills the container's memory limit, so the kernel's OOM killer, inside the container's own memory
  cgroup, kills the init and with it the container (Docker reports ``OOMKilled``);
- ``image_unavailable``: the sandbox image's tag is removed for a while (held under another tag, so no
  layer is lost), so every sandbox create of that image fails as the pipeline's real error path sees it
  (image missing: ``SandboxNotReady``) and succeeds again once the tag is back.

A run's containers are found by the labels the Docker backend puts on every sandbox
(``durable-rollouts.run``).

Why Docker alone may not thaw it (reproduced on Docker 20.10, runc 1.1.5, cgroup v1):
- a freeze fails ("unable to freeze") while processes fork inside (runc gives up after 1,000 FREEZINGs);
- a freeze racing a ``docker exec`` hangs: the exec's ``runc init`` sleeps in ``__refrigerator``, containerd's
  resume queues behind that exec, and dockerd holds the container's lock, so unpause and every inspect hang.

Invariants: only containers labelled with the run are touched; a paused container is always thawed on
leaving the context (its freezer reads THAWED, or `ContainerFaultError` says it could not be), a failed
pause is never left half-applied, and a removed tag is always restored (``held_images`` lists tags an
injector that died left held); the image fault never removes an image, only a tag.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker
import docker.errors

from durable_rollouts.faults import freezer
from durable_rollouts.sandboxes.docker_backend import LABEL_PROJECT, LABEL_ROLLOUT, LABEL_RUN

log = logging.getLogger(__name__)

HOLD_REPO = "durable-rollouts-chaos-hold"
"""Repository of the tags that keep an image while its own tag is removed."""
HOG = "exec tail /dev/zero"
"""Grows its line buffer until the memory limit: /dev/zero never yields a newline."""
DOCKER_WAIT_S = 10.0
"""How long a ``docker pause``/``unpause`` (and each step of a heal) is waited for before the freezer is set
directly."""


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
def paused(container: Any, wait_s: float | None = None, root: Path | None = None) -> Iterator[Any]:
    """Freeze the container on entry (`pause`); thaw it on exit (`unpause`: always; removed meanwhile is
    fine)."""
    pause(container, wait_s, root)
    try:
        yield container
    finally:
        unpause(container, wait_s, root)


@dataclass
class _Call:
    """A Docker call run in a daemon thread, waited for a bounded time (a hung call is left behind)."""

    fn: Callable[[], Any]
    error: BaseException | None = None
    thread: threading.Thread = field(init=False)

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self._run, name="chaos-docker-call", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.fn()
        except BaseException as e:  # reported by `why`, never lost in the thread
            self.error = e

    def wait(self, wait_s: float) -> bool:
        """Whether the call has returned (or raised) within ``wait_s``."""
        self.thread.join(wait_s)
        return not self.thread.is_alive()

    @property
    def ok(self) -> bool:
        return not self.thread.is_alive() and self.error is None

    def why(self, wait_s: float) -> str:
        if self.thread.is_alive():
            return f"no answer in {wait_s:g} s"
        if self.error is None:
            return "returned"
        said = getattr(self.error, "explanation", None) or self.error  # Docker's own words, not the URL
        return f"{type(self.error).__name__}: {said}"[:200]


def pause(container: Any, wait_s: float | None = None, root: Path | None = None) -> None:
    """``docker pause`` the container (waited up to ``wait_s``, default `DOCKER_WAIT_S`; ``root``: the cgroup
    mount, default ``freezer.CGROUP_ROOT``).

    Raises:
        docker.errors.NotFound: the container is gone.
        ContainerFaultError: the pause failed or hung; the container is thawed first (`unpause`), so a
            failed freeze (runc's "unable to freeze" can leave the cgroup FREEZING) is never left applied.
    """
    wait_s, root = _defaults(wait_s, root)
    call = _Call(container.pause)
    if call.wait(wait_s) and call.error is None:
        return
    if isinstance(call.error, docker.errors.NotFound):
        raise call.error
    how = unpause(container, wait_s, root)
    raise ContainerFaultError(f"container {container.name}: docker pause failed ({call.why(wait_s)}); {how}")


def unpause(container: Any, wait_s: float | None = None, root: Path | None = None) -> str:
    """Thaw the container whatever Docker does; returns how it was healed (one line, also logged).

    ``docker unpause`` is waited for up to ``wait_s``; then the container's freezer is read directly and, if
    not THAWED, written THAWED and waited for. Thawed that way, Docker may still call it paused (its late
    unpause finds runc's container running) and refuse every exec: once that unpause has ended, the cgroup is
    frozen again and unpaused through Docker, so Docker's state is running again.

    Raises:
        ContainerFaultError: the freezer still does not read THAWED after ``wait_s``.
    """
    wait_s, root = _defaults(wait_s, root)
    first = _Call(container.unpause)
    first.wait(wait_s)
    fz = freezer.find(container.id, root)
    state = _state(fz)
    if fz is None or state in (None, freezer.THAWED):
        if first.ok:
            how = "thawed by docker unpause"
        elif isinstance(first.error, docker.errors.NotFound):
            how = "the container is gone"
        else:
            how = f"not frozen (docker unpause: {first.why(wait_s)})"
        log.info("container %s: %s", container.name, how)
        return how
    _thaw(container, fz, wait_s)
    how = f"thawed its freezer directly ({state}; docker unpause: {first.why(wait_s)}); " + _resync(
        container, fz, first, wait_s
    )
    log.warning("container %s: %s", container.name, how)
    return how


def _defaults(wait_s: float | None, root: Path | None) -> tuple[float, Path]:
    """Read at call time, so a test (or a caller) can change the module's defaults."""
    return DOCKER_WAIT_S if wait_s is None else wait_s, freezer.CGROUP_ROOT if root is None else root


def _state(fz: freezer.Freezer | None) -> str | None:
    try:
        return fz.state() if fz is not None else None
    except OSError:  # the cgroup went with the container
        return None


def _thaw(container: Any, fz: freezer.Freezer, wait_s: float) -> None:
    if not fz.set(freezer.THAWED, wait_s):
        why = f"freezer {fz.path} not THAWED after {wait_s:g} s"
        raise ContainerFaultError(f"container {container.name}: {why}")


def _resync(container: Any, fz: freezer.Freezer, first: _Call, wait_s: float) -> str:
    """After a direct thaw: make Docker's state say running again (see `unpause`); returns what it says."""
    if not first.wait(wait_s):
        return "its docker unpause is still pending"
    reload = _Call(container.reload)
    if not reload.wait(wait_s) or reload.error is not None:
        return f"Docker's state unknown ({reload.why(wait_s)})"
    if not container.attrs.get("State", {}).get("Paused"):
        return "Docker says running"
    if not fz.set(freezer.FROZEN, wait_s):  # processes forking as it freezes: leave it thawed
        _thaw(container, fz, wait_s)
        return "Docker still says paused (could not freeze it again to unpause it through Docker)"
    again = _Call(container.unpause)
    if again.wait(wait_s) and again.error is None and _state(fz) in (None, freezer.THAWED):
        return "Docker says running (frozen again and unpaused through Docker)"
    _thaw(container, fz, wait_s)
    return f"Docker still says paused (docker unpause: {again.why(wait_s)})"


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
