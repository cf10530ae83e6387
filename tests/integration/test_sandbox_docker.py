"""Docker sandbox backend against the real daemon: hardening, containment, lifecycle and faults.

Every test runs under its own run id and reaps that run's containers afterwards, so nothing outlives it.
Skipped (with the reason) only when the daemon is unreachable or the sandbox image is not built.
"""

from __future__ import annotations

import subprocess
import threading
import time
import uuid

import docker.errors
import pytest

from durable_rollouts.sandboxes import (
    DEFAULT_IMAGE,
    AsyncSandboxBackend,
    DockerBackend,
    SandboxError,
    SandboxFileError,
    SandboxGone,
    SandboxNotReady,
    SandboxPathError,
    SandboxSpec,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

SMALL = SandboxSpec(
    memory_mb=256, cpus=1.0, pids_limit=64, workdir_size_mb=128, tmp_size_mb=32, command_timeout_s=20
)


@pytest.fixture(scope="module")
def backend() -> DockerBackend:
    try:
        backend = DockerBackend()
        backend.api.ping()
    except Exception as exc:
        pytest.skip(f"docker daemon unreachable: {exc}")
    try:
        backend.api.inspect_image(DEFAULT_IMAGE)
    except docker.errors.ImageNotFound:
        pytest.skip(f"image {DEFAULT_IMAGE} missing: build it with `sudo sandboxes/image/build_image.sh`")
    return backend


@pytest.fixture
def sandbox(backend: DockerBackend, run_id: str):
    """Factory: `sandbox(spec=SMALL, key=None)` creates a sandbox in this test's run."""

    def make(spec: SandboxSpec = SMALL, key: str | None = None):
        return backend.create(key or f"{run_id}/{uuid.uuid4().hex[:8]}", run_id, spec)

    return make


def wait_for(predicate, timeout_s: float = 20.0, what: str = "condition") -> None:
    """Poll `predicate` until true (event-driven waits are not available for in-container state)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def command_lines(backend: DockerBackend, handle) -> list[str]:
    return backend.exec(handle, "ps -eo args=").output.splitlines()


# ------------------------------------------------------------------------------------------ hardening


def test_runs_as_non_root_without_capabilities_or_network(backend, sandbox):
    handle = sandbox()
    assert backend.exec(handle, "id -u").output.strip() == "1000"
    status = backend.exec(handle, "grep -E '^(CapEff|CapPrm|CapBnd|NoNewPrivs|Seccomp):' /proc/self/status")
    fields = dict(line.split(":\t") for line in status.output.strip().splitlines())
    assert (
        int(fields["CapEff"], 16) == 0 and int(fields["CapPrm"], 16) == 0 and int(fields["CapBnd"], 16) == 0
    )
    assert fields["NoNewPrivs"] == "1"
    assert fields["Seccomp"] == "2"
    interfaces = backend.exec(handle, "ls /sys/class/net").output.split()
    assert interfaces == ["lo"]
    attrs = backend.api.inspect_container(handle.container_id)
    host = attrs["HostConfig"]
    assert host["NetworkMode"] == "none" and host["ReadonlyRootfs"] and not host["Privileged"]
    assert host["CapDrop"] == ["ALL"] and host["Init"] is True
    assert host["Memory"] == host["MemorySwap"] == 256 * 2**20
    assert host["PidsLimit"] == 64
    assert not any("docker.sock" in mount.get("Source", "") for mount in attrs["Mounts"])


def test_network_connection_attempts_fail(backend, sandbox):
    handle = sandbox()
    probe = (
        "python3 -c 'import socket\n"
        'for addr in [("1.1.1.1", 53), ("172.17.0.1", 2375), ("127.0.0.1", 1)]:\n'
        "    try:\n"
        '        socket.create_connection(addr, timeout=3); print("CONNECTED", addr)\n'
        '    except OSError as exc: print("refused", addr, exc.errno)\''
    )
    result = backend.exec(handle, probe)
    assert result.exit_code == 0, result.output
    assert "CONNECTED" not in result.output
    assert result.output.count("refused") == 3


def test_writes_outside_workdir_fail(backend, sandbox):
    handle = sandbox()
    for target in ["/etc/x", "/x", "/usr/bin/x", "/root/x"]:
        result = backend.exec(handle, f"echo pwned > {target}")
        assert result.exit_code != 0, target
        assert "Read-only file system" in result.output or "Permission denied" in result.output
    assert (
        backend.exec(handle, "echo ok > /tmp/x && echo ok > /work/x && cat /tmp/x /work/x").output
        == "ok\nok\n"
    )
    full = backend.exec(handle, "head -c 200M /dev/zero > big; echo rc=$?; rm big")
    assert "No space left on device" in full.output and "rc=1" in full.output, full
    assert backend.exec(handle, "echo fine").output == "fine\n"


def test_a_writable_root_is_the_operators_choice_and_the_rest_stays_hardened(backend, sandbox):
    """``sandbox.writable_root`` (for tasks that install packages as they run) lifts only the read-only
    root: the same sandbox still runs as its non-root user, without capabilities or network."""
    read_only = sandbox()
    default = backend.api.inspect_container(read_only.container_id)["HostConfig"]
    writable = sandbox(SMALL.model_copy(update={"writable_root": True}))
    host = backend.api.inspect_container(writable.container_id)["HostConfig"]
    assert default["ReadonlyRootfs"] is True and host["ReadonlyRootfs"] is False
    assert host["CapDrop"] == default["CapDrop"] and host["NetworkMode"] == default["NetworkMode"] == "none"
    assert backend.exec(writable, "id -u").output.strip() != "0"
    # /var/tmp is the image's own world-writable folder on the root filesystem (no mount over it).
    assert backend.exec(writable, "touch /var/tmp/probe && echo ok").output == "ok\n"
    refused = backend.exec(read_only, "touch /var/tmp/probe")
    assert refused.exit_code != 0 and "Read-only file system" in refused.output, refused


# ---------------------------------------------------------------------------------------- containment


def test_fork_bomb_is_contained_and_sandbox_stays_usable(backend, sandbox):
    handle = sandbox()
    started = time.monotonic()
    result = backend.exec(handle, ":(){ :|:& };:; sleep 100", timeout_s=5)
    assert time.monotonic() - started < 12
    assert result.timed_out and result.exit_code in (124, 137), result
    assert "Resource temporarily unavailable" in result.output  # fork failed at the pids limit
    events = backend.exec(
        handle, "cat /sys/fs/cgroup/pids/pids.events 2>/dev/null || cat /sys/fs/cgroup/pids.events"
    )
    assert int(events.output.split()[-1]) > 0, "the pids limit was never reached"
    # Only this command's own bash may remain: every bomb process (a bash fork) is gone.
    after = backend.exec(handle, "ps -eo comm= > /tmp/procs; echo alive; grep -c '^bash$' /tmp/procs")
    assert after.output.split() == ["alive", "1"], after.output
    assert subprocess.run(["true"], check=False).returncode == 0  # the host can still fork


def test_memory_hog_is_killed_not_hung(backend, sandbox):
    handle = sandbox()
    started = time.monotonic()
    try:
        result = backend.exec(handle, "python3 -c \"b = b'x' * (2 * 1024**3); print(len(b))\"", timeout_s=60)
    except SandboxGone:
        return  # the container itself died: reported as a lost sandbox, which is allowed
    assert time.monotonic() - started < 60
    assert result.exit_code == 137 and result.oom_killed and not result.timed_out, result
    assert "out of memory" in result.output
    assert backend.exec(handle, "echo still-here").output == "still-here\n"


def test_stdout_flood_is_capped_quickly(backend, sandbox):
    handle = sandbox(SMALL.model_copy(update={"output_limit_bytes": 65536}))
    started = time.monotonic()
    result = backend.exec(handle, "yes | head -c 100000000")
    assert time.monotonic() - started < 10
    assert result.exit_code == 0 and result.truncated
    assert len(result.output.encode()) <= 65536 + 100
    assert result.output.endswith(f"[output truncated: {100_000_000 - 65536} bytes omitted]")


def test_stdout_and_stderr_are_interleaved_with_exit_code(backend, sandbox):
    handle = sandbox()
    result = backend.exec(handle, "echo one; echo two >&2; echo three; exit 3")
    assert (result.exit_code, result.output, result.truncated, result.timed_out) == (
        3,
        "one\ntwo\nthree\n",
        False,
        False,
    )


def test_path_traversal_is_rejected(backend, sandbox):
    handle = sandbox()
    assert (
        backend.exec(handle, "ln -s / link && ln -s /etc/passwd pw && mkdir d && ln -s .. d/up").exit_code
        == 0
    )
    for path in ["../x", "/etc/passwd", "a/../../x", "link/etc/passwd", "pw", "d/up/x", "link", "a\x00b"]:
        with pytest.raises(SandboxPathError, match="rejected path"):
            backend.read_file(handle, path)
        with pytest.raises(SandboxPathError, match="rejected path"):
            backend.write_file(handle, path, "x")
    untouched = backend.exec(
        handle, "head -c 5 /etc/passwd; test -e /x || test -e /work/../x || echo ' no-x'"
    )
    assert untouched.output == "root: no-x\n"


def test_file_round_trip_and_file_errors(backend, sandbox):
    handle = sandbox()
    payload = bytes(range(256)) * 20_000  # 5 MB, every byte value
    backend.write_file(handle, "deep/er/data.bin", payload)
    backend.write_file(handle, "text.py", "print('héllo')\n")
    assert backend.read_file(handle, "deep/er/data.bin", max_bytes=len(payload)) == payload
    assert backend.exec(handle, "python3 text.py").output == "héllo\n"
    backend.write_file(handle, "text.py", "again")
    assert backend.read_file(handle, "./text.py") == b"again"
    with pytest.raises(SandboxFileError, match="no such file"):
        backend.read_file(handle, "missing.txt")
    with pytest.raises(SandboxFileError, match="larger than"):
        backend.read_file(handle, "deep/er/data.bin", max_bytes=1000)
    with pytest.raises(SandboxFileError, match="not a regular file"):
        backend.read_file(handle, "deep")
    with pytest.raises(SandboxFileError):
        backend.write_file(handle, "deep", "cannot replace a directory")


def test_timeout_kills_whole_process_group(backend, sandbox):
    handle = sandbox()
    result = backend.exec(handle, "sleep 1000 & sleep 1000", timeout_s=2)
    assert result.timed_out and result.exit_code in (124, 137)
    assert 2 <= result.duration_s < 6
    assert "timed out after 2 s" in result.output
    assert "sleep 1000" not in command_lines(backend, handle)


def test_background_children_die_when_command_exits(backend, sandbox):
    handle = sandbox()
    result = backend.exec(handle, "sleep 1000 & echo started", timeout_s=30)
    assert result.output == "started\n" and result.duration_s < 5 and not result.timed_out
    assert "sleep 1000" not in command_lines(backend, handle)


def test_command_cannot_kill_its_sandbox(backend, sandbox):
    handle = sandbox()
    result = backend.exec(handle, "kill -9 -1; pkill -9 sleep; kill -9 1; echo unreachable")
    assert result.exit_code == 137 and "unreachable" not in result.output
    assert "no exit status" in result.output
    assert backend.exec(handle, "echo alive").output == "alive\n"


def test_detached_process_survives_and_cannot_hang_exec(backend, sandbox):
    handle = sandbox()
    # The command waits until its child is in a session of its own: before that it is still in the group.
    detach = (
        "setsid sleep 1000 > /dev/null 2>&1 & until [ $(ps -o sid= -p $!) = $! ]; do :; done; echo detached"
    )
    redirected = backend.exec(handle, detach)
    assert redirected.output == "detached\n" and redirected.duration_s < 5
    assert "sleep 1000" in command_lines(backend, handle)  # setsid + redirect is how a daemon persists
    hold = "setsid sleep 2000 & until [ $(ps -o sid= -p $!) = $! ]; do :; done; echo partial"
    holding = backend.exec(handle, hold, timeout_s=30)
    assert holding.exit_code == 0 and holding.duration_s < 8 and not holding.timed_out
    assert holding.output.startswith("partial\n") and "still holds it open" in holding.output


# ----------------------------------------------------------------------------------- lifecycle, faults


def test_create_is_idempotent_and_destroy_is_idempotent(backend, sandbox, run_id):
    key = f"{run_id}/same"
    first = sandbox(key=key)
    second = sandbox(key=key)
    assert first.container_id == second.container_id
    assert [info.key for info in backend.list_containers(run_id)] == [key]
    with pytest.raises(SandboxError, match="another run or spec"):
        backend.create(key, run_id, SMALL.model_copy(update={"pids_limit": 99}))
    backend.destroy(key)
    backend.destroy(key)
    assert backend.list_containers(run_id) == []


def test_container_killed_from_outside_raises_gone_then_is_replaced(backend, sandbox, run_id):
    key = f"{run_id}/killed"
    handle = sandbox(key=key)
    backend.api.kill(handle.container_id)
    with pytest.raises(SandboxGone):
        backend.exec(handle, "echo hi")
    with pytest.raises(SandboxGone):
        backend.write_file(handle, "a.txt", "x")
    replaced = sandbox(key=key)
    assert replaced.container_id != handle.container_id
    assert backend.exec(replaced, "echo hi").output == "hi\n"
    with pytest.raises(SandboxGone):  # the old handle names the old container
        backend.exec(handle, "echo hi")


def test_container_killed_mid_exec_raises_gone(backend, sandbox):
    handle = sandbox()
    outcome: list[BaseException | object] = []

    def run() -> None:
        try:
            outcome.append(backend.exec(handle, "sleep 30 && echo finished", timeout_s=60))
        except BaseException as exc:
            outcome.append(exc)

    worker = threading.Thread(target=run)
    worker.start()
    wait_for(
        lambda: any("sleep 30" in " ".join(p) for p in backend.api.top(handle.container_id)["Processes"]),
        what="sleep 30 to start",
    )
    backend.api.kill(handle.container_id)
    worker.join(timeout=20)
    assert not worker.is_alive()
    assert isinstance(outcome[0], SandboxGone), outcome


def test_paused_container_raises_gone(backend, sandbox):
    handle = sandbox()
    backend.api.pause(handle.container_id)
    try:
        with pytest.raises(SandboxGone, match="paused"):
            backend.exec(handle, "echo hi")
    finally:
        backend.api.unpause(handle.container_id)


def test_reap_removes_labelled_orphans_of_one_run(backend, sandbox, run_id):
    kept = sandbox(key=f"{run_id}/keep")
    sandbox(key=f"{run_id}/orphan-1")
    sandbox(key=f"{run_id}/orphan-2")
    other_run = f"{run_id}-other"
    other = backend.create(f"{other_run}/x", other_run, SMALL)
    try:
        assert backend.reap(run_id=run_id, older_than_s=3600) == []
        removed = backend.reap(run_id=run_id, keep=frozenset({kept.key}))
        assert len(removed) == 2 and all("orphan" in name for name in removed)
        assert [info.key for info in backend.list_containers(run_id)] == [kept.key]
        assert [info.key for info in backend.list_containers(other_run)] == [other.key]
    finally:
        backend.reap(run_id=other_run)


def test_missing_image_is_a_clear_error(backend, run_id):
    spec = SMALL.model_copy(update={"image": "durable-rollouts-sandbox:does-not-exist"})
    with pytest.raises(SandboxNotReady, match=r"build_image\.sh"):
        backend.create(f"{run_id}/noimage", run_id, spec)


async def test_async_wrapper_runs_calls_in_threads(backend, run_id):
    sandboxes = AsyncSandboxBackend(backend)
    handle = await sandboxes.create(f"{run_id}/async", run_id, SMALL)
    await sandboxes.write_file(handle, "x.txt", "async")
    result = await sandboxes.exec(handle, "cat x.txt")
    assert result.output == "async"
    assert await sandboxes.read_file(handle, "x.txt") == b"async"
    await sandboxes.destroy(handle.key)
