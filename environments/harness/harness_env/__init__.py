"""mini-swe-agent, unchanged, as the agent of Harbor task directories (``run.env = "mini-swe-agent"``).

A plug-in in its own distribution (``durable-rollouts-harness``) using the core's harness trait
(``environments.harness_trait``) and the harbor plug-in's tasks, image builds and verifier:

- Tasks: Harbor task directories, read at submit as the harbor plug-in reads them.
- Sandbox: the harbor plug-in's plan (its task image, limits, seed, /logs /tests /solution), with one
  layer more, ``/opt/harness`` copied from ``HARNESS_IMAGE`` (mini-swe-agent and its dependencies, built
  offline by ``build_image.sh``), and the rollout's gateway folder mounted (no network).
- Harness: ``python3 -m minisweagent.run.mini`` in yolo mode with the task's instruction (``Task id:
  <name>`` first), its local environment (commands run in the sandbox's working directory as the
  sandbox's user), the model ``openai/<rollout model>`` at the gateway's loopback URL.
- Score: Harbor's verifier in the same container once the harness exits 0.
"""

from __future__ import annotations

import base64
import hashlib
import shlex
from typing import Any, ClassVar

from harbor_env import HarborEnvironment, HarborTask, load_dataset

from durable_rollouts.environments.base import SandboxPlan, Score, Task, TurnContext
from durable_rollouts.environments.harness_trait import HarnessCommand, HarnessEnvironment
from durable_rollouts.sandboxes.base import SandboxSpec

__all__ = ["HARNESS_IMAGE", "MiniSweAgentEnvironment"]

MSWEA_VERSION = "2.4.6"
HARNESS_IMAGE = f"dr-harness/mini-swe-agent:{MSWEA_VERSION}"
"""The image /opt/harness is copied from (``environments/harness/build_image.sh``)."""
STATE = "/tmp/.dr-harness"
TRAJECTORY = f"{STATE}/trajectory.json"
"""mini-swe-agent's own trajectory file, kept with the rollout (`RunStore.harness_files`)."""
STEP_TIMEOUT_S = 60
"""mini-swe-agent's limit of one command (its local environment's ``timeout``)."""
CLIENT_TIMEOUT_S = 900
"""The harness's HTTP timeout of one model call (litellm ``timeout``): longer than a call may wait on a
worker's death, its activity's retry and the engine (see the docs: "what survives which fault")."""

_HARBOR = HarborEnvironment()


def task_text(task: HarborTask) -> str:
    return f"Task id: {task.id}\n\n{task.instruction.strip()}\n\nYour working directory is {task.workdir}."


class MiniSweAgentEnvironment(HarnessEnvironment):
    """Harbor tasks solved by mini-swe-agent through the rollout's gateway (see the module docstring)."""

    name: ClassVar[str] = "mini-swe-agent"
    env_version: ClassVar[str] = f"mini-swe-agent-{MSWEA_VERSION}-harbor-v1"
    verifier_version: ClassVar[str] = HarborEnvironment.verifier_version
    task_model: ClassVar[type[Task]] = HarborTask

    def load_tasks(self, path: Any) -> list[Task]:
        return list(load_dataset(path))

    def sandbox(self, task: Task, default: SandboxSpec) -> SandboxPlan:
        plan = _HARBOR.sandbox(task, default)
        assert plan.image_build is not None
        build = plan.image_build
        tag = "dr-harness-env:" + hashlib.sha256(f"{build.tag}\0{HARNESS_IMAGE}".encode()).hexdigest()[:32]
        dockerfile = base64.b64decode(build.context["Dockerfile"]).decode()
        dockerfile += f"COPY --from={HARNESS_IMAGE} /opt/harness /opt/harness\n"
        context = {**build.context, "Dockerfile": base64.b64encode(dockerfile.encode()).decode()}
        image = build.model_copy(update={"tag": tag, "context": context})
        spec = plan.spec.model_copy(update={"image": tag, "gateway": True})
        return plan.model_copy(update={"spec": spec, "image_build": image})

    def harness_command(self, task: Task) -> HarnessCommand:
        t = _harbor(task)
        overrides = [
            "agent.step_limit=0",
            "agent.cost_limit=0",
            f"environment.timeout={STEP_TIMEOUT_S}",
            f"model.model_kwargs.timeout={CLIENT_TIMEOUT_S}",
        ]
        config = " ".join(f"-c {shlex.quote(o)}" for o in ["mini.yaml", *overrides])
        command = (
            "python3 -m minisweagent.run.mini --yolo --exit-immediately"
            ' --model "openai/$DR_MODEL" --task "$DR_TASK" --environment-class local'
            f" --output {TRAJECTORY} {config}"
        )
        env = {
            "PYTHONPATH": "/opt/harness",
            "DR_TASK": task_text(t),
            "MSWEA_CONFIGURED": "true",
            "MSWEA_COST_TRACKING": "ignore_errors",
            "MSWEA_SILENT_STARTUP": "1",
            "MSWEA_GLOBAL_CONFIG_DIR": f"{STATE}/mswea",
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            "PAGER": "cat",
        }
        return HarnessCommand(command=command, env=env, tcp_port=8011, keep=(TRAJECTORY,))

    async def score(self, ctx: TurnContext, text: str | None) -> Score:
        return await _HARBOR.score(ctx, text)


def _harbor(task: Task) -> HarborTask:
    if isinstance(task, HarborTask):
        return task
    return HarborTask.model_validate(task.model_dump(mode="json"))
