"""A trainer's process with its own ``config.py``, ``metrics.py``, ``store.py`` and ``trainer.py`` first on
``sys.path``, beside TRL and transformers, imports this package and the durable-rollouts core in-process,
and both work there: the user's modules stay the user's, the core's load only as ``durable_rollouts.*``.

The script does real work against a store in a temporary directory through
:class:`durable_rollouts_trl.core.Core`: it reads the run config and tasks, publishes two versions (the
second written by ``weights.save_weights``, the core's ``policy_io``), takes from the trainer feed, reads
the books, and gets one-line errors back, one of them from the core's background event loop while its own
asyncio loop runs. It starts no child process.

The control, in the same environment, shows the user's modules really are first on ``sys.path``: the
core's source folders are on the path too (after them), and importing one of those folders by its bare
name gets the user's module instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from trl_support import MODEL_DIR, REPO

USER_MODULES = ("config", "metrics", "store", "trainer", "errors", "records", "contracts")

SCRIPT = textwrap.dedent(
    """
    import asyncio, json, sys, threading
    from pathlib import Path

    import config, metrics, store, trainer            # the user's own modules, from the script's folder
    import transformers, trl                            # and the trainer stack
    from trl.experimental.async_grpo import AsyncGRPOTrainer  # noqa: F401
    import psutil
    from safetensors.torch import load_file

    import durable_rollouts_trl
    from durable_rollouts_trl import DurableRolloutWorker, make_rollout_func  # noqa: F401
    from durable_rollouts_trl.core import Core, CoreError
    from durable_rollouts_trl.weights import save_weights

    home, model_dir, repo = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    out = {"sys_path_0": sys.path[0]}
    with Core(home) as core:
        out["hello"] = core.hello()
        out["before"] = [p["version"] for p in core.policies()]
        st = core.settings(None, [])
        out["settings"] = {"env": st.config.run.env, "tasks": len(st.tasks)}
        core.publish([], "v0", model_dir)                 # no engine: the version is recorded
        moved = ((k, t + 0.01) for k, t in load_file(model_dir / "model.safetensors").items())
        v1 = save_weights(moved, model_dir, home / "policies" / "v1")
        out["v1"] = core.publish([], "v1", v1)["version"]
        out["after"] = [p["version"] for p in core.policies()]
        batch = core.take("no-run", 4, "v1", 1, True, "processed_logprobs")
        out["take"] = {"groups": len(batch.groups), "discarded": len(batch.discarded)}
        led = core.ledger("no-run")
        out["ledger"] = {"balanced": led.balanced, "generated": led.generated.records}
        try:
            core.take("no-run", 1, "v9", 0, False, "processed_logprobs")
        except CoreError as e:
            out["feed_error"] = str(e)

        async def trainer_code_with_its_own_loop():
            try:
                core.start_run(None, ['temporal.address="127.0.0.1:1"'], "r-1")
            except CoreError as e:
                return str(e)

        out["loop_error"] = asyncio.run(trainer_code_with_its_own_loop())
        out["threads_open"] = sorted(t.name for t in threading.enumerate() if t.name.startswith("durable"))
    try:
        core.policies()
    except CoreError as e:
        out["closed_error"] = str(e)
    out["threads_closed"] = sorted(t.name for t in threading.enumerate() if t.name.startswith("durable"))
    out["children"] = [c.pid for c in psutil.Process().children(recursive=True)]
    out["mine"] = {m: sys.modules[m].OWNER for m in ("config", "metrics", "store", "trainer")}
    core_files = {}
    for name, mod in list(sys.modules.items()):
        f = getattr(mod, "__file__", None)
        if f and Path(f).resolve().is_relative_to(repo):
            rel = Path(f).resolve().relative_to(repo)
            if rel.parts[0] not in (".venv", "integrations"):
                core_files[name] = str(rel)
    out["core_modules"] = core_files
    print(json.dumps(out))
    """
)

CONTROL = textwrap.dedent(
    """
    import json, sys
    import store
    out = {"sys_path_0": sys.path[0], "owner": getattr(store, "OWNER", None)}
    try:
        import store.runstore  # the core's store, were it imported by its folder's bare name
    except ImportError as e:
        out["error"] = str(e)
    print(json.dumps(out))
    """
)


def _user_dir(tmp_path: Path) -> Path:
    d = tmp_path / "user"
    d.mkdir()
    for m in USER_MODULES:
        (d / f"{m}.py").write_text(f'OWNER = "user {m}"\n')
    (d / "train.py").write_text(SCRIPT)
    (d / "control.py").write_text(CONTROL)
    return d


def _own_dist(rel: str) -> bool:
    """An environment's own distribution (``environments/<env>/`` with its pyproject.toml, e.g. math_env):
    a package of its own unique name, not one of the core's."""
    parts = Path(rel).parts
    return (
        len(parts) > 3
        and parts[0] == "environments"
        and (REPO / parts[0] / parts[1] / "pyproject.toml").is_file()
    )


def _run(user: Path, *argv: str) -> dict:
    # The user's folder first; the core's source folders (bare names config, store, ...) reachable after it.
    env = {**os.environ, "PYTHONPATH": f"{user}{os.pathsep}{REPO}", "TRL_EXPERIMENTAL_SILENCE": "1"}
    env.pop("PYTHONSAFEPATH", None)
    out = subprocess.run(
        [sys.executable, *argv], cwd=user, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_client_and_the_core_work_in_a_trainer_process_with_same_named_modules(tmp_path: Path) -> None:
    user = _user_dir(tmp_path)
    home = tmp_path / "home"
    got = _run(user, "train.py", str(home), str(MODEL_DIR), str(REPO))
    assert got["sys_path_0"] == str(user)
    # the user's modules are still the user's ...
    assert got["mine"] == {m: f"user {m}" for m in ("config", "metrics", "store", "trainer")}
    # ... and the core's modules are loaded in this process, every one of them as durable_rollouts.*
    core = got["core_modules"]
    for name, rel in {
        "durable_rollouts.store.runstore": "store/runstore.py",
        "durable_rollouts.config.load": "config/load.py",
        "durable_rollouts.trainer.feed": "trainer/feed.py",
        "durable_rollouts.trainer.policy_io": "trainer/policy_io.py",
        "durable_rollouts.engines.policy": "engines/policy.py",
    }.items():
        assert core.get(name) == rel, (name, core.get(name))
    assert [
        n for n, rel in core.items() if not n.startswith("durable_rollouts.") and not _own_dist(rel)
    ] == []
    # ... and they worked on the store in tmp: the core's RunStore, feed, publish and config
    assert Path(got["hello"]["core"]) == REPO and Path(got["hello"]["store"]) == home.resolve()
    assert got["before"] == [] and got["after"] == ["v0", "v1"] and got["v1"] == "v1"
    assert got["settings"] == {"env": "math", "tasks": 200}
    assert (home / "policies" / "v1" / "model.safetensors").is_file()
    assert got["take"] == {"groups": 0, "discarded": 0}
    assert got["ledger"] == {"balanced": True, "generated": 0}
    # errors come back as one line: the core's own message, and one from its background event loop
    assert got["feed_error"] == "current version 'v9' was never published (published: v0, v1)"
    assert got["loop_error"].startswith("cannot reach Temporal at 127.0.0.1:1")
    assert "\n" not in got["loop_error"]
    # one background thread for the core's async calls while open, none after close; no child process
    assert got["threads_open"] == ["durable-rollouts-core"] and got["threads_closed"] == []
    assert got["closed_error"] == "policies: the durable-rollouts core handle is closed"
    assert got["children"] == []


def test_control_the_user_modules_come_first(tmp_path: Path) -> None:
    user = _user_dir(tmp_path)
    got = _run(user, "control.py")
    assert got["sys_path_0"] == str(user)
    assert got["owner"] == "user store"  # not the core's store/ folder, which is on the path too
    assert "not a package" in got["error"]
