"""Harbor datasets: task directories read at submit into self-contained tasks (everything a worker needs).

A dataset (``run.task_file``) is one of:

- a task directory (it holds ``task.toml``);
- a folder of task directories (each sub-folder not starting with ``.`` must be one);
- a dataset file listing them: TOML with ``tasks = ["dir", "more/*", ...]`` (paths relative to the file,
  globs allowed) and optionally ``network_policy = "no-network"`` (run tasks whose network mode is
  ``public`` or ``allowlist`` without network; without it they need the run's egress policy:
  `harbor_env.network`) and ``default_user`` (the user of every task that names no ``[agent].user``, as
  if it named this one: ``"root"`` for task sets written to run as root, such as Terminal-Bench 2; root
  still runs only on a sandbox host whose daemon remaps users, and is refused in one line elsewhere), or
  a plain text file with one path per line (``#`` comments).

Each task directory becomes one `HarborTask`: its parsed ``task.toml`` (``harbor_env.config``), its
instruction (canary lines stripped, as Harbor does), and the files of ``environment/``, ``tests/`` and
``solution/`` (base64), so a worker on another host never reads the submitter's disk.

Invariant: a task directory that is missing a part, does not parse, or asks for what the pipeline cannot
honour is refused with one line ``<dir>: <file or field>: <why>`` (`TaskFileError`), and nothing starts.
"""

from __future__ import annotations

import base64
import glob
import hashlib
import os
import re
import tomllib
from pathlib import Path
from typing import Any

from pydantic import ConfigDict, Field

from durable_rollouts.environments.base import Task
from durable_rollouts.errors import TaskFileError
from durable_rollouts.sandboxes.egress_policy import EgressPolicy
from harbor_env import config as cfgmod
from harbor_env import network

MAX_TASK_BYTES = 64 * 1024 * 1024
"""Largest task directory (environment, tests and solution together) accepted."""
SEED_VERSION = "harbor-seed-v1"
"""Version of what the pipeline adds to a task's image (part of its content hash)."""
DEFAULT_WORKDIR = "/app"
"""Working directory when neither ``[environment].workdir`` nor the Dockerfile's ``WORKDIR`` says
(Terminal-Bench tasks work in /app)."""
_CANARY = re.compile(r"^(<!--.*canary.*-->|#.*canary.*)$", re.IGNORECASE)
TASK_PARTS = ("instruction.md", "environment", "tests", "solution")
"""What makes a folder a task directory even without its task.toml."""
COMPOSE_FILES = ("docker-compose.yaml", "docker-compose.yml", "compose.yaml", "compose.yml")
NO_EGRESS = EgressPolicy()
"""The egress policy a dataset is checked against when the caller names none: no host allowed."""


class HarborTask(Task):
    """One Harbor task directory, read at submit (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    source: str
    """The task directory it was read from (for messages only; workers never read it)."""
    instruction: str
    config: dict[str, Any]
    """The parsed ``task.toml`` (`harbor_env.config.TaskConfig`, dumped)."""
    files: dict[str, str] = Field(default_factory=dict)
    """``environment/...``, ``tests/...``, ``solution/...`` -> base64 content."""
    executables: list[str] = Field(default_factory=list)
    workdir: str
    content_hash: str
    """sha256 of what the task's image is built from (environment files, docker_image, workdir, seed)."""

    @property
    def cfg(self) -> cfgmod.TaskConfig:
        return cfgmod.TaskConfig.model_validate(self.config)

    def tree(self, top: str) -> dict[str, bytes]:
        """The files under ``top/`` (``tests``, ``solution``, ``environment``), relative to it."""
        prefix = top + "/"
        return {p[len(prefix) :]: base64.b64decode(b) for p, b in self.files.items() if p.startswith(prefix)}


def load_dataset(path: str | Path, egress: EgressPolicy | None = NO_EGRESS) -> list[HarborTask]:
    """Every task of the dataset at ``path`` (see the module docstring), in order, ids unique.

    ``egress``: the run's egress policy, which a task's network mode must fit (`harbor_env.network`); the
    default allows nothing; None: not known here (checked when each rollout's sandbox is planned).

    Raises:
        TaskFileError: one line naming the task directory (or dataset file) and the field at fault.
    """
    p = Path(path)
    policy: str | None = None
    default_user: str | None = None
    if p.is_file():
        dirs, policy, default_user = _listing(p)
    elif (p / "task.toml").is_file() or any((p / part).exists() for part in TASK_PARTS):
        dirs = [p]  # a task directory (one without task.toml is refused as such)
    elif p.is_dir():
        dirs = sorted(d for d in p.iterdir() if d.is_dir() and not d.name.startswith("."))
        if not dirs:
            raise TaskFileError(f"{p}: no task directories in this folder")
    else:
        raise TaskFileError(f"{p}: no such dataset (a task directory, a folder of them, or a dataset file)")
    tasks: list[HarborTask] = []
    seen: dict[str, Path] = {}
    for d in dirs:
        task = load_task_dir(d, policy, egress, default_user)
        if task.id in seen:
            raise TaskFileError(f"{d}: task name {task.id!r} is also the name of {seen[task.id]}")
        seen[task.id] = d
        tasks.append(task)
    return tasks


def _listing(path: Path) -> tuple[list[Path], str | None, str | None]:
    text = _read(path, path, "dataset file")
    base = path.parent
    policy = default_user = None
    if path.suffix == ".toml":
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise TaskFileError(f"{path}: not valid TOML ({e})") from None
        unknown = set(data) - {"tasks", "network_policy", "default_user"}
        if unknown:
            raise TaskFileError(
                f"{path}: field {sorted(unknown)[0]!r}: unknown (tasks, network_policy, default_user)"
            )
        entries = data.get("tasks")
        if not isinstance(entries, list) or not entries or not all(isinstance(e, str) for e in entries):
            raise TaskFileError(f"{path}: field 'tasks': a non-empty list of task directory paths")
        policy = data.get("network_policy")
        if policy not in (None, "no-network"):
            raise TaskFileError(
                f"{path}: field 'network_policy': {policy!r}: only \"no-network\" is possible"
            )
        default_user = data.get("default_user")
        if default_user is not None and (
            isinstance(default_user, bool)
            or not isinstance(default_user, (str, int))
            or cfgmod.bad_user(default_user)
        ):
            raise TaskFileError(
                f"{path}: field 'default_user': {default_user!r}: a user name or uid, e.g. \"root\""
            )
        default_user = cfgmod.user_name(default_user)
    else:
        entries = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    dirs: list[Path] = []
    for entry in entries:
        full = str(base / entry)
        matches = sorted(glob.glob(full)) if glob.has_magic(entry) else [full]
        if not matches:
            raise TaskFileError(f"{path}: {entry!r} matches no task directory")
        dirs += [Path(m) for m in matches if Path(m).is_dir() or not glob.has_magic(entry)]
    if not dirs:
        raise TaskFileError(f"{path}: no tasks")
    return dirs, policy, default_user


def load_task_dir(
    d: Path,
    network_policy: str | None = None,
    egress: EgressPolicy | None = NO_EGRESS,
    default_user: str | None = None,
) -> HarborTask:
    """One task directory as a `HarborTask` (``default_user``: the dataset's user for a task that names
    no ``[agent].user``).

    Raises:
        TaskFileError: ``<dir>: <file or field>: <why>``.
    """
    if not d.is_dir():
        raise TaskFileError(f"{d}: not a task directory")
    toml_path = d / "task.toml"
    if not toml_path.is_file():
        raise TaskFileError(f"{d}: task.toml: missing (a Harbor task directory has task.toml)")
    try:
        cfg = cfgmod.parse(_read(d, toml_path, "task.toml"))
    except cfgmod.ConfigProblem as e:
        raise TaskFileError(f"{d}: {e}") from None
    bad = cfgmod.unsupported(cfg)
    if bad is not None:
        raise TaskFileError(f"{d}: task.toml {bad[0]}: {bad[1]}")
    if default_user is not None and cfg.agent.user is None:
        cfg = cfg.model_copy(update={"agent": cfg.agent.model_copy(update={"user": default_user})})
    if network_policy == "no-network":
        cfg = network.offline(cfg)
    elif egress is not None:
        try:
            network.egress_for(cfg, egress)
        except network.NetworkRefused as e:
            raise TaskFileError(f"{d}: task.toml {e}") from None
    if not (d / "instruction.md").is_file():
        raise TaskFileError(f"{d}: instruction.md: missing")
    instruction = strip_canary(_read(d, d / "instruction.md", "instruction.md"))
    own = cfg.verifier.environment
    bundled = cfgmod.verifier_mode(cfg) == "separate" and (
        (own is not None and own.docker_image is not None) or (d / "tests" / "Dockerfile").is_file()
    )  # the verifier's own image holds /tests (Harbor's bundled tests)
    if not bundled and not (d / "tests" / "test.sh").is_file():
        raise TaskFileError(f"{d}: tests/test.sh: missing (the verifier runs tests/test.sh)")
    env_dir = d / "environment"
    for name in COMPOSE_FILES:
        if (env_dir / name).exists():
            raise TaskFileError(f"{d}: environment/{name}: compose-based environments are not supported")
    dockerfile = env_dir / "Dockerfile"
    if cfg.environment.docker_image is None and not dockerfile.is_file():
        raise TaskFileError(f"{d}: environment/Dockerfile: missing (and [environment].docker_image unset)")
    for ignore in d.rglob(".harborignore"):
        raise TaskFileError(f"{d}: {ignore.relative_to(d)}: .harborignore is not supported")
    files, executables = _files(d, ("environment", "tests", "solution"))
    workdir = cfg.environment.workdir or (
        dockerfile_workdir(dockerfile.read_text(errors="replace")) if dockerfile.is_file() else None
    )
    workdir = workdir or DEFAULT_WORKDIR
    env_files = sorted((p, b) for p, b in files.items() if p.startswith("environment/"))
    digest = hashlib.sha256()
    for part in (
        SEED_VERSION,
        workdir,
        cfg.environment.docker_image or "",
        repr(env_files),
        repr(executables),
    ):
        digest.update(part.encode() + b"\0")
    name = cfg.task.name if cfg.task is not None else d.resolve().name
    return HarborTask(
        id=name, source=str(d), instruction=instruction, config=cfg.model_dump(mode="json"), files=files,
        executables=executables, workdir=workdir, content_hash=digest.hexdigest(),
    )  # fmt: skip


def _files(d: Path, tops: tuple[str, ...]) -> tuple[dict[str, str], list[str]]:
    files: dict[str, str] = {}
    executables: list[str] = []
    total = 0
    root = d.resolve()
    for top in tops:
        base = d / top
        if not base.is_dir():
            continue
        for dirpath, dirnames, filenames in os.walk(base, followlinks=False):
            dirnames.sort()
            for f in sorted(filenames):
                full = Path(dirpath) / f
                rel = full.relative_to(d).as_posix()
                if not full.resolve().is_relative_to(root):
                    raise TaskFileError(f"{d}: {rel}: a link that leaves the task directory")
                if not full.is_file():
                    continue
                data = full.read_bytes()
                total += len(data)
                if total > MAX_TASK_BYTES:
                    raise TaskFileError(f"{d}: {top}/: the task's files exceed {MAX_TASK_BYTES >> 20} MiB")
                files[rel] = base64.b64encode(data).decode()
                if os.access(full, os.X_OK):
                    executables.append(rel)
    return files, executables


def dockerfile_workdir(text: str) -> str | None:
    """The last ``WORKDIR`` of a Dockerfile's last stage (a relative one joined to the one before)."""
    workdir: str | None = None
    for raw in text.splitlines():
        line = raw.strip()
        upper = line.upper()
        if upper.startswith("FROM "):
            workdir = None
        elif upper.startswith("WORKDIR "):
            value = line.split(None, 1)[1].strip().strip('"').strip("'")
            workdir = value if value.startswith("/") else f"{(workdir or '').rstrip('/')}/{value}"
    return os.path.normpath(workdir) if workdir else None


def strip_canary(text: str) -> str:
    """Harbor's ``strip_canary``: leading canary comment lines and the blank lines after them removed."""
    lines = text.split("\n")
    i = 0
    while i < len(lines) and _CANARY.match(lines[i].strip()):
        i += 1
    while i < len(lines) and lines[i].strip() == "":
        i += 1
    return "\n".join(lines[i:])


def _read(d: Path, path: Path, what: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TaskFileError(f"{d}: {what}: cannot read ({getattr(e, 'strerror', None) or e})") from None
