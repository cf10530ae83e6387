"""The SWE environment without Docker: task validation, parse/act/score/replay on an in-memory sandbox.

The fake sandbox runs nothing: it stores written files and answers each command with a canned result, so
these tests check what the environment sends and how it reads the answers. Real execution is checked in
``test_swe_docker.py``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from swe_env import SweEnvironment, SweTask, reward_from_junit
from swe_env.transcripts import TASKS, transcripts, turns, write

from durable_rollouts.environments import registry
from durable_rollouts.environments.base import Prompt, SandboxPlan, Step, TurnContext
from durable_rollouts.errors import EnvironmentFailure, SandboxPathError, TaskFileError
from durable_rollouts.sandboxes.base import ExecResult, SandboxSpec

REPORT = '<testsuites><testsuite tests="{n}" failures="{f}" errors="0" skipped="0"/></testsuites>'


class FakeSandbox:
    """Files in a dict; ``exec`` records the command and returns the next canned result."""

    def __init__(self, results: list[ExecResult] | None = None) -> None:
        self.files: dict[str, str] = {}
        self.commands: list[str] = []
        self.results = list(results or [])

    async def exec(self, cmd: str, timeout_s: float | None = None, once_key: str | None = None) -> ExecResult:
        self.commands.append(cmd)
        return self.results.pop(0) if self.results else ExecResult(exit_code=0, output="")

    async def write_file(self, path: str, content: bytes | str) -> None:
        if path.startswith("/") or ".." in path.split("/"):
            raise SandboxPathError(f"rejected path {path!r}: absolute (paths are relative to the workdir)")
        self.files[path] = content if isinstance(content, str) else content.decode()

    async def read_file(self, path: str, max_bytes: int = 1 << 20) -> bytes:
        return self.files[path].encode()[:max_bytes]


def _ctx(task: SweTask, box: FakeSandbox | None) -> TurnContext:
    return TurnContext(task=task, rollout_id="run/g0/0", turn=0, last_turn=False, sandbox=box)


def _line(task: SweTask, **changes: Any) -> dict[str, Any]:
    obj = task.model_dump(mode="json")
    for key, value in changes.items():
        if value is None:
            obj.pop(key)
        else:
            obj[key] = value
    return obj


# -- tasks ----------------------------------------------------------------------------------------------
def test_the_entry_point_names_this_environment(env: SweEnvironment) -> None:
    env_cls = registry.installed()["swe"].load()
    assert env_cls is SweEnvironment and registry.get("swe").name == "swe"
    assert env.uses_sandbox and env.observation_role == "tool" and env.task_model is SweTask


def test_bundled_tasks_cover_two_images_and_both_reward_kinds(tasks: list[SweTask]) -> None:
    assert len(tasks) >= 4 and len({t.image for t in tasks}) >= 2
    assert {t.reward for t in tasks} == {"junit", "exit_status"}
    for t in tasks:
        assert t.expected_tests >= 3 and t.reference != t.wrong
        assert not set(t.hidden_tests) & set(t.reference)


@pytest.mark.parametrize(
    ("changes", "error"),
    [
        ({"image": None}, r"field 'image': Field required"),
        ({"image": "two words"}, r"field 'image': 'two words' is not an image tag"),
        ({"repo_dir": "opt/repo"}, r"field 'repo_dir': .* absolute path"),
        ({"visible": ["../etc"]}, r"field 'visible': path '../etc' must be relative"),
        ({"visible": []}, r"field 'visible': List should have at least 1 item"),
        ({"hidden_tests": {"hidden.py": "x"}}, r"field 'hidden_tests': 'hidden.py' is not named test_"),
        ({"hidden_tests": {"tests/test_x.py": "x"}}, r"field 'hidden_tests': hidden test .* visible path"),
        ({"reference": {"setup.py": "x"}}, r"field 'reference': 'setup.py' is not under a visible path"),
        ({"test_command": "pytest {tests}"}, r"field 'task': .*\{junit\}"),
        ({"reward": "vibes"}, r"field 'reward': Input should be 'junit' or 'exit_status'"),
        ({"setup": "make"}, r"field 'setup': Input should be a valid list"),
        ({"colour": "blue"}, r"field 'colour': Extra inputs are not permitted"),
        ({"id": "has space"}, r"field 'id': must not contain whitespace"),
    ],
)
def test_bad_task_lines_name_file_line_and_field(
    env: SweEnvironment, tasks: list[SweTask], tmp_path: Path, changes: dict, error: str
) -> None:
    path = tmp_path / "tasks.jsonl"
    lines = [_line(tasks[0]), _line(tasks[1], **changes)]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    with pytest.raises(TaskFileError, match=rf"tasks\.jsonl:2: {error}") as info:
        env.load_tasks(path)
    assert "\n" not in str(info.value)


def test_duplicate_ids_and_bad_json_name_the_line(
    env: SweEnvironment, tasks: list[SweTask], tmp_path: Path
) -> None:
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps(_line(tasks[0])) + "\n\n" + json.dumps(_line(tasks[0])) + "\n")
    with pytest.raises(TaskFileError, match=r"tasks\.jsonl:3: field 'id': duplicate task id"):
        env.load_tasks(path)
    path.write_text("{nope\n")
    with pytest.raises(TaskFileError, match=r"tasks\.jsonl:1: not valid JSON"):
        env.load_tasks(path)


# -- prompt and sandbox plan -----------------------------------------------------------------------------
def test_prompt_names_the_task_and_the_visible_files(env: SweEnvironment, tasks: list[SweTask]) -> None:
    prompt = env.prompt(tasks[0])
    assert isinstance(prompt, Prompt) and prompt.messages is not None
    system, user = prompt.messages
    assert system["role"] == "system" and "<tool_call>" in system["content"]
    assert user["content"].startswith(f"Task id: {tasks[0].id}\n") and tasks[0].problem in user["content"]
    assert all(path in user["content"] for path in tasks[0].visible)


def test_sandbox_plan_uses_the_tasks_image_and_copies_its_visible_files(
    env: SweEnvironment, tasks: list[SweTask]
) -> None:
    default = SandboxSpec(memory_mb=512, workdir_size_mb=64, tmp_size_mb=64, workdir="/work")
    plan = env.sandbox(tasks[0], default)
    assert isinstance(plan, SandboxPlan)
    assert plan.spec == default.model_copy(update={"image": tasks[0].image})
    copy, *rest = plan.setup
    assert copy == f"cd /opt/repo && cp -r --parents -- {' '.join(tasks[0].visible)} /work/"
    assert rest == tasks[0].setup and not plan.files
    images = {p.spec.image for p in (env.sandbox(t, default) for t in tasks) if p is not None}
    assert images == {t.image for t in tasks}


# -- parse / act / replay ---------------------------------------------------------------------------------
async def test_parse_and_act_run_each_tool_in_the_sandbox(env: SweEnvironment, tasks: list[SweTask]) -> None:
    box = FakeSandbox([ExecResult(exit_code=1, output="boom"), ExecResult(exit_code=0, output="")])
    ctx = _ctx(tasks[0], box)

    async def turn(text: str) -> Step:
        parsed = env.parse(ctx, text)
        return parsed if isinstance(parsed, Step) else await env.act(ctx, parsed)

    assert (
        await turn('<tool_call>{"name": "bash", "arguments": {"cmd": "false"}}</tool_call><|end|>junk')
    ) == Step(observation="boom\n[exit code 1]")
    assert (
        await turn('<tool_call>{"name": "bash", "arguments": {"cmd": "true"}}</tool_call>')
    ).observation == ("[exit code 0]")
    assert box.commands == ["false", "true"]
    wrote = await turn(
        '<tool_call>{"name": "write_file", "arguments": {"path": "a/b.py", "content": "é"}}</tool_call>'
    )
    assert wrote.observation == "wrote 2 bytes to a/b.py" and box.files == {"a/b.py": "é"}
    read = await turn('<tool_call>{"name": "read_file", "arguments": {"path": "a/b.py"}}</tool_call>')
    assert read.observation == "é"
    bad = await turn(
        '<tool_call>{"name": "write_file", "arguments": {"path": "/etc/x", "content": ""}}</tool_call>'
    )
    assert bad.observation is not None and bad.observation.startswith("error: rejected path '/etc/x'")
    assert not bad.done
    malformed = env.parse(ctx, '<tool_call>{"name": "rm"}</tool_call>')
    assert isinstance(malformed, Step) and "unknown tool 'rm'" in (malformed.observation or "")
    no_call = env.parse(ctx, "no call at all")
    assert isinstance(no_call, Step) and (no_call.observation or "").startswith("error: no tool call")
    assert env.parse(ctx, '<tool_call>{"name": "submit"}</tool_call>') == Step(done=True)


async def test_a_timed_out_command_truncates_the_rollout(env: SweEnvironment, tasks: list[SweTask]) -> None:
    box = FakeSandbox([ExecResult(exit_code=124, output="", timed_out=True)])
    step = await env.act(_ctx(tasks[0], box), {"name": "bash", "arguments": {"cmd": "sleep 99"}})
    assert step.truncated == "command_timeout" and step.observation == "[timed out]"


async def test_replay_redoes_commands_and_writes_only(env: SweEnvironment, tasks: list[SweTask]) -> None:
    box = FakeSandbox()
    ctx = _ctx(tasks[0], box)
    for action in (
        {"name": "bash", "arguments": {"cmd": "touch x"}},
        {"name": "write_file", "arguments": {"path": "f.py", "content": "1"}},
        {"name": "write_file", "arguments": {"path": "/abs", "content": "1"}},  # rejected again, quietly
        {"name": "read_file", "arguments": {"path": "missing.py"}},
    ):
        await env.replay(ctx, action)
    assert box.commands == ["touch x"] and box.files == {"f.py": "1"}


async def test_no_sandbox_is_an_environment_failure(env: SweEnvironment, tasks: list[SweTask]) -> None:
    with pytest.raises(EnvironmentFailure, match="needs a sandbox"):
        await env.act(_ctx(tasks[0], None), {"name": "bash", "arguments": {"cmd": "ls"}})


# -- score -------------------------------------------------------------------------------------------------
async def test_score_writes_hidden_tests_at_a_fresh_path_and_reads_the_report(
    env: SweEnvironment, tasks: list[SweTask]
) -> None:
    task = next(t for t in tasks if t.reward == "junit")
    out = f"swe-exit: 1\n{REPORT.format(n=task.expected_tests, f=1)}"
    box = FakeSandbox([ExecResult(exit_code=0, output=out), ExecResult(exit_code=0, output=out)])
    ctx = _ctx(task, box)
    assert await env.score(ctx, None) == (task.expected_tests - 1) / task.expected_tests
    assert await env.score(ctx, None) == (task.expected_tests - 1) / task.expected_tests
    dirs = {path.split("/")[0] for path in box.files}
    assert len(dirs) == 2 and all(re.fullmatch(r"\.swe-hidden-[0-9a-f]{16}", d) for d in dirs)
    assert {path.split("/", 1)[1] for path in box.files} == set(task.hidden_tests)
    first, second = box.commands
    assert first != second and "--junitxml=/tmp/swe-score-" in first and "--noconftest" in first


@pytest.mark.parametrize(
    ("output", "reward"),
    [
        ("swe-exit: 0\n" + REPORT.format(n=4, f=0), 1.0),
        ("swe-exit: 1\n" + REPORT.format(n=4, f=3), 0.25),
        ("swe-exit: 0\n" + REPORT.format(n=5, f=0), 0.0),  # counts another number of tests
        ("swe-exit: 0\n" + REPORT.format(n=3, f=0), 0.0),
        ("swe-exit: 2\n", 0.0),  # no report
        ("swe-exit: 0\n<testsuite tests='4'", 0.0),  # unreadable
    ],
)
async def test_junit_reward(env: SweEnvironment, tasks: list[SweTask], output: str, reward: float) -> None:
    task = next(t for t in tasks if t.reward == "junit" and t.expected_tests == 4)
    assert await env.score(_ctx(task, FakeSandbox([ExecResult(exit_code=0, output=output)])), None) == reward


async def test_exit_status_reward(env: SweEnvironment, tasks: list[SweTask]) -> None:
    task = next(t for t in tasks if t.reward == "exit_status")
    for output, reward in (("swe-exit: 0\n", 1.0), ("swe-exit: 1\n", 0.0), ("swe-exit: 124\n", 0.0)):
        assert (
            await env.score(_ctx(task, FakeSandbox([ExecResult(exit_code=0, output=output)])), None) == reward
        )


async def test_a_scoring_copy_that_fails_is_an_environment_failure_not_a_reward(
    env: SweEnvironment, tasks: list[SweTask]
) -> None:
    box = FakeSandbox([ExecResult(exit_code=1, output="cp: cannot stat '/opt/repo/.': No such file")])
    with pytest.raises(EnvironmentFailure, match="scoring copy failed: cp: cannot stat"):
        await env.score(_ctx(tasks[0], box), None)
    timed_out = FakeSandbox([ExecResult(exit_code=124, output="", timed_out=True)])
    assert await env.score(_ctx(tasks[0], timed_out), None) == 0.0


def test_reward_from_junit_sums_suites() -> None:
    two = (
        '<testsuites><testsuite tests="2" failures="1"/>'
        '<testsuite tests="2" errors="0" skipped="1"/></testsuites>'
    )
    assert reward_from_junit(two, 4) == 0.5 and reward_from_junit(two, 0) == 0.0


# -- transcripts -------------------------------------------------------------------------------------------
def test_transcripts_cover_every_task_in_both_modes_and_load_in_the_simulated_engine(
    env: SweEnvironment, tasks: list[SweTask], tmp_path: Path
) -> None:
    from durable_rollouts.simengine.policies import load_transcripts

    loaded = load_transcripts(write(tmp_path / "t.jsonl", TASKS))
    assert set(loaded) == {(t.id, mode) for t in tasks for mode in ("reference", "wrong")}
    assert len(transcripts(tasks)) == 2 * len(tasks)
    task = tasks[0]
    ctx = _ctx(task, FakeSandbox())
    parsed = [env.parse(ctx, text) for text in turns(task, "reference")]
    assert parsed[0] == {"name": "bash", "arguments": {"cmd": f"cat {next(iter(task.reference))}"}}
    assert [p["arguments"] for p in parsed[1:-1]] == [  # type: ignore[index]
        {"path": path, "content": content} for path, content in task.reference.items()
    ]
    assert parsed[-1] == Step(done=True)
