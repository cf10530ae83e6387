"""Terminal-Bench 2 survey, part 2: each task's image built here, on a local stand-in for its base image.

Every Terminal-Bench 2 task names a prebuilt image (``[environment].docker_image =
"alexgshaw/<task>:20251031"``) that no registry here can serve. The survey builds the task's own
``environment/Dockerfile`` instead and tags the result with that name on the local daemon, as the
plug-in's guide says to provide any image a task names (``environments/harbor/base_images.sh``); the plug-in
then builds its rollout image ``FROM`` it unchanged.

A Dockerfile's ``FROM`` must name an image the daemon has. One stand-in is made: Debian bookworm from the
project's debootstrap sandbox image (``durable-rollouts-sandbox:latest``) with ``USER root`` and
``python`` linked to its ``python3``, tagged ``python:3.13-slim-bookworm``. It is a stand-in, not the
image: its Python is bookworm's 3.11, not 3.13. There is no local Ubuntu 24.04 (debootstrap needs a mirror),
so tasks on ``ubuntu:24.04`` and the other bases are counted as not buildable, untried.

Builds run with ``--network none`` (nothing may download here), one at a time, each under a time limit;
a failure is labelled by its cause (a download at build time, a file missing from the published copy,
a time limit, other) with the build log's last line.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Any

SANDBOX_IMAGE = "durable-rollouts-sandbox:latest"
STANDIN_LABEL = "org.durable-rollouts.standin"
STANDINS = {
    "python:3.13-slim-bookworm": (
        f"FROM {SANDBOX_IMAGE}\nUSER root\nENV HOME=/root\nWORKDIR /\n"
        "RUN ln -sf /usr/bin/python3 /usr/local/bin/python\n"
        f'LABEL {STANDIN_LABEL}="python:3.13-slim-bookworm from Debian bookworm (python 3.11)"\n'
    ),
}
"""Base image name -> the Dockerfile of its local stand-in."""


def _docker(*args: str, timeout: float = 120, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DOCKER_BUILDKIT": "0"}
    return subprocess.run(
        ["docker", *args], capture_output=True, text=True, input=stdin, timeout=timeout, env=env
    )


def has_image(name: str) -> bool:
    return _docker("image", "inspect", name).returncode == 0


def make_standins(made: list[str]) -> dict[str, str]:
    """Tag each stand-in base image that is missing (appending the names made to ``made``); returns
    base name -> why it is unavailable, for those that could not be made."""
    missing: dict[str, str] = {}
    for name, dockerfile in STANDINS.items():
        if has_image(name):
            continue
        if not has_image(SANDBOX_IMAGE):
            missing[name] = f"{SANDBOX_IMAGE} is missing (sandboxes/image/build_image.sh builds it)"
            continue
        done = _docker("build", "-q", "--network", "none", "-t", name, "-", stdin=dockerfile, timeout=600)
        if done.returncode != 0:
            missing[name] = f"stand-in build failed: {_last_line(done.stderr or done.stdout)}"
            continue
        made.append(name)
    return missing


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


def _cause(log: str, facts: dict[str, Any]) -> str:
    if re.search(r"COPY failed|not found in build context", log, re.I):
        return "a file the Dockerfile copies is missing from the published copy"
    if facts["dockerfile_fetches"]:
        return "downloads at build time (no network here)"
    return "build failed"


def other_images(dockerfile: str) -> list[str]:
    """Images a Dockerfile names besides its first ``FROM`` (later stages' bases, ``COPY --from=image``),
    leaving out its own stage names: each would be pulled from a registry."""
    stages: set[str] = set()
    named: list[str] = []
    for raw in dockerfile.splitlines():
        words = raw.split("#", 1)[0].split()
        if len(words) >= 2 and words[0].upper() == "FROM":
            named.append(words[1])
            if len(words) >= 4 and words[2].upper() == "AS":
                stages.add(words[3].lower())
        elif words and words[0].upper() == "COPY":
            named += [w.split("=", 1)[1] for w in words[1:] if w.startswith("--from=")]
    return [n for n in named[1:] if n.lower() not in stages and not n.isdigit()]


def build_task(
    task: Path, facts: dict[str, Any], timeout_s: float, made: list[str], network: list[str] | None = None
) -> dict[str, Any]:
    """Build ``task``'s Dockerfile as its ``docker_image`` name; the outcome with its cause. ``network``:
    the build's network arguments (default ``--network none``)."""
    tag = facts["docker_image"] or f"tb2-survey/{task.name}:local"
    base = facts["from"]
    if base not in STANDINS:
        return {"built": False, "tag": tag, "cause": f"no local stand-in for base image {base}"}
    others = [n for n in other_images((task / "environment" / "Dockerfile").read_text()) if not has_image(n)]
    if others:
        return {"built": False, "tag": tag, "cause": "names another image, from a registry", "images": others}
    if has_image(tag):
        return {"built": True, "tag": tag, "cause": None, "note": "image already present; not rebuilt"}
    net = ["--network", "none"] if network is None else network
    args = ["build", *net, "--rm", "--force-rm", "-t", tag, str(task / "environment")]
    try:
        done = _docker(*args, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"built": False, "tag": tag, "cause": f"build ran past {timeout_s:.0f} s", "log": ""}
    if done.returncode == 0:
        made.append(tag)
        return {"built": True, "tag": tag, "cause": None}
    log = (done.stdout or "") + (done.stderr or "")
    return {
        "built": False, "tag": tag, "cause": _cause(log, facts), "fetches": facts["dockerfile_fetches"],
        "log": _last_line(log),
    }  # fmt: skip


def remove_images(names: list[str]) -> None:
    """Remove the images this survey tagged (never one it found already there)."""
    for name in reversed(names):
        _docker("image", "rm", "-f", name)
