"""The separate verifier's sandbox plan (``harbor_env.separate.plan``): its image by Harbor's precedence,
its limits, mounts and user, and where the agent's artifacts go; pure, no Docker."""

from __future__ import annotations

from harbor_env import image_tag
from harbor_env.separate import Definition, plan, source_path
from harbor_env.tasks import load_task_dir
from harbor_paths import MakeTask

from durable_rollouts.sandboxes.base import SandboxSpec

SEP = '[verifier]\nenvironment_mode = "separate"\n'
NO_NET = '[environment]\nnetwork_mode = "no-network"\n'
BASE = SandboxSpec(memory_mb=1024, workdir_size_mb=128, tmp_size_mb=64)


def test_the_tasks_own_image_is_reused_with_tests_copied_in(make_task: MakeTask) -> None:
    t = load_task_dir(make_task(toml=SEP + NO_NET + "memory_mb = 768\n"))
    p, d = plan(t, BASE)
    assert not d.bundled and p.spec.image == image_tag(t) and p.image_build is not None
    assert p.image_build.tag == image_tag(t)  # the agent's very image: no second build
    assert p.spec.mounts == {"/logs": 32, "/tests": 32} and p.spec.workdir == "/app"
    assert p.spec.memory_mb == 768 and p.spec.user == BASE.user and not p.spec.allow_root


def test_tests_dockerfile_builds_an_image_that_holds_the_tests(make_task: MakeTask) -> None:
    dockerfile = "FROM harbor-examples/base:bookworm\nWORKDIR /srv\nCOPY . /tests/\n"
    t = load_task_dir(make_task(toml=SEP + NO_NET, tests__Dockerfile=dockerfile))
    p, d = plan(t, BASE)
    assert d.bundled and d.workdir == "/srv" and p.spec.workdir == "/srv"
    assert p.spec.image.startswith("dr-harbor-verifier:") and p.spec.image != image_tag(t)
    assert p.image_build is not None and set(p.image_build.context) == {"Dockerfile", "test.sh"}
    assert p.spec.mounts == {"/logs": 32}  # /tests is the image's own


def test_a_named_image_and_the_verifiers_own_limits_and_user(make_task: MakeTask) -> None:
    toml = (
        '[agent]\nuser = "agent"\n[verifier]\nuser = 1234\n[verifier.environment]\n'
        'docker_image = "verifier/base:1"\nnetwork_mode = "no-network"\nmemory_mb = 512\ncpus = 2\n' + NO_NET
    )
    t = load_task_dir(make_task(toml=toml))
    p, d = plan(t, BASE.model_copy(update={"user": "agent", "user_source": "task t1 [agent].user"}))
    assert d.bundled and p.image_build is not None
    assert p.image_build.context["Dockerfile"]  # FROM the named image, plus the seed layer
    assert (p.spec.memory_mb, p.spec.cpus, p.spec.user, p.spec.allow_root) == (512, 2.0, "1234", True)
    assert "[verifier].user = '1234'" in p.spec.user_source and p.spec.exec_users == {}
    # Unset, the verifier runs as the sandbox's default user, not the agent's named one.
    t2 = load_task_dir(make_task("t2", toml='[agent]\nuser = "agent"\n' + SEP + NO_NET))
    p2, _ = plan(t2, BASE.model_copy(update={"user": "agent", "user_source": "task t2 [agent].user"}))
    assert p2.spec.user == SandboxSpec().user and p2.spec.user_source == ""


def test_a_verifier_workdir_of_its_own_gets_its_own_seed_and_tag(make_task: MakeTask) -> None:
    toml = '[verifier.environment]\nworkdir = "/check"\nnetwork_mode = "no-network"\n' + NO_NET
    t = load_task_dir(make_task(toml=toml))
    d = Definition(t)
    assert not d.bundled and d.workdir == "/check" and d.build.tag != image_tag(t)
    assert d.build.tag.startswith("dr-harbor-verifier:")


def test_artifact_paths_resolve_against_the_agents_workdir(make_task: MakeTask) -> None:
    from harbor_env.config import ArtifactConfig, artifact_entries

    toml = 'artifacts = ["out/r.txt", "/data/", {source = "./y"}]\n' + SEP + NO_NET
    t = load_task_dir(make_task(toml=toml))
    entries = artifact_entries(t.cfg)
    assert [source_path(t, a) for a in entries] == ["/logs/artifacts", "/app/out/r.txt", "/data", "/app/y"]
    assert source_path(t, ArtifactConfig(source="/logs/artifacts/")) == "/logs/artifacts"
