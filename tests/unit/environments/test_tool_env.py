"""The tool-call environments (bundled coding, the swe and harbor plug-ins) share one parse/act/replay
(`environments.tool_env`): the same observations, a turn's bash command claimed once per turn in its sandbox
(so a retried step whose worker died mid-command is not run twice), every changing action redone on replay."""

from __future__ import annotations

import json
from typing import Any

import pytest

from durable_rollouts.environments import registry
from durable_rollouts.environments.base import Environment, Step, Task, TurnContext
from durable_rollouts.environments.tool_env import READ_LIMIT, ToolCallEnvironment
from durable_rollouts.errors import EnvironmentFailure, SandboxPathError
from durable_rollouts.sandboxes.base import ExecResult

NAMES = ["coding", "swe", "harbor"]


class RecordingSandbox:
    """Files in a dict; every exec recorded with its once_key."""

    def __init__(self, result: ExecResult | None = None) -> None:
        self.files: dict[str, bytes] = {}
        self.execs: list[tuple[str, str | None]] = []
        self.result = result or ExecResult(exit_code=0, output="ok")

    async def exec(self, cmd: str, timeout_s: float | None = None, once_key: str | None = None) -> ExecResult:
        self.execs.append((cmd, once_key))
        return self.result

    async def write_file(self, path: str, content: bytes | str) -> None:
        if path.startswith("/"):
            raise SandboxPathError(f"rejected path {path!r}")
        self.files[path] = content.encode() if isinstance(content, str) else content

    async def read_file(self, path: str, max_bytes: int = 1 << 20) -> bytes:
        return self.files[path][:max_bytes]


def _env(name: str) -> Environment:
    if name not in registry.installed():
        pytest.skip(f"the {name} plug-in is not installed")
    return registry.get(name)


def _ctx(box: RecordingSandbox | None, turn: int = 3) -> TurnContext:
    return TurnContext(task=Task(id="t"), rollout_id="run/g0/0", turn=turn, last_turn=False, sandbox=box)


def _call(name: str, **arguments: str) -> str:
    return f"thinking <tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


@pytest.mark.parametrize("name", NAMES)
async def test_every_tool_call_environment_acts_through_the_one_shared_harness(name: str) -> None:
    env = _env(name)
    assert isinstance(env, ToolCallEnvironment) and env.uses_sandbox and env.observation_role == "tool"
    for hook in ("parse", "act", "replay", "run_tool_call"):  # no copy of its own
        assert getattr(type(env), hook) is getattr(ToolCallEnvironment, hook), (name, hook)
    box = RecordingSandbox(ExecResult(exit_code=2, output="boom"))
    ctx = _ctx(box)
    action: Any = env.parse(ctx, _call("bash", cmd="make"))
    step = await env.act(ctx, action)
    assert step == Step(observation="boom\n[exit code 2]") and box.execs == [("make", "turn-3")]
    write = env.parse(ctx, _call("write_file", path="a.py", content="xé"))
    assert (await env.act(ctx, write)).observation == "wrote 3 bytes to a.py"
    box.files["big"] = b"x" * (READ_LIMIT + 10)
    read = env.parse(ctx, _call("read_file", path="big"))
    assert (await env.act(ctx, read)).observation == "x" * READ_LIMIT
    bad = env.parse(ctx, _call("write_file", path="/etc/x", content="1"))
    assert (await env.act(ctx, bad)).observation.startswith("error: rejected path")
    assert env.parse(ctx, _call("submit")) == Step(done=True)
    malformed = env.parse(ctx, "<tool_call>{not json</tool_call>")
    assert isinstance(malformed, Step) and malformed.observation and not malformed.done


@pytest.mark.parametrize("name", NAMES)
async def test_a_timed_out_command_truncates_and_replay_redoes_what_changes_the_sandbox(name: str) -> None:
    env = _env(name)
    box = RecordingSandbox(ExecResult(exit_code=124, output="", timed_out=True))
    ctx = _ctx(box)
    step = await env.act(ctx, {"name": "bash", "arguments": {"cmd": "sleep 9"}})
    assert step.observation == "[timed out]" and step.truncated == "command_timeout"
    box.execs.clear()
    for action in (
        {"name": "bash", "arguments": {"cmd": "touch x"}},
        {"name": "write_file", "arguments": {"path": "f", "content": "1"}},
        {"name": "read_file", "arguments": {"path": "missing"}},  # reading changes nothing: not redone
    ):
        await env.replay(ctx, action)
    assert box.execs == [("touch x", None)] and box.files == {"f": b"1"}  # a fresh sandbox: no once-claim


@pytest.mark.parametrize("name", NAMES)
async def test_acting_without_a_sandbox_is_an_environment_failure(name: str) -> None:
    env = _env(name)
    with pytest.raises(EnvironmentFailure, match=f"the {name} environment needs a sandbox"):
        await env.act(_ctx(None), {"name": "bash", "arguments": {"cmd": "ls"}})
