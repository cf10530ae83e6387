"""The mini-swe-agent plug-in runs on its own runtime (environments/harness): its command and the TCP shim use
the bundled interpreter, never the task image's ``python3``, and nothing it exports points the agent's
commands at /opt/harness; the image tag the plug-in copies from is the one build_image.sh builds."""

from __future__ import annotations

import re
import sys

from durable_rollouts.environments.harness_trait import HarnessCommand
from durable_rollouts.gateway.harness import SHIM_PYTHON, gateway_env, launcher
from tests import REPO_ROOT

HARNESS = REPO_ROOT / "environments" / "harness"
for _p in (HARNESS, REPO_ROOT / "environments" / "harbor"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from harbor_env.tasks import load_dataset  # noqa: E402
from harness_env import HARNESS_IMAGE, PYTHON, MiniSweAgentEnvironment  # noqa: E402

TASK = REPO_ROOT / "environments" / "harbor" / "examples" / "fix-inventory-totals"


def test_the_harness_and_its_shim_run_on_the_bundled_interpreter() -> None:
    cmd = MiniSweAgentEnvironment().harness_command(load_dataset(TASK)[0])
    assert cmd.command.startswith(f"{PYTHON} -m minisweagent.run.mini ")
    assert cmd.env[SHIM_PYTHON] == PYTHON
    assert not any(k.startswith("PYTHON") or k.startswith("LD_") for k in cmd.env)
    script = launcher(cmd, gateway_env(cmd, "key", "model"))
    assert f"{PYTHON} /tmp/.dr-harness/shim.py 8011 " in script and f"! {PYTHON} -c " in script
    assert not re.search(r"(^|[\s;&|!])python3 ", script)  # the image's python3 is named nowhere


def test_without_a_runtime_of_its_own_the_shim_uses_the_task_images_python3() -> None:
    cmd = HarnessCommand(command="my-agent", env={"X": "1"})
    script = launcher(cmd, gateway_env(cmd, "key", "model"))
    assert "\npython3 /tmp/.dr-harness/shim.py 8011 " in script and "! python3 -c " in script


def test_the_plugin_copies_the_image_build_image_sh_builds() -> None:
    text = (HARNESS / "build_image.sh").read_text()
    fields = dict(re.findall(r'^(VERSION|REVISION)="([^"]+)"$', text, re.M))
    assert f"dr-harness/mini-swe-agent:{fields['VERSION']}-{fields['REVISION']}" == HARNESS_IMAGE
    launcher_script = (HARNESS / "image" / "python3").read_text()
    assert "--argv0 /opt/harness/bin/python3" in launcher_script and PYTHON == "/opt/harness/bin/python3"
    assert " -I " in launcher_script and "LD_LIBRARY_PATH" not in launcher_script
