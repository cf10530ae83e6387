"""The coding environment: a task, a hardened sandbox, tools, and a reward from hidden tests.

The harness renders the first prompt once (system message with the tool format, user message with the
task), then every model turn is parsed as one tool call (see ``environments.tool_calls``) and its result
comes back
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

from coding_env.tasks import CodingTask
from durable_rollouts.environments.base import Prompt, SandboxPlan, Task, TurnContext
from durable_rollouts.environments.tool_calls import TOOLS
from durable_rollouts.environments.tool_env import ToolCallEnvironment
from durable_rollouts.sandboxes.base import SandboxSpec

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


class CodingEnvironment(ToolCallEnvironment):
    """Tool-using coding agent in a hardened sandbox; reward from hidden tests (see the module docstring)."""

    name = "coding"
    env_version = ENV_VERSION
    verifier_version = VERIFIER_VERSION
    task_model = CodingTask

    def prompt(self, task: Task) -> Prompt:
        return Prompt(messages=first_messages(task.model_dump()))

    def sandbox(self, task: Task, default: SandboxSpec) -> SandboxPlan:
        assert isinstance(task, CodingTask)
        return SandboxPlan(spec=default, files=dict(task.files))

    async def score(self, ctx: TurnContext, text: str | None) -> float:
        """Hidden tests run in the sandbox on a copy of the submitted files."""
        task, sandbox = ctx.task, self.sandbox_of(ctx)
        assert isinstance(task, CodingTask)
        hidden = f".hidden-{secrets.token_hex(6)}"
        for path, src in task.tests.items():
            await sandbox.write_file(f"{hidden}/{path}", src)
        files = sorted(set(task.files) | set(task.reference))
        cmd, _ = scoring_command(files, hidden)
        res = await sandbox.exec(cmd, timeout_s=300)
        reward, _, _ = reward_from_junit(res.output, count_tests(task.tests))
        return reward


__all__ = [
    "ENV_VERSION",
    "SYSTEM_PROMPT",
    "TOOLS",
    "VERIFIER_VERSION",
    "CodingEnvironment",
    "count_tests",
    "first_messages",
    "reward_from_junit",
    "scoring_command",
]
