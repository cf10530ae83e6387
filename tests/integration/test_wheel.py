"""The package as a user installs it: the wheels built from this repository, installed into a fresh virtual
environment in an empty directory whose ``sys.path`` starts with a training project's own ``config.py``,
``store.py``, ``metrics.py``, ``trainer.py``, ``records.py``, ``errors.py`` and ``models.py``. From there:
the core imports in-process beside TRL and transformers, ``rollouts stack up -d`` starts the stack, the
bundled math example runs by its name, and it exports and reports; no module of the checkout is loaded.

The new environment gets the third-party packages by links to the project's venv (a fresh resolve would
download several GB of torch and vLLM); the project's own distributions, their editable finders and every
``.pth`` file are left out, so the core and the math plug-in come from the wheels only.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import pytest

from durable_rollouts.stack import procs, stack
from tests import REPO_ROOT

pytestmark = pytest.mark.integration

USER_MODULES = ("config", "store", "metrics", "trainer", "records", "errors", "models")
"""A training project's own top-level modules: the names the core's folders have."""

IN_PROCESS = """
import json, sys
from pathlib import Path
mine = {m: __import__(m).OWNER for m in %(user)r}
import trl, transformers
import durable_rollouts.contracts.types, durable_rollouts.config.models, durable_rollouts.store
from durable_rollouts.config.load import load_config
from durable_rollouts.config.paths import TINY_POLICY, resolve_path
cfg = load_config("math")
checkout = Path(%(repo)r)
venv = checkout / ".venv"
loaded = [str(Path(m.__file__).resolve()) for m in list(sys.modules.values()) if getattr(m, "__file__", None)]
from_checkout = [f for f in loaded if Path(f).is_relative_to(checkout) and not Path(f).is_relative_to(venv)]
print(json.dumps({
    "mine": mine,
    "core": durable_rollouts.config.models.__file__,
    "tasks": str(resolve_path(cfg.run.task_file)),
    "policy": str(resolve_path(TINY_POLICY)),
    "from_checkout": from_checkout,
}))
"""


def _clean_copy(dest: Path) -> Path:
    """The files a clean clone has (tracked, or new and not ignored), copied: a build from it sees no
    leftovers of earlier builds (``build/``, ``*.egg-info``) and writes none into the checkout."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO_ROOT, capture_output=True, check=True,
    ).stdout.decode().split("\0")  # fmt: skip
    for name in filter(None, listed):
        source = REPO_ROOT / name
        if source.is_file() and not source.is_symlink():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


def _build_wheels(dest: Path) -> list[Path]:
    """The core's wheel and the math plug-in's, built from a clean copy without build isolation."""
    tree = _clean_copy(dest.parent / "tree")
    for source in (tree, tree / "environments" / "math"):
        built = subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dest),
             str(source)],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert built.returncode == 0, built.stderr[-2000:]
    wheels = sorted(dest.glob("*.whl"))
    assert [w.name.split("-")[0] for w in wheels] == ["durable_rollouts", "durable_rollouts_math"], wheels
    return wheels


def _fresh_venv(where: Path, wheels: list[Path]) -> Path:
    """A new venv holding the wheels, with links to the project venv's third-party packages and binaries."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True, timeout=120)
    python = where / "bin" / "python"
    target = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()
    )  # fmt: skip
    ours = Path(sysconfig.get_paths()["purelib"])
    for entry in ours.iterdir():
        name = entry.name.lower()
        ours_or_hook = name.startswith(("durable_rollouts", "__editable__", "_durable", "math_env"))
        if ours_or_hook or name.endswith(".pth"):
            continue
        (target / entry.name).symlink_to(entry)
    for tool in ("temporal", "temporal-test-server"):
        (where / "bin" / tool).symlink_to(Path(sys.executable).parent / tool)
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index",
         *map(str, wheels)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert installed.returncode == 0, installed.stderr[-2000:]
    return where


@pytest.fixture
def user_project(tmp_path: Path) -> Iterator[tuple[Path, Path, dict[str, str]]]:
    """(the fresh venv, the user's project folder, the environment its commands run in); the stack its
    home holds is stopped at teardown, by pid."""
    venv = _fresh_venv(tmp_path / "venv", _build_wheels(tmp_path / "dist"))
    project = tmp_path / "project"
    project.mkdir()
    for name in USER_MODULES:
        (project / f"{name}.py").write_text(f'OWNER = "user {name}"\n')
    home = tmp_path / "home"
    env = {
        "PATH": f"{venv / 'bin'}:/usr/local/bin:/usr/bin:/bin",
        "HOME": os.environ.get("HOME", str(tmp_path)),
        "PYTHONPATH": str(project),
        "ROLLOUTS_HOME": str(home),
        "HF_HUB_OFFLINE": "1",
        "COLUMNS": "160",
    }
    try:
        yield venv, project, env
    finally:
        for component in reversed(stack.COMPONENTS):
            procs.stop_component(home, component, timeout=10)


def _rollouts(venv: Path, project: Path, env: dict[str, str], *args: str, timeout: float = 400):
    done = subprocess.run(
        [str(venv / "bin" / "rollouts"), *args], cwd=project, env=env, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip
    assert done.returncode == 0, f"rollouts {' '.join(args)}: {done.stdout[-1500:]}{done.stderr[-1500:]}"
    return done


def test_the_wheel_runs_the_bundled_math_example_beside_a_trainer_and_its_own_modules(user_project) -> None:
    venv, project, env = user_project
    probe = subprocess.run(
        [str(venv / "bin" / "python"), "-c", IN_PROCESS % {"user": USER_MODULES, "repo": str(REPO_ROOT)}],
        cwd=project, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert probe.returncode == 0, probe.stderr[-3000:]
    seen = json.loads(probe.stdout.strip().splitlines()[-1])
    assert seen["mine"] == {m: f"user {m}" for m in USER_MODULES}  # the user's modules stay the user's
    assert Path(seen["core"]).is_relative_to(venv), seen["core"]
    assert Path(seen["tasks"]).is_relative_to(venv) and Path(seen["tasks"]).is_file(), seen["tasks"]
    assert (Path(seen["policy"]) / "config.json").is_file() and Path(seen["policy"]).is_relative_to(venv)
    assert seen["from_checkout"] == [], seen["from_checkout"]

    t, ui, e, m, sdk = procs.free_ports(5)
    (project / "stack.toml").write_text(
        f"[stack]\ntemporal_port = {t}\nui_port = {ui}\nengine_port = {e}\n"
        f"worker_metrics_port = {m}\nworker_sdk_metrics_port = {sdk}\n"
    )
    _rollouts(venv, project, env, "stack", "up", "-d", "-c", "stack.toml")
    worker_pid = procs.read_pid(Path(env["ROLLOUTS_HOME"]), "worker")
    assert worker_pid is not None
    assert Path(os.readlink(f"/proc/{worker_pid}/exe")).name.startswith("python")
    cmdline = Path(f"/proc/{worker_pid}/cmdline").read_bytes().split(b"\0")
    assert cmdline[0].decode() == str(venv / "bin" / "python"), cmdline  # the worker runs from the wheel
    sets = [f'temporal.address="127.0.0.1:{t}"', f'engine.urls=["http://127.0.0.1:{e}"]']
    _rollouts(
        venv, project, env, "run", "math", "--run-id", "wheel", "--groups", "2", "--wait",
        *[a for s in sets for a in ("--set", s)],
    )  # fmt: skip
    _rollouts(venv, project, env, "export", "wheel", "-o", "wheel.jsonl")
    lines = [json.loads(x) for x in (project / "wheel.jsonl").read_text().splitlines()]
    rollouts = [x for x in lines if x["kind"] == "rollout"]
    assert len(rollouts) == 8 and sum(x["kind"] == "group" for x in lines) == 2, [x["kind"] for x in lines]
    outcomes = [(x["outcome"], x["reason"]) for x in rollouts]
    assert "completed" in {o for o, _ in outcomes} and "failed" not in {o for o, _ in outcomes}, outcomes
    _rollouts(venv, project, env, "report", "wheel", "-o", "wheel.html")
    assert (project / "wheel.html").stat().st_size > 1000
    _rollouts(venv, project, env, "stack", "down")
    assert procs.read_pid(Path(env["ROLLOUTS_HOME"]), "worker") is None
