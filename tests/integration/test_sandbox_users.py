"""Sandbox users as a task names them (``sandboxes.users``), on the main Docker daemon and on a second one
started here with ``--userns-remap=default`` (own socket, data root, exec root and bridge; stopped by its
pid), which gets the sandbox image and the Harbor examples' base by ``docker save | docker load``.

- Main daemon: a named user and a bare uid run as themselves; a name the image lacks is the task's
  failure; root is refused before any container exists, in one line naming who asked and what the
  operator must do.
- Remapping daemon: root in the sandbox is host uid >= 100000 (its real uid seen from the host's /proc),
  with no capabilities, no new privileges, no host devices, no Docker socket, a read-only root, host
  root's files owned by nobody and unwritable, and no view of another sandbox's processes; the keeper
  (pid 1) survives its kill.
- Through the pipeline (real Temporal, the simulated engine playing solve.sh): a Harbor task with
  ``[agent].user = "root"`` and ``[verifier].user = "root"`` scores 1.0 on the remapping daemon, its
  verifier checking it ran as root, and so does one whose agent is ``"agent"`` and verifier ``"root"``
  (Terminal-Bench's pair); tasks naming ``"agent"`` (a user its Dockerfile adds) and ``1000`` score 1.0 on
  the main daemon as those users (the latter with ``[environment].env`` and a health check that passes);
  the two root tasks on the main daemon fail, each reason the one-line refusal naming its field; a task
  whose health check never passes fails as the environment's, naming the check.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from temporalio.client import Client

from durable_rollouts.errors import EnvironmentFailure
from durable_rollouts.sandboxes import DockerBackend
from durable_rollouts.sandboxes.base import DEFAULT_IMAGE, SandboxSpec
from durable_rollouts.sandboxes.users import SandboxUserRefused
from durable_rollouts.simengine import Mode, ModeRule, SimEngine, SimSettings
from tests import REPO_ROOT
from tests.integration.docker_daemons import SecondDockerd, need_second_daemon
from tests.integration.support import export, make_config, run_to_end, worker

pytestmark = pytest.mark.timeout(300)
HARBOR_BASE = "harbor-examples/base:bookworm"
SPEC = SandboxSpec(memory_mb=256, workdir_size_mb=32, tmp_size_mb=32, command_timeout_s=20)
ROOT_FIELD = "task t (tasks/t/task.toml) [agent].user = 'root'"


@pytest.fixture(scope="module")
def userns_daemon(docker: DockerBackend) -> Iterator[SecondDockerd]:
    """A dockerd with ``--userns-remap=default`` (it adds the ``dockremap`` user and its /etc/subuid and
    /etc/subgid ranges), holding the sandbox image and the Harbor examples' base."""
    need_second_daemon()
    subprocess.run(
        ["bash", str(REPO_ROOT / "environments/harbor/base_images.sh")], check=True, capture_output=True
    )
    daemon = SecondDockerd("dr-un", "--userns-remap=default", "--shutdown-timeout", "2")
    try:
        daemon.start()
        daemon.load(DEFAULT_IMAGE, HARBOR_BASE)
        yield daemon
    finally:
        daemon.close()


@pytest.fixture(scope="module")
def remapped(userns_daemon: SecondDockerd) -> DockerBackend:
    return userns_daemon.backend(timeout=120)


def _key() -> str:
    return f"users-{uuid.uuid4().hex[:10]}"


def test_named_users_and_uids_run_as_themselves_and_root_is_refused_on_a_plain_daemon(
    docker: DockerBackend,
) -> None:
    key = _key()
    try:
        box = docker.create(
            key, "users", SPEC.model_copy(update={"user": "sandbox", "exec_users": {"1000": "x"}})
        )
        assert docker.exec(box, "id -u; id -g; id -un").output.split() == ["1000", "1000", "sandbox"]
        assert docker.exec(box, "id -u", user="1000").output.strip() == "1000"
        with pytest.raises(ValueError, match="not the sandbox's user"):
            docker.exec(box, "id -u", user="0")
    finally:
        docker.destroy(key)
    with pytest.raises(EnvironmentFailure, match=r"user 'nosuch' is not in the image's /etc/passwd"):
        docker.create(_key(), "users", SPEC.model_copy(update={"user": "nosuch"}))
    with pytest.raises(SandboxUserRefused) as refused:
        docker.create(_key(), "users", SPEC.model_copy(update={"user": "0:0", "allow_root": True,
                                                               "user_source": ROOT_FIELD}))  # fmt: skip
    msg = str(refused.value)
    assert msg.startswith(ROOT_FIELD + ": ") and "--userns-remap=default" in msg and "\n" not in msg, msg
    named_root = SPEC.model_copy(
        update={"exec_users": {"root": "task t [verifier].user"}, "allow_root": True}
    )
    with pytest.raises(SandboxUserRefused, match=r"^task t \[verifier\].user: 'root' is root"):
        docker.create(_key(), "users", named_root)
    assert docker.list_containers("users") == []  # refused before any container exists


def _host_uid_of(marker: bytes, stop: threading.Event) -> int | None:
    """The real uid, as the host sees it, of the process whose command line is ``marker``."""
    while not stop.is_set():
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if Path(f"/proc/{pid}/cmdline").read_bytes() == marker:
                    status = Path(f"/proc/{pid}/status").read_text()
                    return int(next(ln for ln in status.splitlines() if ln.startswith("Uid:")).split()[1])
            except OSError:
                continue
        time.sleep(0.05)
    return None


def test_root_in_a_remapped_sandbox_cannot_reach_the_host(remapped: DockerBackend) -> None:
    spec = SPEC.model_copy(update={"user": "0:0", "allow_root": True, "gateway": True,
                                   "exec_users": {"1000:1000": "the other user"}})  # fmt: skip
    key, other = _key(), _key()
    try:
        box = remapped.create(key, "users", spec)
        neighbour = remapped.create(other, "users", SPEC)
        assert remapped.exec(box, "id -u; id -g").output.split() == ["0", "0"]
        assert remapped.exec(box, "id -u", user="1000:1000").output.strip() == "1000"
        # Root here is an unprivileged host user: the mapping, and the host's view of a root process.
        inside, host, _ = remapped.exec(box, "cat /proc/self/uid_map").output.split()
        assert inside == "0" and int(host) >= 100000
        found: list[int | None] = []
        stop = threading.Event()
        seeker = threading.Thread(target=lambda: found.append(_host_uid_of(b"sleep\x003.4567\x00", stop)))
        seeker.start()
        remapped.exec(box, "exec sleep 3.4567")
        stop.set()
        seeker.join()
        assert found and found[0] == int(host), found
        # No capabilities at all, no new privileges.
        caps = remapped.exec(
            box, "grep -E '^(Cap(Inh|Prm|Eff|Bnd|Amb)|NoNewPrivs):' /proc/self/status"
        ).output
        values = dict(line.split(":\t") for line in caps.strip().splitlines())
        assert all(
            values[c] == "0000000000000000" for c in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")
        )
        assert values["NoNewPrivs"] == "1"
        # No host devices, no Docker socket, a read-only root.
        devices = remapped.exec(box, "find /dev -type b -o -type c | sort").output.split()
        allowed = {
            f"/dev/{d}" for d in ("null", "zero", "full", "random", "urandom", "tty", "ptmx", "console")
        }
        assert set(devices) - {"/dev/pts/ptmx"} <= allowed, devices
        probe = "ls /var/run/docker.sock /run/docker.sock 2>&1; grep -c docker.sock /proc/mounts"
        assert remapped.exec(box, probe).output.count("No such file") == 2
        assert remapped.exec(box, "touch /etc/owned && echo wrote").exit_code != 0
        # The host folder bound in (owned by host root) is nobody's here, and root cannot write to it.
        owner = remapped.exec(box, "stat -c %u /.dr-gateway; touch /.dr-gateway/x 2>&1; echo rc=$?").output
        assert owner.split()[0] == "65534" and "rc=0" not in owner, owner
        # Another sandbox's processes are out of sight; the keeper survives root's kill.
        marker = "sleep 3.8765"
        running = threading.Thread(target=remapped.exec, args=(neighbour, f"exec {marker}"))
        running.start()
        time.sleep(0.5)
        seen = remapped.exec(box, "cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' '").output
        assert marker not in seen and "sleep infinity" in seen
        assert remapped.exec(box, "kill -9 1; echo rc=$?").output.strip().endswith("rc=1")
        assert remapped.exec(box, "echo alive").output.strip() == "alive"
        running.join(timeout=15)
    finally:
        remapped.destroy(key)
        remapped.destroy(other)


# ------------------------------------------------------------------------------------- through Harbor

TASK_TOML = """schema_version = "1.4"
[task]
name = "users/{name}"
[agent]
timeout_sec = 120.0
{agent}
[verifier]
timeout_sec = 60.0
{verifier}
[environment]
network_mode = "no-network"
memory_mb = 512
storage_mb = 64
"""


def _task(
    root: Path, name: str, agent: str, verifier: str, expect_uid: int, extra: str = "", check: str = "true",
    verifier_uid: int | None = None,
) -> None:  # fmt: skip
    d = root / name
    (d / "environment").mkdir(parents=True)
    (d / "solution").mkdir()
    (d / "tests").mkdir()
    (d / "task.toml").write_text(TASK_TOML.format(name=name, agent=agent, verifier=verifier) + extra)
    (d / "instruction.md").write_text("Write your uid to /app/who.txt.\n")
    (d / "environment" / "Dockerfile").write_text(
        f"FROM {HARBOR_BASE}\nWORKDIR /app\n"
        "RUN echo 'agent:x:1234:1234::/app:/bin/bash' >> /etc/passwd && echo 'agent:x:1234:' >> /etc/group\n"
    )
    (d / "solution" / "solve.sh").write_text("#!/bin/bash\nid -u > /app/who.txt\n")
    (d / "tests" / "test.sh").write_text(
        "#!/bin/bash\n"
        f'if [ "$(cat /app/who.txt)" = {expect_uid} ] && [ "$(stat -c %u /app/who.txt)" = {expect_uid} ] '
        f'&& [ "$(id -u)" = {expect_uid if verifier_uid is None else verifier_uid} ] && {check}; then '
        "echo 1 > /logs/verifier/reward.txt; "
        "else echo 0 > /logs/verifier/reward.txt; fi\n"
    )


@pytest.fixture(scope="module")
async def sim(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[str, Path]]:
    from harbor_env.transcripts import write

    work = tmp_path_factory.mktemp("users")
    tasks = work / "tasks"
    _task(tasks, "root", 'user = "root"', 'user = "root"', 0)
    _task(tasks, "agent", 'user = "agent"', "", 1234)
    _task(tasks, "split", 'user = "agent"', 'user = "root"', 1234, verifier_uid=0)  # Terminal-Bench's pair
    healthy = (
        '[environment.env]\nMODE = "strict"\n[environment.healthcheck]\ncommand = "test -d /logs/verifier"\n'
    )
    _task(tasks, "uid", "user = 1000", "", 1000, healthy, check='[ "$MODE" = strict ]')
    sick = '[environment.healthcheck]\ncommand = "test -f /nothing"\ninterval_sec = 0.1\nretries = 2\n'
    _task(tasks, "unhealthy", "", "", 1000, sick)
    settings = SimSettings(
        transcripts=write(work / "transcripts.jsonl", tasks),
        mode_rules=[ModeRule(on="request", prefix="harbor-ref", mode=Mode.REFERENCE)],
        max_model_len=8192,
    )
    async with SimEngine(settings).serve(port=0) as url:
        yield url, tasks


def _config(url: str, task_queue: str, dataset: Path, groups: int = 1):
    return make_config(
        [url], task_queue,
        run={"env": "harbor", "task_file": str(dataset), "num_groups": groups, "group_size": 1},
        sampling={"max_tokens": 2048}, rollout={"max_turns": 8, "max_total_tokens": 8000},
        sandbox={"memory_mb": 512, "workdir_size_mb": 64, "tmp_size_mb": 64, "command_timeout_s": 30},
    )  # fmt: skip


async def test_harbor_tasks_run_as_their_users_and_root_only_where_it_is_remapped(
    client: Client, docker: DockerBackend, userns_daemon: SecondDockerd, sim: tuple[str, Path],
    task_queue: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    url, tasks = sim
    async with worker(client, task_queue, tmp_path / "plain") as store:
        await run_to_end(client, _config(url, task_queue, tasks, groups=5), "harbor-ref-plain")
    records, _ = export(store, "harbor-ref-plain")
    for name in ("agent", "uid"):
        (rec,) = [r for r in records if r["task_id"] == f"users/{name}"]
        assert rec["outcome"] == "completed" and rec["reward"] == 1.0, (name, rec["reason"])
    sick = [r for r in records if r["task_id"] == "users/unhealthy"]
    assert sick and all(r["outcome"] == "failed" and r["reward"] is None for r in sick), sick
    assert sick[0]["reason"].startswith("environment: EnvironmentFailure: "), sick[0]["reason"]
    assert "health check failed after 2 consecutive retries: test -f /nothing" in sick[0]["reason"]
    assert docker.list_containers("harbor-ref-plain") == []  # the failed health check's sandbox too
    for name, field in (("root", "[agent].user = 'root'"), ("split", "[verifier].user = 'root'")):
        # a group may try again: every try is refused
        refused = [r for r in records if r["task_id"] == f"users/{name}"]
        assert refused and all(r["outcome"] == "failed" and r["reward"] is None for r in refused), refused
        assert len({r["reason"] for r in refused}) == 1, [r["reason"] for r in refused]
        reason = refused[0]["reason"]
        assert reason.startswith(f"infra: SandboxUserRefused: task users/{name} (") and "\n" not in reason
        assert f"task.toml) {field}" in reason and "--userns-remap=default" in reason, reason

    monkeypatch.setenv("DOCKER_HOST", userns_daemon.url)  # the worker's sandboxes on the remapping daemon
    async with worker(client, task_queue, tmp_path / "remapped") as store:
        listing = tasks.parent / "remapped.toml"
        listing.write_text('tasks = ["tasks/root", "tasks/split"]\n')
        await run_to_end(client, _config(url, task_queue, listing, groups=2), "harbor-ref-remapped")
    records, _ = export(store, "harbor-ref-remapped")
    assert sorted(r["task_id"] for r in records) == ["users/root", "users/split"]
    for rec in records:
        assert rec["outcome"] == "completed" and rec["reward"] == 1.0, (rec["task_id"], rec["reason"])
