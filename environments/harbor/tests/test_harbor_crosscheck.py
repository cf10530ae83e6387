"""The plug-in's task.toml parse against Harbor's own model (PyPI ``harbor==0.25.0``), on every example
task, on the legacy spellings Harbor migrates, and on the fields honoured since (users, container
environment, health checks, Terminal-Bench 2.1's empty tables and zero values).

Harbor 0.25 needs Python >= 3.12 while the project's venv is 3.11: ``make harbor-venv`` (run by ``make
test``) creates ``.venv-harbor`` with Python 3.12 and ``harbor==0.25.0``; this test runs Harbor's
``Task(dir)`` and ``TaskConfig.model_validate_toml`` there in a subprocess and compares name, instruction
and every field
of the config with this plug-in's parse. The one intended difference: Harbor ignores unknown fields, the
plug-in refuses them (tested in test_harbor_tasks.py).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from harbor_env.tasks import load_task_dir
from harbor_paths import EXAMPLES, PACKAGE, MakeTask

HARBOR_PYTHON = PACKAGE.parents[1] / ".venv-harbor" / "bin" / "python"


def harbor_parse(dirs: list[Path]) -> list[dict[str, Any]]:
    if not HARBOR_PYTHON.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{HARBOR_PYTHON} is missing: `make harbor-venv` creates it")
        pytest.skip(f"{HARBOR_PYTHON} is missing: `make harbor-venv` creates it (Python 3.12, harbor 0.25)")
    done = subprocess.run(
        [str(HARBOR_PYTHON), str(Path(__file__).with_name("harbor_dump.py")), *map(str, dirs)],
        capture_output=True, text=True, timeout=300, env={"PATH": os.environ.get("PATH", "")},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return [json.loads(line) for line in done.stdout.splitlines()]


def assert_same(harbor: Any, ours: Any, where: str) -> None:
    if isinstance(harbor, dict):
        assert isinstance(ours, dict), where
        assert set(harbor) == set(ours), (where, set(harbor) ^ set(ours))
        for k in harbor:
            assert_same(harbor[k], ours[k], f"{where}.{k}")
    else:
        assert harbor == ours and type(harbor) is type(ours), (where, harbor, ours)


def test_every_example_parses_as_harbor_parses_it(make_task: MakeTask) -> None:
    legacy = make_task(
        "legacy",
        toml='version = "1.0"\n[environment]\nmemory = "2G"\nstorage = "512M"\nallow_internet = false\n'
        'cpus = 2.0\n[verifier]\ntimeout_sec = 120\n[verifier.env]\nMODE = "strict"\n',
        **{"instruction.md": "<!-- harbor-canary GUID 1234 -->\n\nDo it.\n"},
    )
    users = make_task(
        "users",
        toml='[agent]\nuser = "agent"\n[verifier]\nuser = "root"\n'
        '[environment]\nnetwork_mode = "no-network"\n[environment.env]\nMODE = "strict"\n'
        '[environment.healthcheck]\ncommand = "test -f /app/ready"\n'
        "start_period_sec = 2.0\nretries = 5\n",
    )
    uid = make_task("uid", toml='[agent]\nuser = 1000\n[environment]\nnetwork_mode = "no-network"\n')
    # Terminal-Bench 2.1's shape: deprecated sizes, explicit empty tables and zero values.
    tb21 = make_task(
        "tb21",
        toml='version = "1.0"\nartifacts = []\n[metadata]\ndifficulty = "medium"\n[verifier]\n'
        "timeout_sec = 900.0\n[verifier.env]\n[agent]\ntimeout_sec = 900.0\n[environment]\n"
        'build_timeout_sec = 600.0\ndocker_image = "harbor-examples/base:bookworm"\ncpus = 1\n'
        'memory = "2G"\nstorage = "10G"\ngpus = 0\nmcp_servers = []\nnetwork_mode = "no-network"\n'
        "[environment.env]\n[solution.env]\n",
        drop=("environment/Dockerfile",),
    )
    dirs = [*sorted(d for d in EXAMPLES.iterdir() if d.is_dir()), legacy, users, uid, tb21]
    results = harbor_parse(dirs)
    assert len(results) == len(dirs)
    for d, theirs in zip(dirs, results, strict=True):
        ours = load_task_dir(d)
        assert ours.id == theirs["name"], d
        assert ours.instruction == theirs["instruction"], d
        assert_same(theirs["config"], ours.config, d.name)


SEPARATE = PACKAGE.parents[1] / "tests" / "integration" / "harbor_tasks"


def test_separate_verifier_tasks_resolve_as_harbor_resolves_them(make_task: MakeTask) -> None:
    """The integration test's separate-verifier tasks, and a verifier with an image named in its own
    [verifier.environment]: parsed as Harbor parses them, and the verifier's mode, image source and bundled
    tests resolved as Harbor resolves them."""
    from harbor_env.config import verifier_mode
    from harbor_env.separate import Definition

    named = make_task(
        "named",
        toml='[verifier.environment]\ndocker_image = "harbor-examples/base:bookworm"\n'
        'network_mode = "no-network"\nmemory_mb = 1024\n[environment]\nnetwork_mode = "no-network"\n',
    )
    dirs = [SEPARATE / "separate-own-image", SEPARATE / "separate-task-image", named]
    for d, theirs in zip(dirs, harbor_parse(dirs), strict=True):
        ours = load_task_dir(d)
        assert ours.id == theirs["name"], d
        assert_same(theirs["config"], ours.config, d.name)
        definition = Definition(ours)
        assert theirs["verifier"] == {
            "mode": verifier_mode(ours.cfg),
            "bundled": definition.bundled,
            "directory": "tests" if definition.bundled else "environment",
        }, d.name
    assert load_task_dir(named).cfg.verifier.environment is not None
