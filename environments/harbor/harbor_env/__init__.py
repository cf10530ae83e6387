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
   tmpfs folders every user of the sandbox may write. ``[environment].env`` is every command's environment.
   The agent's commands run as ``[agent].user`` (unset: the sandbox's non-root user), the verifier as
   ``[verifier].user`` (unset: the agent's); root only on a daemon that remaps users (``sandboxes.users``).
   Same hardening as every sandbox otherwise: no capabilities, and no network unless the task's
   ``network_mode`` asks for it and the run's egress policy allows it (`harbor_env.network`: then the
   egress proxy to the allowed hosts only). ``[environment.healthcheck]``
   runs last in setup, before the agent's first turn, by Harbor's rule (failures within
   ``start_period_sec`` do not count; ``retries`` consecutive failures after it fail the rollout).
3. ``prompt``: the tool format, ``Task id: <name>``, the instruction (``instruction.md``), the working
   directory. Every turn is one tool call (``environments.tool_calls``: bash, write_file, read_file, submit),
   recorded with the turn before it runs. ``[agent].timeout_sec`` is the rollout's wall-clock limit from
   its sandbox's creation (``SandboxPlan.timeout_s``: truncated, reason ``timeout``; the run's
   ``rollout.timeout_s`` still applies when shorter), and caps each bash command's limit.
4. ``score``: Harbor's verifier in the same container (`harbor_env.verifier`): reward from
   ``/logs/verifier/reward.json`` or ``reward.txt``; no reward or a timeout is `EnvironmentFailure`. A
   separate verifier (``environment_mode = "separate"``) runs in a fresh sandbox of its own image with the
   agent's artifacts handed over (`harbor_env.separate`).

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
from harbor_env import network, verifier
from harbor_env.config import HealthcheckConfig, healthcheck_bound_s, user_name, verifier_mode
from harbor_env.tasks import HarborTask, load_dataset

__all__ = ["HarborEnvironment", "HarborTask", "healthcheck_script", "image_tag", "load_dataset"]

SYSTEM_PROMPT = (
    "You are an agent solving a task in a Linux container. Each turn, call exactly one tool by writing\n"
    '<tool_call>{"name": TOOL, "arguments": {...}}</tool_call>\n'
    "Tools: bash(cmd), write_file(path, content), read_file(path), submit(). Paths are relative to the "
    "working directory; there is no network. Call submit() when the task is done: tests then check it."
)
NETWORK_NOTE = "the network reaches only the hosts this run allows (through the proxy in $HTTP_PROXY)"
"""What the system prompt says of the network when the agent's phase has one (`harbor_env.network`)."""
SEED_DIR = "/.harbor-seed"
MOUNTS = {"/logs": 32, "/tests": 32, "/solution": 32}
"""Writable tmpfs folders every Harbor sandbox has besides its working directory and /tmp (MiB)."""
SHARED_DIRS = ("/logs/agent", "/logs/verifier")
"""Writable by every user of the sandbox (mode 777), with `MOUNTS`: the verifier may run as another user."""
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

    def load_tasks(self, path: Any, sandbox: SandboxSpec | None = None) -> list[Task]:
        """A Harbor dataset (`harbor_env.tasks.load_dataset`); with the run's ``[sandbox]``, each task's
        network mode is checked against its egress policy here (else when its sandbox is planned)."""
        return list(load_dataset(path, egress=sandbox.egress if sandbox is not None else None))

    def prompt(self, task: Task) -> Prompt:
        t = _harbor(task)
        user = f"Task id: {t.id}\n\n{t.instruction.strip()}\n\nYour working directory is {t.workdir}."
        system = SYSTEM_PROMPT
        if network.phases(t.cfg)[0][1] != "no-network":  # the agent's phase has the run's allowed hosts
            system = system.replace("there is no network", NETWORK_NOTE)
        return Prompt(messages=[{"role": "system", "content": system}, {"role": "user", "content": user}])

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
                "env": {**default.env, **env.env}, **users(t, default),
                "egress": network.planned(t.cfg, default.egress, f"task {t.id} ({t.source}/task.toml)"),
            }
        )  # fmt: skip
        SandboxSpec.model_validate(spec.model_dump())  # the copy skipped validation
        setup = [
            f"if [ -d {SEED_DIR} ]; then cp -r {SEED_DIR}/. ./; fi",
            "mkdir -p /logs/agent /logs/verifier && chmod 777 " + " ".join([*MOUNTS, *SHARED_DIRS]),
        ]
        setup_timeout = 600.0
        if env.healthcheck is not None:
            setup.append(healthcheck_script(env.healthcheck))
            setup_timeout = max(setup_timeout, healthcheck_bound_s(env.healthcheck) + 30)
        return SandboxPlan(
            spec=spec,
            image_build=image_build(t, spec.image),
            setup=setup,
            setup_timeout_s=setup_timeout,
            timeout_s=t.cfg.agent.timeout_sec,
        )

    async def score(self, ctx: TurnContext, text: str | None) -> Score:
        t = _harbor(ctx.task)
        if verifier_mode(t.cfg) == "separate":
            from harbor_env import separate

            return await separate.verify(ctx, t, self.sandbox_of(ctx))
        tests = t.tree("tests")
        executables = {p.removeprefix("tests/") for p in t.executables if p.startswith("tests/")}
        ver = t.cfg.verifier
        return await verifier.verify(
            self.sandbox_of(ctx), t.id, tests, executables, ver.timeout_sec, ver.env,
            once=f"score-{ctx.turn}", user=verifier_user(t),
        )  # fmt: skip


def users(t: HarborTask, default: SandboxSpec) -> dict[str, Any]:
    """The spec fields naming the task's users: ``[agent].user`` as the sandbox's user, ``[verifier].user``
    (when another) as an exec user, each with the task file and field that named it; root allowed when
    the task names a user (the sandbox host still refuses it unless its daemon remaps users)."""
    agent, ver = user_name(t.cfg.agent.user), verifier_user(t)
    where = f"task {t.id} ({t.source}/task.toml)"
    out: dict[str, Any] = {}
    if agent is not None:
        out.update(user=agent, user_source=f"{where} [agent].user = {agent!r}")
    if ver is not None and ver != (agent or default.user):
        out["exec_users"] = {ver: f"{where} [verifier].user = {ver!r}"}
    if agent is not None or ver is not None:
        out["allow_root"] = True
    return out


def verifier_user(t: HarborTask) -> str | None:
    """Who the verifier runs as: ``[verifier].user``; None (unset): the sandbox's user, the agent's."""
    return user_name(t.cfg.verifier.user)


def healthcheck_script(hc: HealthcheckConfig) -> str:
    """Harbor's ``run_healthcheck`` as one shell command: run ``command`` (each run under ``timeout_sec``)
    until it succeeds; a failure that starts within ``start_period_sec`` waits ``start_interval_sec`` and
    does not count; after it, ``retries`` consecutive failures (``interval_sec`` apart) fail the check."""
    import shlex

    start_ms = int(hc.start_period_sec * 1000)
    return (
        "hc0=$(date +%s%N); n=0; while :; do "
        "early=$(( ($(date +%s%N) - hc0) / 1000000 < " + str(start_ms) + " )); "
        f"if timeout -k 1 {hc.timeout_sec:g} bash -c {shlex.quote(hc.command)} </dev/null "
        ">/tmp/.harbor-healthcheck.log 2>&1; then exit 0; fi; "
        f'if [ "$early" = 1 ]; then sleep {hc.start_interval_sec:g}; continue; fi; '
        f"n=$((n + 1)); if [ $n -ge {hc.retries} ]; then "
        f"echo {shlex.quote(f'health check failed after {hc.retries} consecutive retries: {hc.command}')}; "
        "tail -c 300 /tmp/.harbor-healthcheck.log; exit 1; fi; "
        f"sleep {hc.interval_sec:g}; done"
    )


def image_build(t: HarborTask, tag: str, workdir: str | None = None) -> ImageBuild:
    """The task's image: ``environment/`` as the context (or ``FROM docker_image``), plus the seed layer
    (of ``workdir``: default the task's working directory)."""
    env = t.cfg.environment
    seed = seed_layer(workdir or t.workdir)
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


def seed_layer(workdir: str) -> str:
    """The Dockerfile lines the pipeline adds to a task's image: the working directory's content copied to
    ``SEED_DIR`` (setup copies it into the sandbox's writable working directory)."""
    return (
        "\nUSER root\n"
        f"RUN rm -rf {SEED_DIR} && mkdir -p {SEED_DIR} && "
        f"if [ -d '{workdir}' ]; then cp -a '{workdir}/.' {SEED_DIR}/; fi && chmod -R a+rX {SEED_DIR}\n"
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
