"""Docker sandbox backend: hardened containers driven through the local daemon's API.

Invariant: every container is created hardened (no network unless its egress policy allows hosts, and
then only its egress proxy (`sandboxes.egress`), no capabilities, no-new-privileges, non-root
unless the spec allows root and the daemon remaps users (`sandboxes.users`), read-only root with size-capped
tmpfs workdir and /tmp, memory/CPU/pids limits, init) and labelled for the reaper; a command's processes
never outlive its exec; a dead, removed or frozen container is raised as `SandboxGone`, never returned as
command output.

All methods block and are thread-safe; call them from asyncio through `AsyncSandboxBackend`.
"""

from __future__ import annotations

import hashlib
import re
import threading
import time
from collections.abc import Set as AbstractSet

import docker
import docker.errors

from durable_rollouts.errors import (
    SandboxError,
    SandboxFileError,
    SandboxGone,
    SandboxNotReady,
    SandboxPathError,
)
from durable_rollouts.sandboxes._docker_build import build_image
from durable_rollouts.sandboxes._docker_exec import (
    EXEC_WRAPPER,
    KILL_AFTER_S,
    READ_SCRIPT,
    STREAM_GRACE_S,
    WRITE_SCRIPT,
    docker_errors,
    exec_result,
    stream_exec,
)
from durable_rollouts.sandboxes.base import (
    ExecResult,
    ImageBuild,
    SandboxHandle,
    SandboxInfo,
    SandboxSpec,
    gateway_binds,
    validate_relative_path,
)
from durable_rollouts.sandboxes.egress import EgressNetworks
from durable_rollouts.sandboxes.users import UserResolver

LABEL_PROJECT = "durable-rollouts"
LABEL_RUN = "durable-rollouts.run"
LABEL_ROLLOUT = "durable-rollouts.rollout"
LABEL_SPEC = "durable-rollouts.spec"

KEEPER_USER = "65534:65534"
"""User of the container's init and main process: not the sandbox user, so commands cannot kill them (and
with them the sandbox); commands and file operations run as `spec.user`."""
FILE_OP_TIMEOUT_S = 60.0
"""Wall-clock limit of one write_file/read_file exec."""
SETTLE_S = 2.0
"""How long an exec that died without a status waits for the daemon to report its container dead."""
MAX_CMD_CHARS = 100_000
ONCE_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
"""A keyed exec's key (a file name in the sandbox's /tmp)."""
"""Longest command accepted (the kernel caps one argv string at 128 KiB)."""
MAX_FILE_BYTES = 256 * 1024 * 1024
"""Largest file write_file/read_file moves in one call."""
_TMPFS_OPTS = "rw,exec,nosuid,nodev"


def container_name(key: str) -> str:
    """Deterministic container name for a sandbox key: `dr-<sanitised key>-<hash>`.

    Args:
        key: Idempotency key of the sandbox (any string).

    Returns:
        A valid Docker container name, unique per key.
    """
    digest = hashlib.sha256(key.encode()).hexdigest()[:10]
    clean = re.sub(r"[^A-Za-z0-9_.-]+", "-", key).strip("-._")[:40]
    return f"dr-{clean}-{digest}" if clean else f"dr-{digest}"


_LATER_FIELDS = ("mounts", "gateway", "exec_users", "user_source", "allow_root", "env", "egress")
"""Spec fields added after the first release: left out of the digest while at their defaults."""


def _spec_digest(spec: SandboxSpec) -> str:
    # A spec with later fields at their defaults hashes as it did before they existed (running sandboxes stay
    # reattachable across an upgrade).
    exclude = {f for f in _LATER_FIELDS if getattr(spec, f) == SandboxSpec.model_fields[f].get_default(
        call_default_factory=True)}  # fmt: skip
    return hashlib.sha256(spec.model_dump_json(exclude=exclude).encode()).hexdigest()[:16]


class DockerBackend:
    """Hardened Docker sandboxes; synchronous and thread-safe.

    Args:
        client: Docker client to use; by default one from the environment (`DOCKER_HOST` or the local socket).
        max_pool_size: HTTP connections kept to the daemon (about the number of concurrent calls).
    """

    def __init__(self, client: docker.DockerClient | None = None, *, max_pool_size: int = 64) -> None:
        try:
            self.client = client or docker.from_env(max_pool_size=max_pool_size, timeout=120)
        except docker.errors.DockerException as exc:
            raise SandboxNotReady(f"docker daemon unreachable: {exc}") from exc
        self.api = self.client.api
        self._locks = [threading.Lock() for _ in range(64)]
        self._host: str | None = None
        self._users = UserResolver(self.api)
        self._egress = EgressNetworks(self.api)

    def host(self) -> str:
        """The daemon's name as ``docker info`` reports it (asked once): the ``RolloutSandboxHost`` of
        the rollouts whose sandboxes run here."""
        if self._host is None:
            try:
                self._host = str(self.client.info().get("Name") or "docker")
            except docker.errors.DockerException as exc:
                raise SandboxNotReady(f"docker daemon unreachable: {exc}") from exc
        return self._host

    def _lock(self, name: str) -> threading.Lock:
        return self._locks[int(hashlib.sha256(name.encode()).hexdigest()[:8], 16) % len(self._locks)]

    # ----------------------------------------------------------------------------------------- lifecycle

    def create(self, key: str, run_id: str, spec: SandboxSpec) -> SandboxHandle:
        """Create the sandbox for `key`, or reattach to it (idempotent on key).

        A running container with the key's name, run and spec is reattached; a dead, paused or exited one is
        removed and replaced.

        Args:
            key: Idempotency key, unique per sandbox on this daemon (e.g. the rollout's workflow id).
            run_id: Run the sandbox belongs to (label for the reaper).
            spec: Image and limits.

        Returns:
            A handle for exec/read_file/write_file.

        Raises:
            SandboxNotReady: the image is missing, the daemon is unreachable or the container did not start.
            SandboxError: a running container with this name belongs to another run or spec.
        """
        name = container_name(key)
        labels = {
            **spec.labels,
            LABEL_PROJECT: "1",
            LABEL_RUN: run_id,
            LABEL_ROLLOUT: key,
            LABEL_SPEC: _spec_digest(spec),
        }
        with self._lock(name), docker_errors(f"create sandbox {name}"):
            for _attempt in range(3):
                attrs = self._inspect_or_none(name)
                if attrs is not None:
                    if self._reattachable(attrs, labels):
                        return SandboxHandle(
                            key=key, run_id=run_id, name=name, container_id=attrs["Id"], spec=spec
                        )
                    self._remove(attrs["Id"])
                try:
                    container_id = self._create_container(name, labels, spec)
                except docker.errors.APIError as exc:
                    if exc.status_code == 409:  # another process took the name meanwhile: look again
                        continue
                    raise
                return SandboxHandle(key=key, run_id=run_id, name=name, container_id=container_id, spec=spec)
        raise SandboxNotReady(f"create sandbox {name}: the name stays in conflict")

    @staticmethod
    def _reattachable(attrs: dict, labels: dict[str, str]) -> bool:
        """True for a running container of the same run and spec; False for a dead one (to be replaced)."""
        state = attrs["State"]
        if not state.get("Running") or state.get("Paused"):
            return False
        found = attrs["Config"].get("Labels") or {}
        if any(found.get(label) != labels[label] for label in (LABEL_RUN, LABEL_SPEC)):
            raise SandboxError(
                f"sandbox {attrs['Name'].lstrip('/')} for key {labels[LABEL_ROLLOUT]!r} is running "
                f"with another run or spec"
            )
        return True

    def _inspect_or_none(self, name: str) -> dict | None:
        try:
            return self.api.inspect_container(name)
        except docker.errors.NotFound:
            return None

    def _create_container(self, name: str, labels: dict[str, str], spec: SandboxSpec) -> str:
        try:
            self.api.inspect_image(spec.image)
        except docker.errors.ImageNotFound as exc:
            raise SandboxNotReady(
                f"sandbox image {spec.image!r} not found; build it with "
                f"`sudo sandboxes/image/build_image.sh` (offline, debootstrap) or "
                f"`docker build -t {spec.image} sandboxes/image`"
            ) from exc
        ids = self._users.of(spec, spec.user, name)
        for user in spec.exec_users:
            self._users.of(spec, user, name)
        uid, gid = ids.uid, ids.gid
        network, proxy = "none", dict[str, str]()  # no egress policy: no network at all
        if spec.egress.enabled:  # its own --internal network, shared with the egress proxy alone
            network, proxy = self._egress.attach(name, labels[LABEL_RUN], spec.egress)
        host_config = self.api.create_host_config(
            network_mode=network,
            cap_drop=["ALL"],
            security_opt=["no-new-privileges"],
            read_only=not spec.writable_root,
            tmpfs={
                spec.workdir: f"{_TMPFS_OPTS},size={spec.workdir_size_mb}m,uid={uid},gid={gid},mode=0755",
                "/tmp": f"{_TMPFS_OPTS},size={spec.tmp_size_mb}m,mode=1777",
                **{
                    path: f"{_TMPFS_OPTS},size={size}m,uid={uid},gid={gid},mode=0755"
                    for path, size in spec.mounts.items()
                },
            },
            mem_limit=f"{spec.memory_mb}m",
            memswap_limit=f"{spec.memory_mb}m",
            nano_cpus=int(spec.cpus * 1e9),
            pids_limit=spec.pids_limit,
            init=True,
            ipc_mode="private",
            ulimits=[docker.types.Ulimit(name="nofile", soft=4096, hard=4096)],
            binds=gateway_binds(spec, labels[LABEL_ROLLOUT]),  # its own gateway folder, nothing else
        )
        created = self.api.create_container(
            spec.image,
            command=["sleep", "infinity"],
            name=name,
            user=KEEPER_USER,
            working_dir=spec.workdir,
            labels=labels,
            hostname="sandbox",
            environment={
                "HOME": spec.workdir,
                "LANG": "C.UTF-8",
                "PYTHONUNBUFFERED": "1",
                **spec.env,
                **proxy,
            },
            network_disabled=not spec.egress.enabled,
            host_config=host_config,
        )
        container_id = created["Id"]
        try:
            self.api.start(container_id)
            state = self.api.inspect_container(container_id)["State"]
        except docker.errors.APIError as exc:
            self._remove(container_id)
            raise SandboxNotReady(f"sandbox {name} did not start: {exc.explanation or exc}") from exc
        if not state.get("Running"):
            logs = self.api.logs(container_id, tail=20).decode(errors="replace")
            self._remove(container_id)
            raise SandboxNotReady(f"sandbox {name} did not start ({state.get('Status')}): {logs.strip()}")
        return container_id

    def destroy(self, key: str) -> None:
        """Remove the sandbox for `key` and its tmpfs contents; absent is fine.

        Args:
            key: The key given to `create`.
        """
        name = container_name(key)
        with self._lock(name), docker_errors(f"destroy sandbox {name}"):
            self._remove(name)
            self._egress.detach(name)

    def _remove(self, name_or_id: str) -> None:
        try:
            self.api.remove_container(name_or_id, force=True, v=True)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as exc:
            if exc.status_code != 409:  # 409: removal already in progress
                raise SandboxError(f"remove sandbox {name_or_id}: {exc.explanation}") from exc

    def list_containers(self, run_id: str | None = None) -> list[SandboxInfo]:
        """List the project's containers (any state), optionally only those of one run.

        Args:
            run_id: Only this run's containers when given.

        Returns:
            One record per container.
        """
        labels = [f"{LABEL_PROJECT}=1"] + ([f"{LABEL_RUN}={run_id}"] if run_id is not None else [])
        with docker_errors("list sandboxes"):
            rows = self.api.containers(all=True, filters={"label": labels})
        return [
            SandboxInfo(
                name=row["Names"][0].lstrip("/"),
                container_id=row["Id"],
                key=row["Labels"].get(LABEL_ROLLOUT, ""),
                run_id=row["Labels"].get(LABEL_RUN, ""),
                state=row.get("State", ""),
                created_at=float(row.get("Created", 0)),
            )
            for row in rows
        ]

    def reap(
        self,
        run_id: str | None = None,
        older_than_s: float | None = None,
        keep: AbstractSet[str] = frozenset(),
    ) -> list[str]:
        """Remove orphaned labelled containers.

        Args:
            run_id: Only this run's containers when given (otherwise every run's).
            older_than_s: Only containers created at least this many seconds ago.
            keep: Sandbox keys (as given to `create`) still in use; their containers are left alone.

        Returns:
            Names of the removed containers.
        """
        now = time.time()
        removed = []
        for info in self.list_containers(run_id):
            if info.key in keep or (older_than_s is not None and now - info.created_at < older_than_s):
                continue
            with self._lock(info.name):
                self._remove(info.container_id)
            removed.append(info.name)
        with docker_errors("reap egress networks"):
            self._egress.reap(run_id, older_than_s)  # networks left by removed sandboxes, idle proxies
        return removed

    # ------------------------------------------------------------------------------------------- images

    def has_image(self, tag: str) -> bool:
        """Whether this daemon has an image tagged ``tag``."""
        with docker_errors(f"inspect image {tag}"):
            try:
                self.api.inspect_image(tag)
            except docker.errors.ImageNotFound:
                return False
        return True

    def build_image(self, build: ImageBuild) -> tuple[bool, str]:
        """Build ``build`` on this daemon (never pulling: ``FROM`` must name a local image); returns whether
        it succeeded and the build log (`sandboxes._docker_build`).

        Raises:
            SandboxNotReady: the daemon is unreachable.
        """
        with docker_errors(f"build image {build.tag}"):
            ok, log = build_image(
                self.api, build, {LABEL_PROJECT: "1", f"{LABEL_PROJECT}.image": build.what[:200]}
            )
        return ok and self.has_image(build.tag), log

    # ------------------------------------------------------------------------------------------ commands

    def exec(
        self,
        handle: SandboxHandle,
        cmd: str,
        timeout_s: float | None = None,
        once_key: str | None = None,
        user: str | None = None,
    ) -> ExecResult:
        """Run `bash -c cmd` as the sandbox user (or ``user``) in the workdir, stdin closed.

        The command runs in its own process group, which is SIGKILLed when the command exits or (after
        SIGTERM and a 1 s grace) when `timeout_s` passes: background jobs and fork bombs die with it. Only a
        process that moved to its own session (`setsid`) before the command ended survives; if it keeps the
        output pipe open, reading stops 2 s after the command exited. Output is stdout+stderr through one
        pipe, capped at `spec.output_limit_bytes` inside the sandbox. A command that kills its own
        supervisor (`kill -9 -1`) gets its exit code and a note; it cannot kill the container.

        Args:
            handle: From `create`.
            cmd: Shell command (bash syntax).
            timeout_s: Wall-clock limit; `spec.command_timeout_s` when None.
            once_key: Run the command at most once per key in this container (letters, digits, ``._-``):
                an exec with a key already used does not run ``cmd`` but waits for the first run to end and
                returns its result, ``replayed`` (a retried step whose worker died mid-command). A key's
                scope is its part before the first dot; a claim forgets the keys of every other scope.
            user: Run as this user instead of ``spec.user``: one of ``spec.exec_users`` (checked at create).

        Returns:
            The command's result, including timeouts and processes killed for memory.

        Raises:
            SandboxGone: the container is not running (killed, OOM-killed, removed) or frozen.
            SandboxError: the exec could not run (e.g. no process slot left).
        """
        spec = handle.spec
        timeout = float(timeout_s if timeout_s is not None else spec.command_timeout_s)
        if not 0 < timeout <= 86400:
            raise ValueError(f"timeout_s must be in (0, 86400], got {timeout}")
        if "\x00" in cmd or len(cmd) > MAX_CMD_CHARS:
            why = "contains a NUL byte" if "\x00" in cmd else f"is longer than {MAX_CMD_CHARS} characters"
            return ExecResult(exit_code=2, output=f"[command rejected: it {why}]")
        if once_key is not None and not ONCE_KEY.fullmatch(once_key):
            raise ValueError(f"once_key must match {ONCE_KEY.pattern}, got {once_key!r}")
        if user is not None and user != spec.user and user not in spec.exec_users:
            raise ValueError(f"user {user!r} is not the sandbox's user nor one of its exec_users")
        ids = self._users.of(spec, user or spec.user, handle.name)
        limit = str(spec.output_limit_bytes)
        argv = ["/bin/sh", "-c", EXEC_WRAPPER, "dr-exec", f"{timeout:.3f}", limit, cmd, f"{KILL_AFTER_S:g}",
                once_key or ""]  # fmt: skip
        start = time.monotonic()
        raw = stream_exec(
            self.api,
            handle,
            argv,
            deadline_s=timeout + KILL_AFTER_S + STREAM_GRACE_S,
            stdout_cap=spec.output_limit_bytes,
            watch_status=True,
            user=ids.docker,
        )
        duration = time.monotonic() - start
        finished = b"dr-status: rc=" in raw.stderr
        if finished or raw.abandoned:
            self._check_alive(handle, "exec")
            return exec_result(raw, timeout, duration, spec)
        # The wrapper died without a status: the container was killed, or the command killed its own wrapper
        # (e.g. `kill -9 -1`), which is the program's doing and is returned as its result.
        self._check_alive(handle, "exec", settle_s=SETTLE_S)
        return exec_result(raw, timeout, duration, spec, wrapper_exit=self._exit_code(handle, raw.exec_id))

    def _check_alive(self, handle: SandboxHandle, what: str, settle_s: float = 0.0) -> None:
        """Raise SandboxGone unless the handle's container is running and not frozen.

        With `settle_s`, keep looking that long for the container to be reported dead: after a `docker kill`
        the exec stream closes a moment before the daemon marks the container stopped.
        """
        deadline = time.monotonic() + settle_s
        while True:
            with docker_errors(f"{what} in sandbox {handle.name}"):
                state = self.api.inspect_container(handle.container_id)["State"]
            if not state.get("Running") or state.get("Paused") or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        if state.get("Paused"):
            raise SandboxGone(f"{what} in sandbox {handle.name}: container is paused (frozen)")
        if not state.get("Running"):
            why = (
                "OOM-killed"
                if state.get("OOMKilled")
                else f"{state.get('Status')}, exit {state.get('ExitCode')}"
            )
            raise SandboxGone(f"{what} in sandbox {handle.name}: container is not running ({why})")

    # --------------------------------------------------------------------------------------------- files

    def write_file(self, handle: SandboxHandle, path: str, content: bytes | str) -> None:
        """Write `content` to `path` under the workdir (atomically, via rename), creating parent dirs.

        Args:
            handle: From `create`.
            path: Relative to the workdir; no `..`, no NUL, no symlink on the way.
            content: Bytes, or text encoded as UTF-8.

        Raises:
            SandboxPathError: the path is rejected.
            SandboxFileError: the target is a directory, a parent is a file, or the workdir is full.
            SandboxGone: the container is gone.
        """
        rel = validate_relative_path(path)
        data = content.encode() if isinstance(content, str) else bytes(content)
        if len(data) > MAX_FILE_BYTES:
            raise SandboxFileError(f"write {path!r}: {len(data)} bytes is more than {MAX_FILE_BYTES}")
        argv = ["/bin/sh", "-c", WRITE_SCRIPT, "dr-write", handle.spec.workdir, rel]
        self._file_op(handle, "write", path, argv, stdin=data, max_bytes=0)

    def read_file(self, handle: SandboxHandle, path: str, max_bytes: int = 1 << 20) -> bytes:
        """Read the regular file at `path` under the workdir.

        Args:
            handle: From `create`.
            path: Relative to the workdir; no `..`, no NUL, no symlink on the way.
            max_bytes: Largest file accepted.

        Returns:
            The file's bytes.

        Raises:
            SandboxPathError: the path is rejected.
            SandboxFileError: missing, not a regular file, or larger than `max_bytes`.
            SandboxGone: the container is gone.
        """
        if not 0 <= max_bytes <= MAX_FILE_BYTES:
            raise ValueError(f"max_bytes must be in [0, {MAX_FILE_BYTES}], got {max_bytes}")
        rel = validate_relative_path(path)
        argv = ["/bin/sh", "-c", READ_SCRIPT, "dr-read", handle.spec.workdir, rel, str(max_bytes + 1)]
        data = self._file_op(handle, "read", path, argv, stdin=None, max_bytes=max_bytes + 1)
        if len(data) > max_bytes:
            raise SandboxFileError(f"read {path!r}: file is larger than max_bytes={max_bytes}")
        return data

    def _file_op(
        self,
        handle: SandboxHandle,
        op: str,
        path: str,
        argv: list[str],
        *,
        stdin: bytes | None,
        max_bytes: int,
    ) -> bytes:
        user = self._users.of(handle.spec, handle.spec.user, handle.name).docker
        raw = stream_exec(
            self.api, handle, argv, deadline_s=FILE_OP_TIMEOUT_S, stdout_cap=max_bytes, stdin=stdin, user=user
        )
        exit_code = None if raw.abandoned else self._exit_code(handle, raw.exec_id)
        if exit_code == 0:
            return bytes(raw.stdout)
        message = raw.stderr.decode(errors="replace").strip()[:300]
        if exit_code == 92:
            raise SandboxPathError(f"rejected path {path!r}: leaves the workdir or goes through a symlink")
        if exit_code in (91, 93, 94, 95):
            raise SandboxFileError(f"{op} {path!r}: {message}")
        self._check_alive(handle, op, settle_s=SETTLE_S)
        if raw.abandoned:
            raise SandboxError(f"{op} {path!r}: no answer within {FILE_OP_TIMEOUT_S:g} s")
        raise SandboxError(f"{op} {path!r}: failed with exit code {exit_code}: {message}")

    def _exit_code(self, handle: SandboxHandle, exec_id: str) -> int | None:
        """Exit code of a finished exec (the daemon may record it just after the stream closes)."""
        with docker_errors(f"exec in sandbox {handle.name}"):
            for _ in range(50):
                info = self.api.exec_inspect(exec_id)
                if not info.get("Running") and info.get("ExitCode") is not None:
                    return int(info["ExitCode"])
                time.sleep(0.02)
        return None
