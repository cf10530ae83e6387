"""A Harbor task's ``network_mode`` as a policy the run's operator bounds (``[sandbox.egress]``).

- ``no-network``: the sandbox has no network.
- ``public``: the hosts the operator allows (``sandbox.egress.allow``), through the egress proxy.
- ``allowlist``: the task's ``allowed_hosts`` bounded by the operator's list (what both allow).

Each phase has Harbor's policy: ``[agent]`` / ``[verifier]`` ``network_mode`` when set, else its
environment's (``[environment]``, or a separate verifier's ``[verifier.environment]``; Harbor's default:
``public``). The verifier shares the agent's container, or (separate) gets a sandbox derived from the
agent's spec, so both phases must come to the same hosts; a task whose phases differ is refused. A
dataset file with ``network_policy = "no-network"`` runs its tasks without network whatever they ask.

Invariant: a task that asks for network on a run whose policy cannot give it (none allowed, or none of
its own hosts) is refused in one line naming the field and the config key the operator would set, at
submit when the run's policy is known there, else when its sandbox is planned; never run with less.
"""

from __future__ import annotations

from durable_rollouts.errors import EnvironmentFailure
from durable_rollouts.sandboxes.egress_policy import EgressPolicy
from harbor_env.config import TaskConfig

KEY = "sandbox.egress.allow"
"""The run config key that lets sandboxes reach hosts."""


class NetworkRefused(ValueError):
    """The run's egress policy cannot give the task the network it asks for; ``field`` names where."""

    def __init__(self, field: str, why: str) -> None:
        super().__init__(f"{field}: {why}")
        self.field, self.why = field, why


def phases(cfg: TaskConfig) -> list[tuple[str, str, list[str]]]:
    """(field, mode, allowed hosts) deciding the agent's and the verifier's network, in that order."""
    out: list[tuple[str, str, list[str]]] = []
    for name, phase in (("agent", cfg.agent), ("verifier", cfg.verifier)):
        own = cfg.verifier.environment if name == "verifier" else None
        env = own if own is not None else cfg.environment
        where = "[verifier.environment]" if own is not None else "[environment]"
        if phase.network_mode is not None:
            out.append((f"[{name}].network_mode", phase.network_mode, list(phase.allowed_hosts or [])))
        else:
            out.append((f"{where}.network_mode", env.network_mode, list(env.allowed_hosts or [])))
    return out


def egress_for(cfg: TaskConfig, egress: EgressPolicy, network_policy: str | None = None) -> EgressPolicy:
    """The sandbox's egress policy for the task under the operator's ``egress``.

    Raises:
        NetworkRefused: a phase asks for network the operator's policy cannot give, or the phases differ.
    """
    none = egress.model_copy(update={"allow": [], "map": {}})
    if network_policy == "no-network":
        return none
    found: list[EgressPolicy] = []
    for field, mode, hosts in phases(cfg):
        found.append(none if mode == "no-network" else _phase(field, mode, hosts, egress))
    (agent_field, agent_mode, _), (ver_field, ver_mode, _) = phases(cfg)
    if found[0].allow != found[1].allow:
        raise NetworkRefused(
            ver_field,
            f"{ver_mode!r} gives the verifier other hosts than {agent_field} {agent_mode!r} gives the agent; "
            "the verifier shares the agent's container, so both phases need the same network",
        )
    return found[0]


def _phase(field: str, mode: str, hosts: list[str], egress: EgressPolicy) -> EgressPolicy:
    baseline = field.endswith("environment].network_mode")
    default = " (Harbor's default)" if baseline and mode == "public" else ""
    if not egress.enabled:
        raise NetworkRefused(
            field,
            f"{mode!r}{default}: the run allows no egress; the operator lists the hosts sandboxes may "
            f'reach in {KEY} (the run config\'s [sandbox.egress]), or set network_mode = "no-network" in '
            'the task, or list the tasks in a dataset file with network_policy = "no-network" to run them '
            "without network",
        )
    if mode == "public":
        return egress
    narrowed = egress.narrowed(hosts)
    if not narrowed.allow:
        where = field.replace("network_mode", "allowed_hosts")
        raise NetworkRefused(where, f"{hosts}: none of them is allowed by the run's {KEY} {egress.allow}")
    return narrowed


def offline(cfg: TaskConfig) -> TaskConfig:
    """``cfg`` with every phase set to ``no-network`` (a dataset's ``network_policy = "no-network"``)."""
    no_env: dict[str, object] = {"network_mode": "no-network", "allowed_hosts": None}
    unset: dict[str, object] = {"network_mode": None, "allowed_hosts": None}
    own = cfg.verifier.environment.model_copy(update=no_env) if cfg.verifier.environment else None
    return cfg.model_copy(
        update={
            "environment": cfg.environment.model_copy(update=no_env),
            "agent": cfg.agent.model_copy(update=unset),
            "verifier": cfg.verifier.model_copy(update={**unset, "environment": own}),
        }
    )


def planned(cfg: TaskConfig, egress: EgressPolicy, where: str) -> EgressPolicy:
    """`egress_for` when a rollout's sandbox is planned: a refusal is the environment's failure, one line
    starting with ``where`` (the task and its task.toml)."""
    try:
        return egress_for(cfg, egress)
    except NetworkRefused as e:
        raise EnvironmentFailure(f"{where} {e}") from None
