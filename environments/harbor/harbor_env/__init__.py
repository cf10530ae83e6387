"""Harbor task directories (Terminal-Bench 2.0, Harbor's SWE adapters) as a durable-rollouts environment.

A plug-in in its own distribution (``durable-rollouts-harbor``), registered under the entry-point group
``environments`` as ``harbor``; it uses only the core's public API.

How one rollout goes (``run.env = "harbor"``, ``run.task_file`` a Harbor dataset: `harbor_env.tasks`):

1. Submit: every task directory is read into the run store (``task.toml`` parsed with Harbor's field names
   and units, refusing what cannot be honoured; instruction, ``environment/``, ``tests/``, ``solution/``).
2. ``sandbox``: the task's image is built by the sandbox host's own daemon from ``environment/Dockerfile``
   (or ``FROM [environment].docker_image``), once per content hash and host (``sandboxes.images``), with one
   layer added: a copy of the working directory's content (``/.harbor-seed``), which setup copies into
   the sandbox's writable working directory (``[environment].workdir``, else the Dockerfile's last
   ``WORKDIR``, else ``/app``). Limits: ``cpus``, ``memory_mb``; ``storage_mb`` caps the working directory
   (a tmpfs: it also stays below the memory limit). ``/logs``, ``/tests`` and ``/solution`` are small
   writable tmpfs folders. Same hardening as every sandbox: no network, no capabilities, non-root.
3. ``prompt``: the tool format, ``Task id: <name>``, the instruction (``instruction.md``), the working
   directory. Every turn is one tool call (``environments.tool_calls``: bash, write_file, read_file, submit),
   recorded with the turn before it runs. ``[agent].timeout_sec`` is the rollout's wall-clock limit from
   its sandbox's creation (``SandboxPlan.timeout_s``: truncated, reason ``timeout``; the run's
   ``rollout.timeout_s`` still applies when shorter), and caps each bash command's limit.
4. ``score``: Harbor's verifier in the same container (`harbor_env.verifier`): reward from
   ``/logs/verifier/reward.json`` or ``reward.txt``; no reward or a timeout is `EnvironmentFailure`.

Invariants: model-generated code runs only in the sandbox; ``parse`` is pure; ``act``/``score``/
``replay`` are safe to repeat. A turn's bash command runs once in its container even when the worker
running the step dies mid-command: the retried step gets the first run's output (``once_key``
``turn-N``); the verifier, likewise, runs once per container (``score-N.*``): a retried score waits for
the first run's reward instead of copying the tests again and rerunning it. A recovered (fresh) sandbox
replays every recorded action without keys.
"""

from __future__ import annotations

from typing import Any, ClassVar, cast

from durable_rollouts.environments.base import Prompt, SandboxPlan, Score, Task, TurnContext
from durable_rollouts.environments.tool_env import ToolCallEnvironment
from durable_rollouts.errors import EnvironmentFailure, TaskFileError
from durable_rollouts.sandboxes.base import ImageBuild, SandboxSpec
from harbor_env import verifier
from harbor_env.tasks import HarborTask, load_dataset

__all__ = ["HarborEnvironment", "HarborTask", "image_tag", "load_dataset"]

SYSTEM_PROMPT = (
    "You are an agent solving a task in a Linux container. Each turn, call exactly one tool by writing\n"
    '<tool_call>{"name": TOOL, "arguments": {...}}</tool_call>\n'
    "Tools: bash(cmd), write_file(path, content), read_file(path), submit(). Paths are relative to the "
    "working directory; there is no network. Call submit() when the task is done: tests then check it."
)
SEED_DIR = "/.harbor-seed"
MOUNTS = {"/logs": 32, "/tests": 32, "/solution": 32}
"""Writable tmpfs folders every Harbor sandbox has besides its working directory and /tmp (MiB)."""
HEADROOM_MB = 64
"""Memory kept free of tmpfs contents for the processes themselves."""


def image_tag(task: HarborTask) -> str:
    """The local tag of the task's image: its content hash (tasks with equal environments share it)."""
    return f"dr-harbor-env:{task.content_hash[:32]}"


class HarborEnvironment(ToolCallEnvironment):
    """Harbor task directories (see the module docstring)."""

    name: ClassVar[str] = "harbor"
    env_version: ClassVar[str] = "harbor-v1"
    verifier_version: ClassVar[str] = "harbor-verifier-v1"
    task_model: ClassVar[type[Task]] = HarborTask

    def load_tasks(self, path: Any) -> list[Task]:
        """A Harbor dataset (`harbor_env.tasks.load_dataset`)."""
        return list(load_dataset(path))

    def prompt(self, task: Task) -> Prompt:
        t = _harbor(task)
        user = f"Task id: {t.id}\n\n{t.instruction.strip()}\n\nYour working directory is {t.workdir}."
        return Prompt(
            messages=[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]
        )

    def sandbox(self, task: Task, default: SandboxSpec) -> SandboxPlan:
        t = _harbor(task)
        env = t.cfg.environment
        memory = env.memory_mb or default.memory_mb
        room = memory - default.tmp_size_mb - sum(MOUNTS.values()) - HEADROOM_MB
        workdir_mb = min(env.storage_mb or default.workdir_size_mb, room)
        if workdir_mb < 16:
            raise EnvironmentFailure(
                f"task {t.id}: memory_mb {memory} leaves no room for the working directory"
            )
        timeout = default.command_timeout_s
        if t.cfg.agent.timeout_sec is not None:
            timeout = min(timeout, t.cfg.agent.timeout_sec)
        spec = default.model_copy(
            update={
                "image": image_tag(t), "workdir": t.workdir, "memory_mb": memory,
                "cpus": float(env.cpus) if env.cpus is not None else default.cpus,
                "workdir_size_mb": workdir_mb, "mounts": dict(MOUNTS), "command_timeout_s": timeout,
            }
        )  # fmt: skip
        SandboxSpec.model_validate(spec.model_dump())  # the copy skipped validation
        return SandboxPlan(
            spec=spec,
            image_build=image_build(t, spec.image),
            setup=[
                f"if [ -d {SEED_DIR} ]; then cp -r {SEED_DIR}/. ./; fi",
                "mkdir -p /logs/agent /logs/verifier",
            ],
            setup_timeout_s=600,
            timeout_s=t.cfg.agent.timeout_sec,
        )

    async def score(self, ctx: TurnContext, text: str | None) -> Score:
        t = _harbor(ctx.task)
        tests = t.tree("tests")
        executables = {p.removeprefix("tests/") for p in t.executables if p.startswith("tests/")}
        ver = t.cfg.verifier
        return await verifier.verify(
            self.sandbox_of(ctx), t.id, tests, executables, ver.timeout_sec, ver.env, once=f"score-{ctx.turn}"
        )


def image_build(t: HarborTask, tag: str) -> ImageBuild:
    """The task's image: ``environment/`` as the context (or ``FROM docker_image``), plus the seed layer."""
    env = t.cfg.environment
    seed = (
        "\nUSER root\n"
        f"RUN rm -rf {SEED_DIR} && mkdir -p {SEED_DIR} && "
        f"if [ -d '{t.workdir}' ]; then cp -a '{t.workdir}/.' {SEED_DIR}/; fi && chmod -R a+rX {SEED_DIR}\n"
    )
    if env.docker_image is not None:
        context = {"Dockerfile": _b64(f"FROM {env.docker_image}\n{seed}")}
        executables: list[str] = []
    else:
        context = {
            p.removeprefix("environment/"): b for p, b in t.files.items() if p.startswith("environment/")
        }
        dockerfile = t.tree("environment")["Dockerfile"].decode("utf-8", errors="replace")
        context["Dockerfile"] = _b64(dockerfile + seed)
        executables = [p.removeprefix("environment/") for p in t.executables if p.startswith("environment/")]
    return ImageBuild(
        tag=tag,
        context=context,
        executables=executables,
        timeout_s=env.build_timeout_sec,
        what=f"task {t.id}",
    )


def _b64(text: str) -> str:
    import base64

    return base64.b64encode(text.encode()).decode()


def _harbor(task: Task | dict[str, Any]) -> HarborTask:
    if isinstance(task, HarborTask):
        return task
    obj = task if isinstance(task, dict) else task.model_dump(mode="json")
    try:
        return cast(HarborTask, HarborEnvironment().validate_task(obj, where=f"task {obj.get('id')!r}"))
    except TaskFileError as e:
        raise EnvironmentFailure(str(e)) from None
