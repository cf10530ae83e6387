"""A harness over Harbor task directories: what every agent program run on Harbor tasks through the
rollout's gateway shares (the mini-swe-agent and Codex plug-ins subclass it).

- Tasks: Harbor task directories, read at submit as the harbor plug-in reads them.
- Sandbox: the harbor plug-in's plan (its task image, limits, seed, /logs /tests /solution), with one layer
  more, the harness's runtime (``runtime_path``) copied from ``runtime_image``, and the rollout's gateway
  folder mounted (no network). The layered image is tagged ``<image_prefix>:<hash of both images>``.
- Score: Harbor's verifier in the same container once the harness exits 0.
"""

from __future__ import annotations

import base64
import hashlib
from typing import Any, ClassVar

from durable_rollouts.environments.base import SandboxPlan, Score, Task, TurnContext
from durable_rollouts.environments.harness_trait import HarnessEnvironment
from durable_rollouts.sandboxes.base import SandboxSpec
from harbor_env import HarborEnvironment, HarborTask

_HARBOR = HarborEnvironment()


def task_text(task: HarborTask) -> str:
    """The harness's task: its id first, the instruction, the working directory."""
    return f"Task id: {task.id}\n\n{task.instruction.strip()}\n\nYour working directory is {task.workdir}."


def as_harbor(task: Task) -> HarborTask:
    """``task`` as the Harbor task it was stored as."""
    if isinstance(task, HarborTask):
        return task
    return HarborTask.model_validate(task.model_dump(mode="json"))


class HarborHarness(HarnessEnvironment):
    """Base of the harness environments on Harbor tasks (see the module docstring); a subclass names its
    runtime (``runtime_image``, ``runtime_path``, ``image_prefix``) and its ``harness_command``."""

    verifier_version: ClassVar[str] = HarborEnvironment.verifier_version
    task_model: ClassVar[type[Task]] = HarborTask
    runtime_image: ClassVar[str]
    """The image the harness's runtime is copied from (built offline by the plug-in's build_image.sh)."""
    runtime_path: ClassVar[str]
    """Where the runtime lives, in that image and in the task's."""
    image_prefix: ClassVar[str]
    """The repository of the layered task images (e.g. ``dr-harness-env``)."""

    def load_tasks(self, path: Any, sandbox: SandboxSpec | None = None) -> list[Task]:
        """As Harbor's (`HarborEnvironment.load_tasks`): network modes checked against the run's egress."""
        return _HARBOR.load_tasks(path, sandbox)

    def sandbox(self, task: Task, default: SandboxSpec) -> SandboxPlan:
        plan = _HARBOR.sandbox(task, default)
        assert plan.image_build is not None
        build = plan.image_build
        digest = hashlib.sha256(f"{build.tag}\0{self.runtime_image}".encode()).hexdigest()[:32]
        tag = f"{self.image_prefix}:{digest}"
        dockerfile = base64.b64decode(build.context["Dockerfile"]).decode()
        dockerfile += f"COPY --from={self.runtime_image} {self.runtime_path} {self.runtime_path}\n"
        context = {**build.context, "Dockerfile": base64.b64encode(dockerfile.encode()).decode()}
        image = build.model_copy(update={"tag": tag, "context": context})
        spec = plan.spec.model_copy(update={"image": tag, "gateway": True})
        return plan.model_copy(update={"spec": spec, "image_build": image})

    async def score(self, ctx: TurnContext, text: str | None) -> Score:
        return await _HARBOR.score(ctx, text)
