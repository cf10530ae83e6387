"""``task.toml`` of a Harbor task directory, read with Harbor's own field names, defaults and units.

Mirrors ``harbor.models.task.config.TaskConfig`` of PyPI ``harbor`` 0.25 (sections ``[task]``, ``[metadata]``,
``[verifier]``, ``[agent]``, ``[environment]``, ``[solution]``, ``steps``, ``artifacts``; the legacy
``version``, ``memory``/``storage`` size strings and ``allow_internet`` are migrated as Harbor migrates them),
with two differences, both at submit and both one line naming the task directory and the field:

- An unknown field is an error (Harbor ignores it): a misspelt ``timeout_secs`` would otherwise silently
  fall back to a default.
- A field this pipeline cannot honour is refused, never ignored (`unsupported`): multi-step tasks,
  compose sidecar hooks and services, GPUs/TPUs, MCP servers, skills, artifacts without a separate
  verifier (Harbor only collects them to the host then), Windows, ``${VAR}`` templates (Harbor fills them
  from the host's environment). A network mode other than ``no-network`` is checked against the run's
  egress policy (``harbor_env.network``). Empty lists and tables and zero counts (``artifacts = []``,
  ``gpus = 0``, an empty ``[environment.env]``) ask for nothing and are accepted, as Harbor accepts them.

A separate verifier (``[verifier].environment_mode = "separate"`` or a ``[verifier.environment]``) is
honoured (`verifier_mode`, `verifier_environment`: Harbor's resolution; ``harbor_env.separate`` runs it),
its environment checked like the task's. Users (``[agent].user``, ``[verifier].user``) are honoured: a
uid or a name the task's image knows, root
included where the sandbox host's daemon remaps users (``sandboxes.users``). Health checks
(``[environment.healthcheck]``) run before the agent's first turn, with Harbor's retry rule.

``tests/test_harbor_crosscheck.py`` parses every example task with Harbor's own model (in a Python 3.12
venv) and compares it with this one.
"""

from __future__ import annotations

import math
import re
import tomllib
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from durable_rollouts.sandboxes.base import USER_PATTERN

NetworkMode = Literal["no-network", "public", "allowlist"]
ORG_NAME_PATTERN = r"^[a-zA-Z0-9][a-zA-Z0-9._-]*/[a-zA-Z0-9][a-zA-Z0-9._-]*$"
"""Harbor's ``org/name`` rule for ``[task].name`` (``harbor.constants``)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Author(_Strict):
    name: str
    email: str | None = None


class PackageInfo(_Strict):
    name: str
    version: str | None = Field(default=None, min_length=1)
    description: str = ""
    authors: list[Author] = Field(default_factory=list)
    keywords: list[str] = Field(default_factory=list)

    @field_validator("name")
    @classmethod
    def _org_name(cls, v: str) -> str:
        if not re.match(ORG_NAME_PATTERN, v) or ".." in v:
            raise ValueError(f"package name must be in 'org/name' format, got {v!r}")
        return v


class HealthcheckConfig(_Strict):
    """Harbor's ``[environment.healthcheck]`` (Docker HEALTHCHECK semantics)."""

    command: str
    interval_sec: float = 5.0
    timeout_sec: float = 30.0
    start_period_sec: float = 0.0
    start_interval_sec: float = 5.0
    retries: int = 3


class _Phase(_Strict):
    network_mode: NetworkMode | None = None
    allowed_hosts: list[str] | None = None


class AgentConfig(_Phase):
    timeout_sec: float | None = None
    user: str | int | None = None


class VerifierConfig(_Phase):
    timeout_sec: float = 600.0
    env: dict[str, str] = Field(default_factory=dict)
    user: str | int | None = None
    environment_mode: Literal["shared", "separate"] | None = None
    environment: EnvironmentConfig | None = None
    """The separate verifier's own environment (the ``[environment]`` schema); implies ``separate``."""
    collect: list[dict[str, Any]] = Field(default_factory=list)

    @model_validator(mode="after")
    def _mode_env_consistency(self) -> VerifierConfig:
        if self.environment_mode == "shared" and self.environment is not None:
            raise ValueError(
                "[verifier].environment_mode='shared' is incompatible with [verifier.environment]; either "
                "omit the environment or set environment_mode='separate'."
            )
        return self


class ArtifactConfig(_Strict):
    """One ``artifacts`` entry (Harbor's ``ArtifactConfig``): a path of the agent's container handed over."""

    source: str
    destination: str | None = None
    exclude: list[str] = Field(default_factory=list)
    service: str | None = None

    @field_validator("source")
    @classmethod
    def _no_dotdot(cls, v: str) -> str:
        if not v.strip() or ".." in v.split("/"):
            raise ValueError(f"artifact source must be a path without '..' components, got {v!r}")
        return v


class EnvironmentConfig(_Strict):
    build_timeout_sec: float = 600.0
    docker_image: str | None = None
    os: Literal["linux", "windows"] = "linux"
    cpus: int | float | None = None
    memory_mb: int | None = None
    storage_mb: int | None = None
    gpus: int | None = None
    gpu_types: list[str] | None = None
    tpu: dict[str, Any] | None = None
    mcp_servers: list[dict[str, Any]] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    skills_dir: str | None = None
    healthcheck: HealthcheckConfig | None = None
    workdir: str | None = None
    network_mode: NetworkMode = "public"
    allowed_hosts: list[str] | None = None
    allow_internet: bool | None = Field(default=None, exclude=True)

    @field_validator("os", mode="before")
    @classmethod
    def _lower_os(cls, v: Any) -> Any:
        return v.lower() if isinstance(v, str) else v

    @field_validator("cpus")
    @classmethod
    def _cpus(cls, v: int | float | None) -> int | float | None:
        if isinstance(v, float):
            if not math.isfinite(v):
                raise ValueError(f"cpus must be a finite number; got {v}")
            if v.is_integer():
                return int(v)
        return v

    @model_validator(mode="before")
    @classmethod
    def _legacy_sizes(cls, data: Any) -> Any:
        """Harbor's migration of the deprecated ``memory`` / ``storage`` size strings ('2G', '512M')."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for old, new in (("memory", "memory_mb"), ("storage", "storage_mb")):
            if old in data:
                value = data.pop(old)
                if isinstance(value, str):
                    mb = parse_size_mb(value)
                    if new in data and data[new] != mb:
                        raise ValueError(
                            f"conflicting {old!r} and {new!r} values: {value!r} != {data[new]!r}"
                        )
                    data.setdefault(new, mb)
        if (
            data.get("allow_internet") is not None
            and "network_mode" not in data
            and not data.get("allowed_hosts")
        ):
            data["network_mode"] = "public" if data["allow_internet"] else "no-network"
        return data


class SolutionConfig(_Strict):
    env: dict[str, str] = Field(default_factory=dict)


class TaskConfig(_Strict):
    """One ``task.toml``; field names, defaults and units as Harbor 0.25's ``TaskConfig``."""

    schema_version: str = "1.4"
    task: PackageInfo | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    verifier: VerifierConfig = Field(default_factory=VerifierConfig)
    agent: AgentConfig = Field(default_factory=AgentConfig)
    environment: EnvironmentConfig = Field(default_factory=EnvironmentConfig)
    solution: SolutionConfig = Field(default_factory=SolutionConfig)
    source: str | None = None
    multi_step_reward_strategy: Literal["mean", "final"] | None = None
    steps: list[dict[str, Any]] | None = None
    artifacts: list[str | ArtifactConfig] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _version_rename(cls, data: Any) -> Any:
        if isinstance(data, dict) and "version" in data:
            data = dict(data)
            data.setdefault("schema_version", data.pop("version"))
        return data


def verifier_mode(cfg: TaskConfig) -> Literal["shared", "separate"]:
    """Harbor's ``resolve_task_verifier_mode``: the explicit mode, else ``separate`` when the verifier has
    its own environment, else ``shared``."""
    ver = cfg.verifier
    if ver.environment_mode is not None:
        return ver.environment_mode
    return "separate" if ver.environment is not None else "shared"


def verifier_environment(cfg: TaskConfig) -> EnvironmentConfig | None:
    """The separate verifier's environment (Harbor's ``resolve_effective_verifier_env_config``):
    ``[verifier.environment]``, else a copy of ``[environment]``; None when the verifier shares."""
    if verifier_mode(cfg) != "separate":
        return None
    return cfg.verifier.environment or cfg.environment.model_copy(deep=True)


def artifact_entries(cfg: TaskConfig) -> list[ArtifactConfig]:
    """``artifacts`` as entries, with Harbor's convention entry ``/logs/artifacts`` first unless listed."""
    entries = [ArtifactConfig(source=a) if isinstance(a, str) else a for a in cfg.artifacts]
    if not any(a.source.rstrip("/") == ARTIFACTS_DIR and a.service in (None, "main") for a in entries):
        entries.insert(0, ArtifactConfig(source=ARTIFACTS_DIR))
    return entries


ARTIFACTS_DIR = "/logs/artifacts"
"""Harbor's conventional folder the agent publishes artifacts in (always handed to a separate verifier)."""


def parse_size_mb(size: str) -> int:
    """Harbor's ``_parse_size_to_mb``: '2G' -> 2048, '512M' -> 512, '2048K' -> 2."""
    s = size.strip().upper()
    units = {"G": 1024.0, "M": 1.0, "K": 1 / 1024}
    if not s or s[-1] not in units:
        raise ValueError(f"invalid size format {size!r}: expected e.g. '1G' or '512M'")
    return int(float(s[:-1]) * units[s[-1]])


class ConfigProblem(ValueError):
    """A ``task.toml`` that does not parse or asks for what the pipeline cannot do; ``field`` names where."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"task.toml {field}: {message}")
        self.field = field


def parse(text: str) -> TaskConfig:
    """``task.toml`` text as a `TaskConfig`.

    Raises:
        ConfigProblem: not TOML, an unknown field, or a value of the wrong type (the first error).
    """
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigProblem("(file)", f"not valid TOML ({e})") from None
    try:
        return TaskConfig.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = [str(x) for x in err["loc"]]
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown field (not in Harbor 0.25's task.toml)"
        raise ConfigProblem(_field(loc), msg) from None


def _field(loc: list[str]) -> str:
    if not loc:
        return "(file)"
    if len(loc) == 1:
        return loc[0]
    return f"[{loc[0]}].{'.'.join(loc[1:])}"


def user_name(user: str | int | None) -> str | None:
    """``[agent].user`` / ``[verifier].user`` as a sandbox user (a uid as its digits); None when unset."""
    return None if user is None else str(user)


def bad_user(user: str | int | None) -> bool:
    """Whether a task's user is neither unset, a uid, nor a user name in Docker's ``--user`` forms."""
    if user is None:
        return False
    if isinstance(user, int):
        return user < 0
    return re.fullmatch(USER_PATTERN, user) is None


def _healthcheck_checks(hc: HealthcheckConfig | None, where: str) -> list[tuple[bool, str, str]]:
    if hc is None:
        return []
    field = f"[{where.strip('[]')}.healthcheck]"
    return [
        (not hc.command.strip(), f"{field}.command", "empty"),
        (not 0 < hc.timeout_sec <= 3600, f"{field}.timeout_sec", f"{hc.timeout_sec}: must be in (0, 3600]"),
        (hc.retries < 0, f"{field}.retries", "must not be negative"),
        (min(hc.interval_sec, hc.start_interval_sec, hc.start_period_sec) < 0, field,
         "intervals and the start period must not be negative"),
        (healthcheck_bound_s(hc) > 86400, field, "its retries and periods add up to more than a day"),
    ]  # fmt: skip


def healthcheck_bound_s(hc: HealthcheckConfig) -> float:
    """Longest a health check can take by Harbor's rule (the start period, then ``retries`` failures)."""
    return (
        hc.start_period_sec
        + hc.start_interval_sec
        + (max(hc.retries, 1) + 1) * (hc.timeout_sec + hc.interval_sec)
    )


def _env_checks(env: EnvironmentConfig, where: str) -> list[tuple[bool, str, str]]:
    """What of an ``[environment]`` (the task's, or a separate verifier's) cannot be honoured."""
    return [
        (env.os != "linux", f"{where}.os", f"{env.os!r}: only linux containers run here"),
        (bool(env.gpus), f"{where}.gpus", f"{env.gpus} GPU(s) asked for: sandboxes have no GPU"),
        (bool(env.gpu_types), f"{where}.gpu_types", "sandboxes have no GPU"),
        (env.tpu is not None, f"{where}.tpu", "sandboxes have no TPU"),
        (bool(env.mcp_servers), f"{where}.mcp_servers", "MCP servers are not supported"),
        (env.skills_dir is not None, f"{where}.skills_dir", "agent skills are not supported"),
        (any("${" in v for v in env.env.values()), f"{where}.env",
         "${VAR} templates are resolved from the host by Harbor; give literal values"),
        (env.build_timeout_sec <= 0, f"{where}.build_timeout_sec", "must be positive"),
        (env.cpus is not None and not 0 < env.cpus <= 64, f"{where}.cpus", f"{env.cpus}: must be in (0, 64]"),
        (env.memory_mb is not None and not 256 <= env.memory_mb <= 65536, f"{where}.memory_mb",
         f"{env.memory_mb}: must be in [256, 65536]"),
        (env.storage_mb is not None and env.storage_mb < 16, f"{where}.storage_mb",
         f"{env.storage_mb}: below 16"),
        (env.workdir is not None and not str(env.workdir).startswith("/"), f"{where}.workdir",
         f"{env.workdir!r}: must be an absolute path"),
        *_healthcheck_checks(env.healthcheck, where),
    ]  # fmt: skip


def _artifact_checks(cfg: TaskConfig) -> list[tuple[bool, str, str]]:
    entries = [ArtifactConfig(source=a) if isinstance(a, str) else a for a in cfg.artifacts]
    return [
        (a.service not in (None, "main"), f"artifacts[{i}].service",
         f"{a.service!r}: compose services are not supported (the agent's container only)")
        for i, a in enumerate(entries)
    ]  # fmt: skip


def unsupported(cfg: TaskConfig) -> tuple[str, str] | None:
    """The first field of ``cfg`` the pipeline cannot honour, as (field, why); None when it can run it
    (network modes aside: ``harbor_env.network`` checks them against the run's egress policy)."""
    env, agent, ver = cfg.environment, cfg.agent, cfg.verifier
    separate = verifier_mode(cfg) == "separate"
    checks: list[tuple[bool, str, str]] = [
        (bool(cfg.steps), "steps", "multi-step tasks are not supported (one instruction, one verifier)"),
        (cfg.multi_step_reward_strategy is not None, "multi_step_reward_strategy",
         "multi-step tasks are not supported"),
        (bool(cfg.artifacts) and not separate, "artifacts", "artifacts are handed over to a separate "
         'verifier only (environment_mode = "separate"); collecting them to the host is not supported'),
        *_artifact_checks(cfg),
        *_env_checks(env, "[environment]"),
        (bad_user(agent.user), "[agent].user", f"{agent.user!r}: a uid, or a user name (name or name:group)"),
        (bad_user(ver.user), "[verifier].user", f"{ver.user!r}: a uid, or a user name (name or name:group)"),
        *(_env_checks(ver.environment, "[verifier.environment]") if ver.environment is not None else []),
        (bool(ver.collect), "[verifier].collect", "collect hooks (compose services) are not supported"),
        (any("${" in v for v in ver.env.values()), "[verifier].env",
         "${VAR} templates are resolved from the host by Harbor; give literal values"),
        (ver.timeout_sec <= 0, "[verifier].timeout_sec", "must be positive"),
        (agent.timeout_sec is not None and agent.timeout_sec <= 0, "[agent].timeout_sec", "must be positive"),
    ]  # fmt: skip
    for bad, field, why in checks:
        if bad:
            return field, why
    return None
