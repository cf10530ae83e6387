"""Image builds of the Docker backend: a build context (``ImageBuild``) streamed to the daemon as a tar.

Invariant: nothing is pulled (``pull=False``; a ``FROM`` must name an image the daemon has), the build
never outlives ``timeout_s`` by more than one log line, and its whole log comes back with the result.
"""

from __future__ import annotations

import base64
import io
import tarfile
import time
from typing import Any

import docker.errors

from durable_rollouts.sandboxes.base import ImageBuild


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
