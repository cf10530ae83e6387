"""The SWE environment: fix a bug in a repository baked into the task's own image; hidden tests score it.

A plug-in, as a user writes one: it lives in its own distribution (``durable-rollouts-swe``), registers
itself under the entry-point group ``environments`` as ``swe`` and uses only the core's
public API (``environments.base``, ``environments.tool_calls``, ``errors``).

How one rollout goes:

1. ``sandbox``: the run's sandbox spec with the task's image; setup copies the task's visible files of
   the repository (``repo_dir`` in the image) into the workdir, then runs the task's setup commands.
2. ``prompt``: a system message with the tool format, a user message with ``Task id: <id>``, the problem
   statement and the visible files.
3. ``parse`` + ``act``: every model turn is one tool call (``environments.tool_calls``: bash, write_file,
read_file,
   submit); ``parse`` turns it into an action (recorded with the turn), ``act`` runs it in the sandbox and
   its result is the observation (a ``tool`` message). ``submit`` ends the rollout; a malformed call is
   an error observation and the rollout carries on.
4. ``score``: the hidden tests enter the sandbox only now, at an unguessable path; they run with the task's
   test command in a fresh copy of the repository (the image's, overlaid with the agent's visible paths).

Invariants:
- Model-generated code runs only in the sandbox; this module runs nothing on the host.
- ``parse`` is pure; ``act``, ``score`` and ``replay`` are safe to repeat: ``act`` of one turn writes the
  same file or runs the same command again, and a retried score uses fresh paths and rebuilds the scoring
  copy. ``replay`` redoes bash and write_file actions (a write the sandbox rejected is rejected again).
- Reward integrity (best effort): hidden tests and the JUnit report live at random paths outside what the
  agent worked on and appear only after its last turn; the repository's own pytest configuration is
  replaced by an empty one; a report counting another number of tests than the hidden ones scores 0.
  Everything in the image is readable by the agent: never bake hidden tests or answers into an image.
- A sandbox failure propagates as the sandbox's error; a task that cannot be scored (the scoring copy
  fails) raises `EnvironmentFailure`. Neither becomes a reward.

A task file may also hold SWE-bench-style instance rows (lines with ``instance_id``): the instance's own
image, its FAIL_TO_PASS and PASS_TO_PASS tests run after the agent, reward 1 only when all pass
(`swe_env.swebench`). Both kinds may share a file and a run.
"""

from __future__ import annotations

import logging
import secrets
import shlex
import xml.etree.ElementTree as ET
from typing import Any, ClassVar, cast

from durable_rollouts.environments.base import Prompt, Sandbox, SandboxPlan, Score, Task, TurnContext
from durable_rollouts.environments.tool_env import ToolCallEnvironment
from durable_rollouts.errors import EnvironmentFailure
from durable_rollouts.sandboxes.base import SandboxSpec
from swe_env import swebench
from swe_env.swebench import SweBenchTask
from swe_env.tasks import DEFAULT_TEST_COMMAND, SweTask

__all__ = ["DEFAULT_TEST_COMMAND", "SweBenchTask", "SweEnvironment", "SweTask", "reward_from_junit"]

SYSTEM_PROMPT = (
    "You are a software engineer fixing a bug in a repository checked out in your working directory. "
    "Each turn, call exactly one tool by writing\n"
    '<tool_call>{"name": TOOL, "arguments": {...}}</tool_call>\n'
    "Tools: bash(cmd), write_file(path, content), read_file(path), submit(). Paths are relative to the "
    "working directory; there is no network. Call submit() when the bug is fixed: hidden tests then score "
    "your change."
)
log = logging.getLogger(__name__)
EXIT_MARK = "swe-exit: "
"""Line the scoring command prints with the test command's exit status, before the report."""


class SweEnvironment(ToolCallEnvironment):
    """SWE-style repository tasks in per-task images (see the module docstring)."""

    name: ClassVar[str] = "swe"
    env_version: ClassVar[str] = "swe-v2"
    verifier_version: ClassVar[str] = "swe-tests-v2"
    task_model: ClassVar[type[Task]] = SweTask

    def __init__(self, image_pattern: str | None = None) -> None:
        self.image_pattern = image_pattern
        """Names the image of a SWE-bench row that names none (`swe_env.harness.image_name`); None: the
        operator's ``DURABLE_ROLLOUTS_SWE_IMAGE_PATTERN``, else SWE-bench's published name."""

    def validate_task(self, obj: dict[str, Any], where: str = "task") -> Task:
        """A `SweBenchTask` for a SWE-bench row (it has ``instance_id``), else a `SweTask`."""
        if "instance_id" not in obj:
            return super().validate_task(obj, where)
        return swebench.validate_row(obj, where, self.image_pattern)

    def prompt(self, task: Task) -> Prompt:
        t = _swe(task)
        if isinstance(t, SweBenchTask):
            user = swebench.prompt_text(t)
        else:
            files = ", ".join(t.visible)
            user = f"Task id: {t.id}\n\n{t.problem}\n\nRepository (your working directory): {files}"
        return Prompt(
            messages=[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]
        )

    def sandbox(self, task: Task, default: SandboxSpec) -> SandboxPlan:
        t = _swe(task)
        if isinstance(t, SweBenchTask):
            return SandboxPlan(
                spec=default.model_copy(update={"image": t.image}),
                setup=swebench.setup_commands(t, default.workdir),
                setup_timeout_s=t.setup_timeout_s,
            )
        paths = " ".join(shlex.quote(p) for p in t.visible)
        copy = f"cd {shlex.quote(t.repo_dir)} && cp -r --parents -- {paths} {shlex.quote(default.workdir)}/"
        return SandboxPlan(
            spec=default.model_copy(update={"image": t.image}),
            setup=[copy, *t.setup],
            setup_timeout_s=t.setup_timeout_s,
        )

    async def score(self, ctx: TurnContext, text: str | None) -> float | Score | None:
        t = _swe(ctx.task)
        box = self.sandbox_of(ctx)
        if isinstance(t, SweBenchTask):
            return await _score_swebench(t, box)
        token = secrets.token_hex(8)
        hidden = f".swe-hidden-{token}"
        for path, src in t.hidden_tests.items():
            await box.write_file(f"{hidden}/{path}", src)
        cmd = scoring_command(t, hidden, token)
        res = await box.exec(cmd, timeout_s=t.test_timeout_s + 60)
        head, mark, tail = res.output.partition(EXIT_MARK)
        if not mark:
            if res.timed_out:
                return 0.0  # the tests (the agent's code) ran out of time before the status was printed
            raise EnvironmentFailure(f"task {t.id}: the scoring copy failed: {head.strip()[-300:]}")
        status, _, xml_text = tail.partition("\n")
        if t.reward == "exit_status":
            return 1.0 if status.strip() == "0" else 0.0
        return reward_from_junit(xml_text, t.expected_tests)


def scoring_command(task: SweTask, hidden: str, token: str) -> str:
    """The shell command (run in the workdir) that scores ``task``.

    It builds ``/tmp/swe-score-<token>``: the image's repository, overlaid with the agent's visible paths
    (those still present), the hidden tests moved in from ``hidden`` and an empty ``pytest.ini``; runs the
    test command there with its output to a log, prints ``swe-exit: <status>`` and then the report.
    """
    run = f"/tmp/swe-score-{token}"
    report = f"{run}/.report-{secrets.token_hex(8)}.xml"
    tests = " ".join(shlex.quote(p) for p in task.hidden_tests)
    test_cmd = task.test_command.replace("{tests}", tests).replace("{junit}", report)
    visible = " ".join(shlex.quote(p) for p in task.visible)
    limit = f"{task.test_timeout_s:g}"
    cmd = (
        f"set -e; rm -rf {run}; mkdir -p {run}; cp -r {shlex.quote(task.repo_dir)}/. {run}/; "
        f'for p in {visible}; do rm -rf {run}/"$p"; '
        f'if [ -e "$p" ]; then cp -r --parents -- "$p" {run}/; fi; done; '
        f"cp -r {hidden}/. {run}/; rm -rf {hidden}; printf '[pytest]\\n' > {run}/pytest.ini; "
        f"cd {run}; set +e; "
        f"timeout -k 5 {limit} bash -c {shlex.quote(test_cmd)} > {run}/.log-{token} 2>&1 </dev/null; "
        f'echo "{EXIT_MARK}$?"; cat {report} 2>/dev/null; true'
    )
    return cmd


def reward_from_junit(xml_text: str, expected_tests: int) -> float:
    """Fraction of tests passed in a JUnit report; 0 when it is missing, unreadable or counts another number
    of tests than ``expected_tests`` (failures, errors and skips all count as not passed)."""
    try:
        root = ET.fromstring(xml_text.strip() or "<none/>")
    except ET.ParseError:
        return 0.0
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    try:
        total = sum(int(s.get("tests", 0)) for s in suites)
        bad = sum(int(s.get(k, 0)) for s in suites for k in ("failures", "errors", "skipped"))
    except ValueError:
        return 0.0
    if expected_tests <= 0 or total != expected_tests:
        return 0.0
    return max(total - bad, 0) / total


async def _score_swebench(t: SweBenchTask, box: Sandbox) -> Score:
    """SWE-bench's rule on the agent's workdir, graded by the swebench package: 1.0 when resolved.

    Its metrics: ``fail_to_pass`` and ``pass_to_pass`` (the shares that passed) and ``test_patch_<applier>``
    = 1.0 for the applier that applied the test patch (``git``, ``patch``, ``stdlib``); each applier that
    failed before it is logged with its cause.
    """
    token = secrets.token_hex(8)
    hidden, files = swebench.hidden_files(t)
    for name, content in files.items():
        await box.write_file(f"{hidden}/{name}", content)
    res = await box.exec(swebench.scoring_command(t, hidden, token), timeout_s=t.test_timeout_s + 120)
    head, mark, tail = res.output.partition(EXIT_MARK)
    applied, tried = swebench.appliers(head)
    if not mark:
        if res.timed_out:
            return Score(reward=0.0)  # the tests (the agent's code) ran out of time before the status
        raise EnvironmentFailure(f"task {t.id}: the scoring copy failed: {head.strip()[-300:]}")
    if tail.startswith("patch"):
        raise EnvironmentFailure(
            f"task {t.id}: its test_patch does not apply to the agent's repository: {'; '.join(tried)}"
        )
    for failure in tried:
        log.info("task %s: test_patch not applied by %s (applied by %s)", t.id, failure, applied)
    log_file = swebench.log_name(token)
    text = (await box.read_file(log_file, max_bytes=swebench.LOG_LIMIT + 4096)).decode("utf-8", "replace")
    await box.exec(f"rm -f {log_file}")
    report = swebench.grade(t, text)
    status = report.get("tests_status") or {}
    metrics = {f"test_patch_{applied}": 1.0}
    for key, name in (("FAIL_TO_PASS", "fail_to_pass"), ("PASS_TO_PASS", "pass_to_pass")):
        counts = status.get(key) or {"success": [], "failure": []}
        total = len(counts["success"]) + len(counts["failure"])
        metrics[name] = len(counts["success"]) / total if total else (0.0 if not status else 1.0)
    return Score(reward=1.0 if report["resolved"] else 0.0, metrics=metrics)


def _swe(task: Task | dict[str, Any]) -> SweTask | SweBenchTask:
    """The task as a `SweTask` or `SweBenchTask` (the pipeline hands over the validated model; a plain one
    is revalidated)."""
    if isinstance(task, SweTask | SweBenchTask):
        return task
    obj = task if isinstance(task, dict) else task.model_dump(mode="json")
    return cast(SweTask, SweEnvironment().validate_task(obj, where=f"task {obj.get('id')!r}"))
