"""A trainer's process with its own ``config.py``, ``metrics.py``, ``store.py`` and ``trainer.py`` first on
``sys.path``, beside TRL and transformers, uses this package; the core's same-named modules never load there.

The control case shows why: in that process the core's own modules cannot be imported (the user's
``store.py`` is not the core's ``store`` package), which is what a trainer importing the core in-process
would hit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

USER_MODULES = ("config", "metrics", "store", "trainer", "errors", "records", "contracts")

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import config, metrics, store, trainer          # the user's own modules, from the working directory
    import transformers, trl                          # and the trainer stack
    from trl.experimental.async_grpo import AsyncGRPOTrainer  # noqa: F401
    import durable_rollouts_trl
    from durable_rollouts_trl import DurableRolloutWorker, make_rollout_func  # noqa: F401
    from durable_rollouts_trl.bridge import Bridge
    b = Bridge(sys.argv[1])
    hello = b.call("hello")
    policies = b.call("policies")
    b.close()
    mine = {m: getattr(sys.modules[m], "OWNER", None) for m in ("config", "metrics", "store", "trainer")}
    print(json.dumps({"hello": hello, "policies": policies, "mine": mine,
                      "core_loaded_here": [m for m in ("durable_rollouts.store.runstore",
                                                       "durable_rollouts.trainer.feed",
                                                       "durable_rollouts.config.load") if m in sys.modules]}))
    """
)

CONTROL = "import config, store\nimport store.runstore\n"


def _user_dir(tmp_path: Path) -> Path:
    d = tmp_path / "user"
    d.mkdir()
    for m in USER_MODULES:
        (d / f"{m}.py").write_text(f'OWNER = "user"\nNAME = "{m}"\n')
    (d / "train.py").write_text(SCRIPT)
    (d / "control.py").write_text(CONTROL)
    return d


def _env() -> dict[str, str]:
    env = dict(os.environ)
    # The core on the sidecar's path only (a source checkout); the trainer's own PYTHONPATH is the user's dir.
    env["DURABLE_ROLLOUTS_PYTHONPATH"] = str(REPO)
    env["TRL_EXPERIMENTAL_SILENCE"] = "1"
    return env


def test_trainer_process_with_same_named_modules_uses_the_client(tmp_path: Path) -> None:
    user = _user_dir(tmp_path)
    env = {**_env(), "PYTHONPATH": str(user)}
    out = subprocess.run(
        [sys.executable, "train.py", str(tmp_path / "home")],
        cwd=user, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["mine"] == {"config": "user", "metrics": "user", "store": "user", "trainer": "user"}
    assert got["core_loaded_here"] == []
    assert Path(got["hello"]["core"]) == REPO  # the sidecar imported the real core
    assert got["policies"] == []  # a fresh store, answered by the core's RunStore


def test_control_the_core_cannot_be_imported_beside_them(tmp_path: Path) -> None:
    user = _user_dir(tmp_path)
    env = {**_env(), "PYTHONPATH": f"{user}{os.pathsep}{REPO}"}
    out = subprocess.run(
        [sys.executable, "control.py"], cwd=user, env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode != 0
    assert "store" in out.stderr and "not a package" in out.stderr
