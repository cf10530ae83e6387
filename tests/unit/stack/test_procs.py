"""Unit tests of the process helpers and of `stack up`'s preconditions (no Temporal or vLLM started)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from durable_rollouts.cli.stack import stack_app
from durable_rollouts.config.models import StackConfig
from durable_rollouts.stack import procs, stack


@pytest.fixture
def pids() -> Iterator[list[int]]:
    """Pids a test started; each is stopped (by pid) at teardown, even when the test failed."""
    started: list[int] = []
    yield started
    for pid in started:
        procs.stop_pid(pid, timeout=2)


def _listener() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


@pytest.mark.timeout(10)
def test_port_in_use_sees_listening_and_bound_sockets() -> None:
    with _listener() as s:
        assert procs.port_in_use(s.getsockname()[1])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        assert procs.port_in_use(s.getsockname()[1])
    assert not procs.port_in_use(procs.free_port())


@pytest.mark.timeout(20)
def test_spawn_writes_pid_and_log_and_stop_ends_process(tmp_path: Path, pids: list[int]) -> None:
    pid = procs.spawn(
        "sleeper", [sys.executable, "-c", "print('hi', flush=True); import time; time.sleep(60)"], tmp_path
    )
    pids.append(pid)
    assert procs.pid_path(tmp_path, "sleeper").read_text().split()[0] == str(pid)
    assert procs.read_pid(tmp_path, "sleeper") == pid
    assert os.getpgid(pid) == pid
    procs.wait_until(lambda: "hi" in procs.log_tail(procs.log_path(tmp_path, "sleeper")), 10, "log", pid)
    procs.stop_pid(pid)
    assert not procs.pid_alive(pid)
    assert procs.read_pid(tmp_path, "sleeper") is None


@pytest.mark.timeout(20)
def test_stop_pid_kills_whole_group_and_escalates_to_sigkill(tmp_path: Path, pids: list[int]) -> None:
    code = (
        "import signal, subprocess, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "c = subprocess.Popen(['sleep', '60']); print(c.pid, flush=True); time.sleep(60)"
    )
    pid = procs.spawn("stubborn", [sys.executable, "-c", code], tmp_path)
    pids.append(pid)
    log = procs.log_path(tmp_path, "stubborn")
    procs.wait_until(lambda: procs.log_tail(log, 1).strip().isdigit(), 10, "child pid", pid)
    child = int(procs.log_tail(log, 1))
    start = time.monotonic()
    procs.stop_pid(pid, timeout=0.5)
    assert time.monotonic() - start < 5
    assert not procs.pid_alive(pid)
    assert not procs.pid_alive(child)
    procs.stop_pid(pid)  # already gone: no error


@pytest.mark.timeout(10)
def test_read_pid_ignores_a_pid_that_now_names_another_process(tmp_path: Path) -> None:
    procs.pid_path(tmp_path, "x").parent.mkdir(parents=True)
    procs.pid_path(tmp_path, "x").write_text(f"{os.getpid()} 1\n")
    assert procs.read_pid(tmp_path, "x") is None
    procs.pid_path(tmp_path, "x").write_text(f"{os.getpid()} {procs._start_time(os.getpid())}\n")
    assert procs.read_pid(tmp_path, "x") == os.getpid()
    assert procs.read_pid(tmp_path, "missing") is None


@pytest.mark.timeout(10)
def test_wait_until_fails_fast_with_log_tail_when_process_dies(tmp_path: Path, pids: list[int]) -> None:
    pid = procs.spawn("crasher", ["sh", "-c", "echo boom-marker; exit 3"], tmp_path)
    pids.append(pid)
    start = time.monotonic()
    with pytest.raises(procs.StackError, match=r"(?s)crasher exited .*boom-marker") as err:
        procs.wait_until(lambda: False, 60, "crasher", pid, procs.log_path(tmp_path, "crasher"))
    assert time.monotonic() - start < 5
    assert "\n" in str(err.value)


@pytest.mark.timeout(10)
def test_wait_until_times_out_and_returns_elapsed() -> None:
    with pytest.raises(procs.StackError, match="never not healthy after"):
        procs.wait_until(lambda: False, 0.3, "never")
    assert procs.wait_until(lambda: True, 1, "now") < 1


def test_argv_builders() -> None:
    from durable_rollouts.workflows.search_attributes import DEFINITIONS

    argv = procs.temporal_argv(Path("/h"), 1234, 5678)
    assert argv[1:3] == ["server", "start-dev"]
    assert argv[argv.index("--db-filename") + 1] == "/h/temporal.sqlite"
    assert argv.count("--search-attribute") == len(DEFINITIONS)
    assert "RolloutTurn=Int" in argv and "--sqlite-pragma" not in argv
    argv = procs.temporal_argv(Path("/h"), 1234, 5678, StackConfig().temporal_sqlite_pragmas)
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--sqlite-pragma"] == [
        "journal_mode=wal", "synchronous=normal",
    ]  # fmt: skip
    cfg = StackConfig(engine_port=9999, kv_cache_gib=0.5, logprob_mode="raw_logprobs")
    eng = procs.engine_argv(cfg)
    assert Path(eng[eng.index("--model") + 1]).is_absolute()
    assert eng[eng.index("--port") + 1] == "9999"
    assert eng[eng.index("--logprobs-mode") + 1] == "raw_logprobs"
    env = procs.engine_env(cfg)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"  # vLLM parses it with int()
    assert env["HF_HUB_OFFLINE"] == env["VLLM_SERVER_DEV_MODE"] == "1"
    assert procs.worker_argv("a:1", "q")[1:] == [
        "-m",
        "durable_rollouts.workers.worker",
        "--address",
        "a:1",
        "--task-queue",
        "q",
    ]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("taken", ["temporal_port", "ui_port", "engine_port"])
def test_up_refuses_a_taken_port_before_starting_anything(tmp_path: Path, taken: str) -> None:
    ports = {
        "temporal_port": procs.free_port(),
        "ui_port": procs.free_port(),
        "engine_port": procs.free_port(),
    }
    with _listener() as s:
        ports[taken] = s.getsockname()[1]
        with pytest.raises(stack.StackError, match=rf"^port {ports[taken]} \(.+\) is already in use$"):
            stack.up(StackConfig(**ports), tmp_path, detach=True)
    assert not (tmp_path / "logs").exists()
    assert not (tmp_path / "pids").exists()


@pytest.mark.timeout(10)
def test_up_names_a_missing_model(tmp_path: Path) -> None:
    cfg = StackConfig(engine_port=procs.free_port(), model_dir=str(tmp_path / "nope"))
    with pytest.raises(stack.StackError, match=r"nope/config.json is missing"):
        stack.up(cfg, tmp_path, detach=True, components=("engine",))
    assert not (tmp_path / "logs").exists()


@pytest.mark.timeout(20)
def test_up_refuses_a_second_stack_in_the_same_home(tmp_path: Path, pids: list[int]) -> None:
    pids.append(procs.spawn("temporal", ["sleep", "60"], tmp_path))
    with pytest.raises(stack.StackError, match="already running"):
        stack.up(
            StackConfig(temporal_port=procs.free_port(), ui_port=procs.free_port()),
            tmp_path,
            True,
            ("temporal",),
        )
    assert stack.down(tmp_path) == ["temporal"]
    assert not procs.pid_alive(pids[0])
    assert not procs.pid_path(tmp_path, "temporal").exists()


@pytest.mark.timeout(20)
def test_cli_reports_a_bad_config_field_on_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[stack]\nengine_port = 70000\n[run]\nnum_groups = 1\n")
    res = CliRunner().invoke(
        stack_app, ["up", "-d", "--config", str(bad)], env={"ROLLOUTS_HOME": str(tmp_path)}
    )
    assert res.exit_code == 2
    assert res.output.strip().splitlines() == [
        f"error: {bad}: stack.engine_port: Input should be less than or equal to 65535"
    ]


@pytest.mark.timeout(20)
def test_cli_status_and_down_on_an_empty_home(tmp_path: Path) -> None:
    env = {"ROLLOUTS_HOME": str(tmp_path)}
    assert CliRunner().invoke(stack_app, ["down"], env=env).output.strip() == "no stack was running"
    res = CliRunner().invoke(stack_app, ["status"], env=env)
    assert res.exit_code == 1
    assert res.output.count("stopped") == 4


@pytest.mark.timeout(10)
def test_pid_alive_is_false_for_an_exited_unreaped_child() -> None:
    child = subprocess.Popen(["true"])
    procs.wait_until(lambda: procs._state(child.pid) == "Z", 5, "zombie")
    assert not procs.pid_alive(child.pid)
    child.wait()


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    low = int(procs.EPHEMERAL_RANGE.read_text().split()[0])
    ports = procs.free_ports(20)
    assert len(set(ports)) == 20
    assert all(10_000 <= p < low for p in ports), ports  # never where outgoing connections take theirs
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
