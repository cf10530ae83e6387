"""mini-swe-agent, unchanged, as the agent of Harbor task directories (``run.env = "mini-swe-agent"``).

A plug-in in its own distribution (``durable-rollouts-harness``) using the core's harness trait
(``environments.harness_trait``) and the harbor plug-in's tasks, image builds and verifier
(``harbor_env.harness_base.HarborHarness``, which both harness plug-ins subclass):

- Tasks: Harbor task directories, read at submit as the harbor plug-in reads them.
- Sandbox: the harbor plug-in's plan (its task image, limits, seed, /logs /tests /solution), with one
  layer more, ``/opt/harness`` copied from ``HARNESS_IMAGE`` (mini-swe-agent, its dependencies and its own
  runtime, CPython 3.11 with the shared libraries it links, built offline by ``build_image.sh``), and the
  rollout's gateway folder mounted (no network).
- Harness: ``/opt/harness/bin/python3 -m minisweagent.run.mini`` (the bundled interpreter, isolated: the
  task image's Python, if it has one, is neither used nor changed; no ``PYTHON*`` variable reaches the
  agent's commands) in yolo mode with the task's instruction (``Task id: <name>`` first), its local
  environment (commands run in the sandbox's working directory as the sandbox's user), the model
  ``openai/<rollout model>`` at the gateway's loopback URL. The loopback shim runs on the same interpreter.
- Score: Harbor's verifier in the same container once the harness exits 0.
"""

from __future__ import annotations

import shlex
from typing import ClassVar

from harbor_env.harness_base import HarborHarness, as_harbor, task_text

from durable_rollouts.environments.base import Task
from durable_rollouts.environments.harness_trait import HarnessCommand
from durable_rollouts.gateway.harness import SHIM_PYTHON

__all__ = ["HARNESS_IMAGE", "PYTHON", "MiniSweAgentEnvironment"]

MSWEA_VERSION = "2.4.6"
RUNTIME_REVISION = "rt2"
"""The revision of the harness image's build (``REVISION`` in build_image.sh)."""
HARNESS_IMAGE = f"dr-harness/mini-swe-agent:{MSWEA_VERSION}-{RUNTIME_REVISION}"
"""The image /opt/harness is copied from (``environments/harness/build_image.sh``)."""
PYTHON = "/opt/harness/bin/python3"
"""The harness's own interpreter (a launcher: the bundled CPython through the bundled loader, ``-I``)."""
STATE = "/tmp/.dr-harness"
TRAJECTORY = f"{STATE}/trajectory.json"
"""mini-swe-agent's own trajectory file, kept with the rollout (`RunStore.harness_files`)."""
STEP_TIMEOUT_S = 60
"""mini-swe-agent's limit of one command (its local environment's ``timeout``)."""
CLIENT_TIMEOUT_S = 900
"""The harness's HTTP timeout of one model call (litellm ``timeout``): longer than a call may wait on a
worker's death, its activity's retry and the engine (see the docs: "what survives which fault")."""


class MiniSweAgentEnvironment(HarborHarness):
    """Harbor tasks solved by mini-swe-agent through the rollout's gateway (see the module docstring)."""

    name: ClassVar[str] = "mini-swe-agent"
    env_version: ClassVar[str] = f"mini-swe-agent-{MSWEA_VERSION}-harbor-v2"
    runtime_image: ClassVar[str] = HARNESS_IMAGE
    runtime_path: ClassVar[str] = "/opt/harness"
    image_prefix: ClassVar[str] = "dr-harness-env"

    def harness_command(self, task: Task) -> HarnessCommand:
        t = as_harbor(task)
        overrides = [
            "agent.step_limit=0",
            "agent.cost_limit=0",
            f"environment.timeout={STEP_TIMEOUT_S}",
            f"model.model_kwargs.timeout={CLIENT_TIMEOUT_S}",
        ]
        config = " ".join(f"-c {shlex.quote(o)}" for o in ["mini.yaml", *overrides])
        command = (
            f"{PYTHON} -m minisweagent.run.mini --yolo --exit-immediately"
            ' --model "openai/$DR_MODEL" --task "$DR_TASK" --environment-class local'
            f" --output {TRAJECTORY} {config}"
        )
        env = {
            SHIM_PYTHON: PYTHON,
            "DR_TASK": task_text(t),
            "MSWEA_CONFIGURED": "true",
            "MSWEA_COST_TRACKING": "ignore_errors",
            "MSWEA_SILENT_STARTUP": "1",
            "MSWEA_GLOBAL_CONFIG_DIR": f"{STATE}/mswea",
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            "PAGER": "cat",
        }
        return HarnessCommand(command=command, env=env, tcp_port=8011, keep=(TRAJECTORY,))
