"""A task's ``network_mode`` under the run's egress policy: no-network stays offline, public gets the
operator's hosts, allowlist what both lists allow; refusals in one line naming the task directory, the
field and the config key, at submit (the run's [sandbox] known) or when the sandbox is planned."""

from __future__ import annotations

from pathlib import Path

import pytest
from harbor_env import HarborEnvironment
from harbor_env.tasks import load_dataset
from harbor_paths import MakeTask

from durable_rollouts.errors import EnvironmentFailure, TaskFileError
from durable_rollouts.sandboxes.base import SandboxSpec
from durable_rollouts.sandboxes.egress_policy import EgressPolicy

OPERATOR = EgressPolicy(
    allow=["pypi.org", "*.pythonhosted.org", "astral.sh"], map={"pypi.org": "10.9.0.2:8000"}
)
ALLOWLIST = '[environment]\nnetwork_mode = "allowlist"\nallowed_hosts = [{}]\n'
RUN = SandboxSpec(memory_mb=1024, egress=OPERATOR)


def _egress(d: Path, spec: SandboxSpec = RUN) -> EgressPolicy:
    env = HarborEnvironment()
    (task,) = env.load_tasks(d, sandbox=spec)
    return env.sandbox(task, spec).spec.egress


def test_modes_map_to_the_operators_hosts(make_task: MakeTask) -> None:
    assert not _egress(make_task("off")).enabled  # no-network: no network even where the run allows hosts
    assert _egress(make_task("public", toml="[agent]\ntimeout_sec = 5.0\n")) == OPERATOR  # Harbor's default
    listed = make_task(
        "listed",
        toml=ALLOWLIST.format('"files.pythonhosted.org", "example.com"'),
    )
    narrowed = _egress(listed)
    assert narrowed.allow == ["files.pythonhosted.org"] and narrowed.map == {}
    phases = make_task(
        "phases", toml='[environment]\nnetwork_mode = "no-network"\n[agent]\nnetwork_mode = "public"\n'
        '[verifier]\nnetwork_mode = "public"\n',
    )  # fmt: skip
    assert _egress(phases) == OPERATOR


@pytest.mark.parametrize(
    ("toml", "spec", "field", "why"),
    [
        ('[environment]\nnetwork_mode = "public"\n', SandboxSpec(), "[environment].network_mode: 'public'",
         "the run allows no egress"),
        ("[agent]\ntimeout_sec = 5.0\n", SandboxSpec(),
         "[environment].network_mode: 'public' (Harbor's default)", "sandbox.egress.allow"),
        (ALLOWLIST.format('"example.com"'), RUN, "[environment].allowed_hosts: ['example.com']",
         "none of them is allowed by the run's sandbox.egress.allow"),
        ('[environment]\nnetwork_mode = "no-network"\n[verifier]\nnetwork_mode = "public"\n', RUN,
         "[verifier].network_mode: 'public' gives the verifier other hosts",
         "both phases need the same network"),
    ],
)  # fmt: skip
def test_what_the_policy_cannot_give_is_refused_at_submit_and_when_planned(
    make_task: MakeTask, toml: str, spec: SandboxSpec, field: str, why: str
) -> None:
    d = make_task(toml=toml)
    with pytest.raises(TaskFileError) as e:
        HarborEnvironment().load_tasks(d, sandbox=spec)
    msg = str(e.value)
    assert msg.startswith(f"{d}: task.toml {field}") and why in msg and "\n" not in msg, msg
    (task,) = HarborEnvironment().load_tasks(d)  # the run's policy not known here: checked when planned
    with pytest.raises(EnvironmentFailure) as planned:
        HarborEnvironment().sandbox(task, spec)
    assert str(planned.value).startswith(f"task t1 ({d}/task.toml) {field}") and why in str(planned.value)


def test_a_dataset_without_network_runs_its_tasks_offline(make_task: MakeTask, tmp_path: Path) -> None:
    make_task("a", toml=ALLOWLIST.format('"example.com"'))
    listing = tmp_path / "dataset.toml"
    listing.write_text('tasks = ["a"]\nnetwork_policy = "no-network"\n')
    (task,) = load_dataset(listing, egress=OPERATOR)
    assert task.cfg.environment.network_mode == "no-network"
    assert not HarborEnvironment().sandbox(task, RUN).spec.egress.enabled


def test_the_prompt_says_which_network_the_agent_has(make_task: MakeTask) -> None:
    env = HarborEnvironment()
    (offline,) = env.load_tasks(make_task("off"), sandbox=RUN)
    (public,) = env.load_tasks(make_task("pub", toml="[agent]\ntimeout_sec = 5.0\n"), sandbox=RUN)
    assert "there is no network" in env.prompt(offline).messages[0]["content"]
    system = env.prompt(public).messages[0]["content"]
    assert "there is no network" not in system and "only the hosts this run allows" in system
