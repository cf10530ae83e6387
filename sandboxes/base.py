"""Sandbox interface, plain data types and errors.

Invariant: a sandbox failure is always raised as a `SandboxError`; it is never returned as command output.
What the model's program did (its exit code, its output, a timeout, a process killed for memory) is an
`ExecResult`; what happened to the sandbox itself (container gone, daemon unreachable) is an exception.

This module imports nothing heavy (no docker), so workflows and other types modules may import it.
"""

from __future__ import annotations

import asyncio
import posixpath
import re
from collections.abc import Set as AbstractSet
from typing import Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from durable_rollouts.errors import (
    SandboxPathError,
)
from durable_rollouts.sandboxes.egress_policy import EgressPolicy

DEFAULT_IMAGE = "durable-rollouts-sandbox:latest"
"""Tag built by `sandboxes/image/build_image.sh`."""

RESERVED_LABEL_PREFIX = "durable-rollouts"
"""Label keys the backend owns; user labels may not start with it."""

GATEWAY_MOUNT = "/.dr-gateway"
"""Where a sandbox with ``gateway`` sees its rollout's gateway folder (the socket is ``gw.sock`` in it)."""

GATEWAY_ROOT_ENV = "DR_GATEWAY_DIR"
"""Environment variable naming the host folder of the gateways' sockets (default /tmp/dr-gateway)."""

USER_PATTERN = r"^([0-9]+|[A-Za-z_][A-Za-z0-9_.-]{0,31})(:([0-9]+|[A-Za-z_][A-Za-z0-9_.-]{0,31}))?$"
"""A sandbox user in Docker's ``--user`` forms: ``uid``, ``uid:gid``, ``name``, ``name:group`` (or mixed)."""

SIBLING_SEP = "#"
"""Joins a rollout's key and a name into the key of another sandbox of that rollout (``<key>#verifier``)."""


def sibling_key(key: str, name: str) -> str:
    """The key of the sandbox ``name`` of the rollout whose own sandbox's key is ``key``."""
    return f"{key}{SIBLING_SEP}{name}"


def owner_key(key: str) -> str:
    """The rollout key a sandbox key belongs to (itself for a rollout's own sandbox)."""
    return key.partition(SIBLING_SEP)[0]


_MAX_PATH_CHARS = 1024
"""Longest relative path accepted by `validate_relative_path`."""


class SandboxSpec(BaseModel):
    """Resources and identity of one sandbox. Every limit is enforced by the backend."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    image: str = Field(default=DEFAULT_IMAGE, min_length=1, max_length=255)
    """Local image tag; never pulled (build it with `sandboxes/image/build_image.sh`)."""

    memory_mb: int = Field(default=1024, ge=64, le=65536)
    """Memory limit of the whole container in MiB, swap disabled. Files in the tmpfs workdir count too."""

    cpus: float = Field(default=1.0, gt=0.0, le=64.0)
    """CPU quota in cores (fractional allowed)."""

    pids_limit: int = Field(default=256, ge=16, le=32768)
    """Most processes and threads alive at once in the container (contains fork bombs)."""

    workdir: str = Field(default="/work")
    """Absolute path of the writable tmpfs where commands run and files are copied."""

    workdir_size_mb: int = Field(default=512, ge=1, le=65536)
    """Size cap of the workdir tmpfs in MiB; with `tmp_size_mb` it must stay below `memory_mb`."""

    tmp_size_mb: int = Field(default=64, ge=1, le=65536)
    """Size cap of the /tmp tmpfs in MiB."""

    user: str = Field(default="1000:1000", pattern=USER_PATTERN)
    """The user commands and file operations run as: ``uid:gid``, ``uid``, ``name`` or ``name:group`` (names
    resolved in the image's /etc/passwd at create: `sandboxes.users`). Never root unless `allow_root`."""

    exec_users: dict[str, str] = Field(default_factory=dict)
    """Other users a command may run as (``exec``'s ``user``), in `user`'s forms, each -> what named it (for
    messages, e.g. ``tasks/x/task.toml [verifier].user``); resolved and checked at create, like `user`."""

    user_source: str = ""
    """What named `user`, for messages (e.g. ``tasks/x/task.toml [agent].user``); empty: the sandbox's own."""

    allow_root: bool = False
    """Let `user` or an `exec_users` entry be root in the sandbox (uid or gid 0). Honoured only on a Docker
    daemon that remaps users (root in the container is an unprivileged host user); on any other the
    backend refuses the sandbox (`sandboxes.users.SandboxUserRefused`). Capabilities stay dropped."""

    env: dict[str, str] = Field(default_factory=dict)
    """Environment variables of every command (besides the backend's HOME, LANG and PYTHONUNBUFFERED, which
    they may override)."""

    command_timeout_s: float = Field(default=60.0, gt=0.0, le=86400.0)
    """Default wall-clock limit of one command when `exec` is given none."""

    output_limit_bytes: int = Field(default=65536, ge=1024, le=16 * 1024 * 1024)
    """Most bytes of stdout+stderr kept per command; the rest is counted and dropped inside the sandbox."""

    labels: dict[str, str] = Field(default_factory=dict)
    """Extra container labels; keys must not start with `durable-rollouts`."""

    mounts: dict[str, int] = Field(default_factory=dict)
    """Extra size-capped tmpfs folders (absolute path -> MiB), writable by `user`, like the workdir (e.g.
    Harbor's ``/logs`` and ``/tests``); they count against `memory_mb` with the workdir and /tmp."""

    gateway: bool = False
    """Bind the rollout's own gateway folder (`gateway_dir`, on the daemon's machine) read-only at
    `GATEWAY_MOUNT`: its Unix socket is the only thing outside the container the sandbox can reach."""

    writable_root: bool = False
    """Let commands write to the container's own filesystem (its copy-on-write layer, not size-capped;
    the host's files stay out of reach), for tasks written to install packages when they run, such as
    Terminal-Bench 2's ``apt-get install`` in ``tests/test.sh``. Off by default: the root filesystem is
    read-only and only the workdir, /tmp and `mounts` are writable."""

    egress: EgressPolicy = Field(default_factory=EgressPolicy)
    """Hosts the sandbox may reach (``[sandbox.egress]``, the operator's; an environment may narrow it
    per task): none by default, and then no network at all. Otherwise its only network is its own
    ``--internal`` Docker network shared with the egress proxy alone (``sandboxes.egress``), named to
    it by ``HTTP_PROXY``/``HTTPS_PROXY`` (and the lower-case forms) in every command's environment."""

    @model_validator(mode="after")
    def _check_tmpfs_fits_memory(self) -> SandboxSpec:
        # tmpfs pages are charged to the container's memory cgroup: a full workdir must not starve processes
        # into OOM kills instead of failing writes with ENOSPC.
        tmpfs = self.workdir_size_mb + self.tmp_size_mb + sum(self.mounts.values())
        if tmpfs >= self.memory_mb:
            raise ValueError(
                f"workdir_size_mb + tmp_size_mb + mounts ({tmpfs}) must be below "
                f"memory_mb ({self.memory_mb}): tmpfs contents count against the memory limit"
            )
        return self

    @field_validator("mounts")
    @classmethod
    def _check_mounts(cls, value: dict[str, int]) -> dict[str, int]:
        for path, size in value.items():
            _check_mount_path(path, "mount")
            if not 1 <= size <= 65536:
                raise ValueError(f"mount {path!r}: size must be in [1, 65536] MiB, got {size}")
        return value

    @field_validator("workdir")
    @classmethod
    def _check_workdir(cls, value: str) -> str:
        return _check_mount_path(value, "workdir")

    @model_validator(mode="after")
    def _check_users(self) -> SandboxSpec:
        for user in (self.user, *self.exec_users):
            if not re.fullmatch(USER_PATTERN, user):
                raise ValueError(f"user {user!r} is not uid, uid:gid, name or name:group")
            if is_literal_root(user) and not self.allow_root:
                raise ValueError(f"sandbox user must be non-root unless allow_root is set, got {user!r}")
        for key in self.env:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
                raise ValueError(f"env: {key!r} is not an environment variable name")
        return self

    @field_validator("labels")
    @classmethod
    def _check_labels(cls, value: dict[str, str]) -> dict[str, str]:
        reserved = [key for key in value if key.startswith(RESERVED_LABEL_PREFIX)]
        if reserved:
            raise ValueError(f"labels starting with {RESERVED_LABEL_PREFIX!r} are reserved: {reserved}")
        return value


def is_literal_root(user: str) -> bool:
    """Whether ``user`` names root without looking at an image (uid or gid 0, or ``root`` by name)."""
    return any(part == "root" or (part.isdigit() and int(part) == 0) for part in user.split(":"))


def gateway_dir(key: str) -> str:
    """The host folder of sandbox ``key``'s gateway socket: one per rollout, so a sandbox mounts only its own
    (named by a hash of the key; the worker serving the sandbox's host creates it, mode 0755)."""
    import hashlib
    import os

    root = os.environ.get(GATEWAY_ROOT_ENV) or "/tmp/dr-gateway"
    return os.path.join(root, hashlib.sha256(key.encode()).hexdigest()[:32])


def gateway_binds(spec: SandboxSpec, key: str) -> dict[str, dict[str, str]] | None:
    """Docker's ``binds`` of sandbox ``key``: its own gateway folder, read-only, when ``spec.gateway``
    (created here, mode 0755); None otherwise."""
    if not spec.gateway:
        return None
    import os

    folder = gateway_dir(key)
    os.makedirs(folder, mode=0o755, exist_ok=True)
    return {folder: {"bind": GATEWAY_MOUNT, "mode": "ro"}}


def _check_mount_path(value: str, what: str) -> str:
    if not value.startswith("/") or posixpath.normpath(value) != value or value == "/":
        raise ValueError(f"{what} must be a normalised absolute path other than '/': {value!r}")
    if value.split("/")[1] in {"proc", "sys", "dev", "etc", "tmp", "usr", "bin", "sbin", "lib"}:
        raise ValueError(f"{what} may not shadow a system directory: {value!r}")
    return value


class ImageBuild(BaseModel):
    """An image built on the Docker daemon that runs the sandbox, from a build context (``sandboxes.images``
    builds it once per tag and host, the tag naming the context's content hash)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tag: str = Field(min_length=1, max_length=255)
    """Local tag of the image; a content hash, so equal contexts share one image per host."""
    context: dict[str, str] = Field(default_factory=dict)
    """Relative path -> base64 content of the build context; ``Dockerfile`` names the Dockerfile."""
    executables: list[str] = Field(default_factory=list)
    """Paths of ``context`` with the executable bit."""
    timeout_s: float = Field(600.0, gt=0)
    """Most seconds one build may take; past it the build fails."""
    what: str = "image"
    """Who needs it, for messages (e.g. ``task hello-world``)."""


class SandboxHandle(BaseModel):
    """Reference to one live sandbox; small and serialisable, so it can cross activity boundaries."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    key: str
    """Caller's idempotency key (unique per sandbox on the daemon, e.g. the rollout's workflow id)."""
    run_id: str
    """Run the sandbox belongs to (used by the reaper)."""
    name: str
    """Container name, derived deterministically from `key`."""
    container_id: str
    """Docker id of the container this handle was created for; a replaced container is a lost sandbox."""
    spec: SandboxSpec
    """Spec the container was created with."""


class ExecResult(BaseModel):
    """Outcome of one command in a sandbox (the sandbox itself survived it)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    exit_code: int
    """Exit status of the command (128+N when killed by signal N; 124 or 137 on timeout)."""
    output: str
    """stdout and stderr interleaved in the order written (one pipe), UTF-8 with replacement, capped at
    `output_limit_bytes` plus the visible notes below."""
    truncated: bool = False
    """Output went past the cap; the kept prefix ends with `[output truncated: N bytes omitted]`."""
    timed_out: bool = False
    """The wall-clock limit fired and the command's whole process group was killed."""
    oom_killed: bool = False
    """A process of the command was killed by the sandbox's memory limit (a note says so in `output`)."""
    duration_s: float = 0.0
    """Wall-clock seconds from starting the exec to collecting its status."""
    replayed: bool = False
    """An exec with a ``once_key`` already used in this sandbox: the command was not run again; this is the
    first run's result (its output, status and duration), collected once that run ended."""


class SandboxInfo(BaseModel):
    """One labelled container as seen by `list_containers`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    container_id: str
    key: str
    run_id: str
    state: str
    """Docker state: created, running, paused, exited, dead, ..."""
    created_at: float
    """Unix time the container was created."""


def validate_relative_path(path: str) -> str:
    """Check a file path meant to be relative to the workdir and return it normalised.

    Only lexical checks; symlinks are checked inside the sandbox by the backend.

    Args:
        path: Path relative to the workdir, POSIX separators.

    Returns:
        The path with duplicate slashes and `.` components removed.

    Raises:
        SandboxPathError: the path is empty, too long, absolute, contains NUL or a `..` component.
    """
    if not isinstance(path, str) or not path:
        raise SandboxPathError(f"rejected path {path!r}: empty")
    if "\x00" in path:
        raise SandboxPathError(f"rejected path {path!r}: contains NUL")
    if len(path) > _MAX_PATH_CHARS:
        raise SandboxPathError(f"rejected path {path[:40]!r}...: longer than {_MAX_PATH_CHARS} characters")
    if path.startswith("/"):
        raise SandboxPathError(f"rejected path {path!r}: absolute (paths are relative to the workdir)")
    parts = [part for part in path.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise SandboxPathError(f"rejected path {path!r}: contains '..'")
    if not parts:
        raise SandboxPathError(f"rejected path {path!r}: names the workdir itself")
    if "\n" in path or "\r" in path:
        raise SandboxPathError(f"rejected path {path!r}: contains a newline")
    return "/".join(parts)


@runtime_checkable
class SandboxBackend(Protocol):
    """Synchronous, thread-safe sandbox backend. Every method may block; see `AsyncSandboxBackend`."""

    def create(self, key: str, run_id: str, spec: SandboxSpec) -> SandboxHandle:
        """Create the sandbox for `key`, or reattach to the running one (idempotent on key)."""
        ...

    def exec(
        self,
        handle: SandboxHandle,
        cmd: str,
        timeout_s: float | None = None,
        once_key: str | None = None,
        user: str | None = None,
    ) -> ExecResult:
        """Run a shell command as the sandbox user (or ``user``, one of ``spec.exec_users``) in the workdir;
        with ``once_key``, at most once per key in this sandbox (a repeat returns the first run's result,
        ``replayed``)."""
        ...

    def write_file(self, handle: SandboxHandle, path: str, content: bytes | str) -> None:
        """Write a file at a path relative to the workdir, creating parent directories."""
        ...

    def read_file(self, handle: SandboxHandle, path: str, max_bytes: int = 1 << 20) -> bytes:
        """Read a regular file at a path relative to the workdir."""
        ...

    def destroy(self, key: str) -> None:
        """Remove the sandbox for `key`; absent is fine."""
        ...

    def list_containers(self, run_id: str | None = None) -> list[SandboxInfo]:
        """List the project's containers, optionally of one run."""
        ...

    def reap(
        self,
        run_id: str | None = None,
        older_than_s: float | None = None,
        keep: AbstractSet[str] = frozenset(),
    ) -> list[str]:
        """Remove labelled containers whose key is not in `keep`; return the removed names."""
        ...


class AsyncSandboxBackend:
    """Runs each call of a synchronous backend in a worker thread, for use from asyncio code.

    Args:
        backend: The synchronous backend; it must be thread-safe (the Docker backend is).
    """

    def __init__(self, backend: SandboxBackend) -> None:
        self.backend = backend

    async def create(self, key: str, run_id: str, spec: SandboxSpec) -> SandboxHandle:
        """See `SandboxBackend.create`."""
        return await asyncio.to_thread(self.backend.create, key, run_id, spec)

    async def exec(
        self,
        handle: SandboxHandle,
        cmd: str,
        timeout_s: float | None = None,
        once_key: str | None = None,
        user: str | None = None,
    ) -> ExecResult:
        """See `SandboxBackend.exec` (``user`` passed on only when given: backends without it still work)."""
        if user is None:
            return await asyncio.to_thread(self.backend.exec, handle, cmd, timeout_s, once_key)
        return await asyncio.to_thread(self.backend.exec, handle, cmd, timeout_s, once_key, user)

    async def write_file(self, handle: SandboxHandle, path: str, content: bytes | str) -> None:
        """See `SandboxBackend.write_file`."""
        await asyncio.to_thread(self.backend.write_file, handle, path, content)

    async def read_file(self, handle: SandboxHandle, path: str, max_bytes: int = 1 << 20) -> bytes:
        """See `SandboxBackend.read_file`."""
        return await asyncio.to_thread(self.backend.read_file, handle, path, max_bytes)

    async def destroy(self, key: str) -> None:
        """See `SandboxBackend.destroy`."""
        await asyncio.to_thread(self.backend.destroy, key)

    async def has_image(self, tag: str) -> bool:
        """Whether the backend's daemon has the image (backends without ``has_image`` answer True)."""
        fn = getattr(self.backend, "has_image", None)
        return True if fn is None else bool(await asyncio.to_thread(fn, tag))

    async def build_image(self, build: ImageBuild) -> tuple[bool, str]:
        """Build an image on the backend's daemon: (succeeded, log). Needs a backend with ``build_image``."""
        fn = getattr(self.backend, "build_image", None)
        if fn is None:
            return False, f"this sandbox backend cannot build images ({type(self.backend).__name__})"
        ok, log = await asyncio.to_thread(fn, build)
        return bool(ok), str(log)

    async def host(self) -> str | None:
        """The host running this backend's sandboxes (the Docker daemon's name), if the backend says
        (a ``host()`` method is optional: backends without one answer None)."""
        fn = getattr(self.backend, "host", None)
        return None if fn is None else str(await asyncio.to_thread(fn))

    async def list_containers(self, run_id: str | None = None) -> list[SandboxInfo]:
        """See `SandboxBackend.list_containers`."""
        return await asyncio.to_thread(self.backend.list_containers, run_id)

    async def reap(
        self,
        run_id: str | None = None,
        older_than_s: float | None = None,
        keep: AbstractSet[str] = frozenset(),
    ) -> list[str]:
        """See `SandboxBackend.reap`."""
        return await asyncio.to_thread(self.backend.reap, run_id, older_than_s, keep)


class BoundSandbox:
    """One live sandbox as an environment sees it (``environments.base.Sandbox``): the backend bound to a
    handle."""

    def __init__(self, backend: AsyncSandboxBackend, handle: SandboxHandle) -> None:
        self.backend, self.handle = backend, handle

    async def exec(
        self, cmd: str, timeout_s: float | None = None, once_key: str | None = None, user: str | None = None
    ) -> ExecResult:
        return await self.backend.exec(self.handle, cmd, timeout_s, once_key, user)

    async def write_file(self, path: str, content: bytes | str) -> None:
        await self.backend.write_file(self.handle, path, content)

    async def read_file(self, path: str, max_bytes: int = 1 << 20) -> bytes:
        return await self.backend.read_file(self.handle, path, max_bytes)
