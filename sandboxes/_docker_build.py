"""Image builds of the Docker backend: a build context (``ImageBuild``) streamed to the daemon as a tar;
and a built image pushed to, or pulled by digest from, the operator's registry (``sandbox_pool.registry``).

Invariants:
- A build pulls nothing (``pull=False``; a ``FROM`` must name an image the daemon has), never outlives
  ``timeout_s`` by more than one log line, and its whole log comes back with the result.
- A push answers the digest the registry stored (or raises `RegistryError`); a pull names the image by
  that digest, never by a tag that could have moved, and leaves it under its local tag.
"""

from __future__ import annotations

import base64
import io
import tarfile
import time
from typing import Any

import docker.errors
import requests.exceptions

from durable_rollouts.sandboxes.base import ImageBuild


class RegistryError(Exception):
    """A push to, or pull from, the registry failed; ``missing``: the registry answered that it has no such
    image (its manifest is unknown), as opposed to being unreachable or refusing."""

    def __init__(self, message: str, missing: bool = False) -> None:
        super().__init__(message)
        self.missing = missing


def context_tar(build: ImageBuild) -> io.BytesIO:
    """The build context as an uncompressed tar (mtimes 0, so equal contexts give equal tars)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for path, b64 in sorted(build.context.items()):
            data = base64.b64decode(b64)
            info = tarfile.TarInfo(path)
            info.size, info.mtime = len(data), 0
            info.mode = 0o755 if path in build.executables else 0o644
            tar.addfile(info, io.BytesIO(data))
    buf.seek(0)
    return buf


def build_image(api: Any, build: ImageBuild, labels: dict[str, str]) -> tuple[bool, str]:
    """Build on the daemon behind ``api`` (docker's low-level client); (no error seen, log)."""
    lines: list[str] = []
    deadline = time.monotonic() + build.timeout_s
    ok = True
    stream = api.build(
        fileobj=context_tar(build), custom_context=True, tag=build.tag, rm=True, forcerm=True, pull=False,
        decode=True, labels=labels, timeout=max(60, int(build.timeout_s) + 30),
    )  # fmt: skip
    try:
        for chunk in stream:
            if "stream" in chunk:
                lines.append(str(chunk["stream"]))
            if "error" in chunk:
                ok = False
                lines.append(f"error: {chunk['error']}\n")
            if time.monotonic() > deadline:
                ok = False
                lines.append(f"error: the build took longer than {build.timeout_s:g} s\n")
                break
    except docker.errors.APIError as exc:
        ok = False
        lines.append(f"error: {exc.explanation or exc}\n")
    finally:
        close = getattr(stream, "close", None)
        if close is not None:
            close()
    return ok, "".join(lines)


def _one_line(text: object) -> str:
    return " ".join(str(text).split())[:500]


def push_image(api: Any, local: str, repository: str, tag: str) -> str:
    """Tag the daemon's image ``local`` as ``repository:tag`` and push it; returns the digest the registry
    stored (``sha256:...``).

    Raises:
        RegistryError: the push failed (the daemon's words), or the registry answered no digest.
    """
    digest = ""
    try:
        api.tag(local, repository, tag)
        for chunk in api.push(repository, tag=tag, stream=True, decode=True):
            if "error" in chunk:
                raise RegistryError(_one_line(chunk["error"]))
            aux = chunk.get("aux") or {}
            digest = str(aux.get("Digest") or digest)
    except docker.errors.APIError as exc:
        missing = isinstance(exc, docker.errors.NotFound)
        raise RegistryError(_one_line(exc.explanation or exc), missing) from None
    except (requests.exceptions.RequestException, docker.errors.DockerException) as exc:
        raise RegistryError(f"docker daemon unreachable: {_one_line(exc)}") from None
    if not digest.startswith("sha256:"):
        raise RegistryError(f"the push of {repository}:{tag} answered no digest")
    return digest


def pull_image(api: Any, reference: str, local: str) -> None:
    """Pull ``reference`` (``repository@sha256:...``) and tag it ``local`` (``name[:tag]``).

    Raises:
        RegistryError: the pull failed (``missing`` when the registry has no such manifest).
    """
    repository, _, digest = reference.partition("@")
    name, sep, tag = local.rpartition(":")
    if not sep or "/" in tag:
        name, tag = local, "latest"
    try:
        for chunk in api.pull(repository, tag=digest, stream=True, decode=True):
            if "error" in chunk:
                text = _one_line(chunk["error"])
                raise RegistryError(text, "manifest unknown" in text)
    except docker.errors.APIError as exc:
        missing = isinstance(exc, docker.errors.NotFound)
        raise RegistryError(_one_line(exc.explanation or exc), missing) from None
    except (requests.exceptions.RequestException, docker.errors.DockerException) as exc:
        raise RegistryError(f"docker daemon unreachable: {_one_line(exc)}") from None
    try:
        api.tag(reference, name, tag)
    except (requests.exceptions.RequestException, docker.errors.DockerException) as exc:
        raise RegistryError(f"tag the pulled image as {local}: {_one_line(exc)}") from None
