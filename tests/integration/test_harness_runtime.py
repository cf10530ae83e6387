"""mini-swe-agent's own runtime (``/opt/harness``: CPython 3.11 with the shared libraries it links, glibc's
loader included) in task images whose Python is not its own, through the real pipeline (Temporal dev
server, Docker, the simulated engine playing the oracle's turns through mini-swe-agent unchanged):

- a task image with no Python at all (the harbor examples' base with every python3 removed);
- a task image with Python 3.12 (pyenv's, copied in) whose own Python the harness neither uses nor changes:
  after the rollout its ``python3 --version`` is still 3.12, its standard library and site-packages are
  file for file as built, and the agent's commands see the image's ``sys.path`` (no ``/opt/harness``, no
  ``PYTHONPATH``/``PYTHONHOME``).

Both score 1.0, as the harbor example does on the bookworm image (tests/integration/test_harness.py): the
verifiers check the above inside the container. The two test base images are tagged by content and reused.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from temporalio.client import Client

from durable_rollouts.sandboxes import DockerBackend
from tests.integration.support import assert_no_containers, export, run_to_end, worker
from tests.integration.test_harness import (  # noqa: F401  (module-scoped fixtures, shared)
    assert_token_exact,
    assert_trajectory_agrees,
    harness_config,
    harness_image,
)

pytestmark = pytest.mark.timeout(600)

BASE = "harbor-examples/base:bookworm"
NO_PYTHON = f"""FROM {BASE}
USER root
RUN rm -rf /usr/bin/python* /usr/bin/pydoc* /usr/bin/py3* /usr/bin/pytest* /usr/lib/python3* \\
        /usr/local/lib/python3* && \\
    if command -v python3 || command -v python; then echo "python left" >&2; exit 1; fi
"""
PY312 = """FROM {base}
USER root
COPY py/ /usr/local/
RUN ln -s python3.12 /usr/local/bin/python3 && echo /usr/local/lib > /etc/ld.so.conf.d/python3.12.conf && \\
    ldconfig && python3 --version && \\
    find /usr/local/lib/python3.12 -type f | sort | xargs md5sum > /etc/python3.12.md5 && \\
    find /usr/local/lib/python3.12 | sort > /etc/python3.12.files
"""
SKIP_STDLIB = ("test", "__pycache__", "idlelib", "tkinter", "turtledemo", "ensurepip", "config-3.12-*")
"""What the task image does not need of the install (its tests, caches, GUI, build files)."""
TASK_TOML = """schema_version = "1.4"

[task]
name = "runtime/{name}"

[agent]
timeout_sec = 120.0

[verifier]
timeout_sec = 60.0

[environment]
memory_mb = 1024
storage_mb = 64
network_mode = "no-network"
"""
# The agent's commands record what they see; the verifier checks it and the task's own Python.
NO_PYTHON_SOLVE = """#!/bin/sh
set -e
cd /app
sed -i 's/helo/hello/' greeting.txt
{ command -v python3 || command -v python || echo none; } > .probe-python
"""
NO_PYTHON_TEST = """#!/bin/bash
cd /app
ok=1
[ "$(cat greeting.txt)" = "hello, world" ] || { echo "greeting: $(cat greeting.txt)"; ok=0; }
[ "$(cat .probe-python)" = none ] || { echo "the agent found a python: $(cat .probe-python)"; ok=0; }
if command -v python3 || command -v python; then echo "the image has a python now"; ok=0; fi
echo $ok > /logs/verifier/reward.txt
"""
PY312_SOLVE = """#!/bin/sh
set -e
cd /app
python3 -c 'import sys; open("version.txt", "w").write("%d.%d" % sys.version_info[:2])'
python3 -c 'import sys; print("\\n".join(sys.path))' > .probe-syspath
env > .probe-env
"""
PY312_TEST = """#!/bin/bash
cd /app
ok=1
case "$(python3 --version)" in "Python 3.12."*) ;; *) echo "python3: $(python3 --version 2>&1)"; ok=0 ;; esac
[ "$(cat version.txt)" = 3.12 ] || { echo "the agent's python3 was $(cat version.txt)"; ok=0; }
md5sum -c --quiet /etc/python3.12.md5 || { echo "python files changed"; ok=0; }
find /usr/local/lib/python3.12 | sort | cmp -s - /etc/python3.12.files || { echo "python files added"; ok=0; }
grep -q /usr/local/lib/python3.12 .probe-syspath || { echo "no sys.path: $(cat .probe-syspath)"; ok=0; }
if grep -n opt/harness .probe-syspath; then ok=0; fi
if grep -E -n '^PYTHON(PATH|HOME)=' .probe-env; then ok=0; fi
echo $ok > /logs/verifier/reward.txt
"""


def _pyenv_312() -> Path:
    """A Python 3.12 install on this host to copy into a task image (pyenv's, as the Makefile finds it)."""
    found = sorted(Path.home().glob(".pyenv/versions/3.12.*/bin/python3.12"))
    if not found:
        pytest.skip("no Python 3.12 under ~/.pyenv/versions (pyenv install 3.12) for the 3.12 task image")
    return found[-1].parent.parent


def _build(tag_repo: str, dockerfile: str, context: Path | None = None, key: str = "") -> str:
    """Build ``dockerfile`` (offline) as ``tag_repo:<hash of it and key>`` unless that tag exists."""
    tag = f"{tag_repo}:{hashlib.sha256((dockerfile + key).encode()).hexdigest()[:16]}"
    if subprocess.run(["docker", "image", "inspect", tag], capture_output=True).returncode == 0:
        return tag
    with tempfile.TemporaryDirectory() as tmp:
        ctx = Path(tmp)
        if context is not None:
            shutil.copytree(context, ctx / "py", symlinks=True)
        (ctx / "Dockerfile").write_text(dockerfile)
        env = {**os.environ, "DOCKER_BUILDKIT": "0"}
        done = subprocess.run(
            ["docker", "build", "-q", "--network", "none", "-t", tag, str(ctx)],
            capture_output=True, text=True, timeout=600, env=env,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
    return tag


def _py312_tree(prefix: Path, dest: Path) -> str:
    """The parts of a Python 3.12 install a task image needs, copied under ``dest``; a key of its files."""
    (dest / "bin").mkdir(parents=True)
    shutil.copy2(prefix / "bin" / "python3.12", dest / "bin")
    (dest / "lib").mkdir()
    shutil.copy2(prefix / "lib" / "libpython3.12.so.1.0", dest / "lib")
    ignore = shutil.ignore_patterns(*SKIP_STDLIB, "*.pth")  # a .pth: this host's own start-up hooks
    shutil.copytree(prefix / "lib" / "python3.12", dest / "lib" / "python3.12", ignore=ignore)
    files = sorted(p for p in dest.rglob("*") if p.is_file())
    return "\n".join(f"{p.relative_to(dest)} {p.stat().st_size}" for p in files)


def _task(root: Path, name: str, image: str, solve: str, test: str, files: dict[str, str]) -> None:
    d = root / name
    (d / "environment" / "app").mkdir(parents=True)
    (d / "task.toml").write_text(TASK_TOML.format(name=name))
    (d / "instruction.md").write_text(f"Solve {name}.\n")
    (d / "environment" / "Dockerfile").write_text(f"FROM {image}\nWORKDIR /app\nCOPY app/ /app/\n")
    for rel, text in files.items():
        (d / "environment" / "app" / rel).write_text(text)
    for folder, script, text in (("solution", "solve.sh", solve), ("tests", "test.sh", test)):
        (d / folder).mkdir()
        (d / folder / script).write_text(text)
        (d / folder / script).chmod(0o755)


@pytest.fixture(scope="module")
def images(harness_image: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:  # noqa: F811
    """The two task base images: no Python; pyenv's Python 3.12 on top of that."""
    prefix = _pyenv_312()
    no_python = _build("dr-test/no-python", NO_PYTHON)
    tree = tmp_path_factory.mktemp("py312") / "py"
    key = _py312_tree(prefix, tree)
    py312 = _build("dr-test/python3.12", PY312.format(base=no_python), tree, key)
    return no_python, py312


@pytest.fixture(scope="module")
def runtime_dataset(images: tuple[str, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    no_python, py312 = images
    root = tmp_path_factory.mktemp("runtime-dataset")
    _task(root, "no-python", no_python, NO_PYTHON_SOLVE, NO_PYTHON_TEST, {"greeting.txt": "helo, world\n"})
    _task(root, "python312", py312, PY312_SOLVE, PY312_TEST, {"README": "A task image with Python 3.12.\n"})
    return root


async def test_mini_swe_agent_runs_on_its_own_runtime_in_images_without_its_python(
    client: Client, docker: DockerBackend, runtime_dataset: Path, task_queue: str, tmp_path: Path
) -> None:
    from harness_env.transcripts import write

    from durable_rollouts.simengine import Mode, ModeRule, SimEngine, SimSettings

    transcripts = write(tmp_path / "transcripts.jsonl", runtime_dataset)
    rules = [ModeRule(on="request", prefix="", mode=Mode.REFERENCE)]
    settings = SimSettings(transcripts=transcripts, mode_rules=rules, max_model_len=65536)
    async with SimEngine(settings).serve(port=0) as sim:
        cfg = harness_config([sim], task_queue, runtime_dataset, "mini-swe-agent", run={"num_groups": 2})
        async with worker(client, task_queue, tmp_path) as store:
            await run_to_end(client, cfg, "harness-runtime")
    recs, _ = export(store, "harness-runtime")
    assert sorted(r["task_id"] for r in recs) == ["runtime/no-python", "runtime/python312"]
    for rec in recs:
        assert rec["outcome"] == "completed" and rec["reward"] == 1.0, (rec["task_id"], rec["reason"])
        assert_token_exact(store, rec)
        traj = assert_trajectory_agrees(store, rec["rollout_id"])  # mini-swe-agent itself ran, to its end
        assert traj["info"]["exit_status"] == "Submitted"
    assert_no_containers(docker, "harness-runtime")
