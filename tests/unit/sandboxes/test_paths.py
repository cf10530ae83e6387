"""Pure logic of the sandbox layer, no Docker daemon: path checks, spec validation, naming, exec status."""

import re

import pytest
from pydantic import ValidationError

from durable_rollouts.sandboxes import (
    DockerBackend,
    SandboxNotReady,
    SandboxPathError,
    SandboxSpec,
    container_name,
    validate_relative_path,
)
from durable_rollouts.sandboxes._docker_exec import RawExec, exec_result, parse_status

pytestmark = pytest.mark.timeout(10)


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("a.txt", "a.txt"),
        ("dir/sub/file.py", "dir/sub/file.py"),
        ("./a/./b", "a/b"),
        ("a//b/", "a/b"),
        (".hidden", ".hidden"),
        ("..name", "..name"),
        ("a..b/c...", "a..b/c..."),
        ("with space/ünïcode", "with space/ünïcode"),
    ],
)
def test_accepts_and_normalises_relative_paths(path, expected):
    assert validate_relative_path(path) == expected


@pytest.mark.parametrize(
    ("path", "reason"),
    [
        ("", "empty"),
        (".", "workdir itself"),
        ("./", "workdir itself"),
        ("/etc/passwd", "absolute"),
        ("//etc/passwd", "absolute"),
        ("..", "'..'"),
        ("../x", "'..'"),
        ("a/../../x", "'..'"),
        ("a/b/..", "'..'"),
        ("a\x00b", "NUL"),
        ("a\nb", "newline"),
        ("x" * 2000, "longer than"),
    ],
)
def test_rejects_unsafe_paths_with_one_line_message(path, reason):
    with pytest.raises(SandboxPathError) as info:
        validate_relative_path(path)
    message = str(info.value)
    assert reason in message
    assert "\n" not in message.replace("\\n", "")
    assert message.startswith("rejected path ")


def test_rejects_non_string_path():
    with pytest.raises(SandboxPathError):
        validate_relative_path(None)  # type: ignore[arg-type]


def test_spec_defaults_are_hardened():
    spec = SandboxSpec()
    assert spec.user == "1000:1000"
    assert spec.workdir == "/work"
    assert spec.image == "durable-rollouts-sandbox:latest"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"user": "0:0"},
        {"user": "1000:0"},
        {"user": "root"},
        {"workdir": "/"},
        {"workdir": "relative"},
        {"workdir": "/work/../etc"},
        {"workdir": "/etc"},
        {"memory_mb": 1},
        {"pids_limit": 0},
        {"cpus": 0},
        {"output_limit_bytes": 10},
        {"labels": {"durable-rollouts.run": "x"}},
        {"memory_mb": 256, "workdir_size_mb": 512},
        {"unknown_field": 1},
    ],
)
def test_spec_rejects_unsafe_or_unknown_settings(kwargs):
    with pytest.raises(ValidationError):
        SandboxSpec(**kwargs)


def test_container_name_is_deterministic_valid_and_collision_resistant():
    name = container_name("run-7/rollout 12/attempt:1")
    assert name == container_name("run-7/rollout 12/attempt:1")
    assert re.fullmatch(r"[a-zA-Z0-9][a-zA-Z0-9_.-]+", name)
    assert name.startswith("dr-run-7-rollout-12-attempt-1-")
    assert container_name("a/b") != container_name("a-b")
    assert re.fullmatch(r"dr-[0-9a-f]{10}", container_name("///"))
    assert len(container_name("x" * 500)) < 64


def test_unreachable_daemon_is_not_ready(monkeypatch):
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    with pytest.raises(SandboxNotReady, match="unreachable"):
        DockerBackend()


def raw(stdout: bytes = b"", status: str = "", **kwargs) -> RawExec:
    return RawExec(stdout=bytearray(stdout), stderr=bytearray(status.encode()), **kwargs)


def test_status_lines_are_split_from_other_wrapper_text():
    status, other = parse_status(
        b"dr-status: rc=3\nsh: 1: Cannot fork\ndr-status: omitted=10\ndr-status: oom=0\n"
    )
    assert status == {"rc": 3, "omitted": 10, "oom": 0}
    assert other == "sh: 1: Cannot fork"


def test_exec_result_notes_truncation_timeout_and_oom():
    spec = SandboxSpec()
    done = exec_result(
        raw(b"hi\n", "dr-status: rc=0\ndr-status: omitted=0\ndr-status: oom=0\n"), 5, 0.1, spec
    )
    assert (done.exit_code, done.output, done.truncated, done.timed_out) == (0, "hi\n", False, False)
    flood = exec_result(raw(b"y" * 10, "dr-status: rc=0\ndr-status: omitted=90\n"), 5, 0.1, spec)
    assert flood.truncated and flood.output == "y" * 10 + "\n[output truncated: 90 bytes omitted]"
    slow = exec_result(raw(b"", "dr-status: rc=124\n"), 2, 2.05, spec)
    assert slow.timed_out and "timed out after 2 s" in slow.output
    own_124 = exec_result(raw(b"", "dr-status: rc=124\n"), 10, 0.5, spec)
    assert not own_124.timed_out  # the program exited 124 by itself, well before the limit
    hog = exec_result(raw(b"", "dr-status: rc=137\ndr-status: oom=1\n"), 10, 0.5, spec)
    assert hog.oom_killed and not hog.timed_out and "out of memory" in hog.output
    killed = exec_result(raw(b"part"), 10, 0.1, spec, wrapper_exit=137)
    assert killed.exit_code == 137 and "supervisor was killed" in killed.output
    frozen = exec_result(raw(b"", abandoned=True), 3, 14.0, spec)
    assert frozen.exit_code == -1 and frozen.timed_out and "did not finish" in frozen.output


def test_a_replayed_result_is_timed_by_its_first_run():
    spec = SandboxSpec()
    first_timed_out = exec_result(
        raw(b"", "dr-status: rc=124\ndr-status: ms=2050\ndr-status: replayed=1\n"), 2, 0.2, spec
    )
    assert first_timed_out.replayed and first_timed_out.timed_out and first_timed_out.duration_s == 2.05
    own_124 = exec_result(
        raw(b"", "dr-status: rc=124\ndr-status: ms=300\ndr-status: replayed=1\n"), 2, 3, spec
    )
    assert own_124.replayed and not own_124.timed_out  # its first run exited 124 by itself
    live = exec_result(raw(b"", "dr-status: rc=0\ndr-status: ms=300\n"), 2, 0.4, spec)
    assert not live.replayed and live.duration_s == 0.4
