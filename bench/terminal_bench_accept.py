"""Terminal-Bench 2 survey, part 1: which task directories the Harbor plug-in's loader accepts at submit.

The loader runs in a child process so that two versions can be compared: today's (the installed plug-in)
and an earlier one from a git worktree (``durable_rollouts`` and ``harbor_env`` put first on ``sys.path``,
ahead of the editable installs' finders). Each task directory is read twice: alone (Harbor's own network
default applies) and as a dataset with ``network_policy = "no-network"`` (the documented dataset-level
override that runs tasks asking for network without it).

Also a static reading of each task's files (base image, what its Dockerfile, solve.sh and test.sh fetch),
which explains the later steps' counts; these are regular-expression counts, labelled as such.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

_CHILD = r"""
import json, sys
from pathlib import Path
import durable_rollouts, harbor_env
from harbor_env.tasks import load_task_dir
from durable_rollouts.errors import TaskFileError
out = {"modules": [durable_rollouts.__path__[0], harbor_env.__file__], "tasks": {}}
for d in sys.argv[1:]:
    row = {}
    for key, policy in (("alone", None), ("no_network_policy", "no-network")):
        try:
            load_task_dir(Path(d), policy)
            row[key] = None
        except TaskFileError as e:
            row[key] = str(e)
    out["tasks"][Path(d).name] = row
print(json.dumps(out))
"""


def task_dirs(root: Path) -> list[Path]:
    """The task directories under ``root`` (sub-folders holding task.toml), sorted."""
    dirs = sorted(d for d in root.iterdir() if d.is_dir() and (d / "task.toml").is_file())
    if not dirs:
        raise SystemExit(f"{root}: no task directories (sub-folders with task.toml)")
    return dirs


def run_loader(dirs: list[Path], checkout: Path | None) -> dict[str, Any]:
    """The loader's verdict on each directory; ``checkout``: a worktree whose plug-in to use (None: now)."""
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="tb2-loader-") as tmp:
        if checkout is not None:
            (Path(tmp) / "durable_rollouts").symlink_to(checkout)
            paths = [tmp, str(checkout / "environments" / "harbor")]
            env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        done = subprocess.run(
            [sys.executable, "-c", _CHILD, *map(str, dirs)],
            capture_output=True, text=True, env=env, timeout=600, cwd=tmp,
        )  # fmt: skip
        if done.returncode != 0:
            raise SystemExit(
                f"loader ({checkout or 'today'}) failed: {done.stderr.strip().splitlines()[-1:]}"
            )
        result: dict[str, Any] = json.loads(done.stdout)
        core, plugin = result["modules"]
        if checkout is not None and not (core.startswith(tmp) and plugin.startswith(str(checkout))):
            raise SystemExit(f"the old loader imported today's code ({core}, {plugin})")
    return result


def reason_key(message: str | None) -> str | None:
    """A refusal's cause without its task directory or the task's own values (for tallies)."""
    if message is None:
        return None
    rest = message.split(": ", 1)[1] if ": " in message else message
    rest = re.sub(r"'[^']*'", "'…'", rest)
    return re.sub(r"\b\d+(\.\d+)?\b", "N", rest)


def tally(rows: dict[str, dict[str, str | None]], key: str) -> dict[str, Any]:
    reasons = Counter(reason_key(r[key]) for r in rows.values() if r[key] is not None)
    return {
        "accepted": sum(r[key] is None for r in rows.values()),
        "refused": sum(reasons.values()),
        "reasons": dict(reasons.most_common()),
    }


def worktree(repo: Path, rev: str, where: Path) -> Path:
    """A detached worktree of ``repo`` at ``rev`` in ``where`` (reused when it is already there)."""
    if not (where / ".git").exists():
        subprocess.run(
            ["git", "-C", str(repo), "worktree", "add", "--detach", str(where), rev],
            check=True, capture_output=True, timeout=120,
        )  # fmt: skip
    return where


def remove_worktree(repo: Path, where: Path) -> None:
    subprocess.run(
        ["git", "-C", str(repo), "worktree", "remove", "--force", str(where)],
        check=False, capture_output=True, timeout=120,
    )  # fmt: skip


_NET_CMD = re.compile(
    r"\b(apt-get|apt|apk|pip3?|uv|uvx|curl|wget|git\s+clone|npm|npx|cargo|opam|conda|go\s+(install|get)"
    r"|huggingface-cli|gem|cabal)\b"
)


def _fetches(text: str) -> list[str]:
    """The download-capable commands a script or Dockerfile runs (comments left out)."""
    lines = [ln.split("#", 1)[0] for ln in text.splitlines()]
    found = {m.group(1).split()[0] for ln in lines for m in _NET_CMD.finditer(ln)}
    return sorted(found)


def static_facts(d: Path) -> dict[str, Any]:
    """What a task's files say, read as text: base image, downloads in the Dockerfile, solve.sh, test.sh."""
    docker = d / "environment" / "Dockerfile"
    text = docker.read_text(errors="replace") if docker.is_file() else ""
    froms = [ln.split()[1] for ln in text.splitlines() if ln.strip().upper().startswith("FROM ")]
    toml = (d / "task.toml").read_text(errors="replace")
    image = re.search(r'^\s*docker_image\s*=\s*"([^"]+)"', toml, re.MULTILINE)
    test = (
        (d / "tests" / "test.sh").read_text(errors="replace") if (d / "tests" / "test.sh").is_file() else ""
    )
    solve_path = d / "solution" / "solve.sh"
    solve = solve_path.read_text(errors="replace") if solve_path.is_file() else ""
    return {
        "docker_image": image.group(1) if image else None,
        "from": froms[0] if froms else None,
        "dockerfile_fetches": _fetches(text),
        "dockerfile_user": any(ln.strip().upper().startswith("USER ") for ln in text.splitlines()),
        "test_fetches": _fetches(test),
        "test_uvx_pytest": "uvx" in test and "pytest" in test,
        "solve_fetches": _fetches(solve),
        "deprecated_sizes": bool(re.search(r"^\s*(memory|storage)\s*=", toml, re.MULTILINE)),
    }
