"""Reading Harbor datasets at submit: task.toml with Harbor's fields, defaults and units, and the refusals
(one line naming the task directory and the field)."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
from harbor_env import HarborEnvironment, image_build, image_tag
from harbor_env.config import parse, parse_size_mb
from harbor_env.tasks import HarborTask, dockerfile_workdir, load_dataset, strip_canary
from harbor_env.verifier import parse_reward
from harbor_paths import EXAMPLES, MakeTask

from durable_rollouts.environments import registry
from durable_rollouts.errors import EnvironmentFailure, TaskFileError
from durable_rollouts.sandboxes.base import SandboxSpec


def test_the_plugin_is_registered_by_entry_point() -> None:
    assert isinstance(registry.get("harbor"), HarborEnvironment)


def test_every_example_loads_with_its_files_and_at_least_three_dockerfiles() -> None:
    tasks = load_dataset(EXAMPLES)
    assert len(tasks) >= 8
    dockerfiles = {t.files.get("environment/Dockerfile") for t in tasks} - {None}
    assert len(dockerfiles) >= 3
    assert any(t.cfg.environment.docker_image for t in tasks)
    for t in tasks:
        assert "tests/test.sh" in t.files and "solution/solve.sh" in t.files
        assert "tests/test.sh" in t.executables
        assert t.workdir == "/app"
        assert t.id.startswith("examples/")


def test_defaults_and_units_are_harbors(make_task: MakeTask) -> None:
    toml = (
        'version = "1.0"\n[environment]\nmemory = "2G"\nstorage = "10G"\nallow_internet = false\ncpus = 2.0\n'
    )
    cfg = parse(toml)
    assert cfg.schema_version == "1.0"
    assert (cfg.environment.memory_mb, cfg.environment.storage_mb) == (2048, 10240)
    assert cfg.environment.network_mode == "no-network" and cfg.environment.cpus == 2
    assert isinstance(cfg.environment.cpus, int)
    assert cfg.verifier.timeout_sec == 600.0 and cfg.agent.timeout_sec is None
    assert cfg.environment.build_timeout_sec == 600.0
    assert parse("").environment.network_mode == "public"  # Harbor's default
    assert parse_size_mb("512M") == 512 and parse_size_mb("2048K") == 2


@pytest.mark.parametrize(
    ("toml", "drop", "field"),
    [
        ("[agent]\ntimeout_secs = 10\n", (), "[agent].timeout_secs: unknown field"),
        ("[agent]\ntimeout_sec = 'soon'\n", (), "[agent].timeout_sec:"),
        ('[environment]\nnetwork_mode = "public"\n', (), "[environment].network_mode: 'public'"),
        ("[environment]\ncpus = 1\n", (), "[environment].network_mode: 'public' (Harbor's default)"),
        ('[environment]\nnetwork_mode = "no-network"\ngpus = 1\n', (), "[environment].gpus"),
        ('[environment]\nnetwork_mode = "no-network"\n[[steps]]\nname = "a"\n', (), "task.toml steps:"),
        ('[environment]\nnetwork_mode = "no-network"\n[agent]\nuser = "a b"\n', (), "[agent].user: 'a b'"),
        ('[environment]\nnetwork_mode = "no-network"\n[verifier]\nuser = -1\n', (), "[verifier].user: -1"),
        ('[environment]\nnetwork_mode = "no-network"\ngpus = 2\n', (), "[environment].gpus: 2 GPU(s)"),
        ('[environment]\nnetwork_mode = "no-network"\nos = "windows"\n', (), "[environment].os: 'windows'"),
        (
            '[environment]\nnetwork_mode = "no-network"\n[environment.env]\nK = "${HOME}"\n',
            (),
            "[environment].env: ${VAR}",
        ),
        (
            '[environment]\nnetwork_mode = "no-network"\n[environment.healthcheck]\ncommand = "true"\n'
            "timeout_sec = 0\n",
            (),
            "[environment.healthcheck].timeout_sec",
        ),
        ('[environment]\nnetwork_mode = "no-network"\n', ("tests/test.sh",), "tests/test.sh: missing"),
        ('[environment]\nnetwork_mode = "no-network"\n', ("task.toml",), "task.toml: missing"),
        ('[environment]\nnetwork_mode = "no-network"\n', ("environment/Dockerfile",), "Dockerfile: missing"),
        ("not toml [", (), "task.toml (file): not valid TOML"),
    ],
)
def test_bad_task_directories_are_refused_in_one_line(
    make_task: MakeTask, toml: str, drop: tuple[str, ...], field: str
) -> None:
    d = make_task(toml=toml, drop=drop)
    with pytest.raises(TaskFileError) as e:
        load_dataset(d.parent if "task.toml" in drop else d)
    msg = str(e.value)
    assert msg.startswith(f"{d}: ") and field in msg and "\n" not in msg, msg


def test_compose_environments_are_refused(make_task: MakeTask) -> None:
    d = make_task(**{"environment/docker-compose.yaml": "services: {}\n"})
    with pytest.raises(TaskFileError, match=r"environment/docker-compose.yaml: compose-based"):
        load_dataset(d)


def test_a_dataset_file_lists_tasks_and_may_set_the_network_policy(
    make_task: MakeTask, tmp_path: Path
) -> None:
    make_task("a")
    make_task("b", toml="[agent]\ntimeout_sec = 5.0\n")  # public by default
    listing = tmp_path / "dataset.toml"
    listing.write_text('tasks = ["a", "b"]\n')
    with pytest.raises(TaskFileError, match=r"/b: task.toml \[environment\].network_mode"):
        load_dataset(listing)
    listing.write_text('tasks = ["*"]\nnetwork_policy = "no-network"\n')
    assert [t.id for t in load_dataset(listing)] == ["a", "b"]
    plain = tmp_path / "tasks.txt"
    plain.write_text("# one per line\na\n")
    assert [t.id for t in load_dataset(plain)] == ["a"]
    listing.write_text('tasks = ["a"]\nnetwork = "x"\n')
    with pytest.raises(TaskFileError, match=r"dataset.toml: field 'network'"):
        load_dataset(listing)


def test_canary_workdir_and_the_content_hash(make_task: MakeTask) -> None:
    assert strip_canary("<!-- canary GUID x -->\n# canary y\n\nHello\n") == "Hello\n"
    assert dockerfile_workdir("FROM a\nWORKDIR /x\nFROM b\nWORKDIR /srv\nWORKDIR app\n") == "/srv/app"
    t1 = load_dataset(make_task("x"))[0]
    t2 = load_dataset(make_task("y"))[0]
    assert t1.content_hash == t2.content_hash  # same environment, whatever the task
    t3 = load_dataset(make_task("z", **{"environment/data.txt": "1"}))[0]
    assert t3.content_hash != t1.content_hash and image_tag(t3) != image_tag(t1)


def test_the_sandbox_plan_honours_limits_and_builds_the_tasks_image(make_task: MakeTask) -> None:
    toml = (
        '[agent]\ntimeout_sec = 30.0\n[environment]\nnetwork_mode = "no-network"\ncpus = 2\n'
        "memory_mb = 1024\nstorage_mb = 100\nbuild_timeout_sec = 42.0\n"
    )
    task = load_dataset(make_task(toml=toml))[0]
    default = SandboxSpec(memory_mb=512, workdir_size_mb=64, tmp_size_mb=64, command_timeout_s=60)
    plan = HarborEnvironment().sandbox(task, default)
    s = plan.spec
    limits = (s.cpus, s.memory_mb, s.workdir_size_mb, s.workdir, s.command_timeout_s)
    assert limits == (2.0, 1024, 100, "/app", 30)
    assert set(s.mounts) == {"/logs", "/tests", "/solution"} and s.user == default.user
    build = plan.image_build
    assert build is not None and build.tag == s.image == image_tag(task) and build.timeout_s == 42.0
    dockerfile = base64.b64decode(build.context["Dockerfile"]).decode()
    assert dockerfile.startswith("FROM harbor-examples/base:bookworm\nWORKDIR /app\n")
    assert "/.harbor-seed" in dockerfile
    big = load_dataset(make_task("big", toml=toml.replace("storage_mb = 100", "storage_mb = 10240")))[0]
    assert HarborEnvironment().sandbox(big, default).spec.workdir_size_mb < 1024  # RAM-backed: below memory


def test_a_docker_image_task_builds_only_the_seed_layer_from_it() -> None:
    task = next(t for t in load_dataset(EXAMPLES) if t.cfg.environment.docker_image)
    build = image_build(task, image_tag(task))
    assert set(build.context) == {"Dockerfile"}
    assert (
        base64.b64decode(build.context["Dockerfile"])
        .decode()
        .startswith(f"FROM {task.cfg.environment.docker_image}\n")
    )


def test_rewards_are_read_by_harbors_rule() -> None:
    def out(name: str, text: str) -> str:
        return f"harbor-reward-file: {name}\n{base64.b64encode(text.encode()).decode()}\n"

    assert parse_reward("t", out("reward.txt", "0.5\n")).reward == 0.5
    score = parse_reward("t", out("reward.json", '{"reward": 0.25, "passed": 3}'))
    assert score.reward == 0.25 and score.metrics == {"reward": 0.25, "passed": 3.0}
    assert parse_reward("t", out("reward.json", '{"a": 1, "b": 0}')).reward == 0.5
    for bad, why in [
        (out("reward.txt", ""), "empty"),
        (out("reward.txt", "nan"), "non-finite"),
        (out("reward.txt", "yes"), "not a number"),
        (out("reward.json", '{"reward": "1"}'), "not a finite number"),
        (out("reward.json", "[1]"), "flat dict"),
        ("harbor-reward-file: none\ntraceback here\n", "wrote no reward"),
    ]:
        with pytest.raises(EnvironmentFailure, match=why):
            parse_reward("t", bad)


def test_tasks_round_trip_through_the_store_format() -> None:
    env = HarborEnvironment()
    for t in load_dataset(EXAMPLES):
        again = env.validate_task(t.model_dump(mode="json"))
        assert isinstance(again, HarborTask) and again == t
