"""Who a sandbox's commands run as: users by number or by name, and root only where it is not the host's.

Invariant: a command runs as root in its sandbox (uid or gid 0) only on a Docker daemon that remaps users
(``dockerd --userns-remap``: the container's root is an unprivileged user of the host, its ids shifted into
the range ``/etc/subuid`` and ``/etc/subgid`` give the remap user) and only when the spec allows root; on any
other daemon the sandbox is refused (`SandboxUserRefused`, one line naming who asked and what the operator
must do) before a container exists. Capabilities stay dropped either way: root in the sandbox owns what it
creates and nothing more.

A user is ``uid``, ``uid:gid``, ``name`` or ``name:group`` (Docker's ``--user`` forms). Names are looked up in
the image's ``/etc/passwd`` and ``/etc/group`` (read from a container created from the image and never
started); a uid the image does not list gets the gid of the same number (Docker would give it gid 0, the
root group). A name the image does not know is the task's fault (`EnvironmentFailure`).
"""

from __future__ import annotations

import io
import re
import tarfile
import threading
from dataclasses import dataclass

import docker
import docker.errors

from durable_rollouts.errors import EnvironmentFailure, SandboxError
from durable_rollouts.sandboxes._docker_exec import docker_errors
from durable_rollouts.sandboxes.base import USER_PATTERN, SandboxSpec

REMAP_HOW = (
    "start the sandbox host's dockerd with --userns-remap=default (root in a container is then an "
    "unprivileged host user; /etc/subuid and /etc/subgid need a range for dockremap, which dockerd adds), "
    "or run rootless Docker"
)


class SandboxUserRefused(SandboxError):
    """A sandbox asked for root in the container on a daemon where that would be root on the host. Final:
    retrying on the same daemon cannot help; the operator must give the host a daemon that remaps users."""

    retryable = False


@dataclass(frozen=True)
class Ids:
    uid: int
    gid: int

    @property
    def docker(self) -> str:
        """As Docker's ``user`` option: ``uid:gid``."""
        return f"{self.uid}:{self.gid}"

    @property
    def root(self) -> bool:
        return self.uid == 0 or self.gid == 0


def daemon_remaps_users(info: dict) -> bool:
    """Whether ``docker info`` says the daemon runs containers in a user namespace (``--userns-remap`` adds
    ``name=userns`` to SecurityOptions; rootless Docker adds ``name=rootless``)."""
    options = info.get("SecurityOptions") or []
    return any(
        "name=userns" in str(opt).split(",") or "name=rootless" in str(opt).split(",") for opt in options
    )


def parse_passwd(text: str) -> dict[str, tuple[int, int]]:
    """``/etc/passwd`` as name -> (uid, primary gid); malformed lines are skipped."""
    out: dict[str, tuple[int, int]] = {}
    for line in text.splitlines():
        parts = line.split(":")
        if len(parts) >= 4 and parts[2].isdigit() and parts[3].isdigit():
            out.setdefault(parts[0], (int(parts[2]), int(parts[3])))
    return out


def parse_group(text: str) -> dict[str, int]:
    """``/etc/group`` as name -> gid."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split(":")
        if len(parts) >= 3 and parts[2].isdigit():
            out.setdefault(parts[0], int(parts[2]))
    return out


def resolve(user: str, passwd: dict[str, tuple[int, int]], group: dict[str, int], where: str) -> Ids:
    """``user`` (see the module docstring) as numeric ids, by the image's ``passwd`` and ``group``.

    Raises:
        EnvironmentFailure: a name the image does not list (``where`` says who named it and the image).
    """
    if not re.fullmatch(USER_PATTERN, user):
        raise EnvironmentFailure(f"{where}: {user!r} is not a user (uid, uid:gid, name or name:group)")
    name, _, grp = user.partition(":")
    if name.isdigit():
        uid = int(name)
        gid = next((g for u, g in passwd.values() if u == uid), uid)
    elif name in passwd:
        uid, gid = passwd[name]
    else:
        raise EnvironmentFailure(
            f"{where}: user {name!r} is not in the image's /etc/passwd; create it in the image "
            "(useradd in its Dockerfile) or name a uid"
        )
    if grp:
        if grp.isdigit():
            gid = int(grp)
        elif grp in group:
            gid = group[grp]
        else:
            raise EnvironmentFailure(f"{where}: group {grp!r} is not in the image's /etc/group")
    return Ids(uid, gid)


class UserResolver:
    """Resolves sandbox users on one daemon (per image, cached) and enforces the root rule; thread-safe."""

    def __init__(self, api: docker.APIClient) -> None:
        self.api = api
        self._lock = threading.Lock()
        self._remaps: bool | None = None
        self._tables: dict[str, tuple[dict[str, tuple[int, int]], dict[str, int]]] = {}
        self._ids: dict[tuple[str, str, bool], Ids] = {}

    def of(self, spec: SandboxSpec, user: str, name: str) -> Ids:
        """``user`` (``spec.user`` or one of ``spec.exec_users``) of sandbox ``name`` as checked numeric ids
        (`ids`), cached per image and user.

        Raises:
            SandboxUserRefused, EnvironmentFailure: see `ids`.
            SandboxNotReady: the daemon is unreachable.
        """
        key = (spec.image, user, spec.allow_root)
        if key not in self._ids:
            where = spec.user_source if user == spec.user else spec.exec_users.get(user, "")
            with docker_errors(f"resolve user {user!r} of sandbox {name}"):
                ids = self.ids(spec.image, user, where or f"sandbox {name}", spec.allow_root)
            with self._lock:
                self._ids[key] = ids
        return self._ids[key]

    def remaps(self) -> bool:
        """Whether this daemon remaps users (asked once)."""
        if self._remaps is None:
            self._remaps = daemon_remaps_users(self.api.info())
        return self._remaps

    def ids(self, image: str, user: str, where: str, allow_root: bool) -> Ids:
        """``user`` in ``image`` as numeric ids, refused when it is root and root is not safe here.

        Raises:
            SandboxUserRefused: root, and ``allow_root`` is off or the daemon does not remap users.
            EnvironmentFailure: a name the image does not know.
        """
        if not re.fullmatch(r"[0-9]+:[0-9]+", user):
            passwd, group = self._table(image)
            ids = resolve(user, passwd, group, f"{where} (image {image})")
        else:
            uid, gid = (int(p) for p in user.split(":"))
            ids = Ids(uid, gid)
        if ids.root:
            if not allow_root:
                raise SandboxUserRefused(f"{where}: {user!r} is root in the sandbox, which this sandbox does "
                                         "not allow")  # fmt: skip
            if not self.remaps():
                name = self.api.info().get("Name") or "docker"
                raise SandboxUserRefused(
                    f"{where}: {user!r} is root in the sandbox, and the Docker daemon of sandbox host {name} "
                    f"does not remap users (it would be root on the host): {REMAP_HOW}"
                )
        return ids

    def _table(self, image: str) -> tuple[dict[str, tuple[int, int]], dict[str, int]]:
        image_id = str(self.api.inspect_image(image)["Id"])
        with self._lock:
            if image_id in self._tables:
                return self._tables[image_id]
        created = self.api.create_container(
            image_id, command=["true"], network_disabled=True, labels={"durable-rollouts.users": "1"}
        )
        try:
            passwd = _read_file(self.api, created["Id"], "/etc/passwd")
            group = _read_file(self.api, created["Id"], "/etc/group")
        finally:
            self.api.remove_container(created["Id"], force=True)
        table = (parse_passwd(passwd), parse_group(group))
        with self._lock:
            self._tables[image_id] = table
        return table


def _read_file(api: docker.APIClient, container: str, path: str) -> str:
    """A small text file of a container (created or running); empty when it has none."""
    try:
        stream, _ = api.get_archive(container, path)
    except docker.errors.NotFound:
        return ""
    data = b"".join(stream)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        for member in tar.getmembers():
            if member.isfile():
                handle = tar.extractfile(member)
                return handle.read().decode("utf-8", errors="replace") if handle else ""
    return ""
