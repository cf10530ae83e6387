"""The coding environment: a task, a hardened sandbox, tools, and a reward from hidden tests.

The harness renders the first prompt once (system message with the tool format, user message with the
task), then every model turn is parsed as one tool call (see ``envs.tool_calls``) and its result comes back
as a ``tool`` message. Reward = fraction of hidden tests passed, computed after ``submit()`` by running the
hidden tests in the sandbox against a copy of the submitted files.

Reward integrity (best effort): hidden tests enter the sandbox only at scoring time, are run from a fresh
directory holding only them and the submitted files, with ``python3 -I`` (no PYTHONPATH, no user site),
``--noconftest`` and a JUnit report at an unguessable path; a report whose test count differs from the
hidden tests' is scored 0.
"""

from __future__ import annotations

import re
import secrets
import shlex
import xml.etree.ElementTree as ET

from contracts.types import TruncationReason
from envs.base import Action, Environment, Prompt, Sandbox, SandboxPlan, Step, Task, TurnContext, until_end
from envs.coding_tasks import CodingTask
from envs.tool_calls import TOOLS, ToolCallError, parse_tool_call
from errors import SandboxFileError, SandboxGone, SandboxPathError
from sandboxes.base import SandboxSpec

READ_LIMIT = 16384
"""Most bytes read_file shows the model."""

ENV_VERSION = "coding-v1"
"""Version of the harness's behaviour (system prompt, tool-call format, observations); every record carries it
(``lineage.env_version``). Bump it whenever that behaviour changes."""
VERIFIER_VERSION = "coding-junit-v1"
"""Version of the reward (hidden tests run by ``scoring_command``, scored by ``reward_from_junit``); recorded
as ``lineage.verifier_version``. Bump it whenever a reward could change."""

SYSTEM_PROMPT = (
    "You are a coding agent working in a sandbox. Each turn, call exactly one tool by writing\n"
    '<tool_call>{"name": TOOL, "arguments": {...}}</tool_call>\n'
    "Tools: bash(cmd), write_file(path, content), read_file(path), submit(). "
    "Paths are relative to the working directory. Call submit() when done; hidden tests then score you."
)


def first_messages(task: dict) -> list[dict[str, str]]:
    """The conversation the prompt is rendered from (once, through the chat template)."""
    files = ", ".join(sorted(task.get("files", {}))) or "(none)"
    user = f"Task id: {task['id']}\n\n{task['prompt']}\n\nFiles: {files}"
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]


def count_tests(tests: dict[str, str]) -> int:
    """Test functions in the hidden test files (module-level ``def test_...``)."""
    return sum(len(re.findall(r"^def test_\w+\(", src, flags=re.MULTILINE)) for src in tests.values())


def scoring_command(solution_files: list[str], hidden_dir: str) -> tuple[str, str]:
    """Shell command that runs the hidden tests on a copy of the submitted files; returns (cmd, report)."""
    run_dir = f"/tmp/score-{secrets.token_hex(8)}"
    report = f"{run_dir}/{secrets.token_hex(8)}.xml"
    copies = " ".join(shlex.quote(f) for f in solution_files)
    cmd = (
        f"rm -rf {run_dir} && mkdir -p {run_dir} && "
        f"(cp --parents {copies} {run_dir}/ 2>/dev/null; true) && "
        f"cp -r {shlex.quote(hidden_dir)}/. {run_dir}/ && rm -rf {shlex.quote(hidden_dir)} && "
        f"cd {run_dir} && python3 -I -m pytest -q -p no:cacheprovider --noconftest "
        f"--junitxml={report} >/dev/null 2>&1; cat {report}"
    )
    return cmd, report


def reward_from_junit(xml_text: str, expected_tests: int) -> tuple[float, int, int]:
    """(reward, passed, total) from a JUnit report; 0 when the report is missing or counts are wrong."""
    try:
        root = ET.fromstring(xml_text.strip() or "<none/>")
    except ET.ParseError:
        return 0.0, 0, expected_tests
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    total = sum(int(s.get("tests", 0)) for s in suites)
    bad = sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) + int(s.get("skipped", 0)) for s in suites)
    if total != expected_tests or expected_tests == 0:
        return 0.0, 0, expected_tests
    passed = max(total - bad, 0)
    return passed / total, passed, total


def format_exec(exit_code: int, output: str, timed_out: bool) -> str:
    """Observation text of a bash call."""
    status = "timed out" if timed_out else f"exit code {exit_code}"
    return f"{output}\n[{status}]" if output else f"[{status}]"


class CodingEnvironment(Environment):
    """Tool-using coding agent in a hardened sandbox; reward from hidden tests (see the module docstring)."""

    name = "coding"
    env_version = ENV_VERSION
    verifier_version = VERIFIER_VERSION
    task_model = CodingTask
    uses_sandbox = True
    observation_role = "tool"

    def prompt(self, task: Task) -> Prompt:
        return Prompt(messages=first_messages(task.model_dump()))

    def sandbox(self, task: Task, default: SandboxSpec) -> SandboxPlan:
        assert isinstance(task, CodingTask)
        return SandboxPlan(spec=default, files=dict(task.files))

    def parse(self, ctx: TurnContext, text: str) -> Action | Step:
        """One tool call per turn; a malformed call becomes an error observation for the model."""
        call = parse_tool_call(until_end(text))
        if isinstance(call, ToolCallError):
            return Step(observation=call.message)
        if call.name == "submit":
            return Step(done=True)  # scored by `score`: the hidden tests
        return call.model_dump(mode="json")

    async def act(self, ctx: TurnContext, action: Action) -> Step:
        """Run the turn's tool call; a bash command runs once per turn in its sandbox (a retried step whose
        worker died mid-command gets the first run's result)."""
        return await self._act(ctx, action, once_key=f"turn-{ctx.turn}")

    async def _act(self, ctx: TurnContext, action: Action, once_key: str | None) -> Step:
        sandbox = _sandbox(ctx)
        name, args = action["name"], action.get("arguments", {})
        if name == "bash":
            res = await sandbox.exec(args["cmd"], once_key=once_key)
            reason = TruncationReason.COMMAND_TIMEOUT if res.timed_out else None
            text = format_exec(res.exit_code, res.output, res.timed_out)
            return Step(observation=text, truncated=reason)
        try:
            if name == "write_file":
                await sandbox.write_file(args["path"], args["content"])
                obs = f"wrote {len(args['content'].encode())} bytes to {args['path']}"
            else:
                data = await sandbox.read_file(args["path"], READ_LIMIT)
                obs = data.decode("utf-8", errors="replace")
        except (SandboxPathError, SandboxFileError) as e:
            obs = f"error: {e}"
        return Step(observation=obs)

    async def score(self, ctx: TurnContext, text: str | None) -> float:
        """Hidden tests run in the sandbox on a copy of the submitted files."""
        task, sandbox = ctx.task, _sandbox(ctx)
        assert isinstance(task, CodingTask)
        hidden = f".hidden-{secrets.token_hex(6)}"
        for path, src in task.tests.items():
            await sandbox.write_file(f"{hidden}/{path}", src)
        files = sorted(set(task.files) | set(task.reference))
        cmd, _ = scoring_command(files, hidden)
        res = await sandbox.exec(cmd, timeout_s=300)
        reward, _, _ = reward_from_junit(res.output, count_tests(task.tests))
        return reward

    async def replay(self, ctx: TurnContext, action: Action) -> None:
        if action["name"] != "read_file":  # reading changes nothing; a fresh sandbox: every action runs
            await self._act(ctx, action, once_key=None)


def _sandbox(ctx: TurnContext) -> Sandbox:
    if ctx.sandbox is None:
        raise SandboxGone(f"rollout {ctx.rollout_id}: no sandbox")
    return ctx.sandbox


__all__ = [
    "ENV_VERSION",
    "SYSTEM_PROMPT",
    "TOOLS",
    "VERIFIER_VERSION",
    "CodingEnvironment",
    "count_tests",
    "first_messages",
    "format_exec",
    "reward_from_junit",
    "scoring_command",
]
